"""The `vllm` shim (compat/vllm_compat) of this tree: the module paths vLLM's offline scripts import from."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_vllm_offline_import_paths():
    """vllm.entrypoints.llm, vllm.logprobs, vllm.engine.arg_utils and vllm.sampling_params.RequestOutputKind were
    ModuleNotFoundError / ImportError under the shim; each is pagedllm's own object."""
    code = ("from vllm.entrypoints.llm import LLM; from vllm.logprobs import Logprob, SampleLogprobs, PromptLogprobs; "
            "from vllm.engine.arg_utils import EngineArgs; from vllm.sampling_params import RequestOutputKind; "
            "import vllm, pagedllm, pagedllm.config, pagedllm.outputs, pagedllm.sampling_params as sp; "
            "assert LLM is pagedllm.LLM and EngineArgs is pagedllm.config.EngineArgs is vllm.EngineArgs; "
            "assert Logprob is pagedllm.outputs.Logprob and RequestOutputKind is sp.RequestOutputKind; "
            "print(vllm.__file__)")
    r = _run_with_shim(code)
    assert r.stdout.strip().startswith(os.path.join(ROOT, "compat")), r.stdout


def test_vllm_metrics_reader_path():
    """`from vllm.v1.metrics.reader import ...` (the types of LLM.get_metrics()): pagedllm's own classes."""
    code = ("from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector, Metric; "
            "import pagedllm.metrics.reader as r; "
            "assert (Counter, Gauge, Histogram, Vector, Metric) == "
            "(r.Counter, r.Gauge, r.Histogram, r.Vector, r.Metric)")
    _run_with_shim(code)


def test_vllm_pooling_output_names():
    """vLLM exports its pooling outputs from vllm and vllm.outputs (PoolingRequestOutput, ClassificationRequestOutput,
    ScoringRequestOutput, ...); the shim had only two of them, so `from vllm import PoolingRequestOutput` failed."""
    names = ("EmbeddingOutput", "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
             "ScoringOutput", "ScoringRequestOutput", "PoolingOutput", "PoolingRequestOutput")
    code = (f"import vllm, vllm.outputs, pagedllm.pooling as p; names = {names!r}; "
            "assert all(getattr(vllm, n) is getattr(vllm.outputs, n) is getattr(p, n) for n in names); "
            "assert set(names) <= set(vllm.__all__); "
            f"from vllm import {', '.join(names)}")
    _run_with_shim(code)


def test_vllm_distributed_cleanup_calls():
    """vLLM scripts free an LLM with `del llm; destroy_model_parallel(); destroy_distributed_environment()` from
    vllm.distributed(.parallel_state): ModuleNotFoundError under the shim. They are pagedllm's, callable without a
    world, leaving the one-rank world the offline LLM runs in."""
    code = ("from vllm.distributed.parallel_state import destroy_model_parallel, destroy_distributed_environment; "
            "import vllm.distributed as d, pagedllm.distributed.parallel_state as ps; "
            "assert (destroy_model_parallel, destroy_distributed_environment) == "
            "(d.destroy_model_parallel, d.destroy_distributed_environment) == "
            "(ps.destroy_model_parallel, ps.destroy_distributed_environment); "
            "destroy_model_parallel(); destroy_distributed_environment(); "
            "assert ps.get_world_group().world_size == 1 and ps.get_tensor_model_parallel_world_size() == 1")
    _run_with_shim(code)


def _run_with_shim(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the vllm shim and src/ on the path; it must exit 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "compat", "vllm_compat"),
                                                       os.path.join(ROOT, "src")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r
