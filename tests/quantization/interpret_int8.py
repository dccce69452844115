"""The W8A8 kernels (INT8; the GEMM and GEMV also on FP8; the norm that quantizes its output) in Triton's
interpreter on the CPU:
`TRITON_INTERPRET=1 python interpret_int8.py` (run by
test_int8_w8a8_kernels.py; the model-shape checks run on the GPU: tests/gpu/test_int8_w8a8_gpu.py)."""
from __future__ import annotations

import os
import sys


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    sys.path[:0] = [here, os.path.join(tests, "lora"), os.path.join(tests, "gpu")]
    from interpret_kernels import patch_interpreter_for_numpy2

    patch_interpreter_for_numpy2()
    import conftest  # noqa: F401  (tests/gpu: the interpreter's comparisons tagged as int1)
    from int8_w8a8_cases import INTERPRETER_OUTPUTS, check_activation_quant, check_fp8_gemm, check_gemm, check_norm_quant

    check_activation_quant("cpu", ks=(64, 300, 9000))
    print("activation quant ok", flush=True)
    check_norm_quant("cpu")
    print("norm + activation quant ok", flush=True)
    small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
    check_gemm("cpu", [(1, 48, 64), (5, 100, 200), (16, 64, 96), (37, 70, 128)],
               [dict(small, SPLIT_K=1), dict(small, SPLIT_K=2), dict(small, SPLIT_K=4),
                dict(small, BLOCK_M=32, SPLIT_K=1)], outputs=INTERPRETER_OUTPUTS)
    # the GEMV, byte by byte and on int32 words (dp4a): one row, and several rows past a column block
    check_gemm("cpu", [(1, 48, 64), (3, 70, 200)],
               [dict(GEMV=True, BLOCK_N=4, WORDS=False), dict(GEMV=True, BLOCK_N=4, WORDS=True)],
               outputs=INTERPRETER_OUTPUTS)
    # the default choice: words up to 4 rows where K is a multiple of 4, else the byte GEMV at 1 row and the tiles
    check_gemm("cpu", [(4, 40, 64), (2, 40, 66), (1, 40, 66)], [None], outputs=INTERPRETER_OUTPUTS)
    print("int8 gemm ok", flush=True)
    check_fp8_gemm("cpu", [(1, 48, 64), (5, 100, 200), (37, 70, 128)],
                   [dict(small, SPLIT_K=1), dict(small, SPLIT_K=4), dict(small, BLOCK_M=32, SPLIT_K=1)],
                   outputs=INTERPRETER_OUTPUTS)
    check_fp8_gemm("cpu", [(1, 48, 64), (3, 70, 200)], [dict(GEMV=True, BLOCK_N=4)], outputs=INTERPRETER_OUTPUTS)
    print("fp8 gemm ok", flush=True)


if __name__ == "__main__":
    main()
