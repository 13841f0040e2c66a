"""The KVQuant harness contract: ``cache.scheme: {name: kvquant}`` is built from the artifact named by
``calibration.kvquant`` and every fresh cache gets its calibrated state installed."""
import numpy as np
import pytest

from kvquant_jax.config import ConfigError, from_dict
from kvquant_jax.eval.metrics import Session, compute

from eval_helpers import TINY


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from kvquant_jax.calibration.kvquant import CalibrationConfig, calibrate_loaded, save
    from kvquant_jax.eval.context import ByteTokenizer, load_eval_model

    m = load_eval_model(from_dict({"model": {"name": "random", "random": TINY}}).model)
    cfg, params = m.cfg, m.params
    ids = np.random.default_rng(1).integers(3, 300, size=400).astype(np.int32)
    cc = CalibrationConfig(num_samples=2, seq_len=32, batch_size=2, k_bits=2, v_bits=2, sink=1, kmeans_n_init=1,
                           kmeans_max_iter=10)
    cal = calibrate_loaded(params, cfg, ids, cc, tokenizer_hash=ByteTokenizer().hash)
    return save(cal, tmp_path_factory.mktemp("kvq") / "art"), cal


def test_kvquant_from_artifact(artifact):
    path, cal = artifact
    cfg = from_dict({"model": {"name": "random", "random": TINY}, "data": {"corpus": "builtin"},
                     "cache": {"scheme": {"name": "kvquant", "k_sparse_capacity": 1}},
                     "calibration": {"kvquant": str(path)},
                     "tasks": {"kv_error": {"seq_len": 40, "prefill": 16, "probes": 2}}})
    s = Session()
    pol = s.policy(cfg)
    assert pol.schemes[0].family == "kvquant" and pol.schemes[0].k_sparse_capacity == 1
    assert pol.schemes[0].calibration_id == cal.calibration_id
    cache = pol.init(s.model(cfg).cfg, 1, 8)
    np.testing.assert_array_equal(np.asarray(cache.groups[0].k_scale), cal.arrays["k_scale"])   # installed
    r = compute(s, cfg, "kv_error")
    assert 0 < r["k_nmse"] < 1 and 0 < r["out_rel"] < 1
    b = compute(s, cfg, "bytes")
    assert b["bits_per_element"] > 2 and b["measured_bytes"] > 0


def test_kvquant_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cache.scheme: kvquant is built from a calibration artifact"):
        from_dict({"cache": {"scheme": "kvquant"}})
    with pytest.raises(ConfigError, match=r"\['k_bits'\] are fixed by the calibration artifact"):
        from_dict({"cache": {"scheme": {"name": "kvquant", "k_bits": 2}}, "calibration": {"kvquant": "x"}})
    cfg = from_dict({"model": {"name": "random", "random": TINY}, "cache": {"scheme": "kvquant"},
                     "calibration": {"kvquant": str(tmp_path / "none")}})
    with pytest.raises(ValueError, match="calibration.kvquant: .*manifest.json"):
        Session().policy(cfg)
