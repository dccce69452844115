"""Sequence classifiers (*ForSequenceClassification, pooling/): LLM.classify's label logits and probabilities equal
transformers' (fp32, the same weights) through chunked prefill and batches of mixed lengths that also generate
nothing; trailing pad tokens are skipped as transformers skips them; a cross-encoder's LLM.score is the sigmoid of
transformers' logit of the tokenizer's pair encoding; what a classifier cannot do is refused."""
from __future__ import annotations

import os
import shutil
import types

import pytest
import torch

from pagedllm import LLM
from pagedllm.pooling import PoolingParams, check_runner_fits, class_probs, classifier_input, sampling_params_for
from tests.engine.test_correctness import random_prompts

_hf: dict[str, torch.nn.Module] = {}


def hf_classifier(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    if model_dir not in _hf:
        _hf[model_dir] = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return _hf[model_dir]


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_classifier(model_dir)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_probs_and_logits_match_hf_through_chunks(arch, tiny_classifier_dir):
    """Prompts longer than the step's budget arrive in chunks, shorter ones share their steps; the label logits (the
    engine's pooled output) and the softmax probabilities are transformers'. Llama's config has a pad token: the
    prompts that end in it are scored at their last other token, as transformers does."""
    pad = 3 if arch == "llama" else None
    model_dir = tiny_classifier_dir(arch, pad_token_id=pad)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=4)
    prompts = random_prompts([37, 1, 6, 20, 13], seed=5)
    if pad is not None:
        prompts += [[5, 6, 7, pad, pad], [9, pad, 11, pad]]
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    raw = llm.generate([{"prompt_token_ids": classifier_input(p, pad)} for p in prompts],
                       sampling_params_for("last"), use_tqdm=False)
    for prompt, out, r in zip(prompts, outs, raw):
        want = hf_logits(model_dir, prompt)
        torch.testing.assert_close(torch.tensor(r.pooled), want, atol=1e-4, rtol=1e-4)
        assert out.outputs.num_classes == 3 and out.prompt_token_ids == classifier_input(prompt, pad)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want.softmax(-1), atol=2e-5, rtol=1e-4)
    assert max(max(o.outputs.probs) for o in outs) > 0.5  # (the probabilities tell the labels apart)
    assert llm.engine.classifier_labels == ["negative", "neutral", "positive"]
    encoded = llm.encode([{"prompt_token_ids": p} for p in prompts[:2]], use_tqdm=False)
    for e, o in zip(encoded, outs):
        assert e.outputs.data.tolist() == pytest.approx(o.outputs.probs, abs=1e-6)
    # token_classify through the same head: every token's logits, transformers' score over each hidden state
    tokens = llm.encode({"prompt_token_ids": prompts[0]}, PoolingParams(use_activation=False), use_tqdm=False,
                        pooling_task="token_classify")[0].outputs.data
    hf = hf_classifier(model_dir)
    with torch.inference_mode():
        want = hf.score(hf.model(torch.tensor([prompts[0]])).last_hidden_state[0])
    torch.testing.assert_close(tokens, want, atol=1e-4, rtol=1e-4)
    raw = llm.classify(prompts[1], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert raw.outputs.probs == pytest.approx(hf_logits(model_dir, prompts[1]).tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="no embeddings"):
        llm.encode("hello", pooling_task="embed")
    with pytest.raises(ValueError, match="sequence classifier.*not generation"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="no embeddings"):
        llm.embed("hello")
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.score("a", "b")


def test_cross_encoder_scores_are_hf_sigmoids_of_pair_encodings(tiny_classifier_dir):
    """A one-label Qwen3 classifier (a cross-encoder reranker): each (text_1, text_2) pair is one input, the
    tokenizer's pair encoding; the score is the sigmoid of transformers' logit; classify() gives the same sigmoid."""
    from transformers import AutoTokenizer

    model_dir = tiny_classifier_dir("qwen3", num_labels=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8, max_num_batched_tokens=32,
              max_num_seqs=4)
    query, docs = "Where is Paris?", ["Paris is the capital of France.", "Bananas are yellow.", "a"]
    want = [torch.sigmoid(hf_logits(model_dir, tok(text=query, text_pair=d)["input_ids"]))[0].item() for d in docs]
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert got == pytest.approx(want, abs=2e-5)
    pairs = llm.score([query, docs[1]], [docs[0], docs[2]], use_tqdm=False)
    assert pairs[0].outputs.score == pytest.approx(want[0], abs=2e-5)
    assert pairs[0].prompt_token_ids == tok(text=query, text_pair=docs[0])["input_ids"]
    probs = llm.classify(query + docs[0], use_tqdm=False)[0].outputs.probs
    logit = hf_logits(model_dir, tok(query + docs[0])["input_ids"])
    assert len(probs) == 1 and probs[0] == pytest.approx(torch.sigmoid(logit)[0].item(), abs=2e-5)
    # truncation is the tokenizer's pair truncation (longest text first: the query stays), as vLLM's
    long_doc = "Paris is the capital of France. " * 4
    query_ids = tok(query)["input_ids"]
    k = 2 * len(query_ids) + 2  # (longest first: the document is cut down to the query's length before the query)
    assert len(tok(long_doc)["input_ids"]) > k
    kept = llm.score(query, long_doc, truncate_prompt_tokens=k, use_tqdm=False)[0].prompt_token_ids
    assert kept == tok(text=query, text_pair=long_doc, truncation="longest_first", max_length=k)["input_ids"]
    assert kept[:len(query_ids)] == query_ids and len(kept) == k
    # truncate_prompt_tokens=max_model_len (allowed) keeps what a pooled input may hold, as -1 does, rather than
    # a length then refused as too long; a too-long input's message says it is a classification input
    max_len = llm.engine.max_model_len
    kept = llm.score(query, "word " * max_len, truncate_prompt_tokens=max_len, use_tqdm=False)[0].prompt_token_ids
    assert len(kept) == max_len - 1
    with pytest.raises(ValueError, match="a classification input may have at most"):
        llm.classify([[5] * max_len], use_tqdm=False)


def test_class_probs_and_pad_skipping():
    assert class_probs([0.0]) == [0.5] and class_probs([-800.0])[0] == pytest.approx(0.0)
    assert class_probs([1000.0, 0.0]) == pytest.approx([1.0, 0.0])
    assert sum(class_probs([0.1, 2.0, -3.0])) == pytest.approx(1.0)
    assert classifier_input([5, 0, 0], 0) == [5] and classifier_input([0, 0], 0) == [0]
    assert classifier_input([5, 0], None) == [5, 0]


def _args(**kw):
    base = dict(convert="auto", task=None, pooler_config=None)
    return types.SimpleNamespace(**{**base, **kw})


def test_runner_flags_against_the_model():
    """--convert / --task classify serve a classifier as it is (a causal LM is refused, pointing to hf_overrides); a
    classifier refuses embed and poolings other than its last token."""
    labels = ["a", "b"]
    check_runner_fits(_args(convert="classify"), labels, "Qwen3ForSequenceClassification")
    check_runner_fits(_args(task="score"), labels, "Qwen3ForSequenceClassification")
    check_runner_fits(_args(pooler_config={"pooling_type": "last"}), labels, "X")
    with pytest.raises(ValueError, match="not one \\(to rank with LM-head rows as Qwen3-Reranker does: hf_overrides"):
        check_runner_fits(_args(convert="classify"), None, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="^task 'score' serves a sequence classifier"):
        check_runner_fits(_args(task="score"), None, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="not embeddings"):
        check_runner_fits(_args(task="embed"), labels, "X")
    with pytest.raises(ValueError, match="pooling_type MEAN"):
        check_runner_fits(_args(pooler_config={"pooling_type": "mean"}), labels, "X")
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="different poolings"):
        EngineArgs(convert="classify", task="embed").validate()
    EngineArgs(convert="classify", task="classify").validate()
    assert EngineArgs(convert="classify").embeddings_only


def test_classify_on_a_causal_model_is_refused(tiny_llama_dir):
    """LLM.classify needs a classifier; LLM.encode on an embedding-capable model is LLM.embed as a tensor."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="needs a sequence classifier"):
        llm.classify("hello")
    with pytest.raises(ValueError, match="needs a sequence classifier"):
        llm.encode("hello", pooling_task="classify")
    encoded = llm.encode([[5, 6, 7]], use_tqdm=False)[0].outputs.data
    assert encoded.tolist() == pytest.approx(llm.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding, abs=1e-6)


def test_causal_lm_served_as_classifier_from_token_rows(tiny_model_dir, tmp_path):
    """vLLM's Qwen3-Reranker recipe (hf_overrides: a classifier architecture, classifier_from_token,
    is_original_qwen3_reranker): the score head is made from the LM head's rows of those tokens, so a two-way
    reranker's score is transformers' two-way softmax of the next-token logits (its `yes` probability) and a
    three-token head gives the softmax over those three; the pair encoding scores as a cross-encoder's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dir("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [40, 41, 57]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def next_logits(prompt):
        with torch.inference_mode():
            return hf(torch.tensor([prompt])).logits[0, -1].float()

    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    small = dict(dtype="float32", num_gpu_blocks_override=64, block_size=8, max_num_batched_tokens=16,
                 max_num_seqs=4)
    two = LLM(model=model_dir, hf_overrides={**arch, "classifier_from_token": tokens[:2],
                                             "is_original_qwen3_reranker": True}, **small)
    assert two.engine.classifier_labels == [tokens[1]]
    prompts = random_prompts([9, 30, 1], seed=3)
    for prompt, out in zip(prompts, two.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)):
        want = next_logits(prompt)[ids[:2]].softmax(-1)[1].item()
        assert out.outputs.probs == pytest.approx([want], abs=1e-5)
    docs = ["the lazy dog", "hello world 42"]
    for doc, scored in zip(docs, two.score("quick brown fox?", docs, use_tqdm=False)):
        pair = tokenizer(text="quick brown fox?", text_pair=doc)["input_ids"]
        assert scored.outputs.score == pytest.approx(next_logits(pair)[ids[:2]].softmax(-1)[1].item(), abs=1e-5)
    del two

    three = LLM(model=model_dir, hf_overrides={**arch, "classifier_from_token": tokens}, **small)
    assert three.engine.classifier_labels == tokens
    out = three.classify({"prompt_token_ids": prompts[0]}, use_tqdm=False)[0]
    assert out.outputs.probs == pytest.approx(next_logits(prompts[0])[ids].softmax(-1).tolist(), abs=1e-5)
    del three

    # The ids resolved once (the multiproc executor passes them to its ranks in hf_overrides) need no tokenizer;
    # ids that do not fit the vocabulary are resolved again from the tokens.
    from pagedllm.models.loader import load_hf_config

    bare = tmp_path / "config_only"
    bare.mkdir()
    shutil.copy(os.path.join(model_dir, "config.json"), bare)
    resolved = {**arch, "classifier_from_token": tokens, "pagedllm_head_token_ids": ids}
    assert load_hf_config(str(bare), overrides=resolved).pagedllm_head_token_ids == ids
    assert load_hf_config(model_dir, overrides={**resolved, "pagedllm_head_token_ids": [1, 2, 10 ** 9]}
                          ).pagedllm_head_token_ids == ids
    with pytest.raises(Exception):  # no tokenizer to resolve them with
        load_hf_config(str(bare), overrides={**resolved, "pagedllm_head_token_ids": ids[:2]})

    for overrides, message in [({"classifier_from_token": tokens[:2]}, "set architectures"),
                               ({**arch, "classifier_from_token": ["no such token at all"]}, "not a token"),
                               ({**arch, "classifier_from_token": tokens, "is_original_qwen3_reranker": True},
                                "two tokens"),
                               ({**arch, "classifier_from_token": "yes"}, "non-empty list")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=model_dir, hf_overrides=overrides, **small)


def test_truncate_prompt_tokens_argument_of_classify(tiny_classifier_dir):
    """vLLM's truncate_prompt_tokens keyword of LLM.classify (it was a TypeError): the last k tokens are classified,
    as with PoolingParams(truncate_prompt_tokens=k)."""
    llm = LLM(model=tiny_classifier_dir("llama"), dtype="float32", num_gpu_blocks_override=32, max_model_len=64)
    (cut,) = llm.classify([list(range(5, 25))], truncate_prompt_tokens=4, use_tqdm=False)
    (want,) = llm.classify([list(range(21, 25))], use_tqdm=False)
    assert cut.prompt_token_ids == list(range(21, 25))
    assert cut.outputs.probs == pytest.approx(want.outputs.probs, abs=1e-6)
    (same,) = llm.classify([list(range(5, 25))], pooling_params=PoolingParams(truncate_prompt_tokens=4),
                           use_tqdm=False)
    assert same.outputs.probs == pytest.approx(cut.outputs.probs, abs=1e-6)


def test_score_takes_pooling_params(tiny_classifier_dir):
    """vLLM's LLM.score(..., pooling_params=...) was a TypeError: on a cross-encoder use_activation=False scores
    with transformers' raw logit, and truncate_prompt_tokens in it cuts as the keyword does."""
    from transformers import AutoTokenizer

    model_dir = tiny_classifier_dir("qwen3", num_labels=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, max_model_len=128)
    query, doc = "Where is Paris?", "Paris is the capital of France."
    logit = hf_logits(model_dir, tok(text=query, text_pair=doc)["input_ids"])[0].item()
    (raw,) = llm.score(query, doc, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    assert raw.outputs.score == pytest.approx(logit, abs=1e-4)
    (sig,) = llm.score(query, doc, use_tqdm=False)
    assert sig.outputs.score == pytest.approx(torch.sigmoid(torch.tensor(logit)).item(), abs=2e-5)
    by_kw = llm.score(query, doc, truncate_prompt_tokens=12, use_tqdm=False)[0]
    by_params = llm.score(query, doc, pooling_params=PoolingParams(truncate_prompt_tokens=12), use_tqdm=False)[0]
    assert by_params.prompt_token_ids == by_kw.prompt_token_ids and len(by_kw.prompt_token_ids) == 12
    assert by_params.outputs.score == pytest.approx(by_kw.outputs.score, abs=1e-6)
