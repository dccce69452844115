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


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    patch_interpreter_for_numpy2()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lora_kernel_cases import check_case

    f32 = torch.float32
    check_case(5, 3, 64, [32, 16, 16], 8, 16, f32, "cpu", pad_rows=3)  # qkv-like slices, padding rows
    check_case(20, 2, 96, [48], 16, 16, f32, "cpu", seed=1)  # K not a multiple of the tile
    check_case(40, 4, 300, [40, 40], 12, 16, f32, "cpu", seed=2, none_frac=0.0)  # gate_up-like, all adapted
    check_case(3, 2, 64, [16], 16, 32, f32, "cpu", seed=3, none_frac=1.0)  # no token has an adapter
    check_case(2, 2, 1024, [24], 8, 16, f32, "cpu", seed=4)  # few tokens, long K: split-K shrink
    print("lora kernels ok")


if __name__ == "__main__":
    main()
