"""qkv_prep's work inside the decode attention kernel (kernels/paged_attention.DecodePrep, PAGEDLLM_DECODE_PREP) in
Triton's interpreter on the CPU: one fp32 case of tests/gpu/test_qkv_prep.py (q / k norms, a padding row, splits)
run with PAGEDLLM_TEST_DEVICE=cpu; the other dtypes and batch shapes run on the GPU."""
from __future__ import annotations

import pytest

from tests.triton_interpreter import needs_triton, run_gpu_tests_interpreted


@needs_triton
def test_decode_prep_interpreted():
    run_gpu_tests_interpreted("test_qkv_prep.py", "decode_prep and fp32-norm-short", "1 passed")


@needs_triton
def test_decode_prep_is_used_for_few_rows_unless_told(monkeypatch):
    """PAGEDLLM_DECODE_PREP: auto (the default) for steps of up to DECODE_PREP_MAX_REQS requests, 1 every decode
    step, 0 never; another value is an error naming the variable."""
    from pagedllm.attention.triton_backend import DECODE_PREP_MAX_REQS, decode_prep_wanted

    monkeypatch.delenv("PAGEDLLM_DECODE_PREP", raising=False)
    assert decode_prep_wanted(1) and decode_prep_wanted(DECODE_PREP_MAX_REQS)
    assert not decode_prep_wanted(DECODE_PREP_MAX_REQS + 1) and not decode_prep_wanted(512)
    monkeypatch.setenv("PAGEDLLM_DECODE_PREP", "1")
    assert decode_prep_wanted(512)
    monkeypatch.setenv("PAGEDLLM_DECODE_PREP", "0")
    assert not decode_prep_wanted(1)
    monkeypatch.setenv("PAGEDLLM_DECODE_PREP", "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_DECODE_PREP='yes': expected one of auto, 1, 0"):
        decode_prep_wanted(1)
