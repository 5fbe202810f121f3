"""The target description table: one row per hardware target, what its floors are quoted at and what its kernels
are bounded by.

`bandwidth` and `peak_flops` are the figures floors are quoted at (the datasheet where there is one);
`measured_*` are the ceilings measured on the machine (bench/README.md says how), kept beside them and never mixed
in. `vector_flops` is the non-matrix-unit rate (fp32 CUDA cores on a GPU): the limit of a streaming GEMV, which
does its multiply-adds there. The floor of a block on a target is `moetune.passes.roofline.floor`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import DTYPE_BYTES, IRError

# The fixed cost of one step of a Pallas TPU grid (the pipeline's bookkeeping and DMA issue between two
# kernel bodies), assumed for every TPU generation: the figure Pallas TPU kernel authors size their blocks
# by; not measured here.
GRID_STEP_S = 0.35e-6


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # "gpu" | "tpu" | "cpu"
    bandwidth: float  # B/s, memory the expert weights live in (HBM; DRAM on a CPU)
    peak_flops: float  # flop/s, dense bf16 on the matrix units (fp32 on a CPU)
    vector_flops: float | None = None  # flop/s off the matrix units (GPU fp32 CUDA cores)
    measured_bandwidth: float | None = None
    measured_flops: float | None = None
    memory_bytes: float | None = None
    fp8_flops: float | None = None  # flop/s, dense FP8 on the matrix units, where the target has them
    smem_per_block: int | None = None  # bytes of shared memory one GPU thread block may use (opt-in maximum)
    sm_count: int | None = None  # streaming multiprocessors (GPU); None where the kernels have no such limit
    vmem_bytes: int | None = None  # bytes of VMEM per TensorCore (TPU): what a Pallas kernel's tiles fit in
    cores: int = 1  # TensorCores per chip (TPU) a kernel's parallel grid axis is split over
    grid_step_s: float | None = None  # fixed cost of one Pallas grid step (TPU): what a cost-model estimate adds
    source: str = ""

    def __post_init__(self) -> None:
        for f_name in ("bandwidth", "peak_flops"):
            v = getattr(self, f_name)
            if not v > 0:
                raise IRError(f"Target({self.name})", f_name, v, "must be positive")

    @property
    def ridge(self) -> float:
        """flop per byte where the floor turns from memory- to compute-bound."""
        return self.peak_flops / self.bandwidth

    def gemv_max_rows(self, weight_dtype: str, default: int = 8) -> int:
        """Rows per expert up to which a weight-streaming GEMV (no matrix units) stays memory-bound.

        Each row does 2 flop per weight element of `bytes` bytes: memory-bound while
        rows · 2 / bytes ≤ vector_flops / bandwidth. Targets without a separate vector rate (TPU:
        the GEMV runs on the MXU anyway; CPU) use `default`.
        """
        if self.vector_flops is None:
            return default
        rows = int(self.vector_flops / self.bandwidth * DTYPE_BYTES[weight_dtype] / 2)
        return max(2, rows)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("h200", "gpu", bandwidth=4.8e12, peak_flops=989e12, vector_flops=67e12, fp8_flops=1979e12,
               measured_bandwidth=4.28e12, measured_flops=750e12, memory_bytes=141e9,
               smem_per_block=227 * 1024, sm_count=132,
               source="NVIDIA H200 SXM datasheet (bf16 and fp8 dense; fp32 as H100 SXM); measured: HBM read with "
                      "Triton over 4 GiB, bf16 matmul 8192^3 (the low ends of repeated runs)"),
        Target("h100", "gpu", bandwidth=3.35e12, peak_flops=989e12, vector_flops=67e12, fp8_flops=1979e12,
               measured_bandwidth=3.10e12, measured_flops=786e12, memory_bytes=80e9,
               smem_per_block=227 * 1024, sm_count=132,
               source="NVIDIA H100 SXM datasheet (bf16, fp8 dense, fp32); measured: HBM read with Triton over "
                      "4 GiB, bf16 matmul 8192^3 (the low ends of repeated runs)"),
        Target("a100", "gpu", bandwidth=2.039e12, peak_flops=312e12, vector_flops=19.5e12, memory_bytes=80e9,
               smem_per_block=163 * 1024, sm_count=108,
               source="NVIDIA A100 SXM 80GB datasheet (bf16 dense, fp32; no FP8 matrix unit); not measured"),
        Target("b200", "gpu", bandwidth=8.0e12, peak_flops=2250e12, vector_flops=75e12, fp8_flops=4500e12,
               memory_bytes=180e9, smem_per_block=227 * 1024, sm_count=148,
               source="NVIDIA HGX B200 datasheet, per GPU (bf16 and fp8 dense; fp32); not measured"),
        Target("tpu-v5e", "tpu", bandwidth=819e9, peak_flops=197e12, memory_bytes=16 * 2**30,
               vmem_bytes=128 * 2**20, cores=1, grid_step_s=GRID_STEP_S,
               source="Google Cloud TPU v5e docs: 197 TFLOP/s bf16 (no FP8 matrix unit), 819 GB/s HBM, 16 GiB; "
                      "VMEM from jax's pallas tpu_info; grid step cost assumed (GRID_STEP_S); not measured"),
        Target("tpu-v6e", "tpu", bandwidth=1640e9, peak_flops=918e12, fp8_flops=918e12, memory_bytes=32 * 2**30,
               vmem_bytes=128 * 2**20, cores=1, grid_step_s=GRID_STEP_S,
               source="Google Cloud TPU v6e (Trillium) docs: 918 TFLOP/s bf16, 1640 GB/s HBM, 32 GiB; "
                      "VMEM from jax's pallas tpu_info; grid step cost assumed (GRID_STEP_S); not measured"),
        Target("tpu-v7", "tpu", bandwidth=7.37e12, peak_flops=2307e12, fp8_flops=4614e12, memory_bytes=192 * 2**30,
               vmem_bytes=64 * 2**20, cores=2, grid_step_s=GRID_STEP_S,
               source="Google Cloud TPU7x (Ironwood) docs: 2307 TFLOP/s bf16 (4614 fp8), 7.37 TB/s "
                      "HBM, 192 GiB, per chip of two TensorCores; VMEM per core from jax's pallas tpu_info; "
                      "grid step cost assumed (GRID_STEP_S); not measured"),
        # No datasheet figures: the floor uses the measured ones (python -m bench cpu,
        # the best of three runs).
        Target("cpu", "cpu", bandwidth=9.28e9, peak_flops=244.5e9, measured_bandwidth=9.28e9,
               measured_flops=244.5e9,
               source="measured by python -m bench cpu "
                      "(numpy stream add, torch fp32 mm); no datasheet"),
    )
}
ALIASES = {"tpu-v7x": "tpu-v7", "ironwood": "tpu-v7", "trillium": "tpu-v6e", "v5e": "tpu-v5e",
           "v6e": "tpu-v6e", "v7": "tpu-v7"}


# The GPU target described when no device names one (the passes run off the GPU, `moetune explain`): the card
# the shipped tables were first tuned on.
DEFAULT_GPU = "h200"


def gpu_target(device_name: str) -> str:
    """The target name of a GPU from its device name ("NVIDIA H100 80GB HBM3" -> "h100"): the described GPU
    target the name contains, else the name itself, lower case, spaces as dashes (a table may still hold
    rows for it; the passes then describe it as DEFAULT_GPU, `runtime.default.pass_target`)."""
    name = device_name.lower()
    known = [t.name for t in TARGETS.values() if t.kind == "gpu"]
    return next((k for k in known if k in name), name.replace(" ", "-"))


def get_target(target: str | Target) -> Target:
    if isinstance(target, Target):
        return target
    name = ALIASES.get(target, target)
    if name not in TARGETS:
        raise IRError("target", "name", target, f"known: {', '.join(TARGETS)}")
    return TARGETS[name]
