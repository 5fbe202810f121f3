"""Finding the expert FFN of a traced JAX function (moetune.jax.graph) and reading its MoEBlock off the shapes.

Two ways of writing the routed experts are recognised, each by its three expert matmuls:

    ragged_dot      rows sorted by expert, group sizes [E] from the ids, gu = ragged_dot(xs [T·k, D], w_gu)
                    (or gate and up with w_gate, w_up apart), h = silu(gate)·up, y = ragged_dot(h, w_down),
                    unsorted and summed with the routing weights (MaxText / Tokamax style)
    gather+einsum   each token's experts' weights gathered, w_gate[ids] [T, k, D, F], and contracted with
                    einsum: gate/up [T, k, F], h, y [T, k, D], the weighted sum over k

Weights [E, in, out] (what lax.ragged_dot takes: the block's transposed layout) or [E, out, in] (the
standard layout). A match is checked in three steps, and each refusal says which failed:
  1. the down matmul's input is computed from the gate/up matmuls' outputs (and numbers of the trace) alone,
     and that computation is an activation of the IR: it is run on random rows and compared with swiglu,
     silu(gate)·up, then with clamped_swiglu (GPT-OSS: (up + 1)·g·σ(alpha·g), g = min(gate, limit), up
     clamped to ±limit) for each alpha and limit among the scalars it reads (its literals and constants),
     each limit on rows N(0, limit²) that reach past it; gate/up as halves or interleaved;
  2. the token count T and top-k come from the ids [T, k] the group sizes (or gathered indices) are computed
     from, x [T, D] is the nearest value before the gate/up input that does not depend on the ids;
  3. the output is the first [T, D] value after the down matmul that is computed from x, the ids, the
     routing weights [T, k] and the expert weights alone (every equation between them is replaced); the
     weights apply to the output when they are read after the down matmul, to the input (the rows x·w)
     when they are read before the gate/up matmuls, and not both; between the down matmul and it, no nonlinear
     step and no arithmetic with a number of the trace's own (a scale of the experts' results) is allowed.
Other activations (a clamp the one limit cannot express among them), routing weights read both before and
after the experts, and computations that read anything else between the inputs and the output are left as
they are, with the reason. Steps 2 and 3 are structural: the sort, unsort, weighting and sum are not run;
what lies between those inputs and that output is taken to be the routed experts' sum, which is what the
two forms above compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import DTYPES, Activation, MoEBlock, WeightLayout
from .graph import Graph, Lit, Node

PROBE_LIMIT = 1 << 24  # elements of the gate/up rows the activation check runs on
COMBINE_WINDOW = 256  # equations after the down matmul searched for the FFN's output


@dataclass(frozen=True)
class Matmul:
    """One expert matmul: rows `lhs` times expert weights `weight` [E, ·, ·] → `out`."""

    node: Node
    form: str  # "ragged_dot" | "gather+einsum"
    lhs: int
    weight: int
    key: int  # ragged_dot: the group sizes; gather+einsum: the gathered indices
    transposed: bool  # weight [E, in, out]
    out: int

    @property
    def where(self) -> str:
        what = "ragged_dot" if self.form == "ragged_dot" else "einsum of gathered weights"
        return f"{what} at eqn {self.node.index}"


@dataclass(frozen=True)
class Match:
    """A recognised expert FFN: the values it reads, the value it makes, its block and its equations."""

    where: str
    block: MoEBlock
    x: int
    ids: int
    weights: int  # routing weights [T, k]
    gate_up: tuple[int, ...]  # (fused,) or (gate, up)
    down: int
    out: int
    nodes: frozenset[int]
    matmuls: tuple[Matmul, ...]

    @property
    def inputs(self) -> tuple[int, ...]:
        return (self.x, self.ids, self.weights, *self.gate_up, self.down)

    def describe(self) -> str:
        apart = ("; gate and up weights apart: joined into one array per call (a copy; "
                 "store them fused to read them in place)" if len(self.gate_up) == 2 else "")
        return (f"{self.where}: expert FFN over eqns {min(self.nodes)}..{max(self.nodes)} → moetune.jax.experts "
                f"(E={self.block.E} k={self.block.k} D={self.block.D} F={self.block.F}, "
                f"{self.block.activation}, layout {self.block.layout}, weights {self.block.weight_format}, "
                f"routing weights on the {self.block.weight_application}){apart}")


@dataclass(frozen=True)
class Finding:
    """One candidate: its match, or why it was left as it is."""

    where: str
    match: Match | None
    reason: str

    def __str__(self) -> str:
        return self.match.describe() if self.match is not None else f"{self.where}: left as is: {self.reason}"


# ----------------------------------------------------------------------------------------- matmuls


def _ints(*vals) -> bool:
    return all(isinstance(v, int) for v in vals)


def _ragged(g: Graph, n: Node) -> Matmul | str:
    lhs, rhs, gs = n.ins[:3]
    dn = n.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    if not _ints(lhs, rhs, gs):
        return "an operand is a literal"
    if (len(g.shape(lhs)) != 2 or len(g.shape(rhs)) != 3 or tuple(lc) != (1,) or tuple(rc) not in ((1,), (2,))
            or tuple(lb) or tuple(rb) or tuple(dn.lhs_ragged_dimensions) != (0,)
            or tuple(dn.rhs_group_dimensions) != (0,) or n.params.get("group_offset") is not None):
        return "not rows [m, in] grouped by expert times weights [E, in, out] or [E, out, in]"
    return Matmul(n, "ragged_dot", lhs, rhs, gs, tuple(rc) == (1,), n.outs[0])


def _gathered(g: Graph, n: Node) -> Matmul | str | None:
    """dot_general of rows and weights gathered per (token, expert); None when no operand is such a gather."""
    (lc, rc), (lb, rb) = n.params["dimension_numbers"]
    for side in (1, 0):
        w = n.ins[side]
        p = g.producer.get(w) if isinstance(w, int) else None
        if p is None or p.name != "gather" or not _ints(*p.ins[:2]) or len(g.shape(p.ins[0])) != 3:
            continue
        W, idx, other = p.ins[0], p.ins[1], n.ins[1 - side]
        shape, wshape = g.shape(w), g.shape(W)
        dnums = p.params["dimension_numbers"]
        if (len(shape) != 4 or shape[2:] != wshape[1:] or tuple(dnums.start_index_map) != (0,)
                or tuple(p.params["slice_sizes"]) != (1, *wshape[1:]) or not isinstance(other, int)):
            return "a gather of expert weights that is not w[ids] [T, k, ·, ·]"
        wc = tuple(rc if side == 1 else lc)
        if wc not in ((2,), (3,)):
            return "contracts the gathered weights over neither of their matrix axes"
        T, k = shape[:2]
        out_dim = shape[5 - wc[0]]
        if g.shape(n.outs[0]) != (T, k, out_dim):
            return f"result {g.shape(n.outs[0])}, not [T, k, out] = {(T, k, out_dim)}"
        return Matmul(n, "gather+einsum", other, W, idx, wc == (2,), n.outs[0])
    return None


def matmuls(g: Graph) -> tuple[list[Matmul], list[Finding]]:
    """The expert matmuls of `g`, and the ragged_dots / weight gathers that are not ones (with the reason)."""
    found, left = [], []
    for n in g.nodes:
        m = _ragged(g, n) if n.name == "ragged_dot_general" else _gathered(g, n) if n.name == "dot_general" else None
        if isinstance(m, Matmul):
            found.append(m)
        elif isinstance(m, str):
            what = "ragged_dot" if n.name == "ragged_dot_general" else "einsum of gathered weights"
            left.append(Finding(f"{what} at eqn {n.index}", None, m))
    return found, left


# ------------------------------------------------------------------------------------- activation


def _region(g: Graph, sources: set[int], target: int) -> list[Node]:
    """The nodes on the paths from `sources` to `target`, in order."""
    anc = g.ancestors(target)
    desc = set().union(*(g.descendants(s) for s in sources))
    return [n for n in g.nodes if any(o in anc and o in desc for o in n.outs) and not set(n.outs) & sources]


def _free(nodes: list[Node]) -> set[int]:
    made = {o for n in nodes for o in n.outs}
    return {i for n in nodes for i in n.ins if isinstance(i, int) and i not in made}


def _constant(g: Graph, v: int) -> bool:
    """Whether `v` is one number computed from the trace's literals and constants alone."""
    return (math.prod(g.shape(v)) == 1 and _floating(g, v)
            and all(u in g.consts or u in g.producer for u in g.ancestors(v)))


def _probe(g: Graph, nodes: list[Node], inputs: tuple[int, ...], out: int, scale: float = 3.0):
    """(inputs' random values [N(0, scale²)], the value `nodes` compute for `out` from them, the float scalars
    `nodes` read: their literals and constants), the arrays in float32."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .graph import run_node

    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval():  # concrete values, also while an outer jit traces
        env = {i: jnp.asarray(rng.standard_normal(g.shape(i), dtype=np.float32) * scale).astype(g.avals[i].dtype)
               for i in inputs}
        env.update((v, c) for v, c in g.consts.items() if any(v in n.ins for n in nodes))
        scalars = set()
        for n in nodes:
            vals = [i.value if isinstance(i, Lit) else env[i] for i in n.ins]
            # each in the shortest decimal its own dtype reads back: 1.702 as a float32 literal is 1.702
            scalars |= {float(str(np.asarray(a).reshape(-1)[0])) for a in vals
                        if np.size(a) == 1 and str(np.asarray(a).dtype) in ("float64", *DTYPES)}
            env.update(zip(n.outs, run_node(n, vals), strict=True))
        return ([np.asarray(env[i], dtype=np.float32) for i in inputs], np.asarray(env[out], dtype=np.float32),
                scalars)


def _gated(act: Activation, gate, up):
    """The block's activation of gate and up (moetune.codegen.pallas_tpu.reference.gated), in float64 numpy."""
    import numpy as np

    gate, up = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    if act.kind == "swiglu":
        return gate / (1 + np.exp(-gate)) * up
    gate = np.minimum(gate, act.limit)
    up = np.clip(up, -act.limit, act.limit)
    with np.errstate(over="ignore"):
        return (up + 1) * gate / (1 + np.exp(-act.alpha * gate))


def _close(got, want, dtype: str) -> bool:
    import numpy as np
    import torch

    from ..codegen.torch.tolerance import tolerances

    rtol, atol = tolerances(getattr(torch, dtype)) if dtype in DTYPES else (1e-5, 1e-5)
    scale = max(1.0, float(np.abs(want).max()))
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= atol * scale + rtol * np.abs(want)))


def _pairs(vals, direct: list[Matmul]):
    """((gate_up,) or (gate, up), interleaved, gate, up) for each way the gate/up rows may be split."""
    if len(direct) == 1:
        (gu,) = vals
        F = gu.shape[-1] // 2
        yield (direct[0],), False, gu[..., :F], gu[..., F:]
        yield (direct[0],), True, gu[..., 0::2], gu[..., 1::2]
    else:
        for a, b in ((0, 1), (1, 0)):
            yield (direct[a], direct[b]), False, vals[a], vals[b]


def _activation(g: Graph, feeders: list[Matmul], h: int):
    """((gate_up,) or (gate, up), interleaved, activation, the constant values it reads) when h is the SwiGLU,
    or the clamped SwiGLU with alpha and limit among the computation's constants, of the feeders' outputs;
    else why not."""
    outs = {m.out for m in feeders}
    nodes = _region(g, outs, h)
    consts = {v for v in _free(nodes) - outs if _constant(g, v)}  # e.g. a limit converted to the rows' dtype
    made = set().union(*(g.ancestors(v) for v in consts))
    nodes = sorted({*nodes, *(n for n in g.nodes if set(n.outs) & made)}, key=lambda n: n.index)
    extra = _free(nodes) - outs - made
    if extra:
        v = min(extra)
        return (f"between the gate/up matmuls and it, the computation also reads a {g.dtype(v)}"
                f"{list(g.shape(v))} value: not an activation of the gate and up rows alone")
    direct = [m for m in feeders if m.out in _free(nodes) or m.out == h]
    if any(m.out == h for m in direct):
        return f"its input is the output of {next(m for m in direct if m.out == h).where} with no activation between"
    if len(direct) not in (1, 2):
        return f"{len(direct)} expert matmuls feed its input; an expert FFN has gate_up, or gate and up"
    size = sum(math.prod(g.shape(m.out)) for m in direct)
    if size > PROBE_LIMIT:
        return f"gate/up rows of {size} elements, over the {PROBE_LIMIT} the activation check runs on"
    dtype = g.dtype(h)
    inputs = tuple(m.out for m in direct)
    vals, got, scalars = _probe(g, nodes, inputs, h)
    swiglu = Activation()
    for gu, interleaved, gate, up in _pairs(vals, direct):
        if _close(got, _gated(swiglu, gate, up), dtype):
            return gu, interleaved, swiglu, made
    limits = sorted({abs(s) for s in scalars} - {0.0})
    for limit in limits:  # each limit checked on rows that reach past it: N(0, limit²)
        vals, got, _ = _probe(g, nodes, inputs, h, scale=max(limit, 1.0))
        for alpha in sorted({1.0, *limits}):
            act = Activation("clamped_swiglu", alpha=alpha, limit=limit)
            for gu, interleaved, gate, up in _pairs(vals, direct):
                if _close(got, _gated(act, gate, up), dtype):
                    return gu, interleaved, act, made
    return ("the computation between the gate/up matmuls and it is not silu(gate)·up (SwiGLU), nor the clamped "
            "SwiGLU (up + 1)·g·σ(alpha·g) with g = min(gate, limit), up clamped to ±limit, for an alpha and a "
            f"limit among its constants {[f'{s:g}' for s in sorted(scalars)]}")


# ----------------------------------------------------------------------------------------- routing


def _nearest(g: Graph, values) -> int | None:
    """The value computed last among `values` (graph inputs count as first)."""
    values = list(values)
    if not values:
        return None
    return max(values, key=lambda v: (g.producer[v].index if v in g.producer else -1, v))


def _floating(g: Graph, v: int) -> bool:
    return g.dtype(v) in DTYPES


def _integer(g: Graph, v: int) -> bool:
    return g.dtype(v).startswith(("int", "uint"))


def _routing(g: Graph, core: tuple[Matmul, ...]) -> tuple[int, int, int, int] | str:
    """(x, ids, T, k) of the FFN whose matmuls are `core` (gate/up first, down last): the ids are the nearest
    integer [T, k] value every matmul's grouping (and, for ragged_dot, the sorted rows) is computed from."""
    down, gate = core[-1], core[0]
    common = frozenset.intersection(*(g.ancestors(m.key) for m in core))
    if down.form == "ragged_dot":
        if any(m.key != down.key for m in core):
            return f"{gate.where} and it group their rows by different group sizes"
        m = g.shape(gate.lhs)[0]
        ids = _nearest(g, (v for v in common & g.ancestors(gate.lhs) if _integer(g, v) and len(g.shape(v)) == 2
                           and g.shape(v)[0] * g.shape(v)[1] == m))
        if ids is None:
            return f"its group sizes and sorted rows are not computed from expert ids [T, k] with T·k = {m}"
    else:
        T, k = g.shape(down.out)[:2]
        ids = _nearest(g, (v for v in common if _integer(g, v) and g.shape(v) == (T, k)))
        if ids is None:
            return f"its weights and the gate/up weights are not gathered by the same expert ids [T, k] = {[T, k]}"
    T, k = g.shape(ids)
    D = g.shape(gate.lhs)[-1]
    routed = g.descendants(ids)
    x = _nearest(g, (v for v in g.ancestors(gate.lhs) if v not in routed and g.shape(v) == (T, D)
                     and _floating(g, v)))
    if x is None:
        return f"the rows of {gate.where} are not taken from hidden states [T, D] = {[T, D]}"
    return x, ids, T, k


def _output(g: Graph, down: Matmul, core: tuple[Matmul, ...], x: int, ids: int, T: int, k: int, D: int,
            consts: set[int]):
    """(out, routing weights, where they apply, region nodes) for the first [T, D] value after `down` that the
    FFN computes from x, ids, the routing weights, the expert weights and the activation's constant values
    `consts` alone; else why none is. The weights apply to the output when they are read after the down
    matmul only, to the input when they are read before the gate/up matmuls only (the rows x·w)."""
    before = g.ancestors(x) | g.ancestors(ids) | set().union(*(g.ancestors(m.weight) for m in core))
    inside = set().union(*(g.ancestors(m.lhs) | g.ancestors(m.key) for m in core))
    after = g.descendants(down.out)
    first_reason = None
    for n in g.nodes[down.node.index + 1:down.node.index + 1 + COMBINE_WINDOW]:
        for v in n.outs:
            if v not in after or g.shape(v) != (T, D) or g.dtype(v) != g.dtype(x):
                continue
            anc = g.ancestors(v)
            applied = "output"
            wts = _nearest(g, (u for u in anc - before - inside if g.shape(u) == (T, k)
                               and _floating(g, u) and u not in after))
            if wts is None:
                applied = "input"
                wts = _nearest(g, (u for u in (anc & inside) - before if g.shape(u) == (T, k)
                                   and _floating(g, u) and u not in after))
            if wts is None:
                first_reason = first_reason or (f"eqn {n.index}'s [T, D] value is not weighted by routing "
                                                f"weights [T, k]")
                continue
            stop = before | g.ancestors(wts)
            nodes = [m for m in g.nodes if set(m.outs) & anc and not set(m.outs) & stop]
            weighted = g.descendants(wts) - after
            twice = [m for m in nodes if m is not down.node and set(m.outs) & after
                     and any(isinstance(i, int) and i in weighted for i in m.ins)]
            if applied == "input" and twice:
                first_reason = first_reason or (f"the routing weights weight the rows before the experts and, at "
                                                f"eqn {twice[0].index}, their results after them")
                continue
            allowed = {x, ids, wts, *(m.weight for m in core), *consts}
            extra = _free(nodes) - allowed
            if extra or any(m.effects for m in nodes):
                u = min(extra) if extra else None
                what = (f"also reads a {g.dtype(u)}{list(g.shape(u))} value" if u is not None else "has effects")
                first_reason = first_reason or f"the [T, D] value of eqn {n.index} {what}"
                continue
            odd = _not_a_sum(g, [m for m in nodes if m is not down.node and set(m.outs) & after], wts)
            if odd is not None:
                first_reason = first_reason or f"eqn {n.index}'s value is not the weighted sum of the experts' " \
                                               f"results: {odd}"
                continue
            others = [m for m in nodes if m.name == "ragged_dot_general" and m not in [c.node for c in core]]
            if others:
                first_reason = first_reason or f"eqn {n.index}'s value also goes through ragged_dot at eqn " \
                                               f"{others[0].index}"
                continue
            return v, wts, applied, nodes
    return first_reason or (f"no [T, D] value of the hidden states' dtype is computed from its result in the "
                            f"{COMBINE_WINDOW} equations after it")


NONLINEAR = {"exp", "exp2", "log", "log1p", "tanh", "logistic", "sqrt", "rsqrt", "pow", "integer_pow", "erf", "abs",
             "max", "min", "sign", "floor", "ceil", "round"}
ARITHMETIC = {"mul", "div", "add", "sub"}


def _not_a_sum(g: Graph, post: list[Node], wts: int) -> str | None:
    """Why the equations after the down matmul are more than an unsort and a weighted sum over k, or None:
    a nonlinear step, or arithmetic with a number of the trace's own (a scale the experts' results would lose
    when the sum is replaced)."""
    import numpy as np

    for m in post:
        if m.name in NONLINEAR:
            return f"eqn {m.index} applies {m.name}"
        if m.name not in ARITHMETIC:
            continue
        for i in m.ins:
            if isinstance(i, Lit):
                v = np.asarray(i.value)
                if v.size == 1 and np.issubdtype(v.dtype, np.floating) and float(v) not in (0.0, 1.0):
                    return f"eqn {m.index} applies {m.name} by {float(v):g}"
            elif i not in g.ancestors(wts) and _constant(g, i):
                return f"eqn {m.index} applies {m.name} by a constant of the trace"
    return None


# ------------------------------------------------------------------------------------------- match


def _block(g: Graph, down: Matmul, gu: tuple[Matmul, ...], interleaved: bool, act: Activation, x: int, k: int,
           wts: int, applied: str, h: int, name: str) -> MoEBlock | str:
    E = g.shape(down.weight)[0]
    D, F = g.shape(x)[1], g.shape(h)[-1]
    if any(m.transposed != down.transposed for m in gu):
        return "gate/up and down weights are in different layouts ([E, in, out] against [E, out, in])"
    lay = WeightLayout(transposed=down.transposed, interleaved=interleaved)
    want_gu = lay.gate_up_shape(E, D, F)
    if len(gu) == 2:
        want_gu = want_gu[:2] + (F,) if down.transposed else (E, F, D)
    for m in gu:
        if g.shape(m.weight) != want_gu:
            return f"gate/up weights {list(g.shape(m.weight))}, expected {list(want_gu)}"
    if g.shape(down.weight) != lay.down_shape(E, D, F):
        return f"down weights {list(g.shape(down.weight))}, expected {list(lay.down_shape(E, D, F))}"
    dtypes = {g.dtype(m.weight) for m in (*gu, down)}
    if len(dtypes) != 1 or g.dtype(x) not in dtypes:
        return f"weights in {', '.join(sorted(dtypes))} and hidden states in {g.dtype(x)}: one dtype expected"
    if g.dtype(x) not in DTYPES or g.dtype(wts) not in DTYPES:
        return f"dtypes {g.dtype(x)} / {g.dtype(wts)}: supported {', '.join(DTYPES)}"
    if not 1 <= k <= E:
        return f"top-k {k} outside [1, E = {E}]"
    return MoEBlock(E=E, k=k, D=D, F=F, activation=act, weight_application=applied, layout=lay,
                    weight_dtype=g.dtype(x), routing_weight_dtype=g.dtype(wts), name=name)


def _ffn(g: Graph, down: Matmul, found: list[Matmul], name: str) -> Match | str:
    h = down.lhs
    anc = g.ancestors(h)
    feeders = [m for m in found if m is not down and m.form == down.form and m.out in anc]
    feeders = [m for m in feeders if not any(m.out in g.ancestors(o.lhs) for o in feeders if o is not m)]
    if not feeders:
        return "no expert matmul before it: not the down projection of an expert FFN"
    act = _activation(g, feeders, h)
    if isinstance(act, str):
        return act
    gu, interleaved, activation, consts = act
    if len(gu) == 2 and gu[0].lhs != gu[1].lhs:
        return f"{gu[0].where} and {gu[1].where} read different rows"
    routing = _routing(g, (*gu, down))
    if isinstance(routing, str):
        return routing
    x, ids, T, k = routing
    core = (*gu, down)
    out = _output(g, down, core, x, ids, T, k, g.shape(x)[1], consts)
    if isinstance(out, str):
        return out
    v, wts, applied, nodes = out
    where = f"{name}: {down.where}" if name else down.where
    block = _block(g, down, gu, interleaved, activation, x, k, wts, applied, h, where)
    if isinstance(block, str):
        return block
    return Match(down.where, block, x, ids, wts, tuple(m.weight for m in gu), down.weight, v,
                 frozenset(n.index for n in nodes), core)


def find(g: Graph, name: str = "") -> list[Finding]:
    """Every expert FFN of `g`, and every candidate left as it is with the reason (module doc)."""
    found, left = matmuls(g)
    results = [(m, _ffn(g, m, found, name)) for m in found]
    matched = [r for _, r in results if isinstance(r, Match)]
    claimed = {c.node.index for r in matched for c in r.matmuls}
    taken: set[int] = set()
    out: list[Finding] = []
    for m, r in results:
        if isinstance(r, Match):
            if r.nodes & taken:
                out.append(Finding(m.where, None, "overlaps an expert FFN matched before it"))
                continue
            taken |= r.nodes
            out.append(Finding(m.where, r, "replaced"))
        elif m.node.index not in claimed:
            out.append(Finding(m.where, None, r))
    return sorted(out + left, key=lambda f: int(f.where.rsplit(" ", 1)[1]))
