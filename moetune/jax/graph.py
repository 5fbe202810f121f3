"""A traced function as one flat list of equations, and its evaluation with some values computed otherwise.

    g = flatten(jax.make_jaxpr(fn)(*args))       # nested jit / closed_call bodies inlined, in order
    outs = evaluate(g, flat_args, {value: Replacement(fn, inputs)})

Values are numbered; `Node.ins` holds value numbers or `Lit` (a literal of the jaxpr). `evaluate` runs only
the equations the outputs need (and those with effects), binding each primitive as jax.core.eval_jaxpr
does; a replaced value is computed by its replacement from its inputs where its own equation stood, so the
equations that only fed it are not run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

INLINE = ("jit", "pjit", "closed_call", "core_call")  # call primitives whose bodies are inlined


@dataclass(frozen=True)
class Lit:
    value: object


@dataclass(frozen=True, eq=False)
class Node:
    index: int
    prim: object  # a jax Primitive
    params: dict
    ins: tuple  # value numbers or Lit
    outs: tuple[int, ...]
    effects: bool = False
    eqn: object = None  # the traced equation: its source information and context are kept

    @property
    def name(self) -> str:
        return self.prim.name


@dataclass(eq=False)
class Graph:
    ins: tuple[int, ...] = ()
    outs: tuple = ()  # value numbers or Lit
    consts: dict[int, object] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    avals: dict[int, object] = field(default_factory=dict)
    producer: dict[int, Node] = field(default_factory=dict)
    users: dict[int, list[Node]] = field(default_factory=dict)
    _ancestors: dict[int, frozenset[int]] = field(default_factory=dict, repr=False)  # filled once flattened
    _descendants: dict[int, frozenset[int]] = field(default_factory=dict, repr=False)

    def value(self, aval) -> int:
        i = len(self.avals)
        self.avals[i] = aval
        return i

    def shape(self, v) -> tuple[int, ...]:
        return tuple(self.avals[v].shape)

    def dtype(self, v) -> str:
        return str(self.avals[v].dtype)

    def ancestors(self, v: int) -> frozenset[int]:
        """Every value `v` is computed from, `v` included."""
        hit = self._ancestors.get(v)
        if hit is None:
            hit = self._ancestors[v] = frozenset(self._walk_back(v))
        return hit

    def _walk_back(self, v: int) -> set[int]:
        seen, stack = set(), [v]
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            n = self.producer.get(u)
            if n is not None:
                stack.extend(i for i in n.ins if isinstance(i, int))
        return seen

    def descendants(self, v: int) -> frozenset[int]:
        """Every value computed from `v`, `v` included."""
        hit = self._descendants.get(v)
        if hit is None:
            hit = self._descendants[v] = frozenset(self._walk_forward(v))
        return hit

    def _walk_forward(self, v: int) -> set[int]:
        seen, stack = set(), [v]
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            for n in self.users.get(u, ()):
                stack.extend(n.outs)
        return seen


def flatten(closed) -> Graph:
    """The ClosedJaxpr `closed` as a Graph (module doc)."""
    g = Graph()
    env: dict = {}
    for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        env[v] = g.value(v.aval)
        g.consts[env[v]] = c
    for v in closed.jaxpr.invars:
        env[v] = g.value(v.aval)
    g.ins = tuple(env[v] for v in closed.jaxpr.invars)
    _walk(g, closed.jaxpr, env)
    g.outs = tuple(_read(env, v) for v in closed.jaxpr.outvars)
    return g


def _read(env: dict, v):
    from jax.extend.core import Literal

    return Lit(v.val) if isinstance(v, Literal) else env[v]


def _walk(g: Graph, jaxpr, env: dict) -> None:
    from jax.extend.core import DropVar

    for eqn in jaxpr.eqns:
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if eqn.primitive.name in INLINE else None
        if sub is not None:
            inner = getattr(sub, "jaxpr", sub)
            senv: dict = {}
            for v, c in zip(inner.constvars, getattr(sub, "consts", ()), strict=True):
                senv[v] = g.value(v.aval)
                g.consts[senv[v]] = c
            for v, a in zip(inner.invars, eqn.invars, strict=True):
                senv[v] = _read(env, a)
            _walk(g, inner, senv)
            for v, o in zip(eqn.outvars, inner.outvars, strict=True):
                if not isinstance(v, DropVar):
                    env[v] = _read(senv, o)
            continue
        ins = tuple(_read(env, v) for v in eqn.invars)
        outs = tuple(g.value(v.aval) for v in eqn.outvars)
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, DropVar):
                env[v] = o
        node = Node(len(g.nodes), eqn.primitive, dict(eqn.params), ins, outs, bool(eqn.effects), eqn)
        g.nodes.append(node)
        for o in outs:
            g.producer[o] = node
        for i in ins:
            if isinstance(i, int):
                g.users.setdefault(i, []).append(node)


@dataclass(frozen=True)
class Replacement:
    """Computes one value of a graph from `inputs` (value numbers): fn(*their values) -> the value."""

    fn: Callable
    inputs: tuple[int, ...]


def needed(g: Graph, replaced: dict[int, Replacement]) -> set[int]:
    """Indices of the nodes an evaluation runs (module doc)."""
    run, seen = set(), set()
    stack = [o for o in g.outs if isinstance(o, int)]
    stack += [o for n in g.nodes if n.effects for o in n.outs]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in replaced:
            stack.extend(replaced[v].inputs)
            continue
        n = g.producer.get(v)
        if n is not None and n.index not in run:
            run.add(n.index)
            stack.extend(i for i in n.ins if isinstance(i, int))
    return run


def run_node(n: Node, vals: list):
    """The node's primitive bound to `vals`: the list of its outputs."""
    from jax._src import source_info_util

    info = n.eqn.source_info
    stack = source_info_util.current_name_stack() + info.name_stack
    with source_info_util.user_context(info.traceback, name_stack=stack), n.eqn.ctx.manager:
        out = n.prim.bind(*vals, **n.prim.get_bind_params(n.params))
    return list(out) if n.prim.multiple_results else [out]


def evaluate(g: Graph, args, replaced: dict[int, Replacement] | None = None, consts=None) -> list:
    """The graph's outputs for the flat arguments `args` (module doc); `consts`: the values of the graph's
    constants in `g.consts` order, where they are passed in (as a jitted caller's arguments)."""
    replaced = replaced or {}
    env = dict(g.consts) if consts is None else dict(zip(g.consts, consts, strict=True))
    env.update(zip(g.ins, args, strict=True))
    at: dict[int, list[int]] = {}  # node index → the replaced values it produced
    for v in replaced:
        at.setdefault(g.producer[v].index, []).append(v)
    run = needed(g, replaced)

    def read(i):
        return i.value if isinstance(i, Lit) else env[i]

    for n in g.nodes:
        for v in at.get(n.index, ()):
            env[v] = replaced[v].fn(*(env[i] for i in replaced[v].inputs))
        if n.index in run:
            for o, val in zip(n.outs, run_node(n, [read(i) for i in n.ins]), strict=True):
                if o not in replaced:
                    env[o] = val
    return [read(o) for o in g.outs]
