"""torch backend: the float32 reference and the CPU schedule variants (registered as "torch").

    kind          params             kernel file
    grouped_gemm  GroupedGemmParams  grouped_gemm.py (sorted pairs; host loop of torch.mm | torch grouped_mm)
    stream_gemv   GatheredParams     stream_gemv.py (chunks of gathered bmm, one row per pair)
    hybrid        HybridParams       hybrid.py (GEMM for experts with ≥ R rows, gathered GEMV for the rest)
    reference.py  the float32 reference every kernel is checked against;  tolerance.py  how close is close

Every variant reads the model's own tensors through views, handles every activation and layout of
the IR (swiglu, clamped_swiglu; standard, transposed, interleaved, biases; weight on the output or
the input), drops ids outside [0, E) and returns x.dtype with the k-sum in float32.
"""

from ..backend import register
from ..contract import KernelBackend
from . import grouped_gemm, hybrid, stream_gemv
from .grouped_gemm import GroupedGemmParams
from .hybrid import HybridParams
from .reference import apply_activation, experts_reference, split_gate_up
from .stream_gemv import GatheredParams
from .tolerance import tolerances, worst_error


class TorchBackend(KernelBackend):
    """Runs wherever moetune is imported (its target: the CPU's description)."""

    name = "torch"
    library = "torch"
    KINDS = (grouped_gemm.KIND, stream_gemv.KIND, hybrid.KIND)
    TARGET = "cpu"


BACKEND = register(TorchBackend())

__all__ = [
    "BACKEND",
    "GatheredParams",
    "GroupedGemmParams",
    "HybridParams",
    "TorchBackend",
    "apply_activation",
    "experts_reference",
    "split_gate_up",
    "tolerances",
    "worst_error",
]
