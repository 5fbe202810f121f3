"""What a timing depends on: the per-kind kernel hash over the files each backend declares, the device and
library identities, and `judge`'s reasons for not using an entry."""

from __future__ import annotations

import dataclasses

import pytest

from moetune.codegen.backend import get, register
from moetune.codegen.torch import BACKEND as TORCH
from moetune.ir import SCHEDULE_KINDS, MoEBlock
from moetune.runtime.entry import DispatchEntry
from moetune.runtime.versions import (
    Versions,
    backend_version,
    device_identity,
    judge,
    kernel_hash_part,
    kernel_source_hash,
    serves,
)

BLOCK = MoEBlock(E=16, k=4, D=64, F=40, weight_dtype="float32", routing_weight_dtype="float32", name="t")
HERE = Versions.current("torch", "cpu")
KINDS = ("grouped_gemm", "hybrid", "stream_gemv")


def entry(kind: str = "stream_gemv", versions: Versions = HERE) -> DispatchEntry:
    return DispatchEntry.of(target="cpu", block=BLOCK, bucket=(1, 1), schedule=TORCH.default(BLOCK, kind, 1),
                            time_us=1.0, versions=versions)


def other(**kw) -> Versions:
    return dataclasses.replace(HERE, **kw)


JUDGE_CASES = [
    ({}, None),
    ({"device": "NVIDIA H200"}, "foreign"),
    ({"capability": "sm_90"}, "foreign"),
    ({"kernel_hash": "deadbeefdeadbeef"}, "stale: stream_gemv kernel sources"),
    ({"backend_version": "torch 2.0.0"}, "retime: same kernel sources, timed with other libraries (torch 2.0.0 → "),
    ({"torch": "2.0.0"}, "retime: same kernel sources, timed with other libraries (torch 2.0.0 → "),  # used
    ({"moetune": "0.0.1"}, None),  # code identity: the kernel hash, not the package version
]


@pytest.mark.parametrize("change,reason", JUDGE_CASES)
def test_judge_names_the_reason(change, reason):
    why = judge(entry(versions=other(**change)), HERE)
    if reason is None:
        assert why is None
    else:
        assert why is not None and why.startswith(reason.split(":")[0]) and reason in why
    assert serves(why) == (reason is None or reason.startswith("retime"))


def test_judge_reads_the_entry_kinds_part_of_a_per_kind_hash():
    now = other(kernel_hash="grouped_gemm=aaaa;hybrid=bbbb;stream_gemv=cccc")
    gemm = entry("grouped_gemm", other(kernel_hash="grouped_gemm=aaaa;stream_gemv=0ld"))
    assert judge(gemm, now) is None  # only the stream_gemv kernel changed
    gemv = entry("stream_gemv", other(kernel_hash="grouped_gemm=aaaa;stream_gemv=0ld"))
    assert judge(gemv, now) == "stale: stream_gemv kernel sources 0ld changed to cccc"
    one_part = entry("grouped_gemm", other(kernel_hash="5eed"))  # an older one-part hash
    assert judge(one_part, now) is not None
    assert kernel_hash_part("5eed", "hybrid") == "5eed"


class DeclaredSources:
    """A backend that declares the files of each kind's kernels."""

    def __init__(self, name: str, files: dict):
        self.name, self.files = name, files

    def sources(self, kind: str):
        return self.files[kind]

    def schemes(self, kind: str):
        return ("none",) if kind in self.files else ()


def test_kernel_hash_covers_exactly_the_declared_files_of_each_kind(tmp_path):
    shared, gemv, gemm, unused = (tmp_path / n for n in ("shared.py", "gemv.py", "gemm.py", "unused.py"))
    for f in (shared, gemv, gemm, unused):
        f.write_text(f"# {f.name}\n")
    be = register(DeclaredSources("declared-sources", {"stream_gemv": (gemv, shared), "hybrid": (gemv, gemm, shared),
                                                       "grouped_gemm": (shared, gemm)}))

    def parts() -> dict[str, str]:
        kernel_source_hash.cache_clear()
        h = kernel_source_hash(be.name)
        assert h == ";".join(f"{k}={kernel_hash_part(h, k)}" for k in KINDS)  # one part per kind, sorted
        return {k: kernel_hash_part(h, k) for k in KINDS}

    before = parts()
    assert len(set(before.values())) == 3
    unused.write_text("# edited\n")  # a file no kind declares: no part changes
    assert parts() == before
    gemv.write_text("# edited\n")
    after = parts()
    assert after["grouped_gemm"] == before["grouped_gemm"]
    assert after["stream_gemv"] != before["stream_gemv"] and after["hybrid"] != before["hybrid"]
    shared.write_text("# edited\n")  # every kind's file: every part
    again = parts()
    assert all(again[k] != after[k] for k in KINDS)
    be.files = {k: tuple(reversed(v)) for k, v in be.files.items()}  # the order declared does not count
    assert parts() == again
    kernel_source_hash.cache_clear()


def test_every_backend_hashes_one_part_per_kind():
    """One part per kind and weight-format scheme its kernels read ("kind", "kind@fp8_block")."""
    from moetune.runtime.versions import hash_key

    for name in ("torch", "triton"):
        if name == "triton":
            pytest.importorskip("triton")
        be = get(name)
        kinds = [k for k in SCHEDULE_KINDS if be.schemes(k)]
        assert set(KINDS) <= set(kinds)
        want = sorted(hash_key(k, s) for k in kinds for s in be.schemes(k))
        h = kernel_source_hash(name)
        assert [p.split("=")[0] for p in h.split(";")] == want and all(
            len(kernel_hash_part(h, k)) == 16 for k in kinds)
    h = kernel_source_hash("torch")
    assert all(kernel_hash_part(h, k, "fp8_block") not in ("", kernel_hash_part(h, k)) for k in KINDS)


def test_device_and_library_identities():
    name, cap = device_identity("cpu")
    assert name.startswith("cpu: ") and cap
    assert backend_version("torch").startswith("torch ")
    assert backend_version("no-such-library") == "none"
    v = Versions.current("torch", "cpu")
    assert (v.device, v.capability) == (name, cap) and v.kernel_hash == kernel_source_hash("torch")


def test_target_of_a_device_is_the_table_target_compile_uses():
    from moetune.runtime.versions import target_of

    assert target_of("cpu") == "cpu"
    assert target_of("meta") == "meta"


class DeclaredFormats(DeclaredSources):
    """A backend whose kinds have kernels for unquantised and for fp8_block weights in separate files."""

    def schemes(self, kind: str):
        return tuple(s for s in ("none", "fp8_block") if (kind, s) in self.files)

    def sources(self, kind: str, scheme: str = "none"):
        return self.files[(kind, scheme)]


def test_kernels_of_another_weight_format_have_their_own_hash_part(tmp_path):
    """Editing the FP8 kernels leaves the unquantised entries of the same kind current, and the reverse."""
    plain, fp8 = tmp_path / "gemv.py", tmp_path / "gemv_fp8.py"
    plain.write_text("# plain\n")
    fp8.write_text("# fp8\n")
    files = {(k, "none"): (plain,) for k in KINDS} | {("stream_gemv", "fp8_block"): (fp8,)}
    be = register(DeclaredFormats("declared-formats", files))
    kernel_source_hash.cache_clear()
    h = kernel_source_hash(be.name)
    assert [p.split("=")[0] for p in h.split(";")] == ["grouped_gemm", "hybrid", "stream_gemv",
                                                       "stream_gemv@fp8_block"]
    assert kernel_hash_part(h, "stream_gemv", "fp8_block") != kernel_hash_part(h, "stream_gemv")
    assert kernel_hash_part(h, "grouped_gemm", "fp8_block") == ""  # no such kernels: nothing serves
    fp8.write_text("# fp8 edited\n")
    kernel_source_hash.cache_clear()
    h2 = kernel_source_hash(be.name)
    assert kernel_hash_part(h2, "stream_gemv") == kernel_hash_part(h, "stream_gemv")
    assert kernel_hash_part(h2, "stream_gemv", "fp8_block") != kernel_hash_part(h, "stream_gemv", "fp8_block")
    kernel_source_hash.cache_clear()


def test_an_fp8_entry_is_judged_on_its_formats_part():
    from moetune.ir import WeightFormat
    from moetune.ir.block import signature_scheme

    q = BLOCK.replace(routing_weight_dtype="bfloat16").with_weight_format(WeightFormat.fp8_block((32, 8)))
    assert signature_scheme(q.signature()) == "fp8_block" and signature_scheme(BLOCK.signature()) == "none"
    e = dataclasses.replace(entry(), signature_text=q.signature())
    now = other(kernel_hash="grouped_gemm=aaaa;hybrid=bbbb;stream_gemv=cccc;stream_gemv@fp8_block=dddd")
    assert judge(dataclasses.replace(e, versions=now), now) is None
    was = other(kernel_hash="grouped_gemm=aaaa;hybrid=bbbb;stream_gemv=cccc;stream_gemv@fp8_block=0ld")
    assert judge(dataclasses.replace(e, versions=was), now) == "stale: stream_gemv kernel sources 0ld changed to dddd"
    plain = dataclasses.replace(entry(), versions=was)  # the unquantised entry of the same kind: current
    assert judge(plain, now) is None
    none = other(kernel_hash="grouped_gemm=aaaa;hybrid=bbbb;stream_gemv=cccc")  # no FP8 kernels here
    assert judge(dataclasses.replace(e, versions=now), none).startswith("stale:")
