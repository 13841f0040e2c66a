"""Confidence intervals of the reports (kvquant_jax.eval.stats) against closed forms and a permutation test."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvquant_jax.eval import stats as S


def test_mean_delta_ci_matches_the_normal_closed_form():
    """Known-mean case: paired differences ~ N(0.2, 0.5^2); with 2000 segments the bootstrap CI of the mean
    difference equals mean ± 1.96 s / sqrt(n) to a few percent of its width, and covers the true 0.2."""
    rng = np.random.default_rng(0)
    n = 2000
    base = rng.normal(3.0, 1.0, n)
    x = base + rng.normal(0.2, 0.5, n)
    ci = S.paired_delta_ci(x, base, np.mean, n_resamples=4000)
    d = x - base
    half = 1.959964 * d.std(ddof=1) / math.sqrt(n)
    assert ci.delta == pytest.approx(d.mean(), abs=1e-12)
    assert ci.lo == pytest.approx(d.mean() - half, abs=0.06 * half)
    assert ci.hi == pytest.approx(d.mean() + half, abs=0.06 * half)
    assert ci.lo < 0.2 < ci.hi and ci.excludes_zero


def test_ppl_delta_ci_matches_the_delta_method():
    """Δppl = exp(mean x) - exp(mean b): the delta-method standard error exp(mu) * sd(x - b) / sqrt(n) (x, b with a
    common mean shift) gives the closed-form interval the bootstrap must reproduce for many segments."""
    rng = np.random.default_rng(1)
    n = 1500
    base = rng.normal(3.0, 0.4, n)
    x = base + rng.normal(0.01, 0.05, n)
    ci = S.ppl_delta_ci(x, base, n_resamples=4000)
    mx, mb = x.mean(), base.mean()
    # gradient of exp(mx) - exp(mb) w.r.t. the per-segment pair means: (exp(mx), -exp(mb)) / n
    g = np.exp(mx) * x - np.exp(mb) * base
    se = g.std(ddof=1) / math.sqrt(n)
    want = np.exp(mx) - np.exp(mb)
    assert ci.delta == pytest.approx(want, rel=1e-12)
    assert ci.lo == pytest.approx(want - 1.96 * se, abs=0.1 * 1.96 * se)
    assert ci.hi == pytest.approx(want + 1.96 * se, abs=0.1 * 1.96 * se)


@pytest.mark.parametrize("shift, distinguishable", [(0.05, True), (0.0, False)])
def test_ci_agrees_with_the_permutation_test(shift, distinguishable):
    rng = np.random.default_rng(2)
    base = rng.normal(3.0, 0.5, 64)
    x = base + shift + rng.normal(0, 0.05, 64)
    ci = S.paired_delta_ci(x, base, np.mean)
    p = S.paired_permutation_pvalue(x, base)
    assert ci.excludes_zero == distinguishable
    assert (p < 0.05) == distinguishable


def test_wilson_interval_matches_its_formula():
    for k, n in ((0, 10), (3, 10), (10, 10), (17, 20), (1, 1)):
        lo, hi = S.wilson_interval(k, n)
        z = 1.959963984540054
        p = k / n
        c = (p + z * z / (2 * n)) / (1 + z * z / n)
        h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        assert lo == pytest.approx(max(0.0, c - h), abs=1e-9)
        assert hi == pytest.approx(min(1.0, c + h), abs=1e-9)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="same segments"):
        S.ppl_delta_ci([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="at least 2"):
        S.ppl_delta_ci([1.0], [1.0])
    with pytest.raises(ValueError, match="non-finite"):
        S.ppl_delta_ci([1.0, np.nan], [1.0, 2.0])
    with pytest.raises(ValueError, match="successes"):
        S.wilson_interval(5, 4)


def test_identical_segments_give_a_zero_width_interval():
    x = np.array([3.0, 3.1, 2.9])
    ci = S.ppl_delta_ci(x, x)
    assert ci.delta == ci.lo == ci.hi == 0.0 and not ci.excludes_zero


def test_report_cells_carry_the_ci_and_mark_indistinguishable_deltas():
    from kvquant_jax.eval import report

    rng = np.random.default_rng(3)
    base = rng.normal(3.0, 0.3, 16)

    def entry(x):
        d = math.exp(np.mean(x)) - math.exp(np.mean(base))
        return {"ppl": {"values": {"segment_nll": list(x)}, "delta": {"delta_ppl": d}},
                "baseline_ppl": {"values": {"segment_nll": list(base)}}}

    clear = report._delta_cell(entry(base + 0.1 + rng.normal(0, 0.01, 16)), "ppl")
    noise = report._delta_cell(entry(base + rng.normal(0, 0.05, 16)), "ppl")
    assert clear.count("[") == 1 and "n.s." not in clear
    assert noise.endswith("n.s.")
    one = {"serving_ppl": {"values": {"segment_nll": [3.0]}, "delta": {"delta_ppl": 0.5}},
           "baseline_serving_ppl": {"values": {"segment_nll": [2.9]}}}
    assert report._delta_cell(one, "serving_ppl").endswith("(1 segment: no CI)")
