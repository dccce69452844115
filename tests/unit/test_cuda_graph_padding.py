"""The decode-graph runner's static inputs (worker/cuda_graph.py) on the CPU, its graphs replaced by a check: at
every replay the step's rows hold the step's inputs and every padding row of the bucket holds the padding values
(token 0, position 0, the scratch slot and block, length 1, its own index in the order), over random sequences of
batch sizes, while the runner resets only the rows a larger batch dirtied, with the token arrays staged in one
buffer (one strided copy) or apart (a copy each)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from pagedllm.compilation_config import GraphSettings
from pagedllm.forward_context import AttentionMetadata, with_kv_groups
from pagedllm.worker.cuda_graph import CudaGraphRunner

SCRATCH, BS, MAX_BLOCKS = 99, 4, 8


class _Check:
    def __init__(self, g: CudaGraphRunner, size: int, log: list):
        self.g, self.size, self.log = g, size, log

    def replay(self):
        g, size = self.g, self.size
        n, want = self.log[-1]
        for name, buf, pad in (("input_ids", g.input_ids, 0), ("positions", g.positions, 0),
                               ("slot_mapping", g.slot_mapping, SCRATCH * BS), ("seq_lens", g.seq_lens, 1)):
            assert buf[:n].tolist() == want[name], name
            assert (buf[n:size] == pad).all(), (name, n, size, buf[n:size])
        assert (g.block_tables[:, n:size, 0] == SCRATCH).all()
        assert (g.group_slot_mappings[:, n:size] == SCRATCH * BS).all()
        assert g.decode_order[n:size].tolist() == list(range(n, size))
        assert g.decode_order[:n].tolist() == want["order"]
        assert g.block_table[:n, :want["nb"]].tolist() == want["table"]


def _runner() -> CudaGraphRunner:
    runner = SimpleNamespace(device=torch.device("cpu"), max_num_seqs=40, scratch_block=SCRATCH, block_size=BS,
                             attn_backend=SimpleNamespace(wants_decode_order=True), num_kv_groups=2,
                             max_blocks_per_req=MAX_BLOCKS, lora=None, model=None,
                             graph_settings=GraphSettings())
    return CudaGraphRunner(runner)


def test_padding_rows_hold_padding_values_at_every_replay():
    g = _runner()
    log: list = []
    g.seq_len_buckets = {s: [64] for s in g.sizes}
    g.graphs = {(s, 64, False): _Check(g, s, log) for s in g.sizes}
    g.outputs = {(s, 64, False): torch.zeros(s, 2) for s in g.sizes}
    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice([1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 40]) if rng.random() < 0.5 else rng.randint(1, 40)
        nb = rng.randint(1, MAX_BLOCKS)
        ids = [rng.randrange(1, 1000) for _ in range(n)]
        pos = [rng.randrange(1, 60) for _ in range(n)]
        slots = [rng.randrange(0, 90) for _ in range(n)]
        lens = [rng.randrange(2, 60) for _ in range(n)]
        table = [[rng.randrange(0, 90) for _ in range(nb)] for _ in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        log.append((n, dict(input_ids=ids, positions=pos, slot_mapping=slots, seq_lens=lens, order=order, nb=nb,
                            table=table)))
        if rng.random() < 0.7:  # staged as the runner stages them: one buffer, each array 64-byte aligned
            stride = -(-n // 8) * 8
            packed = torch.full((3 * stride + 5,), -1, dtype=torch.long)
            ids_t, pos_t, slots_t = (packed[i * stride:i * stride + n] for i in range(3))
            for t, v in ((ids_t, ids), (pos_t, pos), (slots_t, slots)):
                t.copy_(torch.tensor(v))
        else:
            ids_t, pos_t, slots_t = torch.tensor(ids), torch.tensor(pos), torch.tensor(slots)
        md = AttentionMetadata(num_actual_tokens=n, num_reqs=n, max_query_len=1, max_seq_len=max(lens),
                               query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                               seq_lens=torch.tensor(lens, dtype=torch.int32),
                               block_table=torch.tensor(table, dtype=torch.int32),
                               slot_mapping=slots_t, decode_order=torch.tensor(order, dtype=torch.int32))
        with_kv_groups(md, [torch.tensor(table, dtype=torch.int32)], [torch.tensor(slots)])
        out = g.run(ids_t, pos_t, md)
        assert out.shape[0] == n
