"""The norm -> MLP part of a decoder layer (a post-attention RMSNorm feeding a Llama MLP's gate_up, as `norm_feeds`
names the pair), with seeded random weights: what the norm-inside-the-GEMV tests run (layernorm.link_norm_gemv)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


def norm_mlp_block(device, hidden: int = 576, intermediate: int = 1536) -> torch.nn.Module:
    from pagedllm.layers.layernorm import RMSNorm
    from pagedllm.models.llama import LlamaMLP

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu",
                                     mlp_bias=False)
            self.post_attention_layernorm = RMSNorm(hidden, 1e-5)
            self.mlp = LlamaMLP(config)

        def norm_feeds(self):
            return [("post_attention_layernorm", "mlp.gate_up_proj")]

        def forward(self, x, residual):
            h, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(h), residual

    torch.manual_seed(0)
    block = Block().to(device=device, dtype=torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    block.post_attention_layernorm.weight.data += 1
    return block
