"""kvq tune-policy: the knapsack against brute force, the probe against the real cache path, the config snippet
round trip, the back-off, and the refusal of the evaluation split (tiny random model: seconds)."""
import itertools
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from kvquant_jax import cli
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.config import load_config
from kvquant_jax.eval import policy_search as PS
from kvquant_jax.eval import tune_policy as TP
from kvquant_jax.eval.quantized_ppl import chunked_nll
from kvquant_jax.eval.tune_cli import parse_budgets, parse_candidates, run
from kvquant_jax.models.testing import random_params, tiny_config

CFG = tiny_config(num_layers=3, vocab_size=259, head_dim=16)


def _brute(bits, cost, budget):
    best = math.inf
    for combo in itertools.product(range(bits.shape[1]), repeat=bits.shape[0]):
        idx = (np.arange(bits.shape[0]), np.array(combo))
        if np.maximum(cost[idx], 0).sum() <= budget + 1e-12:
            best = min(best, bits[idx].mean())
    return best


@pytest.mark.parametrize("seed", range(12))
def test_exact_solver_matches_brute_force_and_greedy_is_feasible(seed):
    rng = np.random.default_rng(seed)
    n, f = rng.integers(2, 6), rng.integers(2, 5)
    bits = rng.choice([2.0, 3.5, 4.25, 5.0, 8.25, 16.0], (n, f))
    cost = rng.integers(-1, 8, (n, f)).astype(float)          # integer costs: the unit-1 grid is exact
    cost[rng.random((n, f)) < 0.15] = np.inf                   # some options not allowed
    cost[:, 0] = np.where(np.isinf(cost[:, 0]), 0.0, cost[:, 0])
    budget = float(rng.integers(0, 3 * n))
    want = _brute(bits, cost, budget)
    if not np.isfinite(want):
        with pytest.raises(ValueError, match="no policy meets the budget"):
            PS.solve_exact(bits, cost, budget, grid=max(int(budget), 1))
        return
    choice = PS.solve_exact(bits, cost, budget, grid=max(int(budget), 1))
    assert PS.policy_cost(cost, choice) <= budget and PS.policy_bits(bits, choice) == pytest.approx(want)
    try:
        g = PS.solve_greedy(bits, cost, budget)
    except ValueError:
        return                                                  # the most-bits start may not fit; exact did
    assert PS.policy_cost(cost, g) <= budget + 1e-9 and PS.policy_bits(bits, g) >= want - 1e-9


@pytest.mark.parametrize("bits, cost, budget, match", [
    (np.ones((2, 2)), np.ones((2, 3)), 1.0, "both be \\[items, options\\]"),
    (np.ones((2, 2)), np.full((2, 2), np.nan), 1.0, "NaN"),
    (np.ones((2, 2)), np.array([[0, 1], [np.inf, np.inf]]), 1.0, "items \\[1\\] have no allowed option"),
    (np.ones((2, 2)), np.ones((2, 2)), -1.0, "budget must be"),
    (np.ones((2, 2)), np.full((2, 2), 5.0), 1.0, "no policy meets the budget"),
])
def test_bad_search_input_names_the_problem(bits, cost, budget, match):
    with pytest.raises(ValueError, match=match):
        PS.solve_exact(bits, cost, budget)


@pytest.fixture(scope="module")
def tiny():
    params = random_params(CFG, seed=0)
    toks = np.random.default_rng(0).integers(3, 259, (2, 32)).astype(np.int32)
    return params, toks


def test_probe_equals_the_real_chunked_cache_path(tiny):
    """Only layer 1's V in int2: the probe (shared float prefix, one layer through a one-layer cache, float tail)
    equals ``chunked_nll`` through a real mixed cache, up to int2 code flips.

    The two are the same computation by different programs, so their float32 inputs to the int2 quantizer differ
    by ulps, and a value at a rounding boundary lands on the neighbouring code (a third of the row's range): the
    per-token NLL then moves by far more than a ulp (measured: 12 of 62 tokens off by up to 4.5e-4 on one CPU,
    1.6e-6 on another).  So the bound is relative to the int2 effect itself, ``|NLL_int2 - NLL_fp32|`` (mean 0.56
    per token, max 3.4): the mean gap under 1e-3 of the mean effect (measured 3.4e-5 = 6e-5 of it), every token
    under 1e-2 of it (measured 4.5e-4).  Probing the wrong layer (0 or 2) or K instead of V gives mean gaps
    0.5-1.0 and max 3-5, i.e. the size of the effect, which both bounds reject by orders of magnitude."""
    params, toks = tiny
    hidden, ref = TP.float_trace(params, CFG, jnp.asarray(toks))
    scheme = TP.candidate_scheme("int2", "v", CFG)
    nll, kl = TP.probe(params, CFG, jnp.asarray(toks), hidden, ref, jnp.int32(1), scheme, 8)
    pol = [make_scheme("fp32")] * 3
    pol[1] = scheme
    real = np.asarray(chunked_nll(params, CFG, toks, tuple(pol), 8))
    base = -np.take_along_axis(np.asarray(ref), toks[:, 1:, None], -1)[..., 0]
    effect = np.abs(real - base).mean()
    assert float(jnp.mean(kl)) > 0 and effect > 0.1                  # int2 V really changed the predictions
    gap = np.abs(np.asarray(nll) - real)
    assert gap.mean() < 1e-3 * effect, f"mean |probe - real| {gap.mean():.2e} vs int2 effect {effect:.2e}"
    np.testing.assert_allclose(np.asarray(nll), real, rtol=0, atol=1e-2 * effect)


def _sens(dnll, candidates=("fp16", "int4", "int2")):
    dnll = np.asarray(dnll, float)
    bits = np.array([[TP.tensor_bits(make_scheme(f), t, rows=64, num_kv_heads=2, head_dim=16) for f in candidates]
                     for t in TP.TENSORS])
    return TP.Sensitivity(dnll=dnll, kl=np.abs(dnll), bits=bits, base_nll=5.0, candidates=tuple(candidates),
                          tokens=62, bits_length=64)


def test_solve_protects_the_sensitive_item_and_snippet_round_trips_through_the_config_loader(tmp_path):
    # layer 1's K is sensitive at int2 and int4; everything else is free
    d = np.zeros((3, 2, 3))
    d[1, 0, 1:] = [0.02, 0.5]
    choice = TP.solve(_sens(d), "ppl", 1.0)
    assert choice.k == ("int2", "fp16", "int2") and choice.v == ("int2",) * 3
    choice = TP.solve(_sens(d), "ppl", 5.0)
    assert choice.k[1] == "int4"
    block = TP.cache_block(choice)
    assert block["layers"][1] == {"layers": [1], "scheme": {"name": "kv", "k": "int4", "v": "int2"}}
    assert TP.policy_from_block(block, CFG).schemes == TP.choice_schemes(choice, CFG)
    f = tmp_path / "tuned.yaml"
    f.write_text(yaml.safe_dump({"base": str((tmp_path / "b.yaml").name), "cache": block}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"name": "b"}))
    loaded = load_config(f)
    from kvquant_jax.eval.policy import build_policy
    assert build_policy(loaded.config.cache, CFG).schemes == TP.choice_schemes(choice, CFG)
    with pytest.raises(ValueError, match="budget metric"):
        TP.solve(_sens(d), "passkey", 1.0)


def _int2_items(schemes) -> int:
    return sum((s.schema.key.payload == "int2") + (s.schema.value.payload == "int2") for s in schemes)


def test_backoff_shrinks_the_budget_until_validation_passes_and_reports_failure(tiny, monkeypatch):
    """Validation says each int2 item costs 1% (the sensitivities claimed 0.1%): the search backs off until the
    validated policy fits; when validation never fits, the result says so after ``max_backoff`` retries."""
    params, toks = tiny
    d = np.zeros((3, 2, 3))
    d[:, :, 1], d[:, :, 2] = 1e-4, 1e-3
    fake = {"nll": 0.0, "base_nll": 0.0, "segment_nll": [], "base_segment_nll": []}
    monkeypatch.setattr(TP, "chunked_nll", lambda *a: np.zeros((1, 2)))
    monkeypatch.setattr(TP, "validate", lambda p, c, t, schemes, **kw: {**fake, "ppl_pct": float(_int2_items(schemes))})
    res = TP.tune(params, CFG, toks, _sens(d), budget=1.0, chunk=8, max_backoff=3)
    assert [a["ppl_pct"] for a in res.attempts] == [6.0, 1.0] and res.within_budget
    assert res.attempts[1]["internal_budget"] < res.attempts[0]["internal_budget"]
    monkeypatch.setattr(TP, "validate", lambda *a, **kw: {**fake, "ppl_pct": 5.0})
    res = TP.tune(params, CFG, toks, _sens(d), budget=1.0, chunk=8, max_backoff=2)
    assert len(res.attempts) == 3 and not res.within_budget


def test_refuses_the_evaluation_split(tmp_path, capsys):
    with pytest.raises(TP.EvaluationSplitError, match="calibration_split is 'test'"):
        TP.check_calibration_text("test", None)
    fake = tmp_path / "wiki.test.raw"
    fake.write_text("the evaluation text")
    with pytest.raises(TP.EvaluationSplitError, match="is the WikiText-2 test file"):
        TP.check_calibration_text("validation", str(fake))
    base = {"model": {"name": "random", "random": {"num_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                                                   "num_heads": 2, "num_kv_heads": 1, "head_dim": 8,
                                                   "vocab_size": 300}},
            "data": {"split": "validation", "calibration_split": "test"}}
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text(yaml.safe_dump(base))
    with pytest.raises(TP.EvaluationSplitError):              # before the model or any text is loaded
        run(load_config(cfgfile), budgets=[1.0], metric="ppl", candidates=("int4",), out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
    cfgfile.write_text(yaml.safe_dump({**base, "data": {"calibration_corpus": str(fake)}}))
    assert cli.main(["tune-policy", str(cfgfile), "--budget", "1", "--out", str(tmp_path / "o2")]) == 2
    assert "is the WikiText-2 test file" in capsys.readouterr().err


def test_cli_arguments_are_checked():
    assert parse_budgets("0.5, 1,2", "ppl") == [0.5, 1.0, 2.0]
    for bad, match in (("x", "not a number"), ("-1", ">= 0"), ("", "at least one")):
        with pytest.raises(ValueError, match=match):
            parse_budgets(bad, "ppl")
    assert parse_candidates("int8,kivi2") == ("int8", "kivi2")
    with pytest.raises(ValueError, match="unknown \\['int9'\\]"):
        parse_candidates("int8,int9")
    with pytest.raises(ValueError, match="repeats"):
        parse_candidates("int8,int8")


def test_cli_end_to_end_writes_a_loadable_policy_and_manifest(tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("Calibration text about caches and keys and values. " * 40)
    cfgfile = tmp_path / "tune.yaml"
    cfgfile.write_text(yaml.safe_dump({
        "model": {"name": "random", "random": {"num_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                                               "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                                               "vocab_size": 300}},
        "data": {"corpus": "builtin", "calibration_corpus": str(text)},
        "tasks": {"ppl": {"seq_len": 32, "max_segments": 1, "chunk": 8}, "bytes": {"length": 64}}}))
    out = tmp_path / "policy"
    assert cli.main(["tune-policy", str(cfgfile), "--budget", "50", "--candidates", "int8,int2",
                     "--out", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["calibration_corpus"]["sha256"] and man["model_sha256"] and man["candidates"] == ["int8", "int2"]
    assert len(man["sensitivity"]["per_item"]) == 2 * 2 * 2 and man["validation"]["within_budget"]
    assert man["validation"]["ppl_pct"] <= 50
    loaded = load_config(out / "policy.yaml")          # the snippet is a config the loader accepts
    from kvquant_jax.eval.policy import build_policy
    from kvquant_jax.eval.context import load_eval_model
    m = load_eval_model(load_config(cfgfile).config.model)
    assert build_policy(loaded.config.cache, m.cfg).schemes == TP.choice_schemes(
        TP.Choice(k=tuple(man["choice"]["k"]), v=tuple(man["choice"]["v"])), m.cfg)
    assert cli.main(["tune-policy", str(cfgfile), "--budget", "1", "--out", str(out)]) == 2    # never overwrites
    assert "exists" in capsys.readouterr().err


def test_item_costs_and_sensitivity_json_round_trip():
    d = np.zeros((3, 2, 3))
    d[0, 0] = [0.0, -0.01, 0.02]
    sens = _sens(d)                                 # kl = |dnll|
    np.testing.assert_array_equal(TP.item_costs(sens, "max")[0, 0], [0.0, 0.01, 0.02])
    np.testing.assert_array_equal(TP.item_costs(sens, "dnll")[0, 0], [0.0, -0.01, 0.02])
    with pytest.raises(ValueError, match="cost must be one of"):
        TP.item_costs(sens, "bits")
    back = TP.sensitivity_from_dict(json.loads(json.dumps(sens.to_dict())))
    np.testing.assert_array_equal(back.dnll, sens.dnll)
    np.testing.assert_array_equal(back.bits, sens.bits)
    assert back.candidates == sens.candidates and back.tokens == sens.tokens


def test_reused_sensitivity_must_come_from_the_same_setup(tmp_path):
    from kvquant_jax.eval.tune_cli import reuse_sensitivity

    ident = {"model_sha256": "abc", "candidates": ["fp16", "int4", "int2"]}
    f = tmp_path / "sensitivity.json"
    f.write_text(json.dumps({**ident, "sensitivity": _sens(np.zeros((3, 2, 3))).to_dict()}))
    assert reuse_sensitivity(f, identity=ident).dnll.shape == (3, 2, 3)
    with pytest.raises(ValueError, match="model_sha256 'abc' != 'xyz'"):
        reuse_sensitivity(f, identity={**ident, "model_sha256": "xyz"})
    f.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        reuse_sensitivity(f, identity=ident)


def test_upper_acceptance_backs_off_while_the_ci_reaches_over_the_budget(tiny, monkeypatch):
    """Point estimate +0.5% but a wide interval over 4 segments: "point" accepts, "upper" backs off."""
    params, toks = tiny
    d = np.zeros((3, 2, 3))
    d[:, :, 1], d[:, :, 2] = 1e-4, 1e-3
    base = [3.0, 3.5, 3.2, 3.4]

    def fake(p, c, t, schemes, **kw):
        n2 = _int2_items(schemes)
        seg = [b + 0.005 + (0.03 if i % 2 else -0.03) * (n2 > 1) for i, b in enumerate(base)]
        return {"nll": float(np.mean(seg)), "base_nll": float(np.mean(base)), "segment_nll": seg,
                "base_segment_nll": base, "ppl_pct": 100 * math.expm1(np.mean(seg) - np.mean(base))}

    monkeypatch.setattr(TP, "chunked_nll", lambda *a: np.zeros((1, 2)))
    monkeypatch.setattr(TP, "validate", fake)
    point = TP.tune(params, CFG, toks, _sens(d), budget=1.0, chunk=8, accept="point")
    upper = TP.tune(params, CFG, toks, _sens(d), budget=1.0, chunk=8, accept="upper")
    assert len(point.attempts) == 1 and point.attempts[0]["judged"] == point.attempts[0]["ppl_pct"] < 1.0
    assert upper.attempts[0]["judged"] > 1.0 and len(upper.attempts) > 1
    assert upper.within_budget
    assert upper.bits > point.bits
    with pytest.raises(ValueError, match="accept must be"):
        TP.tune(params, CFG, toks, _sens(d), budget=1.0, chunk=8, accept="mean")
