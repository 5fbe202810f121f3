"""moetune: capture MoE blocks, specialise them per rows-per-expert regime, tune, dispatch."""

__version__ = "0.1.0"

from .runtime import install_experts_hook as _install_experts_hook  # noqa: E402

# "moetune" becomes a registered transformers experts implementation (now, or when transformers loads
# its MoE integration), so from_pretrained(..., experts_implementation="moetune") works after this import.
_install_experts_hook()


def compile(model, cache=None, backend=None, **kwargs):  # noqa: A001
    """Run `model`'s captured MoE experts through moetune (see moetune.runtime.compiled.compile)."""
    from .runtime.compiled import compile as _compile

    return _compile(model, cache, backend, **kwargs)


def uncompile(model):
    """Undo `compile`: the previous experts implementation, no plans attached."""
    from .runtime.compiled import uncompile as _uncompile

    return _uncompile(model)


def explain(model, *, print_: bool = True, check: bool = True):
    """Print and return each MoE block of `model`: its IR, or why it was left as it is."""
    from .ir.explain import explain as _explain

    return _explain(model, print_=print_, check=check)


def tune(model, *, backend=None, target=None, tokens=(1, 1024), budget_s=60.0, cache=None, **kwargs):
    """Tune a dispatch table for `model` (a model, a MoEBlock or a preset name) on this machine within
    `budget_s` seconds and write the winners to `cache`; returns the per-bucket results (needs Optuna;
    see moetune.search.tune.tune)."""
    from .search.tune import tune as _tune

    return _tune(model, backend=backend, target=target, tokens=tokens, budget_s=budget_s, cache=cache, **kwargs)


def capture(model, *, check: bool = True, T_max: int = 4096):
    """Each MoE block of `model` as a `Captured` (imports torch on first use)."""
    from .ir.capture import capture as _capture

    return _capture(model, check=check, T_max=T_max)
