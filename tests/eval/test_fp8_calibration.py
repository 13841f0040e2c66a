"""FP8 `calibrated` scales for the evaluation: observed per-layer absmax -> per-layer scales in every fresh cache."""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.config import from_dict
from kvquant_jax.eval.calib import load_fp8_artifact, observe_fp8, save_fp8_artifact
from kvquant_jax.eval.errors import exact_qkv
from kvquant_jax.eval.metrics import Session, compute
from kvquant_jax.eval.policy import build_policy

from eval_helpers import TINY


def test_observed_absmax_and_scales(tiny, tokens, tmp_path):
    cfg, params = tiny
    ids = tokens(1, 96, seed=9)[0]
    cal = observe_fp8(params, cfg, ids, 96, corpus_sha256="ab" * 32, seq_len=48)
    _, k, v = exact_qkv(params, cfg, jnp.asarray(ids.reshape(2, 48)))
    np.testing.assert_allclose(cal.k_amax, np.abs(np.asarray(k)).max(axis=(1, 2, 4)), rtol=1e-6)
    np.testing.assert_allclose(cal.v_amax, np.abs(np.asarray(v)).max(axis=(1, 2, 4)), rtol=1e-6)
    assert cal.calibration_id.startswith("observed:abababababab:96:")
    path = tmp_path / "scales.npz"
    save_fp8_artifact(cal, path)
    back = load_fp8_artifact(path, cfg.num_layers)
    assert back.calibration_id == cal.calibration_id and np.array_equal(back.k_amax, cal.k_amax)

    for axis in ("tensor", "head"):
        c = from_dict({"cache": {"scheme": {"name": "fp8_e5m2", "scales": "calibrated", "scale_axis": axis}},
                       "calibration": {"fp8_scales": "observe"}})
        pol = build_policy(c.cache, cfg, fp8=cal)
        assert pol.schemes[0].calibration_id == cal.calibration_id
        cache = pol.init(cfg, 1, 16)
        want = cal.k_amax.max(axis=1, keepdims=True) if axis == "tensor" else cal.k_amax
        stored = np.asarray(cache.groups[0].k_scale)                                  # [L, Hkv]
        np.testing.assert_allclose(stored, np.broadcast_to(want / 57344.0, stored.shape), rtol=1e-6)
    with pytest.raises(ValueError, match="k_amax/v_amax or k_scale/v_scale"):
        np.savez(tmp_path / "bad.npz", x=np.ones(2))
        load_fp8_artifact(tmp_path / "bad.npz", cfg.num_layers)


def test_calibrated_fp8_through_the_metrics(tmp_path):
    calib_text = tmp_path / "calib.txt"
    calib_text.write_text("Calibration text that is not the evaluation text. " * 40)
    cfg = from_dict({"model": {"name": "random", "random": TINY}, "data": {"corpus": "builtin",
                                                                            "calibration_corpus": str(calib_text)},
                     "cache": {"scheme": {"name": "fp8_e4m3", "scales": "calibrated"}},
                     "calibration": {"fp8_scales": "observe", "observe_tokens": 256},
                     "tasks": {"kv_error": {"seq_len": 40, "prefill": 16, "probes": 2}}})
    s = Session(artifact_dir=tmp_path)
    r = compute(s, cfg, "kv_error")
    assert 0 < r["k_nmse"] < 1e-2 and 0 < r["out_rel"] < 0.1
    assert len(list(tmp_path.glob("fp8_scales_*.npz"))) == 1
    # the same text for calibration and evaluation is refused
    same = from_dict({**cfg.to_dict(), "data": {"corpus": "builtin", "calibration_corpus": "builtin"}})
    with pytest.raises(ValueError, match="calibration text .* is the evaluation text"):
        compute(Session(), same, "kv_error")
