"""Sleep mode (vLLM's LLM.sleep / wake_up / is_sleeping) on the CPU: the KV cache is freed and reallocated, level 2
discards the weights and reloads them from the model's files, and greedy tokens are the same before and after."""
from __future__ import annotations

import operator

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": list(range(20, 60))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", num_gpu_blocks_override=32, max_model_len=128, enable_sleep_mode=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def weight_elements(llm: LLM) -> int:
    return sum(p.numel() for p in llm.engine.worker.model.parameters())


def test_sleep_and_wake_up_keep_greedy_tokens(tiny_llama_dir):
    with LLM(tiny_llama_dir, **ENGINE) as llm:
        before = tokens(llm)
        weights = weight_elements(llm)
        runner = llm.engine.worker.runner

        llm.sleep(level=1)
        assert llm.is_sleeping() and runner.kv_caches == []
        assert all(layer.kv_cache is None for layer in runner.model.attn_layers)
        assert not llm.engine.scheduler.kv_cache_manager.block_pool.cached_blocks  # the prefix cache is forgotten
        with pytest.raises(ValueError, match="sleeping"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.sleep(level=1)  # already asleep: a warning, nothing else
        llm.wake_up()
        assert not llm.is_sleeping() and len(runner.kv_caches) > 0
        assert tokens(llm) == before

        llm.sleep(level=2)
        assert weight_elements(llm) == 0  # discarded, not kept anywhere
        assert llm.engine.get_stats().sleep_state == "discard_all"  # (vllm:engine_sleep_state's; level 1 offloads)
        llm.wake_up(tags=["weights"])  # vLLM's order for a weight update: weights first, then the KV cache
        assert llm.is_sleeping() and weight_elements(llm) == weights
        assert llm.engine.get_stats().sleep_state == "kv_cache_asleep"
        with pytest.raises(ValueError, match="sleeping"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.collective_rpc("reload_weights") == [None]
        llm.wake_up(tags="kv_cache")  # one tag as a string
        assert not llm.is_sleeping() and llm.engine.get_stats().sleep_state == "awake"
        assert tokens(llm) == before

        for level in (3, 1.0, True):  # (1.0 and True are no level, though they equal 1)
            with pytest.raises(ValueError, match="level must be 1"):
                llm.sleep(level=level)
        with pytest.raises(ValueError, match="tags must be among"):
            llm.wake_up(tags=["weights", "optimizer"])
        with pytest.raises(ValueError, match="no public method"):
            llm.collective_rpc("_start")
        # vLLM's callable form (it was 'no public method <function ...>'): called with the rank's worker first
        assert llm.collective_rpc(lambda worker, k: (worker is llm.engine.worker, k), args=(3,)) == [(True, 3)]
        assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]  # vLLM's apply_model
        with pytest.raises(ValueError, match=r"timeout=\.\.\.\) is not supported"):  # refused, not silently ignored
            llm.collective_rpc("reload_weights", timeout=5.0)


def test_sleep_with_unfinished_requests_is_refused(tiny_llama_dir):
    from pagedllm.core.engine_core import EngineCoreRequest

    with LLM(tiny_llama_dir, **ENGINE) as llm:
        engine = llm.engine
        engine.add_request(EngineCoreRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4)))
        with pytest.raises(ValueError, match="1 unfinished request"):
            llm.sleep()
        with pytest.raises(ValueError, match="reload the weights with 1 unfinished request"):
            llm.collective_rpc("reload_weights")
        engine.abort_requests(["r1"])
        llm.sleep()
        assert llm.is_sleeping()


def test_sleep_finishes_a_step_launched_for_finished_requests(tiny_llama_dir):
    """Async scheduling: the step launched before the last token came back is still in flight when the request is
    done (a server's client already has its answer); sleep applies it instead of refusing."""
    from pagedllm.core.engine_core import EngineCoreRequest

    with LLM(tiny_llama_dir, async_scheduling=True, **ENGINE) as llm:
        engine = llm.engine
        prompt = PROMPTS[0]["prompt_token_ids"]
        first = tokens(llm)[0]
        # A stop token the scheduler cannot foresee (a length limit it can): the next step is launched meanwhile.
        stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first[2]])
        engine.add_request(EngineCoreRequest("r1", prompt, stop))
        while engine.scheduler.has_unfinished_requests():
            engine.step()
        assert engine.has_unfinished_requests()  # the launched step
        llm.sleep()
        assert llm.is_sleeping()
        llm.wake_up()
        assert tokens(llm)[0] == first


def test_sleep_needs_enable_sleep_mode(tiny_llama_dir):
    with LLM(tiny_llama_dir, **dict(ENGINE, enable_sleep_mode=False)) as llm:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            llm.sleep()
        assert not llm.is_sleeping()
    with pytest.raises(ValueError, match="--enable-sleep-mode with --enable-lora is not supported yet"):
        LLM(tiny_llama_dir, enable_lora=True, **ENGINE)


def test_weights_moved_through_host_copies_keep_ties(tiny_model_dir):
    """The accelerator's path (one host copy per storage, tensors rebuilt on it) forced on the CPU: a tied LM head
    still shares the embedding's tensor after wake-up, and the tokens are the same."""
    with LLM(tiny_model_dir("llama", tie_word_embeddings=True), **ENGINE) as llm:
        before = tokens(llm)
        worker = llm.engine.worker
        worker._weight_sleeper().offload = True
        llm.sleep(level=1)
        assert weight_elements(llm) == 0
        llm.wake_up()
        model = worker.model
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert tokens(llm) == before


@pytest.mark.timeout(240)
def test_tensor_parallel_ranks_all_sleep(tiny_llama_dir):
    """TP=2 (gloo worker processes): each rank frees and restores its own shard; level 2 reloads on every rank."""
    with LLM(tiny_llama_dir, device="cpu", enforce_eager=True, tensor_parallel_size=2, **ENGINE) as llm:
        before = tokens(llm)
        llm.sleep(level=2)
        with pytest.raises(ValueError, match="sleeping"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert tokens(llm) == before
        assert llm.collective_rpc("reload_weights") == [None, None]
        assert tokens(llm) == before
        # a callable goes to each rank pickled: a picklable one runs there, a lambda is one clear sentence
        assert [str(d) for d in llm.collective_rpc(operator.attrgetter("device"))] == ["cpu", "cpu"]
        with pytest.raises(ValueError, match="cannot be sent to the worker processes"):
            llm.collective_rpc(lambda worker: 1)
        assert llm.apply_model(operator.attrgetter("training")) == [False, False]


def test_packed_gguf_model_sleeps_with_its_cpu_decode_stack(smollm2_gguf_path):
    """A .gguf on the CPU keeps its weights as packed buffers and decodes through the fused C++ stack (which holds
    the weights' and KV cache's tensors): level 2 discards the packed buffers too, the stack is rebuilt."""
    with LLM(smollm2_gguf_path, max_model_len=128, num_gpu_blocks_override=16, enable_sleep_mode=True) as llm:
        prompts = ["The capital of France is", "Once upon a time"]
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        inner = llm.engine.worker.model.model
        stack = inner.fast_path.stack
        assert stack is not None  # the fused path ran
        llm.sleep(level=2)
        model = llm.engine.worker.model
        assert weight_elements(llm) == 0 and sum(b.numel() for b in model.buffers()) < 1000  # only the KV scales
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before
        assert inner.fast_path.stack is not stack
