"""moetune: capture MoE blocks, specialise them per rows-per-expert regime, tune, dispatch."""

__version__ = "0.1.0"

# Importing the runtime registers "moetune" in transformers' ExpertsInterface and defines the custom op
# moetune::experts, so that from_pretrained(..., experts_implementation="moetune") works after `import moetune`.
from .runtime.compiled import compile, uncompile  # noqa: E402,A004


def explain(model, *, print_: bool = True, check: bool = True):
    """Print and return each MoE block of `model`: its IR, or why it was left as it is."""
    from .ir.explain import explain as _explain

    return _explain(model, print_=print_, check=check)


def capture(model, *, check: bool = True, T_max: int = 4096):
    """Each MoE block of `model` as a `Captured` (imports torch on first use)."""
    from .ir.capture import capture as _capture

    return _capture(model, check=check, T_max=T_max)
