"""Run the LoRA kernel cases in Triton's interpreter on the CPU: `TRITON_INTERPRET=1 python interpret_kernels.py`.

A script (run in a subprocess by test_lora_kernels.py) because TRITON_INTERPRET must be set before any kernel is
defined, which a pytest process that already imported kernels cannot undo.
"""
from __future__ import annotations

import os
import sys

import torch


def patch_interpreter_for_numpy2() -> None:
    """Triton's interpreter turns its 1-element scalar arrays into ints with int(array), which numpy >= 2.4
    refuses for arrays of ndim > 0; take the element instead."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def interpret_attention_kernels(script: str) -> None:
    """For a script under tests/ that runs the attention kernels interpreted: checks TRITON_INTERPRET, puts
    tests/gpu on the path, patches the interpreter, and imports tests/gpu/conftest (which tags the interpreter's
    comparisons as int1, as the kernels' masks need)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    sys.path.insert(0, os.path.join(tests, "gpu"))
    patch_interpreter_for_numpy2()
    import conftest  # noqa: F401


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    patch_interpreter_for_numpy2()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(0, os.path.join(os.path.dirname(here), "gpu"))
    import conftest  # noqa: F401  (tests/gpu: the interpreter's comparisons tagged as int1)
    from lora_kernel_cases import (check_case, check_expand_rows_case, check_gemv_lora_case, check_norm_shrink_case,
                                   check_output_shrink_case, check_shrink_rows_case)

    f32 = torch.float32
    check_case(5, 3, 64, [32, 16, 16], 8, 16, f32, "cpu", pad_rows=3)  # qkv-like slices, padding rows
    check_case(20, 2, 96, [48], 16, 16, f32, "cpu", seed=1)  # K not a multiple of the tile
    check_case(40, 4, 300, [40, 40], 12, 16, f32, "cpu", seed=2, none_frac=0.0)  # gate_up-like, all adapted
    check_case(3, 2, 64, [16], 16, 32, f32, "cpu", seed=3, none_frac=1.0)  # no token has an adapter
    check_case(2, 2, 1024, [24], 8, 16, f32, "cpu", seed=4)  # few tokens, long K: split-K shrink
    check_case(12, 16, 64, [16, 16], 8, 16, f32, "cpu", seed=7)  # most slots empty: blocks span slots with gaps
    check_case(50, 7, 64, [24], 16, 16, f32, "cpu", seed=6, none_frac=0.2)  # row blocks across segment bounds
    check_case(1100, 5, 32, [32, 16], 8, 16, f32, "cpu", seed=5)  # a prefill-sized step: 64-row blocks
    check_case(20, 1, 64, [16, 16], 8, 16, f32, "cpu", seed=8)  # max_loras 1: a one-lane slot table
    # The few-row path: the shrink in the norm, the few-token shrink and expand (+ SiLU).
    check_norm_shrink_case(3, 2, 96, 3, 8, 16, f32, "cpu")
    check_norm_shrink_case(2, 3, 64, 2, 16, 16, f32, "cpu", residual=False, seed=1)
    check_norm_shrink_case(4, 2, 80, 1, 4, 16, f32, "cpu", fp32_product=True, seed=2)
    check_norm_shrink_case(40, 3, 64, 2, 8, 16, f32, "cpu", seed=3)  # multi-row steps (the A/B above 8 rows)
    check_shrink_rows_case(3, 2, 1000, 1, 16, 16, f32, "cpu")  # o / down: K not a multiple of the slice
    check_shrink_rows_case(2, 3, 256, 3, 8, 16, f32, "cpu", seed=1)
    check_expand_rows_case(3, 2, [200, 40, 40], 8, 16, f32, "cpu")  # qkv: columns of a block in two slices
    check_expand_rows_case(2, 3, [150], 16, 16, f32, "cpu", split=4, seed=1)
    check_expand_rows_case(4, 2, [130, 130], 12, 16, f32, "cpu", silu=True, seed=2)  # gate_up: expand + SiLU
    check_gemv_lora_case(3, 2, 48, [40, 12, 12], 8, 16, f32, "cpu", split=2)  # qkv: the expand in the base GEMV
    check_gemv_lora_case(2, 3, 64, [24, 24], 16, 16, f32, "cpu", gated=True, bias=True, seed=1)  # gate_up + SiLU
    check_gemv_lora_case(1, 2, 100, [30], 4, 8, f32, "cpu", seed=2)  # one row (o / down), K not a power of two
    check_output_shrink_case(3, 2, 4, 2, 16, 8, 16, f32, "cpu")  # o_proj's shrink in the decode attention's reduce
    check_output_shrink_case(2, 3, 4, 4, 32, 16, 16, f32, "cpu", num_splits=1, seed=1)  # one split: not done
    print("lora kernels ok")


if __name__ == "__main__":
    main()
