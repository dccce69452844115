"""LoRA through the worker processes: every rank holds its shard of each adapter (registered on all ranks through
the executor's control messages), and a mixed batch of the base model and several adapters gives the tokens of
transformers + PEFT, as with one in-process rank (tests/lora/test_lora_engine.py)."""
from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.lora.request import LoRARequest
from tests.lora.lora_helpers import make_adapter
from tests.lora.test_lora_engine import adapter_factory, check_mixed_batch  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_worker_ranks_serve_adapters_like_peft(tiny_llama_dir, tiny_model_dir, adapter_factory, layout,  # noqa: F811
                                               tmp_path):
    paths = adapter_factory(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", enforce_eager=True, enable_lora=True, max_loras=2,
              max_lora_rank=16, num_gpu_blocks_override=256, **layout)
    try:
        # three adapters on two slots: the ranks swap slots in step, as one rank would
        check_mixed_batch(llm, tiny_llama_dir, paths, vocab=llm.engine.vocab_size)
        # a bad adapter is refused with the reason from the ranks, and the engine keeps serving
        with pytest.raises(ValueError, match="adapter_config.json"):
            llm.engine.add_lora(LoRARequest("missing", 90, str(tmp_path / "none")))
        # a deeper base model's adapter: under pp2 each stage skipped the layer it lacks, so it loaded and ran
        # without that layer's delta
        deep = make_adapter(tiny_model_dir("llama", num_hidden_layers=3), str(tmp_path / "deep"), r=4, alpha=4,
                            targets=["q_proj"], seed=7)
        with pytest.raises(ValueError, match="has 2 decoder layers"):
            llm.engine.add_lora(LoRARequest("deep", 91, deep))
        assert llm.engine.remove_lora(1) and not llm.engine.remove_lora(1)
        assert 1 not in llm.engine.list_loras()
        check_mixed_batch(llm, tiny_llama_dir, paths[1:], vocab=llm.engine.vocab_size, lengths=(7, 33, 4), seed=1)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_adapter_gone_from_disk_fails_its_requests_alone(tiny_llama_dir, layout, tmp_path):
    """As with one rank (tests/lora/test_lora_engine.py): an adapter evicted from the ranks' host caches whose
    files were removed cannot be read again mid-step. That used to kill a rank and with it the engine for good;
    now every rank skips the step alike, the adapter's requests end with 'error', and the rest of the batch and
    later requests are served as without the failure."""
    import shutil

    from pagedllm import SamplingParams

    a, b, c = (make_adapter(tiny_llama_dir, str(tmp_path / n), r=4, alpha=8, targets=["q_proj", "v_proj"], seed=s)
               for n, s in (("a", 31), ("b", 32), ("c", 33)))
    ra, rb, rc = LoRARequest("a", 1, a), LoRARequest("b", 2, b), LoRARequest("c", 3, c)
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", enforce_eager=True, enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_lora_rank=8, num_gpu_blocks_override=64, **layout)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14])]

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]

    try:
        llm.generate(prompts[2], sp, lora_request=ra, use_tqdm=False)
        # b's and c's reads evict a's host copy (one host entry): a step that needs a must read it again
        want = tokens(llm.generate(prompts, sp, lora_request=[None, rb, rc], use_tqdm=False))
        shutil.rmtree(a)
        outs = llm.generate(prompts, sp, lora_request=[None, rb, ra], use_tqdm=False)
        assert tokens(outs[:2]) == want[:2]
        assert outs[2].outputs[0].finish_reason == "error"
        assert tokens(llm.generate([prompts[0], prompts[2]], sp, lora_request=[None, rc], use_tqdm=False)) == \
            [want[0], want[2]]
        assert tokens(llm.generate(prompts[1], sp, lora_request=rb, use_tqdm=False)) == [want[1]]
    finally:
        llm.engine.shutdown()


def _lose_adapter_on_rank1(worker, lora_id: int, path: str) -> None:
    """Point rank 1's copy of an adapter's path elsewhere: as on a node whose disk lost the files."""
    from pagedllm.distributed.parallel_state import get_world_group

    if get_world_group().rank_in_group == 1:
        name, _ = worker.lora_manager.paths[lora_id]
        worker.lora_manager.paths[lora_id] = (name, path)


def test_adapter_gone_on_one_rank_fails_its_requests_on_all(tiny_llama_dir, tmp_path):
    """The ranks agree on a failed re-read before the step's first collective: had rank 0 gone on into the
    forward while rank 1 skipped the step, rank 0 would wait in its all-reduce until the collective timeout."""
    from pagedllm import SamplingParams

    a, b = (make_adapter(tiny_llama_dir, str(tmp_path / n), r=4, alpha=8, targets=["q_proj"], seed=s)
            for n, s in (("a", 41), ("b", 42)))
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", enforce_eager=True, enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_lora_rank=8, num_gpu_blocks_override=64, tensor_parallel_size=2)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 5, 6], [7, 8, 9])]
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=[ra, rb], use_tqdm=False)]
        # pytest imports this file as `parallel.test_parallel_lora`; the ranks (started in the repository root)
        # import the function by the module's full name
        from tests.parallel.test_parallel_lora import _lose_adapter_on_rank1 as lose

        llm.collective_rpc(lose, args=(1, str(tmp_path / "gone")))
        outs = llm.generate(prompts, sp, lora_request=[ra, rb], use_tqdm=False)  # a was evicted by b: re-read
        assert outs[0].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == want[1]
        assert llm.generate(prompts[1], sp, lora_request=rb, use_tqdm=False)[0].outputs[0].token_ids == want[1]
    finally:
        llm.engine.shutdown()
