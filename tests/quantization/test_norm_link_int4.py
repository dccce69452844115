"""layernorm.link_norm_gemv and 4-bit weight-only layers (PAGEDLLM_NORM_GEMV_MMA): the norm before a GPTQ qkv /
gate_up layer is linked to it only with the switch on (the int4 tensor-core GEMV then computes it at 1-16 row
steps on CUDA: tests/gpu/test_qgemv_mma_gpu.py); on the CPU a linked norm still runs its own kernel, and the
layer's products are unchanged."""
from __future__ import annotations

import torch

from pagedllm.layers.layernorm import RMSNorm, link_norm_gemv
from pagedllm.layers.linear import MergedColumnParallelLinear
from pagedllm.quantization.gptq import GPTQConfig


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(256, 1e-5, params_dtype=torch.float16)
        self.gate_up = MergedColumnParallelLinear(256, [512, 512], bias=False, params_dtype=torch.float16,
                                                  quant_config=GPTQConfig(4, 128, desc_act=False, sym=False),
                                                  prefix="gate_up")
        gen = torch.Generator().manual_seed(0)
        for name, p in self.gate_up.named_parameters():
            if p.dtype == torch.int32 and name != "g_idx":
                p.data.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, dtype=torch.int64)
                             .to(torch.int32))
            elif name != "g_idx":
                p.data.copy_(torch.rand(p.shape, generator=gen) * 0.02 + 0.001)
        self.gate_up.linear_method.process_weights_after_loading(self.gate_up)

    def norm_feeds(self):
        return [("norm", "gate_up")]

    def forward(self, x, residual):
        h, residual = self.norm(x, residual)
        return self.gate_up(h), residual


def test_int4_layers_are_linked_only_with_the_switch(monkeypatch):
    x = torch.randn(3, 256, dtype=torch.float16)
    r = torch.randn(3, 256, dtype=torch.float16)
    before = _Block()
    want, want_res = before(x, r)
    for on, linked in (("0", 0), ("1", 1)):
        monkeypatch.setenv("PAGEDLLM_NORM_GEMV_MMA", on)
        block = _Block()
        assert link_norm_gemv(block) == linked
        assert (block.norm.gemv_consumer is block.gate_up) == bool(linked)
        assert block.gate_up.__dict__.get("norm_gemv_gated", False) is False  # (the MLP applies SiLU after it)
        got, got_res = block(x, r)
        assert torch.equal(got, want) and torch.equal(got_res, want_res)
