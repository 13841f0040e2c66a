"""The ``activation`` config block: W8A8 weights + policy and SmoothQuant / SmoothAttention folds applied by the
evaluation session, so every metric runs the transformed model through the same cache path."""
import numpy as np
import pytest

from kvquant_jax.config import from_dict
from kvquant_jax.eval.metrics import Session, compute
from kvquant_jax.models.w8a8 import QuantLinear, W8A8Policy

from eval_helpers import TINY

TASKS = {"ppl": {"seq_len": 48, "max_segments": 2, "chunk": 16}, "serving_ppl": {"prefill": 16, "decode": 12}}


def _cfg(**activation):
    return from_dict({"model": {"name": "random", "random": TINY}, "data": {"corpus": "builtin"},
                      "activation": activation, "tasks": TASKS})


@pytest.fixture(scope="module")
def session():
    return Session()


def test_w8a8_block_quantizes_weights_and_sets_the_policy(session):
    m = session.model(_cfg(enabled=True))
    assert isinstance(m.cfg.activation, W8A8Policy) and m.cfg.activation.prefill == "w8a8"
    assert isinstance(m.params["layers"]["wq"], QuantLinear) and m.params["layers"]["wq"].codes.dtype == np.int8
    assert session.model(_cfg()).cfg.activation is None                       # the raw model is untouched
    assert not isinstance(session.model(_cfg()).params["layers"]["wq"], QuantLinear)


def test_w8a8_changes_ppl_slightly_and_all_float_layers_reproduce_float(session):
    ref = compute(session, _cfg(), "ppl")["ppl"]
    q = compute(session, _cfg(enabled=True), "ppl")["ppl"]
    assert q != ref and abs(q - ref) / ref < 0.05, (q, ref)
    # every layer kept float (per-layer rule, lax.cond inside the layer scan) == the float model
    allf = compute(session, _cfg(enabled=True, float_layers=list(range(TINY["num_layers"]))), "ppl")["ppl"]
    np.testing.assert_allclose(allf, ref, rtol=1e-6)
    one = compute(session, _cfg(enabled=True, float_layers=[0]), "ppl")["ppl"]
    assert one not in (ref, q)
    s = compute(session, _cfg(enabled=True), "serving_ppl")
    assert np.isfinite(s["ppl"])


def test_smoothing_needs_calibration_text_and_keeps_float_model(session, tmp_path):
    with pytest.raises(ValueError, match=r"activation: smoothing statistics: the calibration text .* is the evaluation text"):
        session.model(from_dict({"model": {"name": "random", "random": TINY},
                                 "data": {"corpus": "builtin", "calibration_corpus": "builtin"},
                                 "activation": {"smooth_alpha": 0.5}}))
    text = tmp_path / "calib.txt"
    text.write_text("Calibration text that is not the evaluation text. " * 200)
    base = {"model": {"name": "random", "random": TINY}, "tasks": TASKS,
            "data": {"corpus": "builtin", "calibration_corpus": str(text)}}
    ref = compute(session, from_dict(base), "ppl")["ppl"]
    for act in ({"smooth_alpha": 0.5, "smooth_windows": 2, "smooth_len": 64},
                {"smooth_attention_alpha": 0.5, "smooth_windows": 2, "smooth_len": 64}):
        got = compute(session, from_dict({**base, "activation": act}), "ppl")["ppl"]
        np.testing.assert_allclose(got, ref, rtol=1e-5)          # float-exact folds


def test_serving_kl_reference_is_the_baseline_cache_on_the_same_transformed_model(session):
    """The serving KL / top-1 compare a point with the baseline cache on the SAME model (W8A8 / folds applied):
    the baseline row scores KL 0 and top-1 1 whichever model was evaluated before it, a quantized cache KL > 0."""
    for act in ({}, {"enabled": True}):
        s = compute(session, _cfg(**act), "serving_ppl")
        assert s["kl"] == 0.0 and s["top1"] == 1.0, (act, s["kl"], s["top1"])
    cfg = from_dict({"model": {"name": "random", "random": TINY}, "data": {"corpus": "builtin"},
                     "activation": {"enabled": True}, "tasks": TASKS, "cache": {"scheme": "int2"}})
    q = compute(session, cfg, "serving_ppl")
    assert q["kl"] > 1e-4 and len(q["segment_kl"]) == cfg.tasks.serving_ppl.segments
