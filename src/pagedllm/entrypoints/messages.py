"""Typed wire messages between the API process and the engine-core process (msgspec + msgpack).

Two ZMQ PUSH/PULL channels, both bound by the API process on ipc:// paths in a private temp dir:
  * input  (API -> engine): AddRequest | AbortRequests | GetStats | Shutdown | AddLora | RemoveLora | GetDashboard |
    Sleep | WakeUp | IsSleeping | ResetPrefixCache
  * output (engine -> API): EngineReady | EngineStartupError | EngineOutputs | RequestError | StatsReply | LoraReply |
    EngineDead | DashboardReply | AdminReply
With data parallelism there is one input channel per engine core and one shared output channel; outputs and
stats carry the sending core's `engine_index`. With several API server processes (`--api-server-count`) each
one has its own input channel to every engine core and its own output channel: what it sends carries its
`client_index`, and the engine core sends each request's outputs (and each reply) to the process that sent it
(entrypoints/ipc.py lays out the addresses; the supervisor, openai/api_server_manager.py, has a control channel
to each engine core and a voice on each API process's output channel).

Every message is a tagged msgspec Struct so the receiving side decodes straight into the right class
(no RPC by method-name strings). Payloads travel as-is: SamplingParams (a dataclass, encoded field by field)
and EngineCoreOutput (a Struct, encoded as an array: one step's outputs are the hot message).
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

from pagedllm.core.batch_plan import EngineCoreOutput
from pagedllm.sampling_params import SamplingParams


class SchedulerStatsMsg(msgspec.Struct, frozen=True):
    """A snapshot of the scheduler's gauges; the prefix-cache and preemption counts are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    num_preemptions: int = 0
    spec_num_drafts: int = 0  # speculative decoding, cumulative
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_aborted: int = 0  # requests the engine finished as aborted (disconnects, stop strings), cumulative
    running_lora_ids: tuple[int, ...] = ()  # distinct adapters of running / waiting requests
    waiting_lora_ids: tuple[int, ...] = ()
    sleep_state: str = "awake"  # awake | weights_offloaded | discard_all | kv_cache_asleep (EngineCore.sleep_state)


# ---- API process -> engine core -------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: Optional[float] = None
    lora_id: Optional[int] = None
    client_index: int = 0  # the API server process that sent it (its outputs go back there)
    cache_salt: Optional[str] = None
    priority: int = 0  # --scheduling-policy priority (lower first)
    # A prompt given as embeddings (--enable-prompt-embeds): the tensor torch.save'd; prompt_token_ids are
    # placeholders of its length.
    prompt_embeds: Optional[bytes] = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    client_index: int = 0  # only this process's requests of these ids are aborted


class GetStats(msgspec.Struct, tag="get_stats"):
    seq: int  # echoed back in StatsReply so the caller can match its answer
    client_index: int = 0


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class AddLora(msgspec.Struct, tag="add_lora"):
    """Register (read + validate) a LoRA adapter; answered by LoraReply with the same seq."""

    seq: int
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: Optional[str] = None
    client_index: int = 0
    # A run-time load: the other API server processes learn the name (LoraEvent) before the reply goes out.
    announce: bool = False
    replaces: Optional[int] = None  # load_inplace: the id that holds the name until this load is done


class RemoveLora(msgspec.Struct, tag="remove_lora"):
    seq: int
    lora_int_id: int
    client_index: int = 0


class GetDashboard(msgspec.Struct, tag="get_dashboard"):
    """What the dashboard page needs beyond the stats (entrypoints/dashboard): answered by DashboardReply."""

    seq: int
    with_info: bool = False  # also the engine's static facts (device, dtype, versions, ...)
    client_index: int = 0


class LoraApplied(msgspec.Struct, tag="lora_applied"):
    """An API server process has applied a LoraEvent (the engine core answers the loading process after all)."""

    origin: int  # client_index of the process whose load / unload it was
    seq: int
    client_index: int


class ClientGone(msgspec.Struct, tag="client_gone"):
    """From the supervisor: an API server process died; its requests are aborted and nothing more goes to it."""

    client_index: int


# Sleep mode and the prefix cache (the dev-mode routes, openai/admin.py): each answered by AdminReply, same seq.
class Sleep(msgspec.Struct, tag="sleep"):
    seq: int
    level: int = 1
    client_index: int = 0


class WakeUp(msgspec.Struct, tag="wake_up"):
    seq: int
    tags: Optional[list[str]] = None  # None: weights and kv_cache
    client_index: int = 0


class IsSleeping(msgspec.Struct, tag="is_sleeping"):
    seq: int
    client_index: int = 0


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    seq: int
    client_index: int = 0


EngineInput = Union[AddRequest, AbortRequests, GetStats, Shutdown, AddLora, RemoveLora, GetDashboard, LoraApplied,
                    ClientGone, Sleep, WakeUp, IsSleeping, ResetPrefixCache]


# ---- engine core -> API process -------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready"):
    """Handshake: the engine core is built and waiting for requests."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    pid: int
    hidden_size: int = 0  # the length of an embedding (pooling/)
    classifier_labels: Optional[list[str]] = None  # a sequence classifier's labels (pooling/); None: not one
    token_labels: Optional[list[str]] = None  # a token classifier's labels (pooling/); None: not one
    pooling_tasks: list[str] = []  # vLLM's pooling tasks the model answers (pooling.supported_tasks)
    step_pooling: Optional[dict] = None  # the engine's STEP pooling settings (pooling.step_pooling); None: ALL
    architecture: Optional[str] = None  # the served model's (config.architectures[0]), for refusals naming it
    pad_token_id: Optional[int] = None  # the config's (a classifier scores the last token that is not it)
    engine_index: int = 0  # which data-parallel engine core is ready
    cache_config: dict[str, str] = {}  # vLLM's CacheConfig fields as strings (vllm:cache_config_info)


class EngineStartupError(msgspec.Struct, tag="startup_error"):
    message: str  # one line, for the user


class EngineOutputs(msgspec.Struct, tag="outputs"):
    """One engine step's outputs for one API process. The usual output of a decode step (one running request,
    one new token, no logprobs) travels as three columns (step_ids, step_tokens, step_cached: request id, the
    token, num_cached_tokens), not as an EngineCoreOutput each: decoding a list of ids and a list of ints costs a
    fraction of a Struct per request. Every other output is in `outputs`. A request is in one or the other, once.
    all_outputs() gives the step as EngineCoreOutputs, whichever way they came."""

    outputs: list[EngineCoreOutput]
    stats: Optional[SchedulerStatsMsg] = None
    timestamp: float = 0.0  # time.time() in the engine process when the step finished
    engine_index: int = 0  # which data-parallel engine core sent it
    step_ids: list[str] = []
    step_tokens: list[int] = []
    step_cached: list[int] = []
    # Several API processes: the whole step's tokens (vllm:iteration_tokens_total), counted by the engine core, on
    # the first process's message (0 on the others): each process sees only its own requests' part of a step.
    iteration_tokens: Optional[int] = None

    def all_outputs(self) -> list[EngineCoreOutput]:
        return self.outputs + [EngineCoreOutput(rid, [token], num_cached_tokens=cached)
                               for rid, token, cached in zip(self.step_ids, self.step_tokens, self.step_cached)]


def step_outputs(outputs: list[EngineCoreOutput], stats: Optional[SchedulerStatsMsg], timestamp: float,
                 engine_index: int) -> EngineOutputs:
    """The EngineOutputs of a step: each output that EngineCoreOutput(request_id, [token], num_cached_tokens=n)
    rebuilds exactly (running, one token, nothing else) into the columns, the others as they are."""
    rest: list[EngineCoreOutput] = []
    ids: list[str] = []
    tokens: list[int] = []
    cached: list[int] = []
    for out in outputs:
        new = out.new_token_ids
        if (len(new) == 1 and out.finish_reason is None and out.new_logprobs is None and out.stop_reason is None
                and out.prompt_logprobs is None and out.pooled is None and out.queued_s is None
                and type(new[0]) is int):
            ids.append(out.request_id)
            tokens.append(new[0])
            cached.append(out.num_cached_tokens)
        else:
            rest.append(out)
    return EngineOutputs(rest, stats, timestamp, engine_index, ids, tokens, cached)


class EngineDead(msgspec.Struct, tag="engine_dead"):
    """The engine core stopped for good (e.g. a worker rank died); one line saying why."""

    message: str
    engine_index: int = 0


class RequestError(msgspec.Struct, tag="request_error"):
    """add_request refused a request (e.g. it cannot fit the KV pool), or (`in_step`) a step failed it after it
    was scheduled; status is the HTTP status."""

    request_id: str
    message: str
    status: int = 400
    param: Optional[str] = None  # the request field at fault, where known (an error's OpenAI `param`)
    in_step: bool = False  # it ran: the metrics count it finished "error" (a refused one never entered the engine)


class StatsReply(msgspec.Struct, tag="stats"):
    seq: int
    stats: SchedulerStatsMsg
    engine_index: int = 0


class LoraReply(msgspec.Struct, tag="lora_reply"):
    seq: int
    error: Optional[str] = None  # None: done
    status: int = 200
    engine_index: int = 0


class AdminReply(msgspec.Struct, tag="admin_reply"):
    seq: int
    error: Optional[str] = None  # None: done
    status: int = 200
    value: bool = False  # is_sleeping: the answer; reset_prefix_cache: whether it was reset
    engine_index: int = 0


class DashboardReply(msgspec.Struct, tag="dashboard"):
    seq: int
    block_states: bytes  # one byte per KV block: core/block_pool's FREE / CACHED / USED / SHARED
    num_preempted: int = 0  # waiting requests that were preempted (they start again when blocks free up)
    info: Optional[dict[str, Union[str, int]]] = None  # static facts, when asked (with_info)
    engine_index: int = 0
    lora_requests: Optional[dict[int, tuple[int, int]]] = None  # adapter id (0: base) -> (running, waiting)


class LoraEvent(msgspec.Struct, tag="lora_event"):
    """To the other API server processes: an adapter was loaded (added) or unloaded by `origin`; answered by
    LoraApplied so that the loading process replies only once every process routes the name."""

    origin: int
    seq: int
    added: bool
    lora_int_id: int
    lora_name: str = ""
    lora_path: str = ""
    base_model_name: Optional[str] = None
    engine_index: int = 0


EngineOutput = Union[EngineReady, EngineStartupError, EngineOutputs, RequestError, StatsReply, LoraReply,
                     EngineDead, DashboardReply, LoraEvent, AdminReply]


class Encoder:
    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._enc.encode(msg)


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineOutput)


def stats_to_msg(stats: object) -> SchedulerStatsMsg:
    """Copy the engine's SchedulerStats (whatever its class) into the wire struct, field by field."""
    names = SchedulerStatsMsg.__struct_fields__
    return SchedulerStatsMsg(**{n: getattr(stats, n) for n in names if hasattr(stats, n)})
