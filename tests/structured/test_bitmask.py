"""The packed bitmask on tensors: unpacking matches xgrammar's own kernel, the sampler applies it, and the greedy
LM-head shortcut (the CPU bf16 screen) picks the same token as the masked fp32 logits."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.bitmask import allowed_tokens, apply_token_bitmask_, forbidden_tokens


def _random_bitmask(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


def test_unpacking_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    bitmask = _random_bitmask(4, vocab)
    logits = torch.randn(4, vocab)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    table = logits.clone().masked_fill_(forbidden_tokens(bitmask, vocab), float("-inf"))  # the CUDA path
    assert torch.equal(ref, table) and torch.isinf(ref).any()
    assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask), ref)  # the CPU path
    allowed = allowed_tokens(bitmask, vocab)
    for t in (0, 31, 32, 999):
        assert bool(allowed[1, t]) == bool((int(bitmask[1, t // 32]) >> (t % 32)) & 1)
    assert allowed_tokens(bitmask[:, :2], 100)[:, 64:].any() == False  # noqa: E712 - past the mask: forbidden


def test_sampler_applies_the_mask_to_greedy_and_random_rows() -> None:
    vocab = 64
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # only token 5
    bitmask[1, 1] = 1 << 3  # only token 35
    bitmask[2] = -1  # unconstrained row
    logits = torch.randn(3, vocab)
    logits[2, 7] = 50.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, [None] * 3, vocab, "cpu")
    meta.token_bitmask = bitmask
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert out == [5, 35, 7]


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_hf_dir: str):
    from pagedllm import LLM

    return LLM(model=smollm2_hf_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20)


def test_cpu_greedy_screen_honours_the_mask(smollm2_llm) -> None:
    lm = smollm2_llm.engine.worker.model
    if lm.lm_head.__dict__.get("cpu_greedy_screen") is None:
        # A machine whose oneDNN has bf16 GEMMs must have the screen (a failed set-up is a bug, not a skip).
        assert not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()), \
            "oneDNN has bf16 here, but the LM head did not set up its CPU greedy screen"
        pytest.skip("no bf16 oneDNN GEMMs on this CPU: the greedy screen does not apply")
    torch.manual_seed(0)
    hidden = torch.randn(6, lm.lm_head.embedding_dim) * 3
    vocab = lm.lm_head.org_vocab_size
    bitmask = _random_bitmask(6, vocab, seed=1)
    bitmask[0] = 0
    bitmask[0, 10] = 1  # one allowed token: 320
    bitmask[5] = -1  # unconstrained
    got = lm.greedy_token_ids(hidden, token_bitmask=bitmask)
    assert got is not None
    ref = apply_token_bitmask_(lm.compute_logits(hidden), bitmask).argmax(dim=-1)
    assert got.tolist() == ref.tolist()
    assert got[0].item() == 320
    assert got[5].item() == lm.compute_logits(hidden[5:]).argmax(dim=-1).item()


def test_greedy_shortcut_and_sampler_path_agree_on_smollm2(smollm2_llm) -> None:
    """argmax_only batches take the LM-head shortcut; asking for logprobs forces the fp32 sampler path."""
    from pagedllm.structured_output import StructuredOutputsParams

    so = StructuredOutputsParams(json={"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                       "required": ["city"]})
    prompt = "<|im_start|>user\nName a city in JSON.<|im_end|>\n<|im_start|>assistant\n"
    fast = smollm2_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so),
                                use_tqdm=False)[0].outputs[0]
    slow = smollm2_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so,
                                                         logprobs=0), use_tqdm=False)[0].outputs[0]
    assert fast.token_ids == slow.token_ids
    assert fast.text.startswith('{') and '"city"' in fast.text
