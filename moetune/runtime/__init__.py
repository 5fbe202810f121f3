"""Run time: the compiled model (experts hook + custom op), dispatch by token bucket, defaults.

`install_experts_hook()` (called by `import moetune`) registers "moetune" in transformers'
ExpertsInterface: at once when transformers' MoE integration is already imported, else the moment it
is, so that `import moetune` itself stays light (no torch, no transformers) and
`from_pretrained(..., experts_implementation="moetune")` still finds the name. The rest is imported
on first use: `moetune.runtime.table` never pulls in torch or transformers. Nothing here imports
the search.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

_LAZY = {
    "compiled": ("PLANS", "Plan", "compile", "describe", "experts_forward", "plans", "uncompile"),
    "default": ("default_at", "default_buckets", "default_for", "default_plan"),
    "dispatch": ("Dispatcher", "DispatchWarning", "Route"),
}
_WHERE = {name: mod for mod, names in _LAZY.items() for name in names}
_TRANSFORMERS_MOE = "transformers.integrations.moe"

__all__ = ["install_experts_hook", *_WHERE]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RegisterAfterLoad(importlib.abc.Loader):
    """Runs transformers' own loader for its MoE integration, then registers moetune's experts function."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        sys.modules[module.__name__] = module  # compiled.py imports it by name
        importlib.import_module(f"{__name__}.compiled")  # registers on import


class _ExpertsHookFinder(importlib.abc.MetaPathFinder):
    """Finds `transformers.integrations.moe` through the other finders and wraps its loader, once."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRANSFORMERS_MOE:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterLoad(spec.loader)
                return spec
        return None


def install_experts_hook() -> None:
    """Make "moetune" a registered experts implementation as soon as transformers can take it."""
    if _TRANSFORMERS_MOE in sys.modules:
        importlib.import_module(f"{__name__}.compiled")
        return
    if not any(isinstance(f, _ExpertsHookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ExpertsHookFinder())
