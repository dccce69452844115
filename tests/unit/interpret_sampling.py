"""The device sampler (kernels/sampling.py) in Triton's interpreter on the CPU:
`TRITON_INTERPRET=1 python interpret_sampling.py` (run by test_device_sampling.py; a script because TRITON_INTERPRET
must be set before any kernel is defined). Small draws: the interpreter runs ~100 programs a second."""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

N_DRAWS = 300


def check_sampler_wiring() -> None:
    """Sampler() on a mixed batch through sample_on_device: greedy rows take the argmax, every token is inside its
    row's reference set, a seeded row's token does not depend on the batch."""
    from device_sampling_cases import llm_row, reference_probs

    from pagedllm.layers import sampler as sampler_mod
    from pagedllm.layers.sampler import Sampler, SamplingMetadata
    from pagedllm.sampling_params import SamplingParams

    vocab = 64
    rows = torch.stack([llm_row(vocab, seed=s) for s in range(6)])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
              SamplingParams(temperature=1.0, top_p=0.5, seed=7), SamplingParams(temperature=1.2, min_p=0.1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=2)]
    sampler_mod._DEVICE_SAMPLING_TYPES = ("cuda", "cpu")
    try:
        def run(idx):
            ps = [params[i] for i in idx]
            meta = SamplingMetadata.build(ps, [[]] * len(ps), [[1, 2]] * len(ps), [None] * len(ps), vocab, "cpu")
            assert sampler_mod.sample_on_device(rows[idx].clone(), meta) is not None
            return Sampler()(rows[idx].clone(), meta).sampled_token_ids
        out = run(list(range(6)))
        for i, p in enumerate(params):
            if p.temperature == 0:
                assert out[i] == rows[i].argmax()
            else:
                probs = reference_probs(rows[i], p.temperature, p.top_k, p.top_p, p.min_p)
                assert probs[out[i]] > 0, (i, out[i])
        assert run([2])[0] == out[2] == run([5, 2, 0])[1]
    finally:
        sampler_mod._DEVICE_SAMPLING_TYPES = ("cuda",)


def check_bf16_logits_read_as_they_are() -> None:
    """Sampler() on bf16 logits (the LM head's dtype) with nothing to edit them draws through sample_on_device
    without a float32 copy, and draws what it draws from that copy: the kernel's float32 values are exact."""
    from device_sampling_cases import llm_row

    from pagedllm.layers import sampler as sampler_mod
    from pagedllm.layers.sampler import Sampler, SamplingMetadata
    from pagedllm.sampling_params import SamplingParams

    vocab = 96
    rows = torch.stack([llm_row(vocab, seed=s) for s in range(5)]).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, top_k=5, top_p=0.8),
              SamplingParams(temperature=1.0, top_p=0.6, seed=3), SamplingParams(temperature=1.1, min_p=0.2),
              SamplingParams(temperature=0.0)]
    sampler_mod._DEVICE_SAMPLING_TYPES = ("cuda", "cpu")
    widened = []
    process = Sampler.process_logits
    Sampler.process_logits = staticmethod(lambda logits, meta: (widened.append(logits.dtype), process(logits, meta))[1])
    try:
        meta = SamplingMetadata.build(params, [[]] * 5, [[1, 2]] * 5, [None] * 5, vocab, "cpu")
        assert sampler_mod._draws_as_is(rows, meta)
        torch.manual_seed(11)
        as_is = Sampler()(rows.clone(), meta).sampled_token_ids
        assert not widened, "bf16 logits were widened although nothing edits them"
        torch.manual_seed(11)
        wide = Sampler()(rows.float(), meta).sampled_token_ids
        assert torch.equal(as_is, wide), (as_is, wide)
        assert as_is[4] == rows[4].float().argmax()
        for other in (SamplingParams(temperature=0.7, logprobs=2), SamplingParams(temperature=0.7, min_tokens=3),
                      SamplingParams(temperature=0.7, presence_penalty=1.0)):  # these still take the general path
            meta = SamplingMetadata.build([other], [[5]], [[1, 2]], [2], vocab, "cpu")
            assert not sampler_mod._draws_as_is(rows[:1], meta), other
    finally:
        sampler_mod._DEVICE_SAMPLING_TYPES = ("cuda",)
        Sampler.process_logits = staticmethod(process)


def check_seeded_row_in_verify_step() -> None:
    """A seeded request without drafts in a verify step (a batch-mate brought drafts) draws the token a plain step
    draws for it: the device sampler's (seed, position) key in both, not the torch generator in one of them."""
    from device_sampling_cases import llm_row

    from pagedllm.layers import sampler as sampler_mod
    from pagedllm.layers.sampler import Sampler, SamplingMetadata
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.spec_decode.rejection_sampler import NO_DRAFT, rejection_sample

    vocab = 80
    rows = torch.stack([llm_row(vocab, seed=s) * 0.5 for s in range(4)])  # flat enough that draws differ
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=21)
    mate = SamplingParams(temperature=0.8)
    sampler_mod._DEVICE_SAMPLING_TYPES = ("cuda", "cpu")
    try:
        tokens = set()
        for out_len in range(6):  # several positions: the draws do differ, and each matches
            outputs = [[1] * out_len]
            plain_meta = SamplingMetadata.build([seeded], [[]], outputs, [None], vocab, "cpu")
            plain = Sampler()(rows[:1].clone(), plain_meta).sampled_token_ids[0]
            # The verify step: the seeded request's one (bonus) row, then a mate with two drafts and its bonus row.
            meta = SamplingMetadata.build([seeded, mate, mate, mate], [[]] * 4,
                                          outputs + [[1], [1, 5], [1, 5, 6]], [None] * 4, vocab, "cpu")
            drafts = torch.tensor([NO_DRAFT, 5, 6, NO_DRAFT])
            verify = rejection_sample(rows.clone(), meta, drafts).final_token_ids[0]
            assert verify == plain, (out_len, verify, plain)
            tokens.add(int(plain))
        assert len(tokens) > 1, tokens
    finally:
        sampler_mod._DEVICE_SAMPLING_TYPES = ("cuda",)


def check_launch_shape_free(kernel) -> None:
    """The draws do not depend on the launch shape (BLOCK, warps): only on the seeds and GROUP. The shape follows
    the batch size, so a seeded row would otherwise change with its company."""
    from device_sampling_cases import STEP_SEED, llm_row

    vocab, n = 300, 6
    logits = torch.stack([llm_row(vocab, seed=s) * 0.3 for s in range(n)])
    temperature = torch.full((n,), 1.0)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.9, 1.0, 0.3])
    seeds = torch.tensor([5, -1, 7, 8, -1, 9])
    runs = []
    for block in (32, 64, 128):
        kernel.LAUNCH = ((1 << 30, block, 1),)
        runs.append(kernel.sample_rows(logits, temperature, STEP_SEED, seeds=seeds, top_p=top_p).tolist())
    assert runs[0] == runs[1] == runs[2], runs
    kernel.LAUNCH = ((1 << 30, 64, 1),)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    sys.path[:0] = [here, os.path.join(tests, "gpu"), os.path.join(tests, "lora")]
    from interpret_kernels import patch_interpreter_for_numpy2

    patch_interpreter_for_numpy2()
    import conftest  # noqa: F401  (tests/gpu: the interpreter's comparisons tagged as int1)
    import pagedllm.kernels.sampling as kernel
    from device_sampling_cases import INTERPRETER_CASES, check_distribution, check_greedy_rows, \
        check_masked_and_seeded, check_non_finite_rows, check_split_rows_match_one_program, llm_row

    kernel.GROUP = 32  # small chunks: several per row, as on a GPU, at the interpreter's pace
    kernel.LAUNCH = ((1 << 30, 64, 1),)
    kernel.SPLIT_BLOCK = 64  # a 300-token row in five parts
    # 14 rows, not the GPU's 40: on the CPU (sm_count 132) every batch of at most 52 rows is cut into the same five
    # parts, and 14 rows already hold each kind of row (special, greedy, seeded, plain) the 40 hold.
    check_split_rows_match_one_program("cpu", n=14)
    check_launch_shape_free(kernel)
    np.seterr(all="ignore")  # -inf - -inf in lanes the kernel masks
    check_greedy_rows("cpu")
    check_non_finite_rows("cpu")
    check_masked_and_seeded("cpu", vocab=160)
    check_sampler_wiring()
    check_bf16_logits_read_as_they_are()
    check_seeded_row_in_verify_step()
    row = llm_row(24)
    for case in INTERPRETER_CASES:
        stat = check_distribution(row, N_DRAWS, "cpu", **case)
        print(f"{case}: chi2/dof {stat:.2f}", flush=True)
    print("device sampling ok")


if __name__ == "__main__":
    main()
