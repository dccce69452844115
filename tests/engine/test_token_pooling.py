"""Per-token pooling (vLLM's token_classify / token_embed, LLM.reward): every prompt token's output, through chunked
prefill and batches of mixed lengths. A token classifier's (*ForTokenClassification) per-token label logits are
transformers' (fp32, the same weights, its score bias included); a causal LM served with convert "reward" gives its
final hidden states as they are, and token_embed makes each an embedding; what such engines cannot do is refused."""
from __future__ import annotations

import types

import pytest
import torch

from pagedllm import LLM
from pagedllm.pooling import PoolingParams, check_pooler_config, check_runner_fits, supported_tasks
from tests.engine.test_correctness import random_prompts

SMALL = dict(dtype="float32", num_gpu_blocks_override=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)


def hf_token_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_token_classifier_logits_match_hf_through_chunks(arch, tiny_classifier_dir):
    """Prompts longer than the step's budget arrive in chunks, shorter ones share their steps: each token's label
    logits are transformers' (with the head's bias); LLM.reward and the default encode give their softmax."""
    model_dir = tiny_classifier_dir(arch, num_labels=5, token=True)
    llm = LLM(model=model_dir, **SMALL)
    assert llm.engine.pooling_tasks == ("token_classify",) and len(llm.engine.token_labels) == 5
    prompts = random_prompts([37, 1, 6, 20], seed=7)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    logits = llm.encode(inputs, PoolingParams(use_activation=False), use_tqdm=False, pooling_task="token_classify")
    rewards = llm.reward(inputs, use_tqdm=False)
    for prompt, out, reward in zip(prompts, logits, rewards):
        want = hf_token_logits(model_dir, prompt)
        assert out.outputs.data.shape == (len(prompt), 5) and out.prompt_token_ids == prompt
        torch.testing.assert_close(out.outputs.data, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(reward.outputs.data, want.softmax(-1), atol=2e-5, rtol=1e-4)
    default = llm.encode(inputs[1:2], use_tqdm=False)[0].outputs.data  # (a token classifier's default task)
    torch.testing.assert_close(default, rewards[1].outputs.data, atol=1e-6, rtol=0)
    # truncate_prompt_tokens keeps the prompt's last tokens: the output is the shortened prompt's
    cut = llm.reward(inputs[0], truncate_prompt_tokens=4, use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompts[0][-4:]
    torch.testing.assert_close(cut.outputs.data, hf_token_logits(model_dir, prompts[0][-4:]).softmax(-1),
                               atol=2e-5, rtol=1e-4)

    for call, message in [(lambda: llm.generate("hello"), "token classifier.*not generation"),
                          (lambda: llm.embed("hello"), "token classifier.*not embeddings"),
                          (lambda: llm.classify("hello"), "needs a sequence classifier"),
                          (lambda: llm.encode("hello", pooling_task="token_embed"), "serves token_classify"),
                          (lambda: llm.encode("hello", pooling_task="encode"), "must be one of"),
                          (lambda: llm.reward("hi", pooling_params=PoolingParams(normalize=False)),
                           "takes use_activation"),
                          (lambda: llm.reward("hi", pooling_params=PoolingParams(step_tag_id=7)),
                           "step_tag_id apply to STEP pooling"),
                          (lambda: llm.reward("hi", truncate_prompt_tokens=2,
                                              pooling_params=PoolingParams()), "not both")]:
        with pytest.raises(ValueError, match=message):
            call()


def test_causal_lm_rewards_are_its_hidden_states(tiny_model_dir):
    """convert "reward" (vLLM's reward pooling: ALL, no normalization, no softmax): each token's final hidden state
    (after the last norm), transformers' last_hidden_state; the engine then serves nothing else. Without it the same
    LM's token_embed is those states made unit length, with every other pooling request on the way."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = random_prompts([30, 3, 17], seed=11)

    def hidden(ids):
        with torch.inference_mode():
            return hf.model(torch.tensor([ids])).last_hidden_state[0]

    llm = LLM(model=model_dir, convert="reward", **SMALL)
    assert llm.engine.pooling_tasks == ("token_classify",)
    outs = llm.reward([{"prompt_token_ids": p} for p in prompts] * 2, use_tqdm=False)  # twice: no prefix-cache hit
    for prompt, out in zip(prompts * 2, outs):
        assert out.outputs.data.shape == (len(prompt), 64)
        torch.testing.assert_close(out.outputs.data, hidden(prompt), atol=1e-4, rtol=1e-4)
    for call, message in [(lambda: llm.generate("hello"), "for rewards.*not generation"),
                          (lambda: llm.embed("hello"), "for rewards.*not embeddings"),
                          (lambda: llm.reward("hi", pooling_params=PoolingParams(use_activation=True)),
                           "no label head")]:
        with pytest.raises(ValueError, match=message):
            call()
    del llm

    llm = LLM(model=model_dir, **SMALL)
    assert llm.engine.pooling_tasks == ("embed", "token_embed")
    mixed = [{"prompt_token_ids": p} for p in prompts]
    rows = llm.encode(mixed, use_tqdm=False, pooling_task="token_embed")
    raw = llm.encode(mixed[:1], PoolingParams(normalize=False), use_tqdm=False, pooling_task="token_embed")[0]
    torch.testing.assert_close(raw.outputs.data, hidden(prompts[0]), atol=1e-4, rtol=1e-4)
    for prompt, out in zip(prompts, rows):
        want = torch.nn.functional.normalize(hidden(prompt), dim=-1)
        torch.testing.assert_close(out.outputs.data, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="LLM.reward needs a token or sequence classifier"):
        llm.reward("hello")


def _args(**kw):
    return types.SimpleNamespace(**{**dict(convert="auto", task=None, pooler_config=None), **kw})


def test_tasks_and_flags_per_model():
    """Which pooling tasks a model serves, and the flags each kind of model refuses."""
    assert supported_tasks(_args(), ["a"], None) == ("classify", "token_classify")
    assert supported_tasks(_args(), None, ["B-PER", "O"]) == ("token_classify",)
    assert supported_tasks(_args(task="reward"), None, None) == ("token_classify",)
    assert supported_tasks(_args(), None, None) == ("embed", "token_embed")
    tokens = ["B-PER", "O"]
    check_runner_fits(_args(convert="classify"), None, "LlamaForTokenClassification", tokens)
    check_runner_fits(_args(convert="reward", pooler_config={"pooling_type": "all"}), None, "LlamaForCausalLM")
    for args, labels, token_labels, message in [
            (_args(task="classify"), None, tokens, "token classifier"),
            (_args(convert="embed"), None, tokens, "token classifier"),
            (_args(pooler_config={"pooling_type": "mean"}), None, tokens, "pooling_type MEAN"),
            (_args(convert="reward", pooler_config={"pooling_type": "last"}), None, None, "pooling_type LAST"),
            (_args(pooler_config={"pooling_type": "all"}), None, None, "pooling_type ALL is the per-token")]:
        with pytest.raises(ValueError, match=message):
            check_runner_fits(args, labels, "X", token_labels)
    assert check_pooler_config({"pooling_type": "ALL"}) == {"pooling_type": "all"}
    assert check_pooler_config({"pooling_type": "STEP"}) == {"pooling_type": "step"}  # (test_reward_models.py)
    from pagedllm.config import EngineArgs

    assert EngineArgs(convert="reward").embeddings_only and EngineArgs(task="reward").embeddings_only
    EngineArgs(convert="reward", task="reward").validate()
    with pytest.raises(ValueError, match="different poolings"):
        EngineArgs(convert="reward", task="embed").validate()
