"""Reward models (vLLM's Qwen2ForRewardModel / Qwen2ForProcessRewardModel: remote code on the Hub, so the reference
is transformers' Qwen2Model with the two-layer head applied in torch, the same weights) and STEP pooling: each token's
reward through chunked prefill and mixed batches, the activation vLLM applies (the sigmoid of one reward, the softmax
of a process reward's two labels), and STEP's rows of step-tag tokens / chosen columns, from pooler_config or
PoolingParams; what stays unsupported is refused by name."""
from __future__ import annotations

import functools
import os
import types

import pytest
import torch

from pagedllm import LLM
from pagedllm.pooling import (PoolingParams, check_pooler_config, check_runner_fits, check_task_params, request_step,
                              step_pooling, step_rows)
from tests.engine.test_correctness import random_prompts

SMALL = dict(dtype="float32", num_gpu_blocks_override=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
TAG = 7  # the step tag token of these tests' prompts


@functools.lru_cache(maxsize=4)
def _reference_model(model_dir: str):
    from safetensors.torch import load_file
    from transformers import Qwen2Model

    hf = Qwen2Model.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    torch.testing.assert_close(hf.embed_tokens.weight, weights["model.embed_tokens.weight"])  # (loaded, not random)
    return hf, {k: v for k, v in weights.items() if k.startswith("score.")}


def reference_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), num_labels]: the head Linear -> ReLU -> Linear over transformers' final hidden states, in fp32."""
    hf, head = _reference_model(model_dir)
    with torch.inference_mode():
        states = hf(torch.tensor([ids])).last_hidden_state[0]
        x = torch.relu(states @ head["score.0.weight"].T + head["score.0.bias"])
        return x @ head["score.2.weight"].T + head["score.2.bias"]


def tagged_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random prompts with the step tag at every fifth position (and never elsewhere)."""
    prompts = [[t if t != TAG else TAG + 1 for t in p] for p in random_prompts(lengths, seed=seed)]
    return [[TAG if i % 5 == 4 else t for i, t in enumerate(p)] for p in prompts]


def test_outcome_reward_model_matches_reference_through_chunks(tiny_reward_dir):
    """Qwen2ForRewardModel: one label (whatever the config's num_labels), ALL pooling; prompts longer than the step's
    budget arrive in chunks. LLM.reward gives the sigmoid of each token's reward, use_activation=False the reward;
    the checkpoint's unused lm_head is no trouble."""
    model_dir = tiny_reward_dir("Qwen2ForRewardModel", lm_head=True)
    llm = LLM(model=model_dir, **SMALL)
    engine = llm.engine
    assert (engine.pooling_tasks, engine.token_labels, engine.step_pooling) == (("token_classify",), ["LABEL_0"], None)
    prompts = random_prompts([37, 1, 6, 20], seed=3)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    raw = llm.encode(inputs, PoolingParams(use_activation=False), use_tqdm=False, pooling_task="token_classify")
    rewards = llm.reward(inputs, use_tqdm=False)
    for prompt, out, reward in zip(prompts, raw, rewards):
        want = reference_logits(model_dir, prompt)
        assert out.outputs.data.shape == (len(prompt), 1) and out.prompt_token_ids == prompt
        torch.testing.assert_close(out.outputs.data, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(reward.outputs.data, want.sigmoid(), atol=2e-5, rtol=1e-4)
    for call, message in [(lambda: llm.generate("hello"), r"\(Qwen2ForRewardModel\) is a reward model.*not generation"),
                          (lambda: llm.embed("hello"), "is a reward model.*not embeddings"),
                          (lambda: llm.classify("hello"), "needs a sequence classifier"),
                          (lambda: llm.reward("hi", pooling_params=PoolingParams(step_tag_id=TAG)),
                           "step_tag_id apply to STEP pooling; this engine pools every token")]:
        with pytest.raises(ValueError, match=message):
            call()


def test_process_reward_model_step_pooling(tiny_reward_dir):
    """Qwen2ForProcessRewardModel: two labels, STEP pooling by default (vLLM's: no step tag set, so every row); a
    request's step_tag_id keeps the rows of that token, returned_token_ids those columns (then the activation over
    them: one column's sigmoid); a prompt without the tag gives [0, width]."""
    model_dir = tiny_reward_dir("Qwen2ForProcessRewardModel")
    llm = LLM(model=model_dir, **SMALL)
    assert llm.engine.step_pooling == {"step_tag_id": None, "returned_token_ids": None}
    assert llm.engine.token_labels == ["LABEL_0", "LABEL_1"]
    prompts = tagged_prompts([33, 9, 14], seed=5)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    wants = [reference_logits(model_dir, p) for p in prompts]
    for out, want in zip(llm.reward(inputs, use_tqdm=False), wants):
        torch.testing.assert_close(out.outputs.data, want.softmax(-1), atol=2e-5, rtol=1e-4)

    at_tags = [torch.tensor([t == TAG for t in p]) for p in prompts]
    outs = llm.reward(inputs, pooling_params=PoolingParams(step_tag_id=TAG), use_tqdm=False)
    for out, want, mask in zip(outs, wants, at_tags):
        assert out.outputs.data.shape == (int(mask.sum()), 2)
        torch.testing.assert_close(out.outputs.data, want[mask].softmax(-1), atol=2e-5, rtol=1e-4)
    one = llm.reward(inputs, pooling_params=PoolingParams(step_tag_id=TAG, returned_token_ids=[1]), use_tqdm=False)
    swapped = llm.encode(inputs, PoolingParams(returned_token_ids=[1, 0], use_activation=False), use_tqdm=False)
    for a, b, want, mask in zip(one, swapped, wants, at_tags):
        torch.testing.assert_close(a.outputs.data, want[mask][:, 1:].sigmoid(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(b.outputs.data, want[:, [1, 0]], atol=1e-4, rtol=1e-4)
    untagged = llm.reward({"prompt_token_ids": [3, 4, 5]}, pooling_params=PoolingParams(step_tag_id=TAG),
                          use_tqdm=False)[0]
    assert untagged.outputs.data.shape == (0, 2)
    for call, message in [(lambda: llm.reward("hi", pooling_params=PoolingParams(returned_token_ids=[2])),
                           r"returned_token_ids \[2\] are out of range.*2 values"),
                          (lambda: llm.encode("hi", PoolingParams(step_tag_id=TAG), pooling_task="token_embed"),
                           "serves token_classify"),
                          (lambda: llm.generate("hello"), "is a reward model.*not generation")]:
        with pytest.raises(ValueError, match=message):
            call()
    del llm

    # pooler_config sets the engine's STEP pooling; a request's own values go over it
    llm = LLM(model=model_dir, pooler_config={"pooling_type": "STEP", "step_tag_id": TAG, "returned_token_ids": [0]},
              **SMALL)
    out = llm.reward(inputs[:1], use_tqdm=False)[0]
    torch.testing.assert_close(out.outputs.data, wants[0][at_tags[0]][:, :1].sigmoid(), atol=2e-5, rtol=1e-4)
    other = prompts[0][1]
    out = llm.reward(inputs[:1], pooling_params=PoolingParams(step_tag_id=other, use_activation=False),
                     use_tqdm=False)[0]
    mask = torch.tensor([t == other for t in prompts[0]])
    torch.testing.assert_close(out.outputs.data, wants[0][mask][:, :1], atol=1e-4, rtol=1e-4)
    del llm
    with pytest.raises(ValueError, match=r"returned_token_ids \[5\] are out of range"):  # (checked at start)
        LLM(model=model_dir, pooler_config={"pooling_type": "STEP", "returned_token_ids": [0, 5]}, **SMALL)


def test_step_pooling_of_a_causal_lm_served_for_rewards(tiny_model_dir):
    """convert "reward" with pooler_config STEP: the chosen hidden-state columns of the step-tag tokens' final hidden
    states, as they are (no head, no activation)."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(model=model_dir, convert="reward", pooler_config={"pooling_type": "STEP", "step_tag_id": TAG,
                                                                "returned_token_ids": [0, 5, 63]}, **SMALL)
    prompts = tagged_prompts([21, 6], seed=13)
    outs = llm.reward([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            states = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        mask = torch.tensor([t == TAG for t in prompt])
        torch.testing.assert_close(out.outputs.data, states[mask][:, [0, 5, 63]], atol=1e-4, rtol=1e-4)


def _args(**kw):
    return types.SimpleNamespace(**{**dict(convert="auto", task=None, pooler_config=None), **kw})


def test_step_flags_and_refusals():
    """pooler_config's STEP keys, the engine's STEP settings per model, a request's over them, and what is refused:
    STEP for a model that is not served for per-token outputs, step keys without STEP, step fields for other tasks."""
    config = check_pooler_config({"pooling_type": "STEP", "step_tag_id": 12, "returned_token_ids": [3, 4]})
    assert config == {"pooling_type": "step", "step_tag_id": 12, "returned_token_ids": [3, 4]}
    assert check_pooler_config({"step_tag_id": 12}) == {"step_tag_id": 12}
    for bad, message in [({"pooling_type": "ALL", "step_tag_id": 1}, "step_tag_id applies to STEP pooling, not ALL"),
                         ({"step_tag_id": -1}, "step_tag_id must be a token id"),
                         ({"returned_token_ids": [True]}, "returned_token_ids must be a list"),
                         ({"pooling_type": "STEPS"}, "LAST, MEAN, CLS, ALL or STEP")]:
        with pytest.raises(ValueError, match=message):
            check_pooler_config(bad)
    assert step_pooling("Qwen2ForProcessRewardModel", None) == {"step_tag_id": None, "returned_token_ids": None}
    assert step_pooling("Qwen2ForProcessRewardModel", {"pooling_type": "all"}) is None
    assert step_pooling("Qwen2ForRewardModel", {"pooling_type": "step", "step_tag_id": 3})["step_tag_id"] == 3
    assert step_pooling("Qwen2ForTokenClassification", {"step_tag_id": 3}) is None
    engine = {"step_tag_id": 3, "returned_token_ids": [1]}
    assert request_step(engine, PoolingParams(step_tag_id=4)) == {"step_tag_id": 4, "returned_token_ids": [1]}
    assert request_step(engine, None) == engine and request_step(None, PoolingParams()) is None
    rows = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert step_rows(rows, [3, 9, 3], {"step_tag_id": 3, "returned_token_ids": [1, 0]}) == [[1.0, 0.0], [5.0, 4.0]]
    assert step_rows(rows, [3, 9, 3], {"step_tag_id": None, "returned_token_ids": None}) == rows

    reward = ["LABEL_0"]
    check_runner_fits(_args(pooler_config={"pooling_type": "step"}), None, "Qwen2ForRewardModel", reward)
    check_runner_fits(_args(convert="reward", pooler_config={"pooling_type": "step"}), None, "Qwen2ForCausalLM")
    for args, labels, token_labels, message in [
            (_args(pooler_config={"pooling_type": "step"}), None, None, "STEP .* not for this model"),
            (_args(pooler_config={"pooling_type": "step"}), ["a"], None, "pooling_type STEP is not supported"),
            (_args(pooler_config={"step_tag_id": 3}), None, ["B", "O"], "apply to STEP pooling; this model .* ALL"),
            (_args(pooler_config={"step_tag_id": 3}), None, None, "apply to STEP pooling; .* serves no per-token"),
            (_args(pooler_config={"pooling_type": "mean"}), None, reward, "pooling_type MEAN is not supported")]:
        with pytest.raises(ValueError, match=message):
            check_runner_fits(args, labels, "X", token_labels)
    for task in ("embed", "classify", "token_embed"):
        with pytest.raises(ValueError, match=f"Task '{task}' takes .* not step_tag_id"):
            check_task_params(task, PoolingParams(step_tag_id=1))
    check_task_params("token_classify", PoolingParams(step_tag_id=1, returned_token_ids=[0]))
