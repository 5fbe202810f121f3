"""The reference of every `Router` kind: logits [T, E] → (top-k ids [T, k], weights [T, k]).

Written for clarity, in float32. It is the yardstick the capture's router check compares a
model's own router against, and what a fused routing kernel is later checked against.

    softmax_topk          p = softmax(logits); ids = top-k of p; w = p[ids] (÷ Σ w iff renormalize)
    topk_softmax          ids = top-k of logits; w = softmax(logits[ids])
    sigmoid_grouped_topk  s = σ(logits); c = s + score_bias; keep topk_group of n_group groups
                          (group score: sum of the top-2 of c in the group); ids = top-k of c;
                          w = s[ids] (÷ (Σ w + 1e-20) iff renormalize) × scaling     (DeepSeek-V3)

Note: topk_softmax and softmax_topk(renormalize=True) give the same ids and weights (softmax is
monotone and the partition function cancels); they stay separate kinds because models compute
them in different precisions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .block import Router
from .errors import IRError


def router_logits(router: Router, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits [T, E] of x [T, D] under the router linear weight [E, D] (and bias [E]).

    `compute_dtype="model"` computes the linear in x's dtype (as transformers does: bf16 logits in
    a bf16 model) and widens afterwards; "float32" widens x and the weight first (DeepSeek-V3).
    """
    if router.logit_bias and bias is None:
        raise IRError(f"Router({router.kind})", "logit_bias", None,
                      "router has a logit bias; pass its tensor")
    if router.compute_dtype == "float32":
        b = bias.float() if router.logit_bias else None
        return F.linear(x.float(), weight.float(), b)  # [T, E]
    b = bias.to(x.dtype) if router.logit_bias else None
    return F.linear(x, weight.to(x.dtype), b).float()  # [T, E]


def selection_scores(router: Router, logits: torch.Tensor, score_bias: torch.Tensor | None) -> torch.Tensor:
    """The float32 scores [T, E] that top-k is taken over; -inf for experts in dropped groups."""
    logits = logits.float()
    if router.kind == "softmax_topk":
        return torch.softmax(logits, dim=-1)  # [T, E]
    if router.kind == "topk_softmax":
        return logits  # [T, E]
    _check_score_bias(router, logits, score_bias)
    c = torch.sigmoid(logits)  # [T, E]
    if router.score_bias:
        c = c + score_bias.float()
    if router.n_group > 1:
        T, E = c.shape
        per = E // router.n_group
        grouped = c.view(T, router.n_group, per)  # [T, G, E/G]
        group_score = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
        keep = group_score.topk(router.topk_group, dim=-1).indices  # [T, topk_group]
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)  # [T, G]
        mask = mask.unsqueeze(-1).expand(T, router.n_group, per).reshape(T, E)  # [T, E]
        c = c.masked_fill(~mask, float("-inf"))
    return c


def route(router: Router, logits: torch.Tensor, score_bias: torch.Tensor | None, k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing: logits [T, E] → ids [T, k] int64, weights [T, k] float32.

    `score_bias` [E] is the per-expert selection bias (DeepSeek-V3's e_score_correction_bias);
    None unless `router.score_bias`. Casting the weights to `router.weights_dtype` is the caller's.
    """
    if logits.dim() != 2:
        raise IRError(f"Router({router.kind})", "logits.shape", tuple(logits.shape), "need [T, E]")
    T, E = logits.shape
    if not 1 <= k <= E:
        raise IRError(f"Router({router.kind})", "k", k, f"need 1 ≤ k ≤ E = {E}")
    logits = logits.float()
    scores = selection_scores(router, logits, score_bias)  # [T, E]
    top, ids = scores.topk(k, dim=-1)  # [T, k]
    if router.kind == "softmax_topk":
        w = top
        if router.renormalize:
            w = w / w.sum(-1, keepdim=True)
    elif router.kind == "topk_softmax":
        w = torch.softmax(top, dim=-1)  # [T, k]
    else:
        w = torch.sigmoid(logits).gather(1, ids)  # [T, k], from s: the bias only selects
        if router.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * router.scaling
    return ids.long(), w.float()


def _check_score_bias(router: Router, logits: torch.Tensor, score_bias: torch.Tensor | None) -> None:
    node = f"Router({router.kind})"
    if router.score_bias:
        if score_bias is None:
            raise IRError(node, "score_bias", None, "router has a per-expert score bias; pass its tensor")
        if tuple(score_bias.shape) != (logits.shape[-1],):
            raise IRError(node, "score_bias.shape", tuple(score_bias.shape),
                          f"need [E] = [{logits.shape[-1]}]")
    elif score_bias is not None:
        raise IRError(node, "score_bias", tuple(score_bias.shape),
                      "router has no score bias (score_bias=False)")
    if logits.shape[-1] % router.n_group:
        raise IRError(node, "n_group", router.n_group, f"does not divide E = {logits.shape[-1]}")
