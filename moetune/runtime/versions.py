"""What a tuned timing depends on besides the block: the kernel sources, the library that compiles them and
the device; and whether a stored entry still says something about this code and machine (`judge`).

    current = Versions.current("triton", "cuda")     # this tree, this Triton, this GPU
    kernel_source_hash("triton")                      # "grouped_gemm=…;grouped_gemm@fp8_block=…;hybrid=…;…"
    judge(entry, current)                             # None, or "stale: …" / "foreign: …" / "retime: …"

A kernel hash has one part per schedule kind and weight-format scheme the backend reads ("kind" for
unquantised weights, "kind@scheme" for the others), over exactly the files the backend declares for it
(`Backend.sources(kind, scheme)`), so editing one kind's kernel, or the kernels of one format, leaves the
tuned entries of the others current.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..ir import SCHEDULE_KINDS, CacheError, MoetuneError
from ..ir.block import signature_scheme

if TYPE_CHECKING:
    from .entry import DispatchEntry


@dataclass(frozen=True)
class Versions:
    """What a measurement depends on besides the block: code, libraries and the device."""

    moetune: str
    kernel_hash: str  # per schedule kind, the sha256 of the files that make its kernels (`kernel_source_hash`)
    backend_version: str  # triton / jax version; torch's for the torch backend
    torch: str
    device: str  # "NVIDIA H200", "cpu: AMD EPYC 7B13", ...
    capability: str  # "sm_90", "x86_64", ...

    @classmethod
    def current(cls, backend: str, device: str = "cpu") -> Versions:
        import torch

        from .. import __version__

        name, cap = device_identity(device)
        return cls(__version__, kernel_source_hash(backend), backend_version(backend), torch.__version__,
                   name, cap)


def files_hash(files: Iterable[Path]) -> str:
    """sha256[:16] of `files` in path order, each as its name and its bytes."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def kernel_source_hash(backend: str) -> str:
    """"grouped_gemm=…;hybrid=…;stream_gemv=…": per schedule kind, the hash of the source files the backend
    declares its kernels of that kind are made of. A changed file makes the old timings of the kinds built
    from it stale, and only those."""
    from ..codegen.backend import get

    try:
        be = get(backend)
    except (MoetuneError, ImportError) as e:
        raise CacheError(f"backend {backend!r}: no kernel sources found ({e})") from e
    sources = getattr(be, "sources", None)
    if sources is None:
        raise CacheError(f"backend {backend!r} declares no kernel sources (Backend.sources(kind))")
    schemes = getattr(be, "schemes", lambda kind: ("none",))
    parts = []
    for kind in sorted(SCHEDULE_KINDS):
        for scheme in schemes(kind):  # none for a kind the backend has no kernel of: no part for it
            files = sources(kind) if scheme == "none" else sources(kind, scheme)
            parts.append(f"{hash_key(kind, scheme)}={files_hash(files)}")
    return ";".join(sorted(parts))


def hash_key(kind: str, scheme: str = "none") -> str:
    """The name of a kernel hash's part for `kind` kernels reading `scheme` weights."""
    return kind if scheme == "none" else f"{kind}@{scheme}"


def kernel_hash_part(kernel_hash: str, kind: str, scheme: str = "none") -> str:
    """What an entry of schedule `kind` on `scheme` weights depends on in a kernel hash: that part of a
    per-kind hash ("" when the hash has kind parts but none for it), else the whole hash (an older one-part
    hash)."""
    key, parts = hash_key(kind, scheme), [p.partition("=") for p in kernel_hash.split(";")]
    for k, sep, h in parts:
        if sep and k == key:
            return h
    return "" if any(sep for _, sep, _ in parts) else kernel_hash


def backend_version(backend: str) -> str:
    """The version of the library that compiles the backend's kernels (its `library`, else its name;
    "none" where it is absent)."""
    from ..codegen.backend import get

    try:
        lib = getattr(get(backend), "library", backend)
    except MoetuneError:
        lib = backend
    try:
        mod = __import__(lib)
    except ImportError:
        return "none"
    return f"{lib} {mod.__version__}"


@functools.cache
def device_identity(device: str = "cpu") -> tuple[str, str]:
    """(device name, compute capability) of "cpu", "cuda[:i]" or "tpu"."""
    if device.startswith("cuda"):
        import torch

        idx = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        return torch.cuda.get_device_name(idx), f"sm_{major}{minor}"
    if device.startswith("tpu"):
        import jax

        d = jax.devices()[0]
        return d.device_kind, d.platform
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {name}", platform.machine()


def target_of(device: str = "cpu") -> str:
    """The dispatch-table target of a device ("cpu", "cuda[:i]"): "cpu", or the GPU's short name ("h200")."""
    if not device.startswith("cuda"):
        return device.split(":")[0]
    from ..targets import gpu_target

    return gpu_target(device_identity(device)[0])


def judge(entry: DispatchEntry, current: Versions) -> str | None:
    """None when `entry` is sound here; else why not: "foreign: …" (another device; never for a cost-model
    estimate, which no device timed), "stale: …" (other kernel sources), or "retime: …" (the same kernel
    sources timed with another version of the backend's library or of torch: still used, see `serves`, though
    its timing may no longer be the fastest)."""
    v = entry.versions
    if not entry.estimated and (v.device, v.capability) != (current.device, current.capability):
        return (f"foreign: tuned on {v.device} ({v.capability}), "
                f"this is {current.device} ({current.capability})")
    scheme, was, now = _hash_parts(entry, current.kernel_hash)
    if not now:
        return f"stale: this tree has no {entry.kind} kernel for {scheme} weights"
    if was != now:
        return f"stale: {entry.kind} kernel sources {was} changed to {now}"
    libs = [f"{a} → {b}" for a, b in ((v.backend_version, current.backend_version),
                                        (f"torch {v.torch}", f"torch {current.torch}")) if a != b]
    if libs:
        return f"retime: same kernel sources, timed with other libraries ({'; '.join(dict.fromkeys(libs))})"
    return None


def _hash_parts(entry: DispatchEntry, kernel_hash: str) -> tuple[str, str, str]:
    """(weight scheme, the part of the entry's kernel hash it depends on, that part of `kernel_hash`)."""
    scheme = signature_scheme(entry.signature_text)
    return (scheme, kernel_hash_part(entry.versions.kernel_hash, entry.kind, scheme),
            kernel_hash_part(kernel_hash, entry.kind, scheme))


def stale_on(entry: DispatchEntry, kernel_hash: str) -> bool:
    """Whether `entry` was timed on other kernel sources than those `kernel_hash` (a tree's
    `kernel_source_hash`) names, for its kind and weight scheme: `judge`'s "stale"."""
    _, was, now = _hash_parts(entry, kernel_hash)
    return not now or was != now


def serves(why: str | None) -> bool:
    """Whether an entry `judge` answered `why` for is used: a sound one, or one to re-time."""
    return why is None or why.startswith("retime:")
