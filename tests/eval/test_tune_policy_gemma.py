"""kvq tune-policy on a sliding-window model (tiny Gemma-3: layers local, local, global, local; window 8): the probe
through each layer's real cache (window ring / full length, the layer's RoPE base) equals the real mixed cache
path, bits/element count what each layer retains at the target context, the knapsack spends bits where they are
stored, and calibration segments follow the BOS protocol (seconds)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.window import WindowScheme
from kvquant_jax.config import load_config
from kvquant_jax.eval import tune_cli
from kvquant_jax.eval import tune_policy as TP
from kvquant_jax.eval.context import EvalModel, TokenizedCorpus
from kvquant_jax.eval.footprint import cache_footprint
from kvquant_jax.eval.quantized_ppl import chunked_nll
from kvquant_jax.models.testing import random_params, tiny_config, tiny_gemma_config

CFG = tiny_gemma_config()                   # 4 layers: local, local, global, local; window 8; BOS required
T, CHUNK = 32, 8                            # segments longer than the window: local layers use the ring


@pytest.fixture(scope="module")
def tiny():
    params = random_params(CFG, seed=1)
    ids = np.random.default_rng(1).integers(3, CFG.vocab_size, 400)
    return params, TP.calibration_segments(ids, T, 2, CFG)


def test_calibration_segments_follow_the_models_bos_protocol():
    ids = np.arange(3, 103)
    g = TP.calibration_segments(ids, 10, 3, CFG)
    assert g.shape == (3, 10) and (g[:, 0] == CFG.bos_id).all()
    np.testing.assert_array_equal(g[:, 1:].ravel(), ids[:27])        # [BOS] + 9 consecutive text tokens each
    plain = TP.calibration_segments(ids, 10, 3, tiny_config())
    np.testing.assert_array_equal(plain.ravel(), ids[:30])            # LLaMA: text only, as before
    with pytest.raises(ValueError, match=r"needs 20 segment\(s\) of 10 tokens \(\[BOS\] \+ text\)"):
        TP.calibration_segments(ids, 10, 20, CFG)


KIVI = "kivi2:group_size=8,v_group_size=16,residual=8"     # groups close inside the 32-token segment


@pytest.mark.parametrize("layer, fmt, tensor", [(3, "int2", "k"), (2, KIVI, "v")])
def test_probe_of_a_local_or_global_layer_equals_the_real_mixed_cache(tiny, layer, fmt, tensor):
    """Layer 3 (local: a window ring at T = 32 rows, RoPE base 1e4) and layer 2 (global: full length, 1e6):
    the probe equals ``chunked_nll`` through a real cache with only that layer's tensor quantized."""
    params, toks = tiny
    schemes = TP.per_layer_schemes(TP.candidate_scheme(fmt, tensor, CFG), CFG, T)
    assert isinstance(schemes[layer], WindowScheme) == (CFG.layer_type(layer) == "local")
    hidden, ref = TP.float_trace(params, CFG, jnp.asarray(toks))
    nll, kl = TP.probe(params, CFG, jnp.asarray(toks), hidden, ref, jnp.int32(layer), schemes[layer], CHUNK)
    pol = [make_scheme("fp32")] * CFG.num_layers
    pol[layer] = TP.candidate_scheme(fmt, tensor, CFG)
    real = np.asarray(chunked_nll(params, CFG, toks, tuple(pol), CHUNK))
    np.testing.assert_allclose(np.asarray(nll), real, rtol=0, atol=2e-5)
    base = -np.take_along_axis(np.asarray(ref), toks[:, 1:, None], -1)[..., 0]
    assert float(jnp.mean(kl)) > 0 and np.abs(np.asarray(nll) - base).max() > 1e-4


def test_bits_count_the_rows_each_layer_retains_at_the_context():
    bits = TP.layer_bits(("fp16", "int4"), CFG, 4096)                # [L, 2, F]
    assert bits.shape == (4, 2, 2)
    np.testing.assert_allclose(bits[2], [[16.0, bits[2, 0, 1]], [16.0, bits[2, 1, 1]]])   # global: full length
    assert (bits[[0, 1, 3]] < bits[2] / 100).all()                   # local: a ring of ~8 rows out of 4096
    short = TP.layer_bits(("fp16", "int4"), CFG, 8)                  # within the window every layer keeps all
    np.testing.assert_allclose(short, np.broadcast_to(short[2], short.shape))
    sens = TP.Sensitivity(dnll=np.zeros((4, 2, 2)), kl=np.zeros((4, 2, 2)), bits=bits, base_nll=1.0,
                          candidates=("fp16", "int4"), tokens=1, bits_length=4096)
    choice = TP.Choice(k=("int4",) * 4, v=("int4",) * 4)
    fp = cache_footprint(TP.choice_schemes(choice, CFG), CFG, 4096)   # the ledger over layer_schemes agrees
    assert TP.choice_bits(sens, choice) == pytest.approx(fp["bits_per_element_excl_metadata"], rel=1e-9)
    back = TP.sensitivity_from_dict(json.loads(json.dumps(sens.to_dict())))
    np.testing.assert_array_equal(back.bits, bits)
    assert sens.to_dict()["bits"]["k"]["fp16"] == 16.0               # "bits": a full-length layer's


def test_the_knapsack_spends_its_budget_where_the_bytes_are():
    """Every item costs the same 0.6% at int2 and the 1% budget admits one: at 4,096 tokens the search gives it
    to the global layer (all its rows are stored), within the window it cannot tell the layers apart."""
    cands = ("fp16", "int2")
    d = np.zeros((4, 2, 2))
    d[:, :, 1] = np.log1p(0.006)
    d[:, 1, 1] += 1.0                                                # V stays fp16: one K item to place
    for rows, want in ((4096, 2), (8, None)):
        sens = TP.Sensitivity(dnll=d, kl=d, bits=TP.layer_bits(cands, CFG, rows), base_nll=1.0, candidates=cands,
                              tokens=1, bits_length=rows)
        choice = TP.solve(sens, "ppl", 1.0)
        assert choice.k.count("int2") == 1 and choice.v == ("fp16",) * 4
        if want is not None:
            assert choice.k[want] == "int2"


class _Session:
    """Stands in for ``eval.metrics.Session``: the tiny Gemma model and a random calibration corpus."""

    def __init__(self, log=None):
        pass

    def model(self, cfg):
        return EvalModel(params=random_params(CFG, seed=1), cfg=CFG, tokenizer=None, sha256="tiny", path="tiny")

    def corpus(self, cfg, calibration=False):
        assert calibration
        ids = np.random.default_rng(2).integers(3, CFG.vocab_size, 400).astype(np.int32)
        return TokenizedCorpus(ids=ids, name="rand", source="rng", sha256="r")


def test_run_writes_a_gemma_policy_with_per_layer_bits(tmp_path, monkeypatch):
    """The command on a sliding-window model: [BOS] calibration segments reach the probe, ``--context`` sets the
    bits length, the manifest keeps per-layer bits and the cache block rebuilds the choice (probe and validation
    stubbed: their numerics are the tests above and tests/eval/test_tune_policy.py)."""
    seen = []

    def fake_probe(params, cfg, tokens, hidden, ref, layer, scheme, chunk):
        seen.append((np.asarray(tokens), type(scheme).__name__, int(layer)))
        return jnp.zeros(ref.shape[:2]), jnp.zeros(ref.shape[:2])

    monkeypatch.setattr(tune_cli, "Session", _Session)
    monkeypatch.setattr(TP, "probe", fake_probe)
    monkeypatch.setattr(TP, "chunked_nll", lambda p, c, toks, pol, ch: np.zeros((len(toks), toks.shape[1] - 1)))
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump({"data": {"calibration_corpus": "builtin"},
                                 "tasks": {"ppl": {"seq_len": T, "max_segments": 1, "chunk": CHUNK}}}))
    man, = tune_cli.run(load_config(f), budgets=[1.0], metric="ppl", candidates=("int8", "int2"),
                        out=tmp_path / "o", validation_segments=1, context=4096, log=lambda m: None)
    assert all(toks[:, 0].tolist() == [CFG.bos_id] for toks, _, _ in seen)
    assert {(layer, name) for _, name, layer in seen} == {(i, "WindowScheme" if CFG.layer_type(i) == "local" else
                                                          "KVSplitScheme") for i in range(4)}
    assert man["calibration_corpus"]["bos"] and man["settings"]["bits_length"] == 4096
    lb = man["sensitivity"]["layer_bits"]["k"]["int8"]
    assert lb[2] > 50 * lb[0]                                         # the global layer holds the rows
    assert man["choice"] == {"k": ["int2"] * 4, "v": ["int2"] * 4} and man["validation"]["within_budget"]
    built = TP.policy_from_block(man["cache"], CFG).schemes
    assert built == TP.choice_schemes(TP.Choice(k=tuple(man["choice"]["k"]), v=tuple(man["choice"]["v"])), CFG)
    again, = tune_cli.run(load_config(f), budgets=[1.0], metric="ppl", candidates=("int8", "int2"),
                          out=tmp_path / "o8", validation_segments=1, context=8, log=lambda m: None,
                          sensitivity=str(tmp_path / "o" / "sensitivity.json"))
    assert again["settings"]["bits_length"] == 8 and "layer_bits" not in again["sensitivity"]   # recounted
    assert again["sensitivity"]["per_item"] == man["sensitivity"]["per_item"]


def test_context_flag_is_checked(tmp_path, capsys):
    from kvquant_jax import cli

    assert cli.main(["tune-policy", str(tmp_path / "none.yaml"), "--budget", "1", "--context", "0",
                     "--out", str(tmp_path / "o")]) == 2
    assert "--context must be >= 1 tokens, got 0" in capsys.readouterr().err and not (tmp_path / "o").exists()
