"""Symbolic sizes: the token count T and the per-expert rows m_e.

T   tokens in one call of the experts (batch × sequence), a bounded symbol
m_e rows routed to expert e in that call: Σ_e m_e = T·k, 0 ≤ m_e ≤ T
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import IRError


@dataclass(frozen=True)
class SymInt:
    """A bounded integer symbol, lo ≤ value ≤ hi."""

    name: str
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise IRError("SymInt", "name", self.name, "must be an identifier")
        if not (0 <= self.lo <= self.hi):
            raise IRError(f"SymInt({self.name})", "lo..hi", (self.lo, self.hi), "need 0 ≤ lo ≤ hi")

    def __contains__(self, value: int) -> bool:
        return self.lo <= value <= self.hi

    def __str__(self) -> str:
        return f"{self.name}∈[{self.lo},{self.hi}]"


@dataclass(frozen=True)
class ExpertRows:
    """The symbolic expert-batch shape: E rows counts m_e over T tokens with top-k routing."""

    T: SymInt
    E: int
    k: int

    @property
    def total(self) -> str:
        return f"Σ m_e = {self.T.name}·{self.k}"

    def check(self, rows: list[int] | tuple[int, ...], tokens: int) -> None:
        """Check a concrete assignment m_e against the constraints (for tests and runtime asserts)."""
        node = f"ExpertRows(E={self.E}, k={self.k})"
        if tokens not in self.T:
            raise IRError(node, "T", tokens, f"outside {self.T}")
        if len(rows) != self.E:
            raise IRError(node, "len(m)", len(rows), f"need E = {self.E}")
        bad = [(e, m) for e, m in enumerate(rows) if not 0 <= m <= tokens]
        if bad:
            raise IRError(node, "m_e", bad[:4], f"need 0 ≤ m_e ≤ T = {tokens}")
        if sum(rows) != tokens * self.k:
            raise IRError(node, "Σ m_e", sum(rows), f"need T·k = {tokens * self.k}")

    def __str__(self) -> str:
        return f"m_e, e<{self.E}: 0 ≤ m_e ≤ {self.T.name}, {self.total}"
