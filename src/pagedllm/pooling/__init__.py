"""Embeddings (vLLM's LLM.embed and /v1/embeddings): a request's prompt runs through the model and its final hidden
states (after the last norm) are pooled into one vector, instead of sampling a continuation.

The engine side rides on the generation path: an embedding request is a prompt with SamplingParams(pooling=...,
max_tokens=1); the runner pools the hidden rows of its prompt as its chunks are computed (worker/model_runner.py
`_pool`) and the step that completes the prompt reports the vector (EngineCoreOutput.pooled); the one token that
step samples is dropped. Pooling types: "last" (the last prompt token: decoder embedding models such as
Qwen3-Embedding), "mean" (every prompt token), "cls" (the first). A model directory's sentence-transformers files
(modules.json, 1_Pooling/config.json) choose the type and whether vectors are L2-normalized, as they do for
sentence-transformers and vLLM; otherwise "last", normalized.

Sequence classifiers (`*ForSequenceClassification`: reward models, cross-encoder rerankers) ride the same path:
their requests pool the last prompt token, and the runner puts the pooled state through the model's `score` head,
so `pooled` holds the label logits (fp32). LLM.classify and POST /classify turn them into probabilities
(`class_probs`); a one-label model is a cross-encoder, whose score of a text pair (encoded as one input) is the
sigmoid of its logit.

Token-wise tasks (vLLM's token_classify / token_embed, LLM.reward) pool "all": every prompt token's final hidden state,
through the model's head when it has one, so `pooled` holds [num_tokens x width] values row after row (width: the
labels of a classifier, else the hidden size). Token classifiers (`*ForTokenClassification`, NER-style) and
sequence classifiers give per-token label logits; a causal LM served with convert / task "reward" gives its raw
hidden states (vLLM's reward pooling: ALL, no normalization, no softmax). Reward models (`REWARD_MODEL_ARCHITECTURES`:
Qwen2ForRewardModel, Qwen2ForProcessRewardModel) are token classifiers whose head is two layers.

STEP pooling (vLLM's, for process reward models) is ALL pooling cut down on the host once the rows arrive
(`step_rows`): only the rows of tokens equal to `step_tag_id` (every row without one), only the `returned_token_ids`
columns of each (every column without them), then the activation over what is left (`token_outputs`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

POOLING_TYPES = ("last", "mean", "cls")  # sequence-wise: one vector per prompt
TOKEN_POOLING = "all"  # token-wise: one row per prompt token (token_classify, token_embed, reward)
STEP_POOLING = "step"  # token-wise, then only the rows of step-tag tokens / the chosen columns (step_rows)
# vLLM's pooling tasks that pagedllm serves (LLM.encode's pooling_task, /pooling's task)
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")

# Decoder stacks saved without their language-model head (transformers' AutoModel: e5-mistral's MistralModel,
# gte-Qwen2's Qwen2Model, ...) -> the causal architecture whose decoder they are. They serve embeddings only: the
# loader ties the head to the embedding (only an embedding request's dropped token reads it) and the engine refuses
# generation for them.
EMBEDDING_ONLY_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                                "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}


# Decoder stacks with a `score` head over the last token (transformers' *ForSequenceClassification): no language-model
# head either, so they serve classification and scoring only.
CLASSIFIER_ARCHITECTURES = ("LlamaForSequenceClassification", "MistralForSequenceClassification",
                            "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")


# Reward models (remote code on the Hub, not in transformers): the decoder and a `score` head Linear(hidden, hidden)
# -> ReLU -> Linear(hidden, num_labels) (both biased) over every token. vLLM fixes each one's labels, whatever the
# config says (its num_labels defaults to 2), and its default token pooling: architecture -> (num_labels, pooling).
REWARD_MODEL_ARCHITECTURES = {"Qwen2ForRewardModel": (1, TOKEN_POOLING),
                              "Qwen2ForProcessRewardModel": (2, STEP_POOLING)}

# Decoder stacks with a `score` head (with a bias) over every token (transformers' *ForTokenClassification), and the
# reward models: they serve token classification only.
TOKEN_CLASSIFIER_ARCHITECTURES = ("LlamaForTokenClassification", "MistralForTokenClassification",
                                  "Qwen2ForTokenClassification", "Qwen3ForTokenClassification",
                                  *REWARD_MODEL_ARCHITECTURES)


def _architecture(hf_config: Any) -> Optional[str]:
    architectures = getattr(hf_config, "architectures", None) or []
    return architectures[0] if architectures else None


def classifier_labels(hf_config: Any) -> Optional[list[str]]:
    """A sequence classifier's label names, in logit order (config.id2label, else LABEL_i); None for other models."""
    return _labels(hf_config) if _architecture(hf_config) in CLASSIFIER_ARCHITECTURES else None


def token_classifier_labels(hf_config: Any) -> Optional[list[str]]:
    """A token classifier's (or reward model's) label names, in logit order; None for other models."""
    arch = _architecture(hf_config)
    if arch in REWARD_MODEL_ARCHITECTURES:
        return _labels(hf_config, REWARD_MODEL_ARCHITECTURES[arch][0])
    return _labels(hf_config) if arch in TOKEN_CLASSIFIER_ARCHITECTURES else None


def _labels(hf_config: Any, num_labels: Optional[int] = None) -> list[str]:
    if num_labels is None:
        num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = {int(k): str(v) for k, v in id2label.items()}
    return [labels.get(i, f"LABEL_{i}") for i in range(num_labels)]


def head_from_tokens(config: Any, model_dir: str) -> None:
    """vLLM's way to serve a causal LM that ranks by next-token logits (Qwen3-Reranker's "yes" / "no") as a
    classifier: hf_overrides {"architectures": [...ForSequenceClassification], "classifier_from_token": [tokens],
    "is_original_qwen3_reranker": true}. The score head is then made from the LM head's rows of those tokens at load
    (models/llama.SequenceClassifier): one label per token, or, for the original reranker's two tokens, one label
    whose logit is the second token's minus the first's (its sigmoid is their two-way softmax). Resolves the tokens
    with the model's tokenizer into config.pagedllm_head_token_ids and sets num_labels / id2label to match."""
    tokens = getattr(config, "classifier_from_token", None)
    if tokens is None:
        return
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"classifier_from_token must be a non-empty list of token strings, got {tokens!r}.")
    if _architecture(config) not in CLASSIFIER_ARCHITECTURES:
        raise ValueError(f"classifier_from_token makes a sequence classifier's head from LM-head rows: set "
                         f"architectures to one of {', '.join(CLASSIFIER_ARCHITECTURES)} too (hf_overrides), got "
                         f"{_architecture(config)!r}.")
    two_way = bool(getattr(config, "is_original_qwen3_reranker", False))
    if two_way and len(tokens) != 2:
        raise ValueError(f"is_original_qwen3_reranker scores with two tokens (classifier_from_token ['no', 'yes']), "
                         f"got {len(tokens)}.")
    config.pagedllm_head_token_ids = _resolved_ids(config, tokens) or _token_ids(model_dir, tokens)
    config.pagedllm_head_two_way = two_way
    labels = [tokens[1]] if two_way else list(tokens)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}


def _resolved_ids(config: Any, tokens: list) -> Optional[list[int]]:
    """The ids an earlier process resolved (passed on in hf_overrides as pagedllm_head_token_ids, so that worker
    ranks do not load the tokenizer again), if they fit the tokens and the vocabulary."""
    ids = getattr(config, "pagedllm_head_token_ids", None)
    vocab = getattr(config, "vocab_size", None)
    if (isinstance(ids, list) and len(ids) == len(tokens) and isinstance(vocab, int)
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)):
        return ids
    return None


def _token_ids(model_dir: str, tokens: list) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for token in tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid < 0 or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this model's vocabulary.")
        ids.append(tid)
    return ids


def wants_reward(engine_args: Any) -> bool:
    """convert / task "reward" (vLLM's): every token's hidden state, through the model's head if it has one."""
    return engine_args.convert == "reward" or engine_args.task == "reward"


def supported_tasks(engine_args: Any, labels: Optional[list[str]], token_labels: Optional[list[str]]
                    ) -> tuple[str, ...]:
    """The pooling tasks the served model answers (vLLM's get_supported_tasks): a sequence classifier classifies
    sequences and, through the same head, tokens; a token classifier, or a model served for rewards, the tokens only;
    any other model gives embeddings, of the sequence or of each token."""
    if labels is not None:
        return ("classify", "token_classify")
    if token_labels is not None or wants_reward(engine_args):
        return ("token_classify",)
    return ("embed", "token_embed")


def check_runner_fits(engine_args: Any, labels: Optional[list[str]], architecture: Optional[str],
                      token_labels: Optional[list[str]] = None) -> None:
    """The engine's runner / convert / task flags against the model (ValueError naming the mismatch): `classify`
    serves a sequence or token classifier as it is (converting a causal LM into one is not built), a classifier
    serves no embeddings, nor a sequence pooling other than its last token; a token classifier or a model served for
    rewards pools every token."""
    wants_classify = engine_args.convert == "classify" or engine_args.task in ("classify", "score")
    wants_embed = engine_args.convert == "embed" or engine_args.task == "embed"
    if token_labels is not None:
        if wants_embed or engine_args.task in ("classify", "score"):
            raise ValueError(f"This model ({architecture}) is a token classifier: it serves per-token label logits "
                             "(token_classify: LLM.encode(pooling_task='token_classify'), LLM.reward, POST /pooling), "
                             f"not task {engine_args.task or 'embed'!r}; drop the task (or use --convert classify).")
    elif wants_classify and labels is None:
        given = f"convert {engine_args.convert!r}" if engine_args.convert == "classify" else \
            f"task {engine_args.task!r}"
        raise ValueError(f"{given} serves a sequence classifier (one of "
                         f"{', '.join(CLASSIFIER_ARCHITECTURES)}); this model ({architecture or 'a causal LM'}) is "
                         "not one (to rank with LM-head rows as Qwen3-Reranker does: hf_overrides with architectures and "
                         "classifier_from_token), or --runner pooling for embeddings.")
    if labels is not None and wants_embed:
        raise ValueError(f"This model ({architecture}) is a sequence classifier: it serves classification and "
                         "scoring, not embeddings; drop convert / task 'embed' (or use --convert classify).")
    pooler = getattr(engine_args, "pooler_config", None) or {}
    kind = pooler.get("pooling_type")
    if labels is not None and kind not in (None, "last"):
        raise ValueError(f"This model ({architecture}) is a sequence classifier, which scores its last token "
                         f"(as transformers does); pooler_config's pooling_type {kind.upper()} is not supported for "
                         "it.")
    token_only = supported_tasks(engine_args, labels, token_labels) == ("token_classify",)
    if token_only and kind not in (None, TOKEN_POOLING, STEP_POOLING):
        raise ValueError(f"This model ({architecture or 'a causal LM'}) is served for per-token outputs (a token "
                         f"classifier, a reward model, or convert / task 'reward'), which pool every token (ALL or "
                         f"STEP); pooler_config's pooling_type {kind.upper()} is not supported for it.")
    if kind == STEP_POOLING and not token_only:
        raise ValueError("pooler_config's pooling_type STEP (per-token rewards at step tags) is supported only for "
                         "models served for per-token outputs only (a token classifier, a reward model such as "
                         "Qwen2ForProcessRewardModel, or convert / task 'reward'), not for this model "
                         f"({architecture or 'a causal LM'}).")
    if kind == TOKEN_POOLING and labels is None and not token_only:
        raise ValueError("pooler_config's pooling_type ALL is the per-token tasks' pooling (token_embed, "
                         "token_classify, reward: they ask for it themselves); embeddings pool LAST, MEAN or CLS.")
    if {"step_tag_id", "returned_token_ids"} & set(pooler) and (not token_only
                                                                or step_pooling(architecture, pooler) is None):
        pools = "pools ALL: give pooling_type STEP with them" if token_only else "serves no per-token rewards"
        raise ValueError(f"pooler_config's step_tag_id / returned_token_ids apply to STEP pooling; this model "
                         f"({architecture or 'a causal LM'}) {pools}.")


def step_pooling(architecture: Optional[str], pooler_config: Optional[dict]) -> Optional[dict]:
    """The engine's STEP pooling ({"step_tag_id", "returned_token_ids"}, either None) where its token pooling is STEP
    (pooler_config's pooling_type, else the model's default: a process reward model's), else None (ALL)."""
    pooler = pooler_config or {}
    kind = pooler.get("pooling_type") or REWARD_MODEL_ARCHITECTURES.get(architecture or "", (0, TOKEN_POOLING))[1]
    if kind != STEP_POOLING:
        return None
    return {"step_tag_id": pooler.get("step_tag_id"), "returned_token_ids": pooler.get("returned_token_ids")}


def request_step(engine_step: Optional[dict], params: Optional["PoolingParams"]) -> Optional[dict]:
    """A request's STEP pooling: its PoolingParams' step_tag_id / returned_token_ids over the engine's (vLLM's
    merge); ValueError when it gives them to an engine that pools ALL."""
    given = {} if params is None else {k: getattr(params, k) for k in ("step_tag_id", "returned_token_ids")
                                       if getattr(params, k) is not None}
    if engine_step is None:
        if given:
            raise ValueError(f"{' and '.join(given)} apply to STEP pooling; this engine pools every token (ALL): "
                             "serve a process reward model, or give pooler_config pooling_type STEP.")
        return None
    return {**engine_step, **given}


def check_step_columns(columns: Optional[list[int]], width: int) -> None:
    """returned_token_ids against the width of the engine's per-token rows (labels, or the hidden size)."""
    bad = [c for c in columns or () if c >= width]
    if bad:
        raise ValueError(f"returned_token_ids {bad} are out of range: this model's per-token rows have {width} "
                         f"values (indices 0 to {width - 1}).")


def step_rows(rows: list[list[float]], token_ids: list[int], step: dict) -> list[list[float]]:
    """vLLM's STEP pooling of one prompt's per-token rows: the returned_token_ids columns (all without them) of the
    rows whose token is step_tag_id (all without it)."""
    columns = step.get("returned_token_ids")
    if columns and rows:
        check_step_columns(columns, len(rows[0]))
        rows = [[row[c] for c in columns] for row in rows]
    tag = step.get("step_tag_id")
    if tag is not None:
        rows = [row for row, t in zip(rows, token_ids) if t == tag]
    return rows


def token_only_refusal(architecture: Optional[str], token_classifier: bool, what: str) -> str:
    """Why a model served for per-token outputs only (a token classifier, or convert / task "reward") refuses
    `what` (generation, embeddings, ...)."""
    name = f" ({architecture})" if architecture else ""
    kind = "a reward model" if architecture in REWARD_MODEL_ARCHITECTURES else "a token classifier"
    served = f"This model{name} is {kind}" if token_classifier else \
        f"This engine serves the model{name} for rewards (convert / task 'reward')"
    return (f"{served}: it gives an output per token (LLM.reward, LLM.encode(pooling_task='token_classify'), POST "
            f"/pooling), not {what}.")


def check_request_pooling(kind: str, tasks: tuple[str, ...], architecture: Optional[str]) -> None:
    """The engine's check of a pooled request against what the model serves (the entry points say it first, in
    their own words): every-token pooling needs a token task, a sequence pooling embed or classify."""
    if kind == TOKEN_POOLING:
        if not {"token_embed", "token_classify"} & set(tasks):
            raise ValueError(f"This model ({architecture}) serves no per-token pooling.")
    elif "embed" not in tasks and "classify" not in tasks:
        raise ValueError(f"This model ({architecture}) gives an output per token only (token_classify), not one "
                         "per sequence.")


def check_task_params(task: str, params: Optional["PoolingParams"]) -> None:
    """vLLM's parameters per pooling task: embed and token_embed take normalize and dimensions (embed also
    pooling_type), classify and token_classify use_activation; every task truncate_prompt_tokens."""
    if params is None:
        return
    allowed = {"embed": ("pooling_type", "normalize", "dimensions"), "token_embed": ("normalize", "dimensions"),
               "classify": ("use_activation",), "token_classify": ("use_activation",)}[task]
    given = [name for name in ("pooling_type", "normalize", "dimensions", "use_activation")
             if getattr(params, name) is not None and name not in allowed]
    if task != "token_classify":  # (STEP pooling is served for per-token rewards only)
        given += [name for name in ("step_tag_id", "returned_token_ids") if getattr(params, name) is not None]
    if given:
        step = " (and step_tag_id, returned_token_ids with STEP pooling)" if task == "token_classify" else ""
        raise ValueError(f"Task {task!r} takes {', '.join(allowed)}{step} and truncate_prompt_tokens of "
                         f"PoolingParams, not {', '.join(given)}.")


NO_HEAD_ACTIVATION = ("use_activation applies to label logits; this model has no label head (convert / task 'reward' "
                      "gives its hidden states as they are).")


def token_rows(flat: list[float], num_tokens: int) -> list[list[float]]:
    """The engine's per-token output (`pooled`: num_tokens rows laid end to end) as one row per prompt token."""
    width = len(flat) // num_tokens if num_tokens else 0
    return [flat[i * width:(i + 1) * width] for i in range(num_tokens)]


def token_outputs(flat: list[float], num_tokens: int, task: str, has_head: bool, use_activation: Optional[bool],
                  normalize: bool = True, dimensions: Optional[int] = None, step: Optional[dict] = None,
                  token_ids: Optional[list[int]] = None) -> list[list[float]]:
    """One row per token as the task gives it: token_classify the label probabilities of a classifier's logits
    (use_activation False: the logits) or, with no head (a model served for rewards), the hidden states as they are
    (vLLM's reward pooling: no normalization, no softmax); token_embed each token's state as an embedding is made
    (`finish`). `step` (STEP pooling, `request_step`): only the rows / columns it keeps (`step_rows`, of the prompt's
    `token_ids`), the activation over the columns kept (vLLM's order: a single column gets the sigmoid)."""
    rows = token_rows(flat, num_tokens)
    if step is not None:
        rows = step_rows(rows, token_ids or [], step)
    if task == "token_embed":
        return [finish(row, normalize, dimensions) for row in rows]
    if not has_head:
        if use_activation:
            raise ValueError(NO_HEAD_ACTIVATION)
        return rows
    return rows if use_activation is False else [class_probs(row) for row in rows]


def embedding_only(hf_config: Any) -> Optional[str]:
    """The architecture name when the model has no language-model head of its own (one of
    EMBEDDING_ONLY_ARCHITECTURES, or a checkpoint the loader found without one: `mark_embedding_only`), else None."""
    marked = getattr(hf_config, "pagedllm_embedding_only", None)
    if marked:
        return marked
    arch = _architecture(hf_config)
    headless = EMBEDDING_ONLY_ARCHITECTURES.keys() | set(CLASSIFIER_ARCHITECTURES) | set(TOKEN_CLASSIFIER_ARCHITECTURES)
    return arch if arch in headless else None


def mark_embedding_only(hf_config: Any) -> None:
    """A checkpoint without a language-model head (and an untied config): its embedding stands in for the head (only
    an embedding request's dropped token reads it) and the engine refuses generation."""
    architectures = getattr(hf_config, "architectures", None) or ["this model"]
    hf_config.tie_word_embeddings = True
    hf_config.pagedllm_embedding_only = architectures[0]

# sentence-transformers' pooling modes (1_Pooling/config.json) -> ours
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass
class PoolingParams:
    """How an embedding is made (vLLM's PoolingParams): pooling_type None takes the model's (see module doc);
    normalize None takes the model's (L2 to unit length unless its sentence-transformers files say otherwise);
    dimensions: the vector's length, shorter than the hidden size only for a Matryoshka-trained model (its first
    values, then normalized); truncate_prompt_tokens: keep the prompt's last k tokens (-1: the model's context).
    use_activation (classify, token_classify): None / True the label probabilities, False the raw logits.
    normalize and dimensions apply to token_embed's rows as to an embedding. step_tag_id / returned_token_ids
    (token_classify on an engine that pools STEP) go over the engine's pooler_config (`request_step`)."""

    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None
    # STEP pooling (token_classify of an engine that pools STEP): over the engine's pooler_config
    step_tag_id: Optional[int] = None
    returned_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if isinstance(self.pooling_type, str):  # (vLLM's pooler_config spells them LAST, MEAN, CLS)
            self.pooling_type = self.pooling_type.lower()
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")
        _check_step_fields(self.step_tag_id, self.returned_token_ids, "")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        for name in ("dimensions", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{name} must be an integer, got {v!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}.")


@dataclass(frozen=True)
class ModelPooling:
    """A model's default pooling: its type, whether its vectors are normalized, and the shortened lengths its
    Matryoshka training allows (config.json's `is_matryoshka` / `matryoshka_dimensions`, vLLM's names): None: none,
    (): any length up to the hidden size."""

    pooling_type: str = "last"
    normalize: bool = True
    matryoshka: Optional[tuple[int, ...]] = None


def _check_step_fields(step_tag_id: Any, returned_token_ids: Any, where: str) -> None:
    if step_tag_id is not None and (isinstance(step_tag_id, bool) or not isinstance(step_tag_id, int)
                                    or step_tag_id < 0):
        raise ValueError(f"{where}step_tag_id must be a token id (an integer >= 0), got {step_tag_id!r}.")
    if returned_token_ids is not None and (not isinstance(returned_token_ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in returned_token_ids)):
        raise ValueError(f"{where}returned_token_ids must be a list of column indices (integers >= 0), got "
                         f"{returned_token_ids!r}.")


def check_pooler_config(config: Any) -> dict:
    """vLLM's pooler_config ({"pooling_type": "LAST" | "MEAN" | "CLS" | "ALL" | "STEP", "normalize": bool,
    "step_tag_id": int, "returned_token_ids": [int]}) checked, the type in our lower-case names; ValueError for
    anything else (a key not built is refused, not ignored)."""
    if not isinstance(config, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {config!r}.")
    keys = ("pooling_type", "normalize", "step_tag_id", "returned_token_ids")
    unknown = sorted(set(config) - set(keys))
    if unknown:
        raise ValueError(f"pooler_config takes {', '.join(keys)}; {unknown} is not supported.")
    out: dict = {}
    kind = config.get("pooling_type")
    if kind is not None:
        if not isinstance(kind, str) or kind.lower() not in POOLING_TYPES + (TOKEN_POOLING, STEP_POOLING):
            raise ValueError(f"pooler_config's pooling_type must be LAST, MEAN, CLS, ALL or STEP, got {kind!r}.")
        out["pooling_type"] = kind.lower()
    _check_step_fields(config.get("step_tag_id"), config.get("returned_token_ids"), "pooler_config's ")
    for name in ("step_tag_id", "returned_token_ids"):
        if config.get(name) is not None:
            if out.get("pooling_type", STEP_POOLING) != STEP_POOLING:
                raise ValueError(f"pooler_config's {name} applies to STEP pooling, not {kind.upper()}.")
            out[name] = list(config[name]) if name == "returned_token_ids" else config[name]
    if "normalize" in config and config["normalize"] is not None:
        if not isinstance(config["normalize"], bool):
            raise ValueError(f"pooler_config's normalize must be true or false, got {config['normalize']!r}.")
        out["normalize"] = config["normalize"]
    return out


def model_pooling(model_dir: Optional[str], pooler_config: Optional[dict] = None,
                  hf_overrides: Optional[dict] = None, config_dir: Optional[str] = None) -> ModelPooling:
    """The defaults from a model directory's sentence-transformers files, else last-token pooling, normalized;
    `pooler_config` (checked by check_pooler_config) overrides them; `hf_overrides` (config.json fields, merged over
    the file's as transformers merges them) may say the model is Matryoshka-trained. config_dir (--hf-config-path,
    EngineArgs.hf_config_dir) holds the config.json read instead of the model's."""
    found = _model_files_pooling(model_dir, hf_overrides or {}, config_dir)
    if not pooler_config:
        return found
    return ModelPooling(pooler_config.get("pooling_type", found.pooling_type),
                        pooler_config.get("normalize", found.normalize), found.matryoshka)


def _read_json(path: str) -> Any:
    """A JSON file's value; None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _model_files_pooling(model_dir: Optional[str], hf_overrides: dict, config_dir: Optional[str] = None
                         ) -> ModelPooling:
    if not model_dir or not os.path.isdir(model_dir):
        return ModelPooling(matryoshka=_matryoshka_of(hf_overrides))
    pooling_type, normalize = "last", True
    config = _read_json(os.path.join(config_dir or model_dir, "config.json"))
    matryoshka = _matryoshka_of({**(config if isinstance(config, dict) else {}), **hf_overrides})
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    pooling_dir = "1_Pooling"
    if isinstance(modules, list):
        kinds = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        normalize = any(k.endswith("Normalize") for k in kinds)
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling") and m.get("path"):
                pooling_dir = str(m["path"])
    config_path = os.path.join(model_dir, pooling_dir, "config.json")
    st_config = _read_json(config_path)
    if isinstance(st_config, dict):
        chosen = [ours for key, ours in _ST_MODES.items() if st_config.get(key)]
        if len(chosen) == 1:
            pooling_type = chosen[0]
        elif any(v is True for k, v in st_config.items() if k.startswith("pooling_mode")):
            modes = sorted(k for k, v in st_config.items() if k.startswith("pooling_mode") and v is True)
            raise ValueError(f"The model's sentence-transformers pooling ({', '.join(modes)} in {config_path}) is "
                             f"not supported: one of {', '.join(_ST_MODES)} is.")
    return ModelPooling(pooling_type, normalize, matryoshka)


def _matryoshka_of(config: dict) -> Optional[tuple[int, ...]]:
    sizes = config.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes and all(isinstance(d, int) and not isinstance(d, bool) for d in sizes):
        return tuple(sizes)
    return () if config.get("is_matryoshka") is True else None


def resolve(params: Optional[PoolingParams], defaults: ModelPooling, hidden_size: int
            ) -> tuple[str, bool, Optional[int]]:
    """(pooling type, normalize, the vector's length or None for the whole) for a request; ValueError for what
    cannot be honoured."""
    params = params or PoolingParams()
    dimensions = params.dimensions
    if dimensions == hidden_size:
        dimensions = None
    if dimensions is not None:
        allowed = defaults.matryoshka
        if allowed is None:
            raise ValueError(f"dimensions={dimensions} is not supported: this model's embeddings have {hidden_size} "
                             "dimensions, and its config.json does not say it was trained for shorter ones "
                             "(is_matryoshka / matryoshka_dimensions).")
        if dimensions > hidden_size or (allowed and dimensions not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
            raise ValueError(f"dimensions={dimensions} is not supported: this model's embeddings may have {sizes} "
                             "dimensions.")
    pooling_type = params.pooling_type or defaults.pooling_type
    normalize = defaults.normalize if params.normalize is None else params.normalize
    return pooling_type, normalize, dimensions


def finish(vector: list[float], normalize: bool, dimensions: Optional[int] = None) -> list[float]:
    """The embedding from the engine's pooled hidden state (fp32): its first `dimensions` values (Matryoshka), then
    L2-normalized when asked."""
    vector = list(vector if dimensions is None else vector[:dimensions])
    if not normalize:
        return vector
    norm = math.sqrt(math.fsum(v * v for v in vector))
    return [v / norm for v in vector] if norm > 0 else vector


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's EmbeddingRequestOutput): .outputs.embedding."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two embeddings (0 for a zero vector): the score of vLLM's score / rerank APIs."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's ScoringRequestOutput): .outputs.score."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's: the class probabilities (softmax over the labels; a one-label model's sigmoid)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """One prompt's classification (vLLM's ClassificationRequestOutput): .outputs.probs."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None


@dataclass
class PoolingOutput:
    """vLLM's generic pooling output: `data`, a torch tensor (an embedding, or a classifier's probabilities)."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """One prompt's LLM.encode result (vLLM's PoolingRequestOutput): .outputs.data."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None


def class_probs(logits: list[float]) -> list[float]:
    """vLLM's classification activation: softmax over the labels, the sigmoid for a one-label model (a cross-encoder
    or reward score, whose softmax would always be 1)."""
    if len(logits) == 1:
        x = logits[0]
        return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def classifier_input(ids: list[int], pad_token_id: Optional[int]) -> list[int]:
    """The prompt a classifier pools: transformers scores the last token that is not the pad token, so trailing pad
    tokens are dropped (causal attention: the earlier tokens' states do not depend on them); one token stays."""
    if pad_token_id is None:
        return ids
    end = len(ids)
    while end > 1 and ids[end - 1] == pad_token_id:
        end -= 1
    return ids if end == len(ids) else ids[:end]


def pair_input(tokenizer: Any, text_1: str, text_2: str, max_tokens: Optional[int] = None) -> list[int]:
    """A cross-encoder's input for a text pair: the tokenizer's pair encoding (its template's special tokens and
    separators), as transformers and vLLM encode it. `max_tokens` (a truncate_prompt_tokens already through
    input_truncation): the tokenizer's own pair truncation, longest text first, so the special tokens and the query
    stay (keeping the last tokens of the whole encoding would cut the query off first). A bound the tokenizer cannot
    meet (fewer places than its special tokens) is left to the caller's last-tokens truncation."""
    if isinstance(max_tokens, int) and max_tokens > 0:
        return list(tokenizer(text=text_1, text_pair=text_2, truncation="longest_first",
                              max_length=max_tokens)["input_ids"])
    return list(tokenizer(text=text_1, text_pair=text_2)["input_ids"])


def input_truncation(k: Optional[int], max_model_len: int) -> Optional[int]:
    """vLLM's truncate_prompt_tokens for an embedding input: -1 (the model's context) keeps what an embedding input
    may hold, max_model_len - 1 (its dropped step needs the last place), not a length it would then refuse; so does
    max_model_len itself, which vLLM accepts (without this it passed the check against max_model_len and then the
    input was refused as too long, telling the user to set the truncate_prompt_tokens they had set)."""
    return max_model_len - 1 if k == -1 or k == max_model_len else k


def _texts(texts: Any, name: str) -> list[str]:
    # Texts only: token ids were read as one prompt by embed() and failed with a KeyError, prompt dicts with
    # "unhashable type".
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"'{name}' must be a string or a list of strings, got {texts!r:.60}.")
    return list(texts)


def score_pairs(text_1: Any, text_2: Any) -> tuple[list[str], list[str]]:
    """vLLM's pairing of a score request: one text_1 against each of text_2, else pairwise (ValueError otherwise)."""
    firsts, seconds = _texts(text_1, "text_1"), _texts(text_2, "text_2")
    if not firsts or not seconds:
        raise ValueError("'text_1' and 'text_2' must not be empty.")
    if len(firsts) == 1:
        return firsts * len(seconds), seconds
    if len(firsts) != len(seconds):
        raise ValueError(f"'text_1' ({len(firsts)} texts) and 'text_2' ({len(seconds)}) must be as long, or 'text_1' "
                         "one text scored against each of 'text_2'.")
    return firsts, seconds


def sampling_params_for(pooling_type: str, truncate_prompt_tokens: Optional[int] = None) -> Any:
    """The SamplingParams an embedding request runs with: one greedy step past the prompt, whose token is dropped."""
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, pooling=pooling_type,
                          truncate_prompt_tokens=truncate_prompt_tokens, output_kind="final_only")


__all__ = ["check_pooler_config", "POOLING_TYPES", "TOKEN_POOLING", "STEP_POOLING", "POOLING_TASKS",
           "TOKEN_CLASSIFIER_ARCHITECTURES", "REWARD_MODEL_ARCHITECTURES", "step_pooling", "request_step", "step_rows",
           "check_step_columns",
           "token_classifier_labels", "wants_reward", "supported_tasks", "token_only_refusal", "check_request_pooling",
           "check_task_params", "token_rows", "token_outputs", "NO_HEAD_ACTIVATION", "EMBEDDING_ONLY_ARCHITECTURES",
           "embedding_only", "CLASSIFIER_ARCHITECTURES", "classifier_labels", "ClassificationOutput",
           "ClassificationRequestOutput", "class_probs", "classifier_input", "pair_input", "check_runner_fits",
           "head_from_tokens", "PoolingOutput", "PoolingRequestOutput", "mark_embedding_only", "PoolingParams",
           "ModelPooling", "model_pooling", "resolve", "finish", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ScoringOutput", "ScoringRequestOutput", "cosine", "input_truncation", "score_pairs", "sampling_params_for"]
