"""Choose one storage format per (layer, tensor) minimizing bits under an additive loss budget.

A multiple-choice knapsack: item ``i`` (one layer's K or V) takes exactly one option ``j`` (a candidate format)
with ``bits[i, j]`` (stored bits per element) and ``cost[i, j]`` (its measured loss when only that item is
quantized, e.g. the mean Δ NLL); the policy minimizes ``mean_i bits[i, choice[i]]`` subject to
``sum_i cost[i, choice[i]] <= budget`` (losses assumed additive; the caller validates the chosen policy end to end
and backs off when the sum underestimates).

:func:`solve_exact` is a dynamic program over costs rounded UP to ``budget / grid`` units (so its policies never
exceed the budget on the rounded costs, and are exact when every cost is a multiple of the unit);
:func:`solve_greedy` is the classic Δcost-per-bit-saved descent, kept as the cheap reference.
Negative measured costs (noise around 0) count as 0: a format never buys budget for another.
"""
from __future__ import annotations

import numpy as np


def _check(bits, cost, budget) -> tuple[np.ndarray, np.ndarray]:
    bits, cost = np.asarray(bits, np.float64), np.asarray(cost, np.float64)
    if bits.ndim != 2 or bits.shape != cost.shape or bits.shape[1] < 1:
        raise ValueError(f"bits and cost must both be [items, options], got {bits.shape} and {cost.shape}")
    if not np.isfinite(bits).all() or (bits < 0).any():
        raise ValueError("bits must be finite and >= 0")
    if np.isnan(cost).any():
        raise ValueError("cost holds NaN (an unmeasured option must be +inf, i.e. not allowed)")
    if not np.isfinite(budget) or budget < 0:
        raise ValueError(f"budget must be a finite number >= 0, got {budget!r}")
    if not np.isfinite(cost).any(axis=1).all():
        bad = np.flatnonzero(~np.isfinite(cost).any(axis=1)).tolist()
        raise ValueError(f"items {bad} have no allowed option (every cost is inf)")
    return bits, np.maximum(cost, 0.0)


def solve_exact(bits, cost, budget: float, *, grid: int = 1000) -> np.ndarray:
    """int ``[items]``: the option of every item minimizing ``sum bits`` with ``sum ceil(cost / unit) <= grid``
    (``unit = budget / grid``).  ``bits``, ``cost``: float ``[items, options]`` (``cost`` +inf = not allowed).
    Raises ``ValueError`` when even the cheapest-cost option of every item exceeds the budget."""
    bits, cost = _check(bits, cost, budget)
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    n, _ = bits.shape
    unit = budget / grid if budget > 0 else 1.0
    with np.errstate(invalid="ignore", divide="ignore"):
        units = np.where(np.isfinite(cost), np.ceil(cost / unit - 1e-9), np.inf)
    units = np.where((cost == 0) & np.isfinite(cost), 0, units)
    cap = grid if budget > 0 else 0
    best = np.zeros(cap + 1)                 # best[g]: min bits of the items so far using at most g units
    pick = np.zeros((n, cap + 1), np.int64)
    for i in range(n):
        new = np.full(cap + 1, np.inf)
        for j in np.flatnonzero(units[i] <= cap):
            u = int(units[i, j])
            cand = np.full(cap + 1, np.inf)
            cand[u:] = best[: cap + 1 - u] + bits[i, j]
            better = cand < new
            new[better], pick[i, better] = cand[better], j
        best = new
    if not np.isfinite(best[cap]):
        raise ValueError(f"no policy meets the budget {budget:g}: the least-loss options already cost "
                         f"{np.min(cost, axis=1).sum():g}")
    choice, g = np.zeros(n, np.int64), cap
    for i in range(n - 1, -1, -1):
        choice[i] = pick[i, g]
        g -= int(units[i, choice[i]])
    return choice


def solve_greedy(bits, cost, budget: float) -> np.ndarray:
    """int ``[items]``: start every item at its most-bits allowed option, then repeatedly take the move (one item
    to an option with fewer bits) with the least added cost per bit saved that still fits the budget."""
    bits, cost = _check(bits, cost, budget)
    n = bits.shape[0]
    choice = np.array([np.flatnonzero(np.isfinite(cost[i]))[np.argmax(bits[i][np.isfinite(cost[i])])]
                       for i in range(n)])
    spent = cost[np.arange(n), choice].sum()
    if spent > budget:
        raise ValueError(f"no policy meets the budget {budget:g}: the most-bits options already cost {spent:g}")
    while True:
        saved = bits[np.arange(n), choice][:, None] - bits              # [items, options]
        extra = cost - cost[np.arange(n), choice][:, None]
        ok = (saved > 0) & np.isfinite(cost) & (spent + extra <= budget)
        if not ok.any():
            return choice
        rate = np.where(ok, np.maximum(extra, 0.0) / np.where(saved > 0, saved, 1.0), np.inf)
        i, j = np.unravel_index(np.argmin(rate), rate.shape)
        spent += extra[i, j]
        choice[i] = j


def policy_bits(bits, choice) -> float:
    """Mean bits per element of a choice (every item holds the same number of elements)."""
    bits = np.asarray(bits, np.float64)
    return float(bits[np.arange(bits.shape[0]), np.asarray(choice)].mean())


def policy_cost(cost, choice) -> float:
    """Sum of the (negative-clipped) costs of a choice."""
    cost = np.maximum(np.asarray(cost, np.float64), 0.0)
    return float(cost[np.arange(cost.shape[0]), np.asarray(choice)].sum())
