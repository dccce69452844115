"""kernels/triton_launch.py on the CPU: the binding of a call to the kernel's parameters, the cache key (a refinement
of Triton's specialization), and which launches go through Triton and which through the kept compiled kernel (a
recording stand-in for Triton's JIT function). tests/gpu/test_triton_launch_gpu.py launches real kernels."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pagedllm.kernels import triton_launch
from pagedllm.kernels.triton_launch import DirectKernel, _spec, _Unkeyable


@triton.jit(do_not_specialize=["m"])
def _toy_kernel(x_ptr, out_ptr, n, m, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 2):
    pass


def test_bind_orders_every_parameter_and_separates_the_options():
    k = DirectKernel(_toy_kernel)
    x = torch.zeros(4)
    full, options = k.bind((x, x, 3), dict(m=5, scale=0.5, flag=True, BLOCK=64, num_warps=4, launch_pdl=False))
    assert full == [x, x, 3, 5, 0.5, True, 64, 2]  # MODE's default applied
    assert options == (("launch_pdl", False), ("num_warps", 4))
    full, _ = k.bind((x, x, 3, 5, 0.5, True, 64, 1), {})
    assert full[-1] == 1
    assert k.bind((x, x), dict(n=3, scale=0.5, flag=True, BLOCK=64)) is None  # m missing: Triton reports it
    assert k.bind((x, x, 3), dict(n=3, m=5, scale=0.5, flag=True, BLOCK=64)) is None  # n given twice
    assert k.bind((x,) * 9, {}) is None  # too many


def test_key_refines_triton_specialization():
    aligned = torch.zeros(64, dtype=torch.float32)
    offset = aligned[1:]  # 4 bytes past a 16-byte boundary
    assert aligned.data_ptr() % 16 == 0
    assert _spec(aligned, False, True) != _spec(offset, False, True)
    assert _spec(aligned, False, True) != _spec(aligned.to(torch.float16), False, True)
    # integers: ==1 and %16 where specialized, the type class (i32 / i64 / u64) always
    assert len({_spec(v, False, True) for v in (1, 16, 17, 2 ** 40, 2 ** 63)}) == 5
    assert _spec(1, False, False) == _spec(17, False, False) != _spec(2 ** 40, False, False)
    assert _spec(True, False, True) != _spec(1, False, True)  # a bool is not the integer 1
    assert _spec(0.5, False, True) == _spec(2.0, False, True)  # floats are not specialized
    assert _spec(64, True, True) != _spec(128, True, True)  # constexpr values are
    assert _spec(None, False, True) is None
    with pytest.raises(_Unkeyable):
        _spec(object(), False, True)
    with pytest.raises(_Unkeyable):
        _spec([1, 2], True, True)


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _FakeJit:
    """Triton's JIT function as DirectKernel sees it: `params` and `fn[grid](*args, **kwargs)` returning the
    compiled kernel (recorded instead of launched)."""

    def __init__(self, fn, compiled=None):
        self.params = _toy_kernel.params
        self.log = []
        self.compiled = compiled or _Compiled  # the compiled kernel's stand-in class

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled(self.log)
        return launch


@pytest.fixture
def toy(monkeypatch):
    """(the recording JIT stand-in, its DirectKernel, a 16-byte aligned tensor), direct launches on."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake = _FakeJit(_toy_kernel)
    triton_launch.set_enabled(True)
    yield fake, DirectKernel(fake), torch.zeros(64)
    triton_launch.set_enabled(None)


def test_launch_keeps_the_compiled_kernel_per_key(toy):
    fake, k, x = toy
    k[(3,)](x, x, 5, m=7, scale=1.0, flag=False, BLOCK=32, num_warps=4)
    k[(3,)](x, x, 5, m=9, scale=2.0, flag=False, BLOCK=32, num_warps=4)  # same key: m is not specialized
    k[(2, 2)](x, x[1:], 5, m=9, scale=2.0, flag=False, BLOCK=32, num_warps=4)  # another alignment: Triton
    k[(3,)](x, x, 5, m=9, scale=2.0, flag=False, BLOCK=32, num_warps=8)  # another option: Triton
    k[(4,)](x, x, 5, m=11, scale=3.0, flag=False, BLOCK=32, num_warps=4)
    assert [e[0] for e in fake.log] == ["triton", "direct", "triton", "triton", "direct"]
    assert fake.log[1] == ("direct", (3, 1, 1), (x, x, 5, 9, 2.0, False, 32, 2))
    assert fake.log[4][1] == (4, 1, 1) and fake.log[4][2][3] == 11
    k[lambda meta: (3,)](x, x, 5, m=7, scale=1.0, flag=False, BLOCK=32, num_warps=4)  # a grid function
    assert fake.log[-1][0] == "triton"
    triton_launch.set_enabled(False)  # off: every launch through Triton
    k[(3,)](x, x, 5, m=7, scale=1.0, flag=False, BLOCK=32, num_warps=4)
    assert fake.log[-1][0] == "triton"


def test_unkeyable_calls_take_triton_and_are_not_kept(toy):
    fake, k, x = toy
    for _ in range(2):
        k[(1,)](x, x, 5, m=7, scale=1.0, flag=object(), BLOCK=32)
        k[(1,)](x, x, 5, m=7, scale=1.0, flag=False, BLOCK=32, num_warps=[4])  # an unhashable option
    assert [e[0] for e in fake.log] == ["triton"] * 4 and not k.compiled


def test_enabled_follows_the_environment(monkeypatch):
    triton_launch.set_enabled(None)
    monkeypatch.setenv("PAGEDLLM_TRITON_DIRECT_LAUNCH", "0")
    assert not triton_launch.enabled()
    triton_launch.set_enabled(None)
    monkeypatch.setenv("PAGEDLLM_TRITON_DIRECT_LAUNCH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no compiled launcher
    assert not triton_launch.enabled()
    triton_launch.set_enabled(None)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_launch.enabled()
    triton_launch.set_enabled(None)


def test_the_kernels_a_step_launches_eagerly_are_wrapped():
    from pagedllm.kernels import argmax, gemv, sampling, spec_decode

    for wrapped in (argmax._argmax_partial, argmax._argmax_merge, gemv._gemv, sampling._sample_launch,
                    sampling._sample_split_launch, spec_decode._spec_inputs, spec_decode._spec_outputs):
        assert isinstance(wrapped, DirectKernel) and isinstance(wrapped.fn, triton.runtime.JITFunction)


def test_a_function_without_params_always_takes_its_own_launch():
    """Triton's interpreter gives InterpretedFunction objects (no `params`): every launch goes through them."""
    log = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: log.append((grid, args, kwargs))

    k = DirectKernel(Interpreted())
    triton_launch.set_enabled(True)
    try:
        k[(2,)](1, 2, BLOCK=4)
        k[(2,)](1, 2, BLOCK=4)
    finally:
        triton_launch.set_enabled(None)
    assert log == [((2,), (1, 2), {"BLOCK": 4})] * 2 and not k.compiled


def test_a_launcher_that_refuses_the_arguments_turns_direct_launches_off(monkeypatch, caplog):
    """A Triton whose compiled launcher takes its arguments otherwise (e.g. without the constexprs) raises a
    TypeError on the first direct launch: that launch and every later one go through Triton, with a warning."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Refusing(_Compiled):
        def __getitem__(self, grid):
            def runner(*args):
                raise TypeError("function takes exactly 9 arguments (11 given)")
            return runner

    fake = _FakeJit(_toy_kernel, compiled=Refusing)
    k = DirectKernel(fake)
    x = torch.zeros(64)
    triton_launch.set_enabled(True)
    try:
        with caplog.at_level("WARNING", logger="pagedllm"):
            for _ in range(3):
                k[(1,)](x, x, 5, m=7, scale=1.0, flag=False, BLOCK=32)
    finally:
        triton_launch.set_enabled(None)
    assert [e[0] for e in fake.log] == ["triton"] * 3 and not k.usable
    assert "refused the arguments" in caplog.text


def test_the_installed_triton_runner_has_the_known_shape():
    """The compiled-kernel runner of the Triton installed here calls `run` as fast_runner does (the GPU test checks
    the GPU machine's Triton)."""
    assert triton_launch._runner_shape_known()


class _Launcher:
    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(args)


class _RunnableCompiled(_Compiled):
    """A compiled kernel with a launcher (`run`), its function handle and packed metadata, as Triton keeps them."""

    def __init__(self, log):
        super().__init__(log)
        self.run, self.function, self.packed_metadata = _Launcher(log), "FN", ("META",)


@pytest.fixture
def fake_driver(monkeypatch):
    """Triton's active driver as fast_runner reads it: the current raw stream per device."""
    from triton.runtime import driver

    class Active:
        @staticmethod
        def get_current_stream(device):
            return 1000 + device

    monkeypatch.setattr(type(driver), "active", property(lambda self: Active()))
    monkeypatch.setattr(triton_launch, "_runner_known", True)


def test_fast_runner_calls_run_as_the_runner_would_without_metadata_or_hooks(fake_driver):
    log = []
    launch = triton_launch.fast_runner(_RunnableCompiled(log))
    launch((3, 2, 1), 1, [7, 8])
    assert log == [(3, 2, 1, 1001, "FN", ("META",), None, None, None, 7, 8)]


def test_fast_runner_declines_with_a_hook_set_an_unknown_runner_or_no_handles(fake_driver, monkeypatch):
    from triton import knobs

    log = []
    assert triton_launch.fast_runner(_Compiled(log)) is None  # no `run` / handles
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a chain of hooks (Triton >= 3.4)
        fn = lambda *a: None  # noqa: E731
        hook.add(fn)
        try:
            assert triton_launch.fast_runner(_RunnableCompiled(log)) is None
        finally:
            hook.remove(fn)
    else:  # a single hook (older Triton)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
        assert triton_launch.fast_runner(_RunnableCompiled(log)) is None
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert triton_launch.fast_runner(_RunnableCompiled(log)) is not None
    monkeypatch.setattr(triton_launch, "_runner_known", False)
    assert triton_launch.fast_runner(_RunnableCompiled(log)) is None


def test_kept_kernels_launch_through_the_fast_runner_when_there_is_one(toy, fake_driver):
    _, _, x = toy
    fake = _FakeJit(_toy_kernel, compiled=_RunnableCompiled)
    k = DirectKernel(fake)
    k[(3,)](x, x, 5, m=7, scale=1.0, flag=False, BLOCK=32)
    k[(3,)](x, x, 5, m=9, scale=1.0, flag=False, BLOCK=32)
    assert fake.log[1] == (3, 1, 1, 1000, "FN", ("META",), None, None, None, x, x, 5, 9, 1.0, False, 32, 2)
    triton_launch.set_fast(False)  # the A/B: the compiled kernel's own runner
    try:
        k[(3,)](x, x, 5, m=9, scale=1.0, flag=False, BLOCK=32)
    finally:
        triton_launch.set_fast(True)
    assert fake.log[2][0] == "direct"
