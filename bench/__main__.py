"""python -m bench <suite> [options]: run one benchmark suite (bench/README.md says what each measures).

A suite module has a docstring (its first line is its summary), `add_arguments(parser)` and `run(args)`
(the exit status). A bad suite or option is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUITES = {  # name: one line (the suite module's is bench/<name>.py, imported only when run)
    "kernels": "the 48-cell table: moetune's kernels (table, defaults, space samples) against transformers' "
               "and the floor",
    "decode": "a preset's real model generating (static KV cache, compiled decode steps): tokens/s and MoE share, "
              "transformers' experts against moetune's",
    "host": "host time of one eager experts call of a compiled tiny model, by the path it takes",
    "dense": "cuBLAS bmm on the same work with perfectly balanced experts (a bound for the grouped GEMM)",
    "tune": "a short `moetune tune` of a preset into a scratch table: each bucket's winner against its "
            "default and the floor",
    "readfloor": "kernels that only read the selected experts' bytes at small T: the floor a launch reaches",
    "cpu": "this machine's CPU ceilings (stream add, fp32 matmul) for the cpu row of the target table",
    "router": "a block's router at decode sizes: the model's own module (compiled) against moetune's fused router",
    "jax": "moetune's Pallas GPU kernels for JAX against jax.lax.ragged_dot and moetune's PyTorch path",
}


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (raised, printed by `main`)."""

    def error(self, message: str) -> None:
        raise UsageError(f"{self.prog}: {' '.join(message.split())}")


def usage() -> str:
    width = max(map(len, SUITES))
    lines = [__doc__.splitlines()[0], "", "suites:"]
    lines += [f"  {n:<{width}}  {d}" for n, d in SUITES.items()]
    lines += ["", "python -m bench <suite> --help: the suite's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        print(f"python -m bench: unknown suite {name!r}; one of {', '.join(SUITES)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"bench.{name}")
    ap = Parser(prog=f"python -m bench {name}", description=mod.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(ap)
    try:
        args = ap.parse_args(rest)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
