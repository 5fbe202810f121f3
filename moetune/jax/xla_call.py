"""moetune's torch-facing kernels inside a JAX program, called through the XLA FFI.

    fn = via_xla(block, experts_fn)     # a JaxExpertsFn; experts_fn a torch ExpertsFn (a backend's `build`)
    be = XlaBridged(backend)            # the backend with build_jax = via_xla ∘ build, all else its own

A backend with no JAX kernels (triton, torch) runs under jitted JAX this way, with its own schedules and
its own dispatch-table entries: the table tuned for the torch runtime applies unchanged. The call is one
`jax.experimental.buffer_callback` (an XLA FFI custom call into Python). When the program reaches it, XLA
hands the callback its device buffers and, on a GPU, the stream it runs the program on; the torch kernels
are launched on that stream (torch.cuda.ExternalStream), so they are ordered with the program's other work
and the host waits for nothing. Buffers cross by DLPack: the weights are read in place and the result is
copied once into the callback's output buffer.

On a GPU the call is traceable into XLA's command buffers (`command_buffer_compatible`): where XLA records the
program, or the part of it around the call, as a CUDA graph, it runs the callback once with the stream
capturing, and afterwards replays the kernels the callback launched without entering Python; it runs the
callback again only when the buffers' addresses change. Two things make the torch kernels safe to record:
  - memory: what the kernels allocate while the stream captures (scratch, partial sums) comes from a
    memory pool of the call site's own (torch.cuda.MemPool), kept as long as the call site, so the replays'
    scratch is never handed to anyone else; a call site's recordings share it (they run one at a time);
  - compilation: a kernel's first launch compiles and loads it, which a capturing thread may not do; a
    call whose first run is a capture first runs once on zeros in another thread, on another stream.
Where XLA makes no command buffer (a program too small for one, or the flag off), the callback runs, and
launches its kernels from the host, every time the program runs.

Ids reach the torch kernels as int64, the dtype the torch runtime passes them in. One-byte floats (e4m3
weights, ue8m0 scales) cross as their bytes (a bitcast to uint8 in the program, a view back in torch):
XLA's GPU buffers do not export 8-bit float types through DLPack.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..codegen.pallas_tpu._common import JaxExperts
from ..codegen.tensors import ExpertsFn, ExpertTensors
from ..ir import MoEBlock, Schedule, UnsupportedSchedule

FIELDS = JaxExperts._fields
_DL_CUDA = 2  # DLPack's device type of a CUDA buffer
_NO_SYNC = -1  # DLPack's stream argument asking the producer not to synchronise: the kernels run on its stream
_VIEWS: dict[tuple, torch.Tensor] = {}  # (address, shape, dtype) of a GPU buffer → its torch view
_STREAMS: dict[tuple[int, int], torch.cuda.ExternalStream] = {}


def _tensor(buf) -> torch.Tensor:
    """A torch view of an XLA FFI buffer (DLPack, no copy). On a GPU the view of an address seen before with
    the same shape and dtype is reused: the weights are the same buffers at every call, and making a view
    is a host cost."""
    cai = getattr(buf, "__cuda_array_interface__", None) if buf.__dlpack_device__()[0] == _DL_CUDA else None
    key = None if cai is None else (cai["data"][0], tuple(buf.shape), str(buf.dtype))
    hit = _VIEWS.get(key) if key is not None else None
    if hit is not None:
        return hit
    try:
        t = torch.utils.dlpack.from_dlpack(buf.__dlpack__(stream=_NO_SYNC) if key is not None else buf.__dlpack__())
    except (TypeError, BufferError):  # a producer refusing the stream argument: torch's own protocol call
        t = torch.from_dlpack(buf)
    if key is not None:
        if len(_VIEWS) >= 256:
            _VIEWS.clear()
        _VIEWS[key] = t
    return t


def _byte_float(dtype) -> torch.dtype | None:
    """The torch dtype of a one-byte float JAX dtype (it crosses as uint8), else None."""
    import numpy as np

    dt = np.dtype(dtype)
    if dt.itemsize != 1 or dt.kind in "iub":
        return None
    t = getattr(torch, dt.name, None)
    if not isinstance(t, torch.dtype):
        raise UnsupportedSchedule(f"moetune.jax: no torch dtype for the one-byte float {dt.name}")
    return t


def _bytes(a):
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(a, jnp.uint8)


def _as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.view(dtype)


def _stream(ctx, buf):
    """Within it, torch's current stream is the one XLA runs the program on (a buffer on a GPU); nothing to do
    on a CPU."""
    kind, index = buf.__dlpack_device__()
    if kind != _DL_CUDA:
        return contextlib.nullcontext()
    key = (index, ctx.stream)
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = torch.cuda.ExternalStream(ctx.stream, device=torch.device("cuda", index))
    return torch.cuda.stream(s)


RERECORD_WARN = 32  # recordings of one call site past which it says that XLA keeps recording it anew


class _CallSite:
    """The torch side of one FFI call site: the torch ExpertsFn, whether it has run (its kernels compiled and
    loaded), the memory pool its recorded kernels allocate from (made at the first recording; a call that is run,
    not recorded, allocates as torch does), and how often XLA has
    recorded it: XLA keeps a few recordings per call, keyed by its buffers' addresses, so a site recorded
    again and again is one whose buffers move at every call (many calls in flight), each recording a Python
    call and a capture; past RERECORD_WARN it says so, once. `total` counts every site's recordings
    (`recordings()`)."""

    total = 0

    def __init__(self, fn: ExpertsFn, name: str = "") -> None:
        self.fn = fn
        self.name = name
        self.warm = False
        self.pool = None
        self.recordings = 0

    def recorded(self) -> None:
        self.recordings += 1
        _CallSite.total += 1
        if self.recordings == RERECORD_WARN:
            import warnings

            from ..runtime.dispatch import DispatchWarning

            warnings.warn(
                f"moetune.jax: XLA has recorded the {self.name or 'torch'} call into its CUDA graphs "
                f"{RERECORD_WARN} times: its buffers move from call to call, and each recording costs a Python "
                "call and a capture; XLA keeps --xla_cmd_buffer_trace_cache_size recordings of a call (raise it "
                "in XLA_FLAGS above the buffer sets the call sees), and the pallas_gpu backend has no such cost",
                DispatchWarning, stacklevel=2)

    def __call__(self, ctx, out, x_b, ids_b, weights_b, arrays, present) -> None:
        with _stream(ctx, out):
            o = _tensor(out)
            x, ids, wts = _tensor(x_b), _tensor(ids_b), _tensor(weights_b)
            tw = ExpertTensors(**{f: _as(_tensor(a), dt) for (f, dt), a in zip(present, arrays, strict=True)})
            if o.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # run, not recorded
                o.copy_(self.fn(x, ids.to(torch.int64), wts, tw))
                self.warm = True
                return
            if not hasattr(torch.cuda, "MemPool"):
                raise UnsupportedSchedule("moetune.jax: XLA records this call into a CUDA graph, and this torch has "
                                          "no torch.cuda.MemPool to keep the recorded kernels' scratch")
            self.recorded()
            if not self.warm:
                self._warm_up(x, ids, wts, tw)
            if self.pool is None:
                self.pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(self.pool, o.device):
                o.copy_(self.fn(x, ids.to(torch.int64), wts, tw))
            self.warm = True

    def _warm_up(self, x, ids, wts, tw) -> None:
        """One run on zeros (expert 0 for every pair) in another thread, on another stream, so that the
        kernels compile and load outside the capture; the weights are only read."""
        failed: list[BaseException] = []

        def run() -> None:
            try:
                s = torch.cuda.Stream(x.device)
                with torch.cuda.stream(s):
                    self.fn(torch.zeros_like(x), torch.zeros(ids.shape, dtype=torch.int64, device=x.device),
                            torch.zeros_like(wts), tw)
                s.synchronize()
            except BaseException as e:  # re-raised in the calling thread
                failed.append(e)

        t = threading.Thread(target=run, name="moetune-xla-warm-up")
        t.start()
        t.join()
        if failed:
            raise failed[0]


def recordings() -> int:
    """How many times XLA has recorded a moetune FFI call into its CUDA graphs in this process, all call sites
    together: each one a Python call and a capture (a bench reads it around a timing)."""
    return _CallSite.total


def via_xla(block: MoEBlock, fn: ExpertsFn):
    """The JaxExpertsFn running the torch ExpertsFn `fn` of `block` at an XLA FFI call (module doc)."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    def call(x, ids, weights, w: JaxExperts):
        present = tuple((f, _byte_float(getattr(w, f).dtype)) for f in FIELDS if getattr(w, f) is not None)
        site = _CallSite(fn, block.name or block.signature_hash())

        def run(ctx, out, x_b, ids_b, weights_b, *arrays) -> None:
            site(ctx, out, x_b, ids_b, weights_b, arrays, present)

        result = jax.ShapeDtypeStruct((x.shape[0], block.D), x.dtype)
        return buffer_callback(run, result, command_buffer_compatible=True)(
            x, ids, weights, *(_bytes(getattr(w, f)) if dt else getattr(w, f) for f, dt in present))

    return call


class XlaBridged:
    """A torch-facing kernel backend seen by moetune.jax: `build_jax` is its `build` behind `via_xla`; every
    other attribute (name, target, kinds, defaults, costs, spaces) is the backend's own."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def build_jax(self, block: MoEBlock, schedule: Schedule):
        return via_xla(block, self._backend.build(block, schedule))

    def available(self) -> str | None:
        why = self._backend.available()
        if why:
            return why
        import jax

        from ..runtime.default import backend_device

        gpu_kernels = backend_device(self._backend.name) == "cuda" and torch.cuda.is_available()
        if gpu_kernels and not any(d.platform == "gpu" for d in jax.devices()):
            return f"the {self._backend.name} kernels run on the GPU and JAX sees none (install jax[cuda])"
        return None


_BRIDGED: dict[int, XlaBridged] = {}


def bridged_backend(backend) -> XlaBridged:
    """`backend` behind the XLA FFI, one object per backend (the routes are cached by it); UnsupportedSchedule
    where it builds no torch kernels."""
    if not callable(getattr(backend, "build", None)):
        raise UnsupportedSchedule(f"moetune.jax: backend {backend.name!r} builds no torch kernels")
    hit = _BRIDGED.get(id(backend))
    if hit is None or hit._backend is not backend:
        hit = _BRIDGED[id(backend)] = XlaBridged(backend)
    return hit
