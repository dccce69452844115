"""The dashboard's event feed: one sampler task for all open pages.

While at least one page listens, the sampler runs every `interval_s` (0.25 s): it asks each engine core for a
`DashboardReply` (the KV block states; `engine_side.py`), reads the scheduler gauges the engine cores already send
with every output batch (`AsyncEngine.last_stats`) and the Prometheus collectors of /metrics, and renders one JSON
event that every listener gets (a slow listener skips to the newest event instead of queueing). With no page open it
only reads the collectors every `idle_interval_s` (5 s), from the server's start (`start()`), so a page opened later
has its last minute of latency and throughput at once. Nothing here runs per engine step or per token.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Optional

from pagedllm.entrypoints.dashboard import summary as s

logger = logging.getLogger("pagedllm.dashboard")

WINDOW_S = 60.0  # latency percentiles and prefix-cache hit rate: over the last minute
RATE_WINDOW_S = 1.0  # tokens per second: over the last second
MAX_CELLS = 4096  # KV grid cells per engine core (more blocks: several per cell)
HISTORY_POINTS = 240  # time series sent to a page when it connects (a minute at 4 updates a second)


class _Listener:
    __slots__ = ("latest", "ready")

    def __init__(self) -> None:
        self.latest: Optional[str] = None
        self.ready = asyncio.Event()


class DashboardFeed:
    def __init__(self, state: Any, interval_s: float = 0.25, idle_interval_s: float = 5.0) -> None:
        self.state = state
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.listeners: set[_Listener] = set()
        self.readings: deque[tuple[s.Reading, Any]] = deque()  # (collector reading, scheduler stats), oldest first
        self.history: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self.engine_info: Optional[dict] = None
        self.seq = 0
        self.started = time.monotonic()
        self._task: Optional[asyncio.Task] = None
        self._wake: Optional[asyncio.Event] = None
        self._last_event: Optional[dict] = None

    # ---- listeners ------------------------------------------------------------------------------------------

    async def stream(self, is_over: Any = None) -> AsyncIterator[str]:
        """SSE text for one page: the newest event as it is made, until is_over() (the server drains) or the
        client leaves (the response's task is cancelled)."""
        listener = _Listener()
        self.listeners.add(listener)
        self._ensure_running()
        try:
            yield "retry: 2000\n\n"
            first = True
            while not (is_over is not None and is_over()):
                try:
                    await asyncio.wait_for(listener.ready.wait(), timeout=max(1.0, 4 * self.interval_s))
                except asyncio.TimeoutError:
                    yield ": waiting for the engine\n\n"  # a comment: keeps proxies from timing the stream out
                    continue
                listener.ready.clear()
                data = listener.latest
                if first and self._last_event is not None:
                    data = json.dumps({**self._last_event, "history": list(self.history)}, separators=(",", ":"))
                first = False
                yield f"data: {data}\n\n"
        finally:
            self.listeners.discard(listener)

    def start(self) -> None:
        """Start sampling now (the server does, at start): a page opened later has its last minute at once, the
        requests that ran before any page was open included. Needs the running event loop."""
        self._ensure_running()

    def _ensure_running(self) -> None:
        if self._wake is not None:
            self._wake.set()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pagedllm-dashboard")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                if self.listeners:
                    await self.tick()
                else:
                    self._remember(s.read_registry(self._registry(), time.monotonic()), self._stats())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the page shows stale numbers; the server goes on
                logger.exception("dashboard sampling failed")
            assert self._wake is not None
            self._wake.clear()
            # a steady rate: the next update is due one interval after the last was due (not after it finished);
            # when a tick took longer (the engine core answers between steps) the next one starts at once
            due = max(due + (self.interval_s if self.listeners else self.idle_interval_s), loop.time())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=due - loop.time())
                due = loop.time()  # a page joined: update now
            except asyncio.TimeoutError:
                pass

    # ---- one update -----------------------------------------------------------------------------------------

    async def tick(self) -> dict:
        engine = self.state.engine
        replies = await engine.dashboard_replies(with_info=self.engine_info is None)
        if self.engine_info is None and replies and replies[0] is not None and replies[0].info is not None:
            self.engine_info = dict(replies[0].info)
        reading = s.read_registry(self._registry(), time.monotonic())
        stats = self._stats()
        self._remember(reading, stats)
        event = self.build_event(reading, stats, replies)
        self._last_event = event
        self.history.append(event["point"])
        text = json.dumps(event, separators=(",", ":"))
        for listener in self.listeners:
            listener.latest = text
            listener.ready.set()
        return event

    def _registry(self) -> Any:
        metrics = getattr(self.state, "metrics", None)
        view = getattr(metrics, "view", None)  # with several API processes: the sums over all of them
        return view() if view is not None else getattr(metrics, "registry", None)

    def _stats(self) -> list:
        return self.state.engine.engine_stats

    def _remember(self, reading: s.Reading, stats: list) -> None:
        self.readings.append((reading, stats))
        while len(self.readings) > 2 and reading.t - self.readings[1][0].t >= WINDOW_S:
            self.readings.popleft()

    def _reading_before(self, t: float, seconds: float) -> tuple[s.Reading, list]:
        """The newest reading at least `seconds` older than t (else the oldest one kept)."""
        for reading, stats in reversed(self.readings):
            if t - reading.t >= seconds:
                return reading, stats
        return self.readings[0]

    def build_event(self, reading: s.Reading, stats: list, replies: list) -> dict:
        state, engine = self.state, self.state.engine
        self.seq += 1
        now_stats = s.sum_stats(stats, ("num_running", "num_waiting", "num_preemptions", "prefix_cache_queries",
                                        "prefix_cache_hits", "spec_num_drafts", "spec_num_draft_tokens",
                                        "spec_num_accepted_tokens"))
        then, then_stats_list = self._reading_before(reading.t, RATE_WINDOW_S)
        secs = reading.t - then.t
        c, c0 = reading.counters, then.counters
        window, window_stats_list = self.readings[0]
        window_s = reading.t - window.t
        window_stats = s.sum_stats(window_stats_list, ("prefix_cache_queries", "prefix_cache_hits",
                                                       "spec_num_draft_tokens", "spec_num_accepted_tokens"))
        then_stats = s.sum_stats(then_stats_list, ("num_preemptions",))
        pools = [self._pool(i, r) for i, r in enumerate(replies)]
        kv = self._kv_totals(pools, stats)
        preempted = sum(r.num_preempted for r in replies if r is not None)
        prompt_tps = s.rate(c.get("prompt_tokens", 0), c0.get("prompt_tokens", 0), secs)
        gen_tps = s.rate(c.get("generation_tokens", 0), c0.get("generation_tokens", 0), secs)
        point = {"t": round(time.time(), 3), "running": int(now_stats["num_running"]),
                 "waiting": int(now_stats["num_waiting"]), "preempted": preempted,
                 "prompt_tps": round(prompt_tps, 2), "gen_tps": round(gen_tps, 2), "kv_usage": kv["usage"]}
        lora = self._lora(replies, stats)
        status = "ok"
        if engine.errored:
            status = "engine_dead"
        elif getattr(getattr(state, "lifecycle", None), "draining", False):
            status = "draining"
        event = {
            "seq": self.seq,
            "time": point["t"],
            "uptime_s": round(time.time() - state.created, 1),
            "status": status,
            "status_detail": engine.dead_reason if engine.errored else "",
            "clients": len(self.listeners),
            "model": self._model(),
            "kv": kv,
            "requests": {"running": point["running"], "waiting": point["waiting"], "preempted": preempted,
                         "preemptions_total": int(now_stats["num_preemptions"]),
                         "preemptions_per_s": round(s.rate(now_stats["num_preemptions"],
                                                           then_stats["num_preemptions"], secs), 2),
                         "finished_total": int(c.get("finished_requests", 0))},
            "throughput": {"prompt_tokens_per_s": point["prompt_tps"], "generation_tokens_per_s": point["gen_tps"],
                           "prompt_tokens_total": int(c.get("prompt_tokens", 0)),
                           "generation_tokens_total": int(c.get("generation_tokens", 0))},
            "latency": {"window_s": round(window_s, 1),
                        **{key: s.latency_summary(reading.histograms.get(key, s.Histogram()).minus(
                            window.histograms.get(key, s.Histogram()))) for key in s.HISTOGRAMS.values()}},
            "prefix_cache": {
                "hit_rate": s.ratio(now_stats["prefix_cache_hits"] - window_stats["prefix_cache_hits"],
                                    now_stats["prefix_cache_queries"] - window_stats["prefix_cache_queries"]),
                "hit_rate_total": s.ratio(now_stats["prefix_cache_hits"], now_stats["prefix_cache_queries"]),
                "queried_tokens_total": int(now_stats["prefix_cache_queries"]),
                "hit_tokens_total": int(now_stats["prefix_cache_hits"])},
            "spec_decode": self._spec(now_stats, window_stats, stats),
            "lora": lora,
            "point": point,
        }
        return event

    def _pool(self, index: int, reply: Any) -> dict:
        if reply is None:  # the core did not answer in time (a long step): the grid waits for the next update
            return {"engine": index, "num_blocks": 0, "blocks_per_cell": 1, "cells": "", "stale": True,
                    **{name: 0 for name in s.STATE_NAMES}}
        cells, k = s.grid_cells(reply.block_states, MAX_CELLS)
        return {"engine": index, "num_blocks": len(reply.block_states), "blocks_per_cell": k, "cells": s.b64(cells),
                "stale": False, **s.state_counts(reply.block_states)}

    def _kv_totals(self, pools: list[dict], stats: list) -> dict:
        block_size = int(getattr(self.state.engine.engine_args, "block_size", 16) or 16)
        num_blocks = sum(p["num_blocks"] for p in pools)
        counts = {name: sum(p[name] for p in pools) for name in s.STATE_NAMES}
        in_use = counts["used"] + counts["shared"]
        usage = in_use / num_blocks if num_blocks else sum(x.kv_cache_usage for x in stats) / max(1, len(stats))
        return {"block_size": block_size, "num_blocks": num_blocks, **counts, "usage": round(usage, 4),
                "tokens_capacity": num_blocks * block_size,
                # a new request can have the free and the evictable cached blocks
                "tokens_free": (counts["free"] + counts["cached"]) * block_size,
                "pools": pools}

    def _model(self) -> dict:
        state, engine = self.state, self.state.engine
        info = dict(self.engine_info or {})
        ready = getattr(engine, "ready", None)
        return {"name": state.model_name, "served_names": list(state.served_model_names),
                "model_dir": getattr(ready, "model_dir", ""), "max_model_len": int(getattr(ready, "max_model_len", 0)),
                "data_parallel_size": int(getattr(engine, "num_engines", 1)), "api_pid": _pid(), **info}

    def _spec(self, now: dict, window: dict, stats: list) -> Optional[dict]:
        if (self.engine_info or {}).get("speculative", "off") == "off" and not now["spec_num_drafts"]:
            return None
        drafts, drafted, accepted = now["spec_num_drafts"], now["spec_num_draft_tokens"], now["spec_num_accepted_tokens"]
        per_pos: list[float] = []
        for st in stats:
            for i, n in enumerate(getattr(st, "spec_num_accepted_tokens_per_pos", ()) or ()):
                if i >= len(per_pos):
                    per_pos.append(0.0)
                per_pos[i] += n
        return {"drafts_total": int(drafts), "draft_tokens_total": int(drafted), "accepted_tokens_total": int(accepted),
                "acceptance_rate_total": s.ratio(accepted, drafted),
                "acceptance_rate": s.ratio(accepted - window["spec_num_accepted_tokens"],
                                           drafted - window["spec_num_draft_tokens"]),
                "mean_acceptance_length": (1.0 + accepted / drafts) if drafts else None,
                "per_position": [round(n / drafts, 4) if drafts else 0.0 for n in per_pos]}

    def _lora(self, replies: list, stats: list) -> Optional[dict]:
        loras = getattr(self.state, "loras", None)
        if loras is None or not getattr(loras, "enabled", False):
            return None
        counts: dict[int, list[int]] = {}  # adapter id -> [running, waiting] requests, over the engine cores
        for reply in replies:
            for lora_id, (running, waiting) in ((reply.lora_requests or {}).items() if reply is not None else ()):
                total = counts.setdefault(int(lora_id), [0, 0])
                total[0] += running
                total[1] += waiting
        adapters = [{"name": name, "id": req.lora_int_id, "path": req.lora_path,
                     "running": counts.get(req.lora_int_id, [0, 0])[0],
                     "waiting": counts.get(req.lora_int_id, [0, 0])[1]}
                    for name, req in sorted(loras.adapters.items(), key=lambda kv: kv[1].lora_int_id)]
        base = counts.get(0, [0, 0])
        max_loras = int(getattr(self.state.engine.engine_args, "max_loras", 0) or 0)
        return {"max_loras": max_loras, "adapters": adapters, "base_running": base[0], "base_waiting": base[1],
                "active": sum(1 for a in adapters if a["running"])}


def _pid() -> int:
    import os

    return os.getpid()
