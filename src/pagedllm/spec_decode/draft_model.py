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
        from pagedllm.attention.backend import get_attention_backend
        from pagedllm.models.loader import get_model, load_hf_config, prepare_model_dir, resolve_model_path

        self.k = config.num_speculative_tokens
        self.device = worker.device
        self.dtype = worker.dtype
        self.block_size = worker.args.block_size
        self.max_model_len = worker.max_model_len
        self.max_num_batched_tokens = worker.max_num_batched_tokens
        self.max_num_seqs = worker.max_num_seqs
        try:
            path = resolve_model_path(config.model)
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
        self.backend = get_attention_backend(worker.args.attention_backend, self.device)
        logger.info("Draft model %s loaded for speculative decoding (k=%d).", self.model_dir, self.k)
        self.kv_caches: list[torch.Tensor] = []
        self.free_blocks: list[int] = []
        self.blocks: dict[str, list[int]] = {}  # request id -> its draft block ids
        self.num_computed: dict[str, int] = {}  # request id -> leading tokens with valid draft K/V

    # ------------------------------------------------------------------ KV cache
    def kv_cache_spec(self):
        from pagedllm.worker.kv_cache import KVCacheSpec

        first = self.model.attn_layers[0]
        return KVCacheSpec(num_layers=len(self.model.attn_layers), num_kv_heads=first.num_kv_heads,
                           head_size=first.head_size, block_size=self.block_size, dtype=self.dtype)

    def initialize(self, num_target_blocks: int) -> None:
        """As many blocks as the target's pool (the same tokens fit), plus room for every request's drafts."""
        from pagedllm.worker.kv_cache import allocate_kv_caches

        num_blocks = num_target_blocks + self.max_num_seqs * (1 + -(-(self.k + 1) // self.block_size))
        self.kv_caches = allocate_kv_caches(self.kv_cache_spec(), num_blocks, self.device,
                                            zeroed=self.backend.needs_zeroed_cache)
        for layer, cache in zip(self.model.attn_layers, self.kv_caches):
            layer.kv_cache = cache
        self.free_blocks = list(range(num_blocks - 1, -1, -1))

    def drop(self, req_ids) -> None:
        for rid in req_ids:
            self.free_blocks.extend(reversed(self.blocks.pop(rid, [])))
            self.num_computed.pop(rid, None)

    def _reserve(self, rid: str, num_tokens: int) -> bool:
        blocks = self.blocks.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            blocks.append(self.free_blocks.pop())
        return True

    # ------------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self, token_ids: np.ndarray, rows: Sequence[int], num_tokens: Sequence[int],
                max_drafts: Sequence[int], req_ids: Optional[Sequence[str]] = None) -> list[list[int]]:
        n = len(rows)
        drafts: list[list[int]] = [[] for _ in range(n)]
        want = [min(self.k, int(m)) for m in max_drafts]
        # Catch up on the tokens the draft has not seen (chunked to the step budget), ending at the last token.
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
            seqs = [(req_ids[i], token_ids[rows[i], start:start + count], start) for i, start, count in batch]
            next_ids = self._forward(seqs)
            still = []
            for (i, start, count), tok in zip(batch, next_ids):
                self.num_computed[req_ids[i]] = start + count
                if start + count == int(num_tokens[i]):
                    drafts[i].append(tok)
                else:
                    still.append(i)
            done = {i for i, _, _ in batch}
            pending = still + [i for i in pending if i not in done and want[i] > 0]
        # k - 1 one-token steps on the drafts themselves (their K/V is overwritten by the next catch-up).
        active = [i for i in range(n) if drafts[i] and len(drafts[i]) < want[i]]
        step = 0
        while active:
            seqs = [(req_ids[i], np.array([drafts[i][-1]]), int(num_tokens[i]) + step) for i in active]
            next_ids = self._forward(seqs)
            for i, tok in zip(active, next_ids):
                drafts[i].append(tok)
            step += 1
            active = [i for i in active if len(drafts[i]) < want[i]]
        return drafts

    def _forward(self, seqs: list[tuple[str, np.ndarray, int]]) -> list[int]:
        """One draft forward over (request id, its new tokens, position of the first): the argmax after each
        request's last token."""
        bs = self.block_size
        lens = np.array([len(t) for _, t, _ in seqs], dtype=np.int64)
        starts = np.array([s for _, _, s in seqs], dtype=np.int64)
        qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        seq_lens = (starts + lens).astype(np.int32)
        max_blocks = int(-(-seq_lens.max() // bs))
        table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for j, (rid, _, _) in enumerate(seqs):
            blocks = self.blocks[rid][:max_blocks]
            table[j, :len(blocks)] = blocks
        input_ids = np.concatenate([t for _, t, _ in seqs]).astype(np.int64)
        positions = np.concatenate([np.arange(s, s + len(t)) for _, t, s in seqs]).astype(np.int64)
        token_req = np.repeat(np.arange(len(seqs)), lens)
        slots = table[token_req, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device

        def t(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(dev)

        md = AttentionMetadata(
            num_actual_tokens=len(input_ids), num_reqs=len(seqs), max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=t(qsl, np.int32), seq_lens=t(seq_lens, np.int32),
            block_table=t(table, np.int32), slot_mapping=t(slots, np.int64),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())
        self.backend.prepare(md)
        with set_forward_context(md, self.backend):
            hidden = self.model(t(input_ids, np.int64), t(positions, np.int64))
        last = hidden.index_select(0, t(qsl[1:] - 1, np.int64))
        greedy = getattr(self.model, "greedy_token_ids", lambda h: None)(last)
        if greedy is None:
            greedy = self.model.compute_logits(last).argmax(dim=-1)
        return greedy.tolist()


def check_vocab(worker, draft_cfg, draft_dir: str) -> None:
    """The draft must speak the target's vocabulary: same size and, where both have tokenizers, same tokens."""
    if draft_cfg.vocab_size != worker.vocab_size:
        raise ValueError(f"The draft model's vocabulary ({draft_cfg.vocab_size} tokens, {draft_dir}) differs from "
                         f"the target's ({worker.vocab_size} tokens): a draft model must share the target's "
                         "tokenizer.")
    try:
        from pagedllm.tokenizer import get_tokenizer

        target = get_tokenizer(worker.args.tokenizer or worker.model_dir).get_vocab()
        draft = get_tokenizer(draft_dir).get_vocab()
    except Exception:  # a model without tokenizer files (e.g. skip_tokenizer_init): the size check stands
        return
    if target != draft:
        raise ValueError(f"The draft model's tokenizer ({draft_dir}) maps tokens to different ids than the "
                         "target's: a draft model must share the target's tokenizer.")
