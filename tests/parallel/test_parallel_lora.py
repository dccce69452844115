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
