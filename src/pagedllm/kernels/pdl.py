"""Programmatic dependent launch (PDL) for the Triton kernels on Hopper and newer GPUs.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still finishing,
so its launch latency overlaps the previous kernel's tail instead of adding a gap. Every kernel launched this
way calls `wait_prior_kernel` as its first statement: `griddepcontrol.wait` blocks until the previous kernel
has completed and its memory writes are visible, so no load or store of ours can race with it. Since each
PDL kernel waits for its predecessor before it can finish, ordering stays transitive along the stream, just
as with ordinary launches. CUDA-graph capture keeps these launches as programmatic edges.

What it saves per kernel is measured in docs/benchmarks.md (GPU section).

`PAGEDLLM_PDL=0` turns it off; it is never used below compute capability 9.0 or outside CUDA.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm import envs

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
    _HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    _HAVE_GDC = False

    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass

# Read once per process (a compile-time constant of every kernel).
_TRIGGER_EARLY = tl.constexpr(envs.PAGEDLLM_PDL_TRIGGER)


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return _HAVE_GDC and torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch with PDL."""
    if device.type != "cuda" or not envs.PAGEDLLM_PDL:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a kernel launch on `device`: the kernel's `USE_PDL` constexpr and Triton's `launch_pdl`
    option, always equal (a PDL launch without the wait in the kernel would race with the previous kernel)."""
    pdl = use_pdl(device)
    return {"USE_PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_prior_kernel(USE_PDL: tl.constexpr):
    """First statement of every kernel that can be launched with PDL (a no-op when USE_PDL is False); only loads
    that do not depend on earlier kernels (weights) may come before it.

    After the wait, the kernel lets the next PDL kernel in the stream launch (`griddepcontrol.launch_dependents`):
    once every program of this kernel has passed this point, the next kernel's programs may start on free SMs
    and run their own prologue (the GEMV's weight loads) while this one finishes. They still wait for this
    kernel's completion before touching its results."""
    if USE_PDL:
        _gdc_wait()
        if _TRIGGER_EARLY:
            _gdc_launch_dependents()
