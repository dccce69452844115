"""Direct launches of compiled Triton kernels, for the kernels a step launches eagerly (outside CUDA graphs).

Triton's `kernel[grid](...)` binds the arguments, computes their specialization and looks the compiled kernel up on
every call: ~45 us of Python per launch on the GPU machine's host, which a small model's step pays several times
(the LM head's GEMV, the argmax, the speculation and sampling kernels; docs/benchmarks.md, "Where a SmolLM2 step's
host time goes"). `direct(kernel)[grid](...)` keeps, per specialization, the compiled kernel that Triton's own
launch returned the first time, and afterwards calls that kernel's launcher with the arguments.

Where this Triton's compiled-kernel runner has the known shape (`CompiledKernel.__getitem__` calling
`self.run(grid..., stream, function, packed metadata, launch metadata, enter hook, exit hook, *args)`) and no launch
hook is set when a kernel is kept, the launch calls `run` itself with no launch metadata and no hooks: the runner
would build the metadata for the hooks on every launch even with none set. (Set a Triton launch hook, e.g. a
profiler's, before the engine starts, or set `PAGEDLLM_TRITON_DIRECT_LAUNCH=0`, for the hooks to see these launches.)

The cache key refines Triton's specialization, so two calls with the same key always get the same compiled kernel
from Triton too: each tensor's dtype and 16-byte alignment; each integer's type class (i32 / i64 / u64 by value)
and, unless the kernel does not specialize it, whether it is 1 or a multiple of 16; the values of constexprs, bools
and None; the launch options (num_warps, launch_pdl, ...). A call with any other kind of argument, under Triton's
interpreter, or with `PAGEDLLM_TRITON_DIRECT_LAUNCH=0`, takes Triton's own path.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

import torch

from pagedllm import envs

logger = logging.getLogger("pagedllm")

_enabled: Optional[bool] = None
_fast_enabled = True  # False: kept kernels launch through their own runner (set_fast: benchmarks' A/B, tests)


def enabled() -> bool:
    """Read once per process (a launch must not pay an environment read)."""
    global _enabled
    if _enabled is None:
        _enabled = envs.PAGEDLLM_TRITON_DIRECT_LAUNCH and not envs.TRITON_INTERPRET
    return _enabled


def set_enabled(value: Optional[bool]) -> None:
    """Tests: force direct launches on or off (None: read the environment again)."""
    global _enabled
    _enabled = value


def set_fast(value: bool) -> None:
    """Direct launches call the compiled kernel's `run` themselves (fast_runner) where they can, or never."""
    global _fast_enabled
    _fast_enabled = value


class _Unkeyable(Exception):
    pass


_I32, _I64 = (-2 ** 31, 2 ** 31), (-2 ** 63, 2 ** 63)


def _spec(arg: Any, constexpr: bool, specialize: bool) -> Any:
    if constexpr:
        try:
            hash(arg)
        except TypeError:
            raise _Unkeyable from None
        return ("c", type(arg), arg)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if arg is None:
        return None
    if isinstance(arg, bool):  # (before int: a bool is an int)
        return ("b", arg)
    if isinstance(arg, int):
        kind = 0 if _I32[0] <= arg < _I32[1] else (1 if _I64[0] <= arg < _I64[1] else 2)
        return ("i", kind, arg == 1, arg % 16 == 0) if specialize else ("i", kind)
    if isinstance(arg, float):
        return ("f",)
    raise _Unkeyable


_RUN_CALL = ("self.run(grid[0],grid[1],grid[2],stream,self.function,self.packed_metadata,launch_metadata,"
             "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*args)")
_runner_known: Optional[bool] = None


def _runner_shape_known() -> bool:
    """Whether this Triton's compiled-kernel runner calls `run` as _RUN_CALL does (read once per process)."""
    global _runner_known
    if _runner_known is None:
        try:
            from triton.compiler.compiler import CompiledKernel

            _runner_known = _RUN_CALL in "".join(inspect.getsource(CompiledKernel.__getitem__).split())
        except (ImportError, OSError, TypeError, AttributeError):
            _runner_known = False
    return _runner_known


def _hooks_idle() -> bool:
    """No Triton launch hook is set (a hook is None, or a chain of hooks holding none)."""
    try:
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        return False
    return all(h is None or (isinstance(getattr(h, "calls", None), list) and not h.calls) for h in hooks)


def fast_runner(compiled) -> Optional[Any]:
    """`launch(grid3, device_index, args)` calling `compiled.run` as its runner would, without launch metadata or
    hooks; None where that is not known to be the same launch (another runner shape, a hook set, no handles)."""
    run, function = getattr(compiled, "run", None), getattr(compiled, "function", None)
    meta = getattr(compiled, "packed_metadata", None)
    if run is None or function is None or meta is None or not (_runner_shape_known() and _hooks_idle()):
        return None
    try:
        from triton.runtime import driver

        get_stream = driver.active.get_current_stream
    except (ImportError, AttributeError, RuntimeError):
        return None

    def launch(grid3, device: int, args) -> None:
        run(grid3[0], grid3[1], grid3[2], get_stream(device), function, meta, None, None, None, *args)
    return launch


class DirectKernel:
    """`direct(jit_fn)`: launched as `kernel[grid](*args, **kwargs)`, like the JIT function it wraps."""

    def __init__(self, fn) -> None:
        self.fn = fn
        # (Triton's interpreter gives an InterpretedFunction without `params`: its launches all go through it)
        params = list(getattr(fn, "params", None) or ())
        self.usable = bool(params)
        self.names = [p.name for p in params]
        self.position = {name: i for i, name in enumerate(self.names)}
        self.defaults = [p.default for p in params]
        self.constexpr = [bool(p.is_constexpr) for p in params]
        self.specialize = [not getattr(p, "do_not_specialize", False) for p in params]
        self.compiled: dict[tuple, Any] = {}
        self.verified = False  # a direct launch went through

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def bind(self, args: tuple, kwargs: dict) -> Optional[tuple[list, tuple]]:
        """(every parameter's value in order, defaults applied; the launch options), or None where Triton's own
        binding must decide (a missing or doubly given argument: Triton raises its error)."""
        n = len(args)
        if n > len(self.names):
            return None
        full = list(args)
        for i in range(n, len(self.names)):
            name = self.names[i]
            if name in kwargs:
                full.append(kwargs[name])
            elif self.defaults[i] is not inspect.Parameter.empty:
                full.append(self.defaults[i])
            else:
                return None
        options = []
        for name, value in kwargs.items():
            i = self.position.get(name)
            if i is None:
                options.append((name, value))
            elif i < n:
                return None
        return full, tuple(sorted(options))

    def key(self, full: list, options: tuple) -> tuple:
        # (Triton keeps compiled kernels per current device: so does this cache)
        return (torch.cuda.current_device(),) + tuple(map(_spec, full, self.constexpr, self.specialize)) + options

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if callable(grid) or not (self.usable and enabled()):  # (a grid function reads Triton's bound arguments)
            self.fn[grid](*args, **kwargs)
            return
        bound = self.bind(args, kwargs)
        try:
            key = None if bound is None else self.key(*bound)
            hash(key)
        except (_Unkeyable, TypeError):
            key = None
        kept = None if key is None else self.compiled.get(key)
        if kept is None:
            kernel = self.fn[grid](*args, **kwargs)
            if key is not None and kernel is not None and hasattr(kernel, "__getitem__"):
                # (its own runner, and fast_runner's launch where there is one; both called as (grid3, device, args))
                self.compiled[key] = (lambda g, _device, a: kernel[g](*a), fast_runner(kernel))
            return
        via_runner, fast = kept
        launch = fast if fast is not None and _fast_enabled else via_runner
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        if self.verified:
            launch(grid3, key[0], bound[0])
            return
        try:  # the first direct launch: a launcher that takes its arguments otherwise refuses them (TypeError)
            launch(grid3, key[0], bound[0])
        except (TypeError, AttributeError) as e:
            self.usable = False
            logger.warning("Eager launches of the Triton kernel %s go through Triton's own launch: its compiled "
                           "launcher refused the arguments (%s).", getattr(self.fn, "__name__", self.fn), e)
            self.fn[grid](*args, **kwargs)
            return
        self.verified = True


def direct(fn) -> DirectKernel:
    return DirectKernel(fn)
