"""DraftModelProposer: a second, smaller model in the same engine proposes k tokens greedily.

The draft keeps its own paged KV cache and its own block tables (a plain free list: no prefix caching, nothing
shared with the target). Per request it remembers how many leading tokens have K/V in its cache; a proposal
first runs the draft over the request's tokens it has not seen (a prompt, or the tokens accepted since its last
proposal) and then k - 1 one-token steps on its own drafts. Only K/V of real tokens is kept valid: the next
proposal restarts from the request's last real token, so rejected drafts need no rollback here.

Drafts are the draft's argmax (q is one-hot at the draft): the rejection sampler then keeps the target's
distribution exactly for sampled requests and the target's argmax for greedy ones. When the draft pool runs
out of blocks, the requests that do not fit get no drafts for that step (never an error).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger("pagedllm")


class DraftModelProposer:
    def __init__(self, config, worker) -> None:
        from pagedllm.core.kv_cache_groups import kv_cache_groups
        from pagedllm.models.loader import get_model, load_hf_config, prepare_model_dir, resolve_model_path
        from pagedllm.worker.kv_cache import attn_layer_index
        from pagedllm.worker.model_runner import ModelRunner

        self.k = config.num_speculative_tokens
        self.device = worker.device
        self.dtype = worker.dtype
        self.block_size = worker.args.block_size
        self.max_model_len = worker.max_model_len
        self.max_num_batched_tokens = worker.max_num_batched_tokens
        self.max_num_seqs = worker.max_num_seqs
        try:
            path = resolve_model_path(config.model, token=getattr(worker.args, "hf_token", None))
            self.model_dir = prepare_model_dir(path, config.draft_load_format)
            cfg = load_hf_config(self.model_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config model {config.model!r} cannot be loaded: {e}") from e
        check_vocab(worker, cfg, self.model_dir)
        from types import SimpleNamespace

        from pagedllm.quantization.gguf import engine_quant_config

        # The target's rule (worker.py): a quantized checkpoint (GPTQ, AWQ, ...) is recognised from its own config,
        # and a .gguf draft on the CPU keeps its quantized blocks (so its decode steps take the fused CPU stack),
        # where dequantizing it would make each draft step read float32 weights.
        draft_args = SimpleNamespace(quantization=config.quantization, load_format=config.draft_load_format,
                                     enable_lora=False, tensor_parallel_size=1)
        quant = engine_quant_config(draft_args, cfg, path, self.model_dir, self.device, self.dtype)
        self.model = get_model(cfg, self.model_dir, dtype=self.dtype, device=self.device,
                               load_format=config.draft_load_format, quant_config=quant,
                               max_model_len=self.max_model_len)
        if self.device.type == "cpu" and self.dtype == torch.float32:
            from pagedllm.layers.linear import pack_cpu_weights

            pack_cpu_weights(self.model)
        # The draft's own model runner gives it a KV cache, the warm-ups and, on CUDA, graphs: decode graphs for
        # the one-token steps, mixed graphs for catching up. Blocks, tables and inputs stay this class's. Its
        # layers share one block table (the attention kernels still mask each layer by its window). Speculation
        # runs at batches up to disable_by_batch_size: larger draft batches run eagerly.
        layers = self.model.attn_layers
        windows = [None] * (1 + max(attn_layer_index(layer, i) for i, layer in enumerate(layers)))
        self.runner = ModelRunner(
            self.model, hf_config=cfg, device=self.device, dtype=self.dtype, block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=min(self.max_num_seqs, config.disable_by_batch_size or self.max_num_seqs),
            max_num_batched_tokens=self.max_num_batched_tokens, eos_token_id=None, vocab_size=cfg.vocab_size,
            attention_backend=worker.args.attention_backend, enforce_eager=worker.runner.enforce_eager,
            kv_groups=kv_cache_groups(windows, self.max_model_len), graph_settings=worker.runner.graph_settings)
        logger.info("Draft model %s loaded for speculative decoding (k=%d).", self.model_dir, self.k)
        self.free_blocks: list[int] = []
        self.scratch_slot = 0  # (initialize) the slot padding rows write their K/V into
        self.blocks: dict[str, list[int]] = {}  # request id -> its draft block ids
        self.num_computed: dict[str, int] = {}  # request id -> leading tokens with valid draft K/V
        # Host arrays go to the device from pinned slots, one per _stage call of a propose(); the next propose()
        # reuses them only once their copies are done (its wait, or _staged).
        from pagedllm.worker.host_stager import HostStager

        self.stager = HostStager(self.device)
        self._num_staged = 0
        self._staged: Optional[torch.cuda.Event] = None
        self.num_graph_forwards = 0  # draft forwards replayed from CUDA graphs (tests and benchmarks read it)
        # LongRoPE with both factor tables: a request the target rotates with the long factors (its rope_long) is
        # rotated so here too, else the drafts past the original context come from other positions' rotations.
        self.long_rope_offset = self.runner.long_rope_offset
        self.rope_long: dict[str, bool] = {}  # request id -> the factors its draft K/V was computed with

    # ------------------------------------------------------------------ KV cache
    def kv_cache_spec(self):
        return self.runner.kv_cache_spec()

    def initialize(self, num_target_blocks: int) -> None:
        """As many blocks as the target's pool (the same tokens fit), plus room for every request's drafts, plus
        the block that padding rows of the draft steps write into."""
        num_blocks = num_target_blocks + self.max_num_seqs * (1 + -(-(self.k + 1) // self.block_size))
        self.runner.initialize_kv_cache(num_blocks + 1)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.scratch_slot = num_blocks * self.block_size
        graphs = self.runner.cuda_graphs
        logger.info("Draft model ready: %d KV blocks of %d tokens; its steps %s.", num_blocks, self.block_size,
                    f"replay CUDA graphs of their own (the second capture above) for up to {graphs.max_size} requests"
                    if graphs is not None else "run eagerly")

    def drop(self, req_ids) -> None:
        for rid in req_ids:
            self.free_blocks.extend(reversed(self.blocks.pop(rid, [])))
            self.num_computed.pop(rid, None)
            self.rope_long.pop(rid, None)

    def _reserve(self, rid: str, num_tokens: int) -> bool:
        blocks = self.blocks.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            blocks.append(self.free_blocks.pop())
        return True

    def _table(self, req_ids: Sequence[str], seq_lens: np.ndarray) -> np.ndarray:
        width = max(1, int(-(-int(seq_lens.max()) // self.block_size)))
        table = np.zeros((len(req_ids), width), dtype=np.int32)
        for j, rid in enumerate(req_ids):
            blocks = self.blocks[rid][:width]
            table[j, :len(blocks)] = blocks
        return table

    # ------------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self, token_ids: np.ndarray, rows: Sequence[int], num_tokens: Sequence[int],
                max_drafts: Sequence[int], req_ids: Optional[Sequence[str]] = None,
                rope_long: Optional[Sequence[bool]] = None,
                prompt_lens: Optional[Sequence[int]] = None) -> list[list[int]]:
        """Up to max_drafts[i] (at most k) greedy drafts per request. The draft's forwards are enqueued one after
        another, each taking the previous one's argmax on the device: the host waits once, for all drafts.
        rope_long: per request, whether the target rotates it with LongRoPE's long factors; prompt_lens: its prompt
        length (dynamic NTK rotates a prompt longer than the model's context with the base for its length)."""
        n = len(rows)
        longs = [False] * n if rope_long is None or self.long_rope_offset is None else [bool(x) for x in rope_long]
        for rid, long in zip(req_ids, longs):
            if self.rope_long.get(rid, False) != long:  # switched factors (as the target): recompute its K/V
                self.num_computed[rid] = 0
                self.rope_long[rid] = long
        drafts: list[list[int]] = [[] for _ in range(n)]
        want = [min(self.k, int(m)) for m in max_drafts]
        if self._staged is not None:
            self._staged.synchronize()  # the last call's staged copies are done: their buffers are free
            self._staged = None
        self._num_staged = 0
        # Catch up on the tokens the draft has not seen (chunked to the step budget), ending at the last token:
        # its argmax is the first draft.
        ready: list[int] = []  # requests caught up, in the order of `firsts`
        firsts: list[torch.Tensor] = []
        pending = [i for i in range(n) if want[i] > 0]
        while pending:
            batch, budget = [], self.max_num_batched_tokens
            for i in pending:
                rid, total = req_ids[i], int(num_tokens[i])
                start = min(self.num_computed.get(rid, 0), total - 1)
                count = min(total - start, budget)
                if count <= 0:
                    break
                if not self._reserve(rid, start + count + want[i]):
                    want[i] = 0  # the draft pool is full: no drafts for it this step
                    continue
                batch.append((i, start, count))
                budget -= count
            if not batch:
                break
            ids = self._catch_up([(req_ids[i], token_ids[rows[i], start:start + count], start)
                                  for i, start, count in batch], [longs[i] for i, _, _ in batch],
                                 None if prompt_lens is None else [int(prompt_lens[i]) for i, _, _ in batch])
            done, still = [], []
            for j, (i, start, count) in enumerate(batch):
                self.num_computed[req_ids[i]] = start + count
                (done if start + count == int(num_tokens[i]) else still).append(j)
            if done:
                ready += [batch[j][0] for j in done]
                # (a copy: the next forward may rewrite the buffer its argmax came in)
                firsts.append(ids.clone() if len(done) == len(batch) else ids[torch.tensor(done, device=ids.device)])
            in_batch = {i for i, _, _ in batch}
            pending = [batch[j][0] for j in still] + [i for i in pending if i not in in_batch and want[i] > 0]
        if not ready:
            self._mark_staged()
            return drafts
        # Then k - 1 one-token steps on the drafts themselves (their K/V is overwritten by the next catch-up).
        steps = max(want[i] for i in ready)
        out = torch.empty((steps, len(ready)), dtype=torch.long, device=self.device)
        out[0].copy_(firsts[0] if len(firsts) == 1 else torch.cat(firsts))
        if steps > 1:
            self._chain(out, [req_ids[i] for i in ready], np.array([int(num_tokens[i]) for i in ready]),
                        np.array([want[i] for i in ready]), [longs[i] for i in ready])
        got = out.t().tolist()  # (the host's one wait: the staged copies are done too)
        for r, i in enumerate(ready):
            drafts[i] = got[r][:want[i]]
        return drafts

    def _chain(self, out: torch.Tensor, req_ids: list[str], num_tokens: np.ndarray, want: np.ndarray,
               longs: Sequence[bool]) -> None:
        """Steps 1..: out[s] (each request's draft s + 1, at position num_tokens + s - 1) -> out[s + 1]. A request
        wanting fewer drafts rides along as a padding row (output unused): at its last real token's position, over
        its valid K/V, writing its K/V into the scratch slot."""
        steps, m = out.shape
        bs = self.block_size
        s = np.arange(1, steps)[:, None]
        real = s < want[None, :]  # [steps - 1, m]
        positions = np.where(real, num_tokens + s - 1, num_tokens - 1)
        seq_lens = (positions + 1).astype(np.int32)
        table = self._table(req_ids, seq_lens.max(axis=0))
        slots = np.where(real, table[np.arange(m), positions // bs].astype(np.int64) * bs + positions % bs,
                         self.scratch_slot)
        qsl = np.arange(m + 1, dtype=np.int32)
        pos_t, slots_t = self._stage([positions, slots], np.int64)
        qsl_t, lens_t, table_t = self._stage([qsl, seq_lens, table], np.int32)
        qsl_cpu = qsl.tolist()
        # (one token per request in every step; none is a prompt token that dynamic NTK rotates otherwise)
        self._set_rope(positions[0], np.asarray(longs, dtype=np.int64))
        for j in range(steps - 1):
            md = AttentionMetadata(
                num_actual_tokens=m, num_reqs=m, max_query_len=1, max_seq_len=int(seq_lens[j].max()),
                query_start_loc=qsl_t, seq_lens=lens_t[j], block_table=table_t, slot_mapping=slots_t[j],
                query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens[j].tolist())
            out[j + 1].copy_(self._run(out[j], pos_t[j], md, None))

    def _set_rope(self, positions: np.ndarray, long_per_token: np.ndarray,
                  prompt_len_per_token: Optional[np.ndarray] = None) -> None:
        """The next forward's rotary offsets, by the target runner's rule (ModelRunner._rope_arrays): LongRoPE's long
        requests read the long factors' rows; dynamic NTK's tokens of a prompt past the model's context (but its
        last) read scratch rows rotated with the base for the prompt's length."""
        runner = self.runner
        if runner.rope_offsets is None:
            return
        if self.long_rope_offset is not None:
            offsets = self.long_rope_offset * long_per_token
        else:
            offsets = np.zeros(len(positions), dtype=np.int64)
            if runner.ntk_ropes and prompt_len_per_token is not None:
                plens = prompt_len_per_token
                need = np.flatnonzero((plens > runner.ntk_original) & (positions < plens - 1))
                if len(need):
                    offsets[need] = runner.ntk_ropes[0].scratch_start + np.arange(len(need)) - positions[need]
                    pos_t = torch.from_numpy(positions[need]).to(self.device)
                    lens_t = torch.from_numpy(plens[need]).to(self.device)
                    for rope in runner.ntk_ropes:
                        rope.write_rows(pos_t, lens_t)
        runner.rope_offsets[:len(offsets)].copy_(torch.from_numpy(offsets))

    def _catch_up(self, seqs: list[tuple[str, np.ndarray, int]], longs: Sequence[bool],
                  prompt_lens: Optional[Sequence[int]] = None) -> torch.Tensor:
        """One draft forward over (request id, its new tokens, position of the first): [requests] the argmax
        after each request's last token, on the device."""
        bs = self.block_size
        lens = np.array([len(t) for _, t, _ in seqs], dtype=np.int64)
        starts = np.array([s for _, _, s in seqs], dtype=np.int64)
        qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        seq_lens = (starts + lens).astype(np.int32)
        table = self._table([rid for rid, _, _ in seqs], seq_lens)
        input_ids = np.concatenate([t for _, t, _ in seqs]).astype(np.int64)
        positions = np.concatenate([np.arange(s, s + len(t)) for _, t, s in seqs]).astype(np.int64)
        token_req = np.repeat(np.arange(len(seqs)), lens)
        slots = table[token_req, positions // bs].astype(np.int64) * bs + positions % bs
        last = (qsl[1:] - 1).astype(np.int64)
        self._set_rope(positions, np.repeat(np.asarray(longs, dtype=np.int64), lens),
                       None if prompt_lens is None else np.repeat(np.asarray(prompt_lens, dtype=np.int64), lens))
        ids_t, pos_t, slots_t, last_t = self._stage([input_ids, positions, slots, last], np.int64)
        qsl_t, lens_t, table_t = self._stage([qsl, seq_lens, table], np.int32)
        md = AttentionMetadata(
            num_actual_tokens=len(input_ids), num_reqs=len(seqs), max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=qsl_t, seq_lens=lens_t, block_table=table_t,
            slot_mapping=slots_t, query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())
        return self._run(ids_t, pos_t, md, None if md.max_query_len == 1 else last_t)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
             last: Optional[torch.Tensor]) -> torch.Tensor:
        """The draft's forward (a graph replay where one fits) and the argmax of its rows `last` (all: None)."""
        runner = self.runner
        hidden = None
        if md.block_table.shape[1] <= runner.max_blocks_per_req:
            graphs = runner.cuda_graphs if md.max_query_len == 1 else runner.mixed_graphs
            if graphs is not None:
                hidden = graphs.run(input_ids, positions, md)
        if hidden is None:
            with set_forward_context(md, runner.attn_backend):
                runner.attn_backend.prepare(md)
                hidden = self.model(input_ids, positions)
        else:
            self.num_graph_forwards += 1
            if last is None:
                ids = graphs.greedy(hidden)  # the graph's greedy tail, where it has one
                if ids is not None:
                    return ids
        if last is not None:
            hidden = hidden.index_select(0, last)
        greedy = getattr(self.model, "greedy_token_ids", lambda h: None)(hidden)
        return greedy if greedy is not None else self.model.compute_logits(hidden).argmax(dim=-1)

    def _stage(self, arrays: list[np.ndarray], dtype) -> list[torch.Tensor]:
        """Host arrays to the device (on CUDA one copy from a pinned slot of this propose() call)."""
        self._num_staged += 1
        return self.stager.stage_in(self._num_staged - 1, arrays, dtype)

    def _mark_staged(self) -> None:
        """A propose() that ends without waiting for the device: the next one waits for its copies first."""
        if self.device.type == "cuda" and self._num_staged:
            self._staged = torch.cuda.Event()
            self._staged.record()


def check_vocab(worker, draft_cfg, draft_dir: str) -> None:
    """The draft must speak the target's vocabulary: same size and, where both have tokenizers, same tokens."""
    if draft_cfg.vocab_size != worker.vocab_size:
        raise ValueError(f"The draft model's vocabulary ({draft_cfg.vocab_size} tokens, {draft_dir}) differs from "
                         f"the target's ({worker.vocab_size} tokens): a draft model must share the target's "
                         "tokenizer.")
    try:
        from pagedllm.tokenizer import engine_tokenizer_options, engine_tokenizer_source, get_tokenizer

        target = get_tokenizer(engine_tokenizer_source(worker.args, worker.model_dir),
                               **engine_tokenizer_options(worker.args)).get_vocab()
        draft = get_tokenizer(draft_dir).get_vocab()
    except Exception:  # a model without tokenizer files (e.g. skip_tokenizer_init): the size check stands
        return
    if target != draft:
        raise ValueError(f"The draft model's tokenizer ({draft_dir}) maps tokens to different ids than the "
                         "target's: a draft model must share the target's tokenizer.")
