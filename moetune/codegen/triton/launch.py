"""Launching the backend's @triton.jit kernels with less host time per call.

`fn[grid](*args, **meta)` goes through Triton's JIT dispatch on every call: bind and specialise every
argument, build the cache key, look the kernel up, check the globals, then launch. An eager decode step
pays that for every launch of every MoE layer. `launch(fn, grid, *args, **meta)` goes through it on the
first call of a key only; after that it calls the compiled kernel's launcher itself.

The key is finer than what Triton specialises on, never coarser: a tensor's dtype and its address modulo
16; every other runtime argument by value (an int's value decides Triton's "is 1", "divisible by 16" and
"fits 32 bits"; a float is always fp32); then the constexprs and launch options (`meta`) and the current
device. So two calls with one key are the same compiled kernel, the one Triton's dispatch would pick.
This holds while an argument position keeps its Python type (1 and True are equal keys), as at every
launch site of this backend. Each new value of a per-call int (P, the tile count) is one trip through
Triton's dispatch, then cached. Launches through `fn[grid]` still: interpreted kernels
(TRITON_INTERPRET=1), launch hooks (profilers), and MOETUNE_TRITON_DIRECT_LAUNCH=0. TMA launches do not
come here: their descriptors are new objects every call.
"""

from __future__ import annotations

import os

import torch

from .layout import interpreting

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction
except ImportError:  # a Triton without knobs (< 3.4): every launch through fn[grid]
    _knobs = _driver = JITFunction = None

DIRECT = os.environ.get("MOETUNE_TRITON_DIRECT_LAUNCH", "1") not in ("0", "")  # read at every launch
_MAX_KERNELS = 4096  # keys kept per kernel before starting afresh


def _hooked() -> bool:
    """Whether a launch hook is registered (None, or a HookChain with calls, by Triton version)."""
    rt = _knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


_CURRENT: tuple = ()


def _current():
    """(current device, current raw stream) functions of the active driver, looked up once."""
    global _CURRENT
    if not _CURRENT:
        _CURRENT = _driver.active.get_current_device, _driver.active.get_current_stream
    return _CURRENT


class _Site:
    """The compiled kernels of one jit function, by specialisation key (module doc)."""

    def __init__(self, fn):
        self.fn = fn
        self.direct = JITFunction is not None and isinstance(fn, JITFunction)
        self.names = list(fn.arg_names) if self.direct else []
        self.defaults = {p.name: p.default for p in fn.params} if self.direct else {}
        # every runtime argument by position, every constexpr by name (else: through Triton)
        self.positional = next((i for i, p in enumerate(fn.params) if p.is_constexpr), len(self.names)) \
            if self.direct else 0
        self.kernels: dict = {}

    @staticmethod
    def key_of(args: tuple) -> tuple:
        """The runtime arguments' part of the key: (dtype, address mod 16) of a tensor, else the value."""
        return tuple([(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a for a in args])

    def __call__(self, grid, args, meta) -> None:
        if not (DIRECT and self.direct) or len(args) != self.positional or _hooked():
            self.fn[grid](*args, **meta)
            return
        device, stream = _current()
        dev = device()
        key = (dev, self.key_of(args), *meta.items())
        hit = self.kernels.get(key)
        if hit is None:
            k = self.fn[grid](*args, **meta)  # compiles on a miss; returns the compiled kernel
            try:
                hit = (k.run, k.function, k.packed_metadata,
                       tuple(meta[n] if n in meta else self.defaults[n] for n in self.names[len(args):]))
            except (AttributeError, KeyError):  # a Triton whose compiled kernel differs: dispatch as it does
                self.direct = False
                return
            if len(self.kernels) >= _MAX_KERNELS:
                self.kernels.clear()
            self.kernels[key] = hit
            return
        run, function, packed, tail = hit
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream(dev), function, packed,
            None, None, None, *args, *tail)


_SITES: dict[int, _Site] = {}


def programmatic(asked: bool) -> bool:
    """Whether a schedule's `pdl` takes effect (programmatic dependent launches, _common's module doc): on
    compiled kernels; interpreted, the launches run one after the other anyway, and the kernels' PDL
    constexpr stays off."""
    return asked and not interpreting()


def pdl_launch(on: bool) -> dict:
    """The launch option that makes a kernel a programmatic dependent launch (Triton's launch_pdl), when `on`."""
    return {"launch_pdl": True} if on else {}


def launch(fn, grid: tuple[int, ...], *args, **meta) -> None:
    """`fn[grid](*args, **meta)` (runtime arguments positional, constexprs and options by name), with
    Triton's dispatch skipped once the specialisation was launched before (module doc)."""
    site = _SITES.get(id(fn))
    if site is None:
        site = _SITES[id(fn)] = _Site(fn)
    site(grid, args, meta)
