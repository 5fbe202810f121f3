"""Routing statistics: the expected expert-batch shape of one call at T tokens.

A call routes T tokens, each to k distinct experts of E; m_e is the number of rows expert e gets
(Σ m_e = T·k, 0 ≤ m_e ≤ T). The passes need, as functions of T:

    distinct(T)          E[#{e : m_e ≥ 1}]                 weight traffic of a streaming kernel
    rows_per_active(T)   T·k / distinct(T)                  the regime: ≈ 1 GEMV … ≫ 1 grouped GEMM
    max_rows(T)          E[max_e m_e]                       the hot expert a hybrid gives GEMM tiles
    share_ge(T, r)       E[#{m_e ≥ r}] / distinct(T)        share of active experts with ≥ r rows
    row_share_ge(T, r)   E[Σ m_e·1(m_e ≥ r)] / (T·k)        share of the rows in such experts

Binomial model (`BinomialRouting`). Tokens are independent; token t selects expert e with
probability p_e (Σ_e p_e = k, each token's k experts distinct, so p_e ≤ 1). Then m_e is exactly
Binomial(T, p_e) whatever the correlations *within* a token, and

    distinct(T)        = Σ_e 1 − (1 − p_e)^T                                      (exact)
    E[#{m_e ≥ r}]      = Σ_e P(Bin(T, p_e) ≥ r)                                   (exact)
    E[Σ m_e 1(m_e≥r)]  = Σ_e T·p_e · P(Bin(T−1, p_e) ≥ r−1)                       (exact)
    E[max m_e]         = Σ_{j<T} 1 − Π_e P(Bin(T, p_e) ≤ j)     (treats the m_e as independent:
                         they are slightly negatively correlated, Σ m_e being fixed; within a few %
                         of a simulation, see tests/passes/test_stats.py), and never below
                         T·k / distinct(T), which bounds it from below
    share_ge           = ratio of the two expectations (not the expectation of the ratio; the
                         difference is below 1 % once distinct ≫ 1)

Uniform routing is p_e = k/E, which gives the closed form distinct = E·(1 − (1 − k/E)^T).
A measured distribution estimates p_e per layer from a trace's counts, with one pseudo-count per
expert (p_e = (c_e + 1) / (N + E/k), N traced tokens, which keeps Σ p_e = k and never lets an
expert that happened not to appear in a short trace count as dead). Statistics of a multi-layer
trace are the mean over the layers (one dispatch table serves every layer of the block).

Resampling model (`ResampledRouting`). Draws T token rows with replacement from a layer's traced
rows, `samples` times, and averages the same quantities over the draws and the layers. The unit
is the token row, not the whole step: a traced step has its own T (the batch it was recorded at),
so a call of another T is built from rows of all steps. It keeps whatever structure the rows have
(which experts go together) at the cost of Monte-Carlo noise and time; the Binomial model is the
default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..ir import IRError, RoutingStats

DEFAULT_RS = (2, 4, 8, 16, 32)


class RoutingModel:
    """Expected routing statistics as functions of the token count T (one layer or a mean of layers)."""

    E: int
    k: int
    source: str

    # primitives, one per model
    def distinct(self, T: int) -> float:
        raise NotImplementedError

    def active_ge(self, T: int, r: int) -> float:
        """E[#{e : m_e ≥ r}]."""
        raise NotImplementedError

    def rows_ge(self, T: int, r: int) -> float:
        """E[Σ_e m_e·1(m_e ≥ r)]."""
        raise NotImplementedError

    def max_rows(self, T: int) -> float:
        raise NotImplementedError

    # derived
    def rows_per_active(self, T: int) -> float:
        return T * self.k / self.distinct(T)

    def share_ge(self, T: int, r: int) -> float:
        if r <= 1:
            return 1.0
        return self.active_ge(T, r) / self.distinct(T)

    def row_share_ge(self, T: int, r: int) -> float:
        if r <= 1:
            return 1.0
        return self.rows_ge(T, r) / (T * self.k)

    def stats(self, T: int, rs: tuple[int, ...] = DEFAULT_RS) -> RoutingStats:
        _check_T(T)
        return RoutingStats(
            tokens=T,
            distinct_experts=self.distinct(T),
            rows_per_active=self.rows_per_active(T),
            max_rows=self.max_rows(T),
            share_ge=tuple((r, self.share_ge(T, r)) for r in rs),
            source=self.source,
        )


def _check_T(T: int) -> None:
    if not isinstance(T, (int, np.integer)) or T < 1:
        raise IRError("RoutingModel", "T", T, "need an int ≥ 1")


def _binom_logpmf(T: int, p: np.ndarray, J: int) -> np.ndarray:
    """log P(Bin(T, p) = j) for j = 0..J; p [..., E] → [..., E, J+1]."""
    p = np.clip(p, 0.0, 1.0 - 1e-12)
    j = np.arange(J + 1)  # [J+1]
    logC = np.concatenate([[0.0], np.cumsum(np.log((T - j[:-1]) / (j[:-1] + 1.0)))])  # [J+1]
    with np.errstate(divide="ignore", invalid="ignore"):
        logit = np.log(p) - np.log1p(-p)  # [..., E]
        out = T * np.log1p(-p)[..., None] + logC + j * logit[..., None]  # [..., E, J+1]
    out[..., 0] = T * np.log1p(-p)  # p = 0 gives 0·(-inf) above
    return np.where(np.isnan(out), -np.inf, out)


def _binom_sf(T: int, p: np.ndarray, r: int) -> np.ndarray:
    """P(Bin(T, p) ≥ r), elementwise over p."""
    if r <= 0:
        return np.ones_like(p)
    if r > T:
        return np.zeros_like(p)
    cdf = np.exp(_binom_logpmf(T, p, r - 1)).sum(-1)
    return np.clip(1.0 - cdf, 0.0, 1.0)


@dataclass(frozen=True, eq=False)
class BinomialRouting(RoutingModel):
    """Per-layer per-expert selection probabilities `probs` [L, E], each row summing to k."""

    probs: np.ndarray
    k: int
    source: str = "uniform"
    E: int = field(init=False)

    def __post_init__(self) -> None:
        p = np.atleast_2d(np.asarray(self.probs, dtype=np.float64))  # [L, E]
        object.__setattr__(self, "probs", p)
        object.__setattr__(self, "E", p.shape[1])
        node = f"BinomialRouting({self.source})"
        if not 1 <= self.k <= self.E:
            raise IRError(node, "k", self.k, f"need 1 ≤ k ≤ E = {self.E}")
        if (p < 0).any() or (p > 1 + 1e-9).any():
            raise IRError(node, "probs", (p.min(), p.max()), "need 0 ≤ p_e ≤ 1")
        sums = p.sum(1)
        if not np.allclose(sums, self.k, rtol=1e-6):
            raise IRError(node, "probs.sum", sums.tolist()[:4], f"each layer's p_e must sum to k = {self.k}")

    @property
    def layers(self) -> int:
        return self.probs.shape[0]

    def distinct(self, T: int) -> float:
        _check_T(T)
        return float((1.0 - np.exp(T * np.log1p(-np.clip(self.probs, 0, 1 - 1e-15)))).sum(1).mean())

    def active_ge(self, T: int, r: int) -> float:
        _check_T(T)
        return float(_binom_sf(T, self.probs, r).sum(1).mean())

    def rows_ge(self, T: int, r: int) -> float:
        _check_T(T)
        if r <= 1:
            return float(T * self.k)
        if T == 1:
            return 0.0
        return float((T * self.probs * _binom_sf(T - 1, self.probs, r - 1)).sum(1).mean())

    def max_rows(self, T: int) -> float:
        _check_T(T)
        out = []
        for p in self.probs:  # [E]
            mean, var = T * p.max(), T * p.max() * (1 - p.max())
            J = int(min(T, math.ceil(mean + 10 * math.sqrt(var) + 10)))
            cdf = np.clip(np.cumsum(np.exp(_binom_logpmf(T, p, J)), -1), 0.0, 1.0)  # [E, J+1]
            with np.errstate(divide="ignore"):
                log_all_le = np.log(cdf).sum(0)  # [J+1]: log P(max ≤ j) under independence
            p_gt = 1.0 - np.exp(log_all_le[:T])  # P(max > j), j = 0..min(J, T-1)
            out.append(float(p_gt.sum()))
        # max_e m_e ≥ T·k / #active in every call, so E[max] ≥ T·k / E[#active] (Jensen): the
        # independence approximation can fall just below that bound (at T = 1 it gives 1 − (1 − p)^E)
        return max(float(np.mean(out)), self.rows_per_active(T))


def uniform(E: int, k: int) -> BinomialRouting:
    """Uniform routing: every expert selected with probability k/E."""
    if not (isinstance(E, int) and isinstance(k, int) and 1 <= k <= E):
        raise IRError("uniform", "E/k", (E, k), "need ints with 1 ≤ k ≤ E")
    return BinomialRouting(np.full((1, E), k / E), k, source="uniform")


def uniform_distinct(E: int, k: int, T: int) -> float:
    """The closed form E·(1 − (1 − k/E)^T)."""
    return E * (1.0 - (1.0 - k / E) ** T)


class ResampledRouting(RoutingModel):
    """Statistics by resampling traced token rows: T rows drawn with replacement, `samples` times."""

    def __init__(self, pools: list[np.ndarray], E: int, k: int, samples: int = 64, seed: int = 0,
                 source: str = "resampled"):
        node = f"ResampledRouting({source})"
        if not pools:
            raise IRError(node, "pools", 0, "need at least one layer of traced rows")
        for i, pool in enumerate(pools):
            if pool.ndim != 2 or pool.shape[1] != k or pool.shape[0] == 0:
                raise IRError(node, f"pools[{i}].shape", pool.shape, f"need [N ≥ 1, k = {k}]")
            if pool.min() < 0 or pool.max() >= E:
                raise IRError(node, f"pools[{i}]", (int(pool.min()), int(pool.max())),
                              f"ids outside [0, {E})")
        self.pools = [np.asarray(p, dtype=np.int64) for p in pools]  # each [N_l, k]
        self.E, self.k, self.samples, self.seed, self.source = E, k, samples, seed, source
        self._cache: dict[int, np.ndarray] = {}

    def _counts(self, T: int) -> np.ndarray:
        """m_e of `samples` draws per layer: [L·samples, E]."""
        _check_T(T)
        if T not in self._cache:
            rng = np.random.default_rng((self.seed, T))
            out = []
            for pool in self.pools:
                rows = rng.integers(0, pool.shape[0], size=(self.samples, T))  # [S, T]
                ids = pool[rows].reshape(self.samples, T * self.k)  # [S, T·k]
                flat = ids + (np.arange(self.samples) * self.E)[:, None]  # [S, T·k]
                out.append(np.bincount(flat.ravel(), minlength=self.samples * self.E)
                           .reshape(self.samples, self.E))  # [S, E]
            self._cache[T] = np.concatenate(out)
        return self._cache[T]

    def distinct(self, T: int) -> float:
        return float((self._counts(T) > 0).sum(1).mean())

    def active_ge(self, T: int, r: int) -> float:
        return float((self._counts(T) >= max(r, 1)).sum(1).mean())

    def rows_ge(self, T: int, r: int) -> float:
        m = self._counts(T)
        return float((m * (m >= r)).sum(1).mean())

    def max_rows(self, T: int) -> float:
        return float(self._counts(T).max(1).mean())


def from_trace(trace, method: str = "probs", prior: float | None = None, phase: str = "all",
               samples: int = 64, seed: int = 0) -> RoutingModel:
    """A routing model of a `moetune.ir.trace.Trace`.

    method "probs": Binomial model with per-layer p_e from the counts; `prior` pseudo-tokens spread
    uniformly (default E/k, one pseudo-count per expert). "resample": `ResampledRouting`.
    `phase`: "all", "prefill" or "decode" steps only.
    """
    pools = trace.pools(phase)  # each [N, k]
    E, k = trace.E, trace.k
    src = f"trace:{trace.name}"
    if method == "resample":
        return ResampledRouting(pools, E, k, samples=samples, seed=seed, source=f"{src} (resampled)")
    if method != "probs":
        raise IRError("from_trace", "method", method, "supported: probs, resample")
    prior = E / k if prior is None else float(prior)
    probs = []
    for pool in pools:
        c = np.bincount(pool.ravel(), minlength=E).astype(np.float64)  # [E]
        probs.append((c + prior * k / E) / (pool.shape[0] + prior))
    return BinomialRouting(np.stack(probs), k, source=src)  # [L, E]
