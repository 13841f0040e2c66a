"""Uncertainty of the reported numbers: paired bootstrap CIs of Δ against the baseline, a paired permutation test,
Wilson intervals for accuracies (issue P, item 1).  Thin wrappers over ``scipy.stats``.

Every quality delta we report compares a point and the baseline on the SAME segments (same tokens), so the
resampling unit is the segment and the resampling is paired: one bootstrap draw picks segment indices and uses them
for both.  Perplexity is ``exp(mean NLL)`` over equal-length segments, so a row's per-segment mean NLL
(``values.segment_nll``) is all a CI needs -- CIs are computed from stored rows at report time, no model run.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
from scipy import stats

__all__ = ["DeltaCI", "paired_delta_ci", "ppl_delta_ci", "paired_permutation_pvalue", "wilson_interval"]

DEFAULT_RESAMPLES = 10_000


@dataclasses.dataclass(frozen=True)
class DeltaCI:
    """``delta`` (point minus baseline) with its ``confidence`` interval ``[lo, hi]`` over ``segments`` paired
    segments; ``excludes_zero``: the difference is distinguishable from 0 at that confidence."""

    delta: float
    lo: float
    hi: float
    segments: int
    confidence: float
    method: str

    @property
    def excludes_zero(self) -> bool:
        return bool(self.lo > 0 or self.hi < 0)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "excludes_zero": self.excludes_zero}


def _paired(x, base, what: str) -> tuple[np.ndarray, np.ndarray]:
    x, b = np.asarray(x, np.float64).ravel(), np.asarray(base, np.float64).ravel()
    if x.shape != b.shape:
        raise ValueError(f"{what}: paired samples need the same segments, got {x.size} and {b.size} values")
    if x.size < 2:
        raise ValueError(f"{what}: need at least 2 paired segments, got {x.size}")
    if not (np.isfinite(x).all() and np.isfinite(b).all()):
        raise ValueError(f"{what}: non-finite per-segment values")
    return x, b


def paired_delta_ci(x, base, statistic, *, confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES,
                    seed: int = 0, what: str = "paired_delta_ci") -> DeltaCI:
    """CI of ``statistic(x) - statistic(base)`` by a paired bootstrap over segments.

    ``x, base``: per-segment values ``[S]`` (same segments, same order); ``statistic(a, axis)``: vectorized over
    ``axis`` (e.g. ``np.mean``).  BCa intervals (scipy.stats.bootstrap), falling back to percentile intervals when
    BCa is degenerate (few segments, ties).
    """
    x, b = _paired(x, base, what)

    def diff(xs, bs, axis=-1):
        return statistic(xs, axis=axis) - statistic(bs, axis=axis)

    delta = float(diff(x, b))
    if np.allclose(x, b, rtol=0, atol=0):
        return DeltaCI(delta, delta, delta, x.size, confidence, "identical segments")
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = stats.bootstrap((x, b), diff, paired=True, vectorized=True, n_resamples=n_resamples,
                                  confidence_level=confidence, method=method, rng=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if np.isfinite(lo) and np.isfinite(hi):
            return DeltaCI(delta, lo, hi, x.size, confidence,
                           f"paired bootstrap over {x.size} segments ({method}, {n_resamples} resamples)")
    raise ValueError(f"{what}: bootstrap interval is not finite")


def _ppl(nll, axis=-1):
    return np.exp(np.mean(nll, axis=axis))


def ppl_delta_ci(segment_nll, base_segment_nll, **kw) -> DeltaCI:
    """CI of Δppl = exp(mean NLL) − exp(mean NLL of the baseline) from equal-length segments' mean NLL."""
    return paired_delta_ci(segment_nll, base_segment_nll, _ppl, what=kw.pop("what", "ppl_delta_ci"), **kw)


def paired_permutation_pvalue(x, base, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> float:
    """Two-sided p-value of "mean(x - base) = 0" by sign flips of the paired differences (scipy.stats)."""
    x, b = _paired(x, base, "paired_permutation_pvalue")
    res = stats.permutation_test((x, b), lambda a, c, axis=-1: np.mean(a - c, axis=axis), permutation_type="samples",
                                 vectorized=True, n_resamples=n_resamples, alternative="two-sided",
                                 rng=np.random.default_rng(seed))
    return float(res.pvalue)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (``successes`` of ``trials``)."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: need 0 <= successes <= trials and trials >= 1, got {successes} / {trials}")
    ci = stats.binomtest(int(successes), int(trials)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)
