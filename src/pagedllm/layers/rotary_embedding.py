"""Rotary position embedding (neox / HF-Llama layout: the two halves of each head are rotated together).

A `RotaryEmbedding` precomputes cos/sin for every position up to its cache length once; `forward` only
gathers rows by position, so any mix of requests and positions in a flattened batch costs one
index_select plus elementwise math (no per-token Python).

Scaling types (HF `rope_scaling` / transformers-5 `rope_parameters`): default, linear, dynamic (NTK: each token
rotated with the base transformers' generation gives it, for its position or its prompt's length past
max_position_embeddings; see `DynamicNTKRotaryEmbedding`), llama3 (HF's exact formula), yarn and longrope (Phi-3 /
Phi-4's "su": short factors for contexts within original_max_position_embeddings, the long ones beyond; see
`LongRopeEmbedding`).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import triton_kernels


def get_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """Normalize a HF config's rope settings into one dict with at least `rope_type` and `rope_theta`.

    Handles transformers >= 5 (`config.rope_parameters`, possibly per layer type) and older configs
    (`config.rope_theta` + `config.rope_scaling` with `type` or `rope_type`).
    """
    params: dict[str, Any] = {}
    rope_parameters = getattr(hf_config, "rope_parameters", None)
    if isinstance(rope_parameters, dict) and rope_parameters:
        if all(isinstance(v, dict) for v in rope_parameters.values()):  # {layer_type: params}
            rope_parameters = rope_parameters.get("full_attention") or next(iter(rope_parameters.values()))
        params.update(rope_parameters)
    else:
        params.update(getattr(hf_config, "rope_scaling", None) or {})
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(getattr(hf_config, "rope_theta", None) or 10000.0)
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    if params["rope_type"] in ("longrope", "su") and params.get("original_max_position_embeddings") is None:
        # transformers < 5 keeps it on the config (Phi-3), not in rope_scaling
        params["original_max_position_embeddings"] = getattr(hf_config, "original_max_position_embeddings", None)
    return params


def _base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    # Exactly HF's expression, so cos/sin match bit for bit.
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim
    return 1.0 / (base ** exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = p["factor"]
    low_freq_factor = p["low_freq_factor"]
    high_freq_factor = p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, rotary_dim: int, p: dict[str, Any], max_position: int
                   ) -> tuple[torch.Tensor, float]:
    original = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def cos_sin_rows(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    """[len(positions), rotary_dim] = cat(cos, sin) of positions x inv_freq (float32), times the scaling."""
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [positions, rotary_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling


def _longrope(base: float, rotary_dim: int, p: dict[str, Any], max_position: int
              ) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """(short inv_freq, long inv_freq, original context, attention scaling) of LongRoPE, as HF computes them."""
    original = p.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_type 'longrope' needs original_max_position_embeddings in the config.")
    factor = p.get("factor") or max_position / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    factors = []
    for key in ("short_factor", "long_factor"):
        values = p.get(key)
        if values is None or len(values) != rotary_dim // 2:
            raise ValueError(f"rope_type 'longrope' needs {key} with rotary_dim / 2 = {rotary_dim // 2} values.")
        factors.append(1.0 / (torch.tensor(values, dtype=torch.float32) * base ** exponent))
    return factors[0], factors[1], int(original), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin cache [max_position, rotary_dim] (cos half | sin half), float32, on the build device.

    Invariant: positions passed to forward are < `max_position`.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0) -> None:
        super().__init__()
        assert rotary_dim % 2 == 0 and rotary_dim <= head_size
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.inv_freq, self.attention_scaling = inv_freq, attention_scaling  # plain attributes (set_context_len)
        cache = cos_sin_rows(torch.arange(max_position, dtype=torch.float32), inv_freq, attention_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def set_context_len(self, context_len: int) -> None:
        """Rows for every position below `context_len`: an engine context past the model's maximum (allowed by
        VLLM_ALLOW_LONG_MAX_MODEL_LEN, as in vLLM) grows the cache, whose rows are only read, never bounds-checked;
        a shorter context keeps it."""
        if context_len > self.max_position:
            self.max_position = context_len
            positions = torch.arange(context_len, dtype=torch.float32, device=self.cos_sin_cache.device)
            self.cos_sin_cache = cos_sin_rows(positions, self.inv_freq, self.attention_scaling)

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions this embedding reads for the model's input positions (LongRoPE: see there)."""
        return positions

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, num_heads * head_size]; key [T, num_kv_heads * head_size] -> same shapes.

        On CUDA (Triton) and on CPU (C++ kernel) query/key are rotated IN PLACE (they may be row-strided views
        of a fused qkv output) and returned; callers must not reuse the unrotated values.
        """
        if query.is_cuda:
            kernels = triton_kernels("rotary")
            if kernels is not None:
                return kernels.apply_rotary(positions, query, key, self.cos_sin_cache, self.head_size)
        else:
            ops = cpu_ops.usable(query)
            if (ops is not None and query.stride(-1) == 1 and key.stride(-1) == 1 and positions.dtype == torch.int64
                    and positions.is_contiguous()):
                num_tokens = positions.shape[0]
                q = query.view(num_tokens, -1, self.head_size)
                k = key.view(num_tokens, -1, self.head_size)
                ops.rotary_neox(positions, q, k, self.cos_sin_cache)
                return query, key
        return self.forward_native(positions, query, key)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, rotary_dim / 2]
        query = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin)
        key = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin)
        return query.view(num_tokens, -1), key.view(num_tokens, -1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, head_size]; same as HF's x * cos + rotate_half(x) * sin on the rotary part.
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:self.rotary_dim]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_size:
            parts.append(x[..., self.rotary_dim:])
        return torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def get_rope(head_size: int, max_position: int, rope_parameters: dict[str, Any],
             rotary_dim: Optional[int] = None) -> RotaryEmbedding:
    """Build the rotary embedding a config describes (see `get_rope_parameters`)."""
    try:
        return _build_rope(head_size, max_position, rope_parameters, rotary_dim)
    except KeyError as e:  # a scaling type without one of its fields: say which (was a bare KeyError)
        raise ValueError(f"rope_type {rope_parameters.get('rope_type', 'default')!r} needs {e.args[0]!r} in the "
                         f"config's rope_scaling (rope_parameters).") from None


def _build_rope(head_size: int, max_position: int, p: dict[str, Any], rotary_dim: Optional[int]) -> RotaryEmbedding:
    if rotary_dim is None:
        rotary_dim = int(head_size * p.get("partial_rotary_factor", 1.0))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        # transformers takes ceil(d / 2) frequencies computed for d and rotates d + 1 dimensions: no rope of pairs
        raise ValueError(f"A rotary dimension of {rotary_dim} (head_dim {head_size} x partial_rotary_factor "
                         f"{p.get('partial_rotary_factor', 1.0)}) is not supported: rope rotates pairs of dimensions, "
                         f"so it must be even and at most head_dim; choose a partial_rotary_factor that makes it so.")
    base = float(p["rope_theta"])
    rope_type = p.get("rope_type", "default")
    attention_scaling = 1.0
    cache_len = max_position
    if rope_type == "default":
        inv_freq = _base_inv_freq(base, rotary_dim)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(base, rotary_dim) / p["factor"]
        cache_len = int(max_position * p["factor"])
    elif rope_type == "dynamic":
        return DynamicNTKRotaryEmbedding(head_size, rotary_dim, max_position, base, float(p["factor"]))
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(_base_inv_freq(base, rotary_dim), p)
    elif rope_type == "yarn":
        inv_freq, attention_scaling = _yarn_inv_freq(base, rotary_dim, p, max_position)
        original = p.get("original_max_position_embeddings")
        if original and p.get("factor"):
            cache_len = max(max_position, int(original * p["factor"]))
    elif rope_type in ("longrope", "su"):
        return _longrope_cache(head_size, rotary_dim, max_position, base, p)
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, dynamic, "
                         f"llama3, yarn, longrope.")
    return RotaryEmbedding(head_size, rotary_dim, cache_len, inv_freq, attention_scaling)


def _longrope_cache(head_size: int, rotary_dim: int, max_position: int, base: float, p: dict[str, Any]
                    ) -> "LongRopeEmbedding":
    short, long, original, scaling = _longrope(base, rotary_dim, p, max_position)
    return LongRopeEmbedding(head_size, rotary_dim, max_position, short, long, original, scaling)


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE: the short factors for sequences within original_max_position_embeddings, the long ones beyond.

    transformers chooses per forward by the sequence's length (max position + 1): every position of a sequence
    longer than the original context is rotated with the long factors, of a shorter one with the short factors;
    a sequence that grows past it is recomputed whole (Phi3ForCausalLM drops its KV cache at that step). Here the
    choice is per request: when the engine's context reaches past the original one (`set_context_len`), the cache
    holds both tables, the short rows first and the long rows `long_offset` rows later, and a token of a request
    whose sequence is longer than the original context reads the long rows (the runner sets `long_offset` as its
    entry of `offsets`, which `model_positions` adds to the positions; the scheduler recomputes a request whose
    sequence outgrows the original context, as transformers does). Within the original context only the short rows exist. Both are scaled by the same attention factor,
    as in transformers. A caller that passes plain positions (no runner: one sequence per forward) gets
    transformers' per-forward choice (`model_positions`)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, short_inv_freq: torch.Tensor,
                 long_inv_freq: torch.Tensor, original_max_position: int, attention_scaling: float) -> None:
        super().__init__(head_size, rotary_dim, max_position, short_inv_freq, attention_scaling)
        self.original_max_position = original_max_position
        self.short_inv_freq, self.long_inv_freq = short_inv_freq, long_inv_freq  # plain attributes: CPU float32
        self.offsets: Optional[torch.Tensor] = None  # the runner's per-token offsets (worker/model_runner.py)
        self.long_offset: Optional[int] = None
        self._build(max_position, max_position > original_max_position)

    def _build(self, rows: int, both: bool) -> None:
        positions = torch.arange(rows, dtype=torch.float32, device=self.cos_sin_cache.device)
        tables = [cos_sin_rows(positions, self.short_inv_freq, self.attention_scaling)]
        if both:
            tables.append(cos_sin_rows(positions, self.long_inv_freq, self.attention_scaling))
        self.max_position, self.long_offset = rows, (rows if both else None)
        self.cos_sin_cache = torch.cat(tables) if both else tables[0]

    def set_context_len(self, context_len: int) -> None:
        """Rows for every position below the engine's context; the long table only if a sequence can outgrow the
        original context."""
        both, rows = context_len > self.original_max_position, max(context_len, self.max_position)
        if both != (self.long_offset is not None) or rows != self.max_position:
            self._build(rows, both)

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions as the rotary reads them: under a runner, plus its per-token offsets (a step larger than the
        buffer is a warm-up's: no request's); plain ones (one sequence) read the long rows when the sequence is
        longer than the original context, as transformers chooses per forward."""
        if self.offsets is not None:
            n = positions.shape[0]
            return positions + self.offsets[:n] if n <= self.offsets.shape[0] else positions
        if self.long_offset is None or positions.numel() == 0:
            return positions
        if int(positions.max()) + 1 > self.original_max_position:
            return positions + self.long_offset
        return positions

    def extra_repr(self) -> str:
        tables = "short" if self.long_offset is None else f"short + long (offset {self.long_offset})"
        return f"{super().extra_repr()}, {tables} factors"


class DynamicNTKRotaryEmbedding(RotaryEmbedding):
    """Dynamic NTK scaling, as transformers applies it in generation.

    transformers recomputes the base at each forward for the sequence length s = max position + 1 (scaled only
    past max_position_embeddings, M) and rotates that forward's queries and keys with it; its KV cache keeps each
    key as the forward that computed it rotated it (cached keys are never re-rotated). So in a generation the
    token at position p is rotated once, with the base for s = max(p + 1, prompt length, M): the prompt's forward
    uses the prompt's length, each decode step its own position. That never changes for a token, so a paged cache
    holds exactly transformers' keys, and pagedllm follows transformers (vLLM computes one base, for M * factor,
    for every sequence: not transformers' numbers even within M).

    Row p of the table: position p with the base for s = max(p + 1, M) (decode tokens, a prompt's last token, and
    every token of a prompt within M). The other tokens of a prompt longer than M need its length's base: the
    runner computes their rows into scratch rows after the table each step (`write_rows`, `scratch_start`) and
    points them there through per-token offsets (`offsets`, added by `model_positions`, as for LongRoPE); the
    scheduler keys such prompts' prefix-cache blocks by their length. With the engine's context within M there is
    one unscaled table. (transformers' module also carries state from one generation to the next: a sequence past
    M after a longer one keeps the longer one's base; each request here gets a fresh model's result.)"""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float, factor: float) -> None:
        super().__init__(head_size, rotary_dim, max_position, _base_inv_freq(base, rotary_dim))
        self.original_max_position, self.base, self.factor = max_position, base, factor
        self.offsets: Optional[torch.Tensor] = None  # the runner's per-token offsets (worker/model_runner.py)
        self.scratch_start: Optional[int] = None  # first scratch row; None: the context is within M

    def inv_freq_for(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[N, rotary_dim / 2]: transformers' inverse frequencies for sequences of these lengths, all past M (in
        float32 from the length tensor, as transformers computes them during generation; within M it uses
        `self.inv_freq`, from the Python float base)."""
        m = self.original_max_position
        seq = seq_lens.to(torch.int64)
        base = self.base * (self.factor * seq / m - (self.factor - 1)) ** (self.rotary_dim / (self.rotary_dim - 2))
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=seq.device).to(torch.float)
        return 1.0 / (base[:, None] ** (exponent / self.rotary_dim)[None, :])

    def rows_for(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """[N, rotary_dim] cos | sin of each position rotated with the base for its sequence length."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq_for(seq_lens)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def set_context_len(self, context_len: int) -> None:
        """Past M: the table's rows for every position below the context (no scratch rows yet)."""
        if context_len <= self.original_max_position or context_len == self.scratch_start:
            return
        m = self.original_max_position
        positions = torch.arange(context_len, dtype=torch.int64, device=self.cos_sin_cache.device)
        self.cos_sin_cache = torch.cat([cos_sin_rows(positions[:m], self.inv_freq, 1.0),
                                        self.rows_for(positions[m:], positions[m:] + 1)])
        self.max_position = self.scratch_start = context_len

    def reserve_scratch(self, rows: int) -> None:
        """At least `rows` scratch rows (before CUDA graphs are captured: they read the cache where it is)."""
        if self.scratch_start is not None and self.cos_sin_cache.shape[0] - self.scratch_start < rows:
            table = self.cos_sin_cache[:self.scratch_start]
            self.cos_sin_cache = torch.cat([table, table.new_zeros(rows, self.rotary_dim)])

    def write_rows(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Scratch rows 0.. = these positions rotated with the base for these sequence lengths."""
        start = self.scratch_start
        self.cos_sin_cache[start:start + positions.shape[0]] = self.rows_for(positions, seq_lens)

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Under a runner: positions plus its per-token offsets (a step larger than the buffer is a warm-up's);
        plain positions (one sequence, no cache): transformers' forward, every position rotated with the base for
        the sequence's length."""
        if self.scratch_start is None or positions.numel() == 0:
            return positions
        n = positions.shape[0]
        if self.offsets is not None:
            return positions + self.offsets[:n] if n <= self.offsets.shape[0] else positions
        seq_len = int(positions.max()) + 1
        if seq_len <= self.original_max_position:
            return positions
        self.reserve_scratch(n)
        self.write_rows(positions, torch.full_like(positions, seq_len))
        return self.scratch_start + torch.arange(n, device=positions.device)

    def extra_repr(self) -> str:
        where = "unscaled, context within" if self.scratch_start is None else "context past"
        return f"{super().extra_repr()}, dynamic NTK ({where} {self.original_max_position})"
