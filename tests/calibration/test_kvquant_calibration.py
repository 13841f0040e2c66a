"""KVQuant offline calibration (design notes 0x07A-0x07E): Fisher gradients, percentile thresholds, weighted
k-means, sink exclusion, determinism, and the artifact (bit-exact round trip, mismatch errors naming fields)."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.kvquant import KVQuantScheme
from kvquant_jax.cache.schema import IncompatibleSchemaError
from kvquant_jax.calibration import kvquant as KC
from kvquant_jax.calibration.fisher import KVActivations, collect, kv_with_gradients, sample_starts
from kvquant_jax.calibration.kmeans import weighted_kmeans
from kvquant_jax.models.llama import attend, decoder_layer, logits_from_hidden
from kvquant_jax.models.testing import random_params, tiny_config

CFG = tiny_config(head_dim=16, num_heads=4, num_kv_heads=2, hidden_size=32, num_layers=2)
IDS = np.random.default_rng(0).integers(0, CFG.vocab_size, 1200)
CONF = KC.CalibrationConfig(num_samples=4, seq_len=24, batch_size=2, k_bits=2, v_bits=2, kmeans_n_init=2,
                            kmeans_max_iter=50)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=3)


@pytest.fixture(scope="module")
def acts(params):
    return collect(params, CFG, IDS, num_samples=CONF.num_samples, seq_len=CONF.seq_len, seed=CONF.seed,
                   batch_size=CONF.batch_size)


# ------------------------------------------------------------------------------------------------ Fisher
def _post_rope_loss(params, tokens, dk_post):
    """Summed NLL with a perturbation added to the POST-RoPE keys (an independent formulation)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    num_new = jnp.full((b,), t, jnp.int32)
    x = params["embed"][tokens]

    def body(x, inp):
        lp, d = inp
        x, _, _ = decoder_layer(CFG, x, lp, positions, lambda q, k, v: attend(q, k + d, v, num_new, None))
        return x, None

    x, _ = jax.lax.scan(body, x, (params["layers"], dk_post))
    lp = jax.nn.log_softmax(logits_from_hidden(params, CFG, x)[:, :-1], axis=-1)
    return -jnp.sum(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))


def test_fisher_gradients_are_pre_rope_loss_gradients(params, acts):
    """grad_k = R^T (gradient w.r.t. post-RoPE keys), checked against finite differences of the loss."""
    from kvquant_jax.abi.rope import apply_rope

    tokens = jnp.asarray(np.stack([IDS[s:s + CONF.seq_len] for s in acts.starts[:1]]).astype(np.int32))
    k, v, gk, gv, nll = kv_with_gradients(params, CFG, tokens)
    np.testing.assert_allclose(np.asarray(k[:, 0]), acts.k[:, 0], atol=1e-5)    # collect stacks the same values
    zeros = jnp.zeros(k.shape, jnp.float32)
    g_post = jax.grad(_post_rope_loss, argnums=2)(params, tokens, zeros)
    pos = jnp.arange(CONF.seq_len, dtype=jnp.int32)
    want = apply_rope(g_post, pos, CFG.rope_theta, CFG.rope_pairing, inverse=True)
    np.testing.assert_allclose(np.asarray(gk), np.asarray(want), rtol=1e-4, atol=1e-6 * float(jnp.abs(want).max()))
    # central finite difference at the largest-gradient element of layer 1
    flat = int(jnp.argmax(jnp.abs(gk[1])))
    idx = (1,) + np.unravel_index(flat, gk.shape[1:])
    eps = 1e-2
    e = jnp.zeros(k.shape, jnp.float32).at[idx].set(1.0)
    e_post = apply_rope(e, pos, CFG.rope_theta, CFG.rope_pairing)             # a pre-RoPE unit perturbation
    fd = (_post_rope_loss(params, tokens, eps * e_post) - _post_rope_loss(params, tokens, -eps * e_post)) / (2 * eps)
    assert abs(float(fd) - float(gk[idx])) <= 0.03 * abs(float(gk[idx]))
    assert float(jnp.sum(nll)) == pytest.approx(float(_post_rope_loss(params, tokens, zeros)), rel=1e-5)
    assert (np.asarray(gv) != 0).any() and np.isfinite(np.asarray(gv)).all()


# ------------------------------------------------------------------------------------------------ k-means
def _optimal_1d(x, w, k):
    """Exact weighted 1-D k-means by dynamic programming over sorted points (float64)."""
    o = np.argsort(x)
    x, w = x[o].astype(np.float64), w[o].astype(np.float64)
    n = x.size
    cw, cx, cxx = (np.concatenate([[0.0], np.cumsum(a)]) for a in (w, w * x, w * x * x))

    def cost(i, j):     # points [i, j)
        sw = cw[j] - cw[i]
        return 0.0 if sw == 0 else (cxx[j] - cxx[i]) - (cx[j] - cx[i]) ** 2 / sw

    dp = np.full((k + 1, n + 1), np.inf)
    dp[0, 0] = 0.0
    for m in range(1, k + 1):
        for j in range(1, n + 1):
            dp[m, j] = min((dp[m - 1, i] + cost(i, j) for i in range(m - 1, j)), default=np.inf)
    return dp[k, n]


def test_weighted_kmeans_near_optimal_and_weight_sensitive():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(-0.6, 0.1, 120), rng.normal(0.4, 0.25, 120)]).clip(-1, 1)
    w = rng.exponential(1.0, x.size)
    w[x > 0] *= 20                                    # the loss cares about the positive mode
    res = weighted_kmeans(x, w, bits=2, seed=0, nbins=1 << 12)
    c = res.centers
    a = np.argmin(np.abs(x[:, None] - c[None, :]), axis=1)
    sse = float(np.sum(w * (x - c[a]) ** 2))
    assert sse <= 1.02 * _optimal_1d(x, w, 4)
    assert (np.diff(c) > 0).all() and c.dtype == np.float32
    u = weighted_kmeans(x, None, bits=2, seed=0, nbins=1 << 12).centers

    def sse_of(centers, weights):
        return float(np.sum(weights * np.min((x[:, None] - centers[None, :]) ** 2, axis=1)))

    assert not np.array_equal(c, u)
    assert sse_of(c, w) < sse_of(u, w) and sse_of(u, np.ones_like(w)) < sse_of(c, np.ones_like(w))
    again = weighted_kmeans(x, w, bits=2, seed=0, nbins=1 << 12)
    np.testing.assert_array_equal(again.centers, c)    # fixed seed: bit-identical


@pytest.mark.parametrize("kw, match", [
    (dict(x=[], bits=2), "no points"),
    (dict(x=[0.0, np.nan], bits=2), "non-finite points"),
    (dict(x=[0.0, 1.0], w=[1.0], bits=2), "2 points but 1 weights"),
    (dict(x=[0.0, 1.0], w=[0.0, 0.0], bits=2), "all weights are zero"),
    (dict(x=[0.0, 1.0], w=[1.0, -1.0], bits=2), "weights must be finite and >= 0"),
    (dict(x=[0.0, 1.0], bits=9), "bits must be an int"),
])
def test_weighted_kmeans_rejects_bad_input(kw, match):
    kw = dict(kw)
    x = kw.pop("x")
    with pytest.raises(ValueError, match=match):
        weighted_kmeans(np.asarray(x, np.float32), **kw)


# ------------------------------------------------------------------------------------------------ fit
def _synthetic(seed=0, n=8, t=40, planted=None):
    rng = np.random.default_rng(seed)
    shape = (CFG.num_layers, n, t, CFG.num_kv_heads, CFG.head_dim)
    k = rng.normal(0, 1, shape).astype(np.float32) * np.linspace(0.5, 3, CFG.head_dim, dtype=np.float32)
    k += np.linspace(-2, 2, CFG.head_dim, dtype=np.float32)                 # per-channel offsets
    v = rng.normal(0, 1, shape).astype(np.float32)
    if planted is not None:
        k[:, :, 0] += planted                                              # position 0 only
        v[:, :, 0] += planted
    g = rng.normal(0, 1, shape).astype(np.float32)
    return KVActivations(k=k, v=v, grad_k=g, grad_v=g * 0.5, starts=np.arange(n) * t, nll=0.0)


def test_percentile_thresholds_and_normalization():
    acts = _synthetic()
    conf = dataclasses.replace(CONF, outlier_fraction=0.02, sink=0, codebook="uniform")
    a = KC.fit(acts, CFG, conf)
    k = acts.k[1].reshape(-1, CFG.num_kv_heads, CFG.head_dim).astype(np.float64)
    np.testing.assert_allclose(a["k_lo"][1], np.quantile(k, 0.01, axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a["k_hi"][1], np.quantile(k, 0.99, axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a["k_zero"], (a["k_lo"] + a["k_hi"]) / 2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a["k_scale"], (a["k_hi"] - a["k_lo"]) / 2, rtol=1e-6)
    assert 0.015 < float(a["k_outlier_rate"][1]) <= 0.03                  # about the 2% asked for
    np.testing.assert_array_equal(a["k_codebook"][0], np.linspace(-1, 1, 4, dtype=np.float32))
    full = KC.fit(acts, CFG, dataclasses.replace(conf, outlier_fraction=0.0))
    np.testing.assert_allclose(full["k_hi"][0], acts.k[0].max(axis=(0, 1)), rtol=1e-6)   # 0%: min / max
    assert float(full["k_outlier_rate"].max()) < 1e-3                       # float32 rounding of the extremes only


def test_sink_token_is_excluded_from_every_statistic():
    clean, planted = _synthetic(), _synthetic(planted=40.0)
    conf = dataclasses.replace(CONF, sink=1)
    a, b = KC.fit(clean, CFG, conf), KC.fit(planted, CFG, conf)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)      # position 0 never seen
    c = KC.fit(planted, CFG, dataclasses.replace(conf, sink=0, outlier_fraction=0.0))
    d = KC.fit(clean, CFG, dataclasses.replace(conf, sink=0, outlier_fraction=0.0))
    assert (c["k_hi"] > d["k_hi"] + 30).all()                               # without a sink it stretches K


def test_fisher_weighting_changes_codebooks_and_lowers_weighted_error():
    acts = _synthetic()
    fisher = KC.fit(acts, CFG, CONF)
    plain = KC.fit(acts, CFG, dataclasses.replace(CONF, weighting="uniform"))
    assert not np.array_equal(fisher["k_codebook"], plain["k_codebook"])
    assert (fisher["sse_k"] < fisher["sse_k_uniform"]).all() and (fisher["sse_v"] < fisher["sse_v_uniform"]).all()
    assert fisher["fisher_k"].shape == (CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    np.testing.assert_allclose(fisher["fisher_k"][0], np.mean(np.square(acts.grad_k[0][:, 1:].astype(np.float64)),
                                                              axis=(0, 1)), rtol=1e-5)


def test_calibration_is_deterministic_for_a_fixed_seed(params, acts):
    again = collect(params, CFG, IDS, num_samples=CONF.num_samples, seq_len=CONF.seq_len, seed=CONF.seed,
                    batch_size=CONF.batch_size)
    for name in ("k", "v", "grad_k", "grad_v"):
        np.testing.assert_array_equal(getattr(again, name), getattr(acts, name))
    a = KC.build(KC.fit(acts, CFG, CONF), CFG, CONF, acts=acts)
    b = KC.build(KC.fit(again, CFG, CONF), CFG, CONF, acts=again)
    assert a.calibration_id == b.calibration_id
    for name in a.arrays:
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])
    other = sample_starts(IDS.size, CONF.num_samples, CONF.seq_len, seed=1)
    assert not np.array_equal(other, acts.starts)                          # the seed picks the windows


# ------------------------------------------------------------------------------------------------ artifact
@pytest.fixture(scope="module")
def calibration(acts):
    return KC.build(KC.fit(acts, CFG, CONF), CFG, CONF, tokenizer_hash="tok123",
                    corpus={"name": "synthetic", "sha256": "ab" * 32, "split": "validation"}, acts=acts)


def test_artifact_round_trip_is_bit_exact(calibration, tmp_path):
    path = KC.save(calibration, tmp_path / "art")
    back = KC.load(path, expect_model=CFG, expect_scheme=calibration.scheme(), expect_tokenizer_hash="tok123")
    assert back.schema == calibration.schema and back.calibration_id == calibration.calibration_id
    assert set(back.arrays) == set(calibration.arrays)
    for name, arr in calibration.arrays.items():
        assert back.arrays[name].dtype == arr.dtype
        np.testing.assert_array_equal(back.arrays[name].view(np.uint32), arr.view(np.uint32))
    man = json.loads((path / "manifest.json").read_text())
    for key in ("schema", "model", "tokenizer_hash", "corpus", "num_samples", "seq_len", "seed", "rope", "date",
                "sample_starts", "calibration_id", "arrays"):
        assert key in man, key
    assert man["model"]["sha256"] == CFG.sha256 and man["corpus"]["sha256"] == "ab" * 32
    assert man["num_samples"] == 4 and man["rope"] == {"theta": CFG.rope_theta, "pairing": "half_split",
                                                       "key_stage": "pre_rope"}
    with pytest.raises(FileExistsError):
        KC.save(calibration, path)


def test_artifact_mismatches_raise_naming_fields(calibration, tmp_path):
    path = KC.save(calibration, tmp_path / "art")
    other_model = dataclasses.replace(CFG, num_layers=3, rope_theta=5e5)
    with pytest.raises(IncompatibleSchemaError) as e:
        KC.load(path, expect_model=other_model)
    assert "num_layers: 2 != 3" in str(e.value) and "rope_theta: 10000.0 != 500000.0" in str(e.value)
    with pytest.raises(IncompatibleSchemaError, match="tokenizer_hash"):
        KC.load(path, expect_tokenizer_hash="other")
    wrong = dataclasses.replace(calibration.scheme(), k_bits=3, sink=0)
    with pytest.raises(IncompatibleSchemaError) as e:
        KC.load(path, expect_scheme=wrong)
    assert "key.payload: 'nuq2' != 'nuq3'" in str(e.value) and "sink: 1 != 0" in str(e.value)
    cache = init_cache(wrong, num_layers=CFG.num_layers, batch=1, capacity=8, num_kv_heads=CFG.num_kv_heads,
                       head_dim=CFG.head_dim)
    with pytest.raises(IncompatibleSchemaError, match="key.payload"):
        calibration.install(cache)
    # a tampered array is refused
    man = json.loads((path / "manifest.json").read_text())
    man["arrays"]["k_scale"]["sha256"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="corrupt artifact"):
        KC.load(path)
    with pytest.raises(ValueError, match="no manifest.json"):
        KC.load(tmp_path)


def test_metadata_edit_of_schema_and_rope_together_is_refused(calibration, tmp_path):
    """Issue Q.8: the arrays' sha256 alone let a consistent edit of the schema and RoPE fields load and install."""
    from kvquant_jax.integrity import CorruptArtifactError

    path = KC.save(calibration, tmp_path / "art")
    man = json.loads((path / "manifest.json").read_text())
    assert man["manifest_sha256"] and man["schema"]["rope_theta"] == CFG.rope_theta
    theta = CFG.rope_theta * 50
    man["schema"]["rope_theta"] = theta
    man["rope"]["theta"] = theta
    man["scheme_config"]["rope_theta"] = theta
    man["model"]["rope_theta"] = theta
    (path / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True))
    with pytest.raises(CorruptArtifactError, match="corrupt artifact.*metadata field was edited"):
        KC.load(path, expect_model=dataclasses.replace(CFG, rope_theta=theta))
    # a byte flip in the manifest (invalid UTF-8) is a clear error too
    path2 = KC.save(calibration, tmp_path / "art2")
    raw = bytearray((path2 / "manifest.json").read_bytes())
    raw[len(raw) // 2] ^= 0x80
    (path2 / "manifest.json").write_bytes(bytes(raw))
    with pytest.raises(CorruptArtifactError, match="corrupt artifact"):
        KC.load(path2)


def test_installed_calibration_serves_the_model(params, calibration):
    from kvquant_jax.models.llama import forward

    s = calibration.scheme(kernel_family="pallas_kvquant_v1")
    assert isinstance(s, KVQuantScheme) and s.k_bits == 2 and s.sink == 1 and s.calibration_id.startswith("kvquant-")
    with pytest.raises(ValueError, match="fixed by the calibration"):
        calibration.scheme(k_bits=4)
    cache = calibration.install(init_cache(s, num_layers=CFG.num_layers, batch=1, capacity=8,
                                           num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim))
    np.testing.assert_array_equal(np.asarray(cache.groups[0].v_codebook), calibration.arrays["v_codebook"])
    logits, cache, ok = forward(params, CFG, jnp.asarray(IDS[None, :6].astype(np.int32)), cache)
    assert bool(ok) and np.isfinite(np.asarray(logits)).all() and int(cache.lengths[0]) == 6


@pytest.mark.parametrize("kw, match", [
    (dict(codebook="kmeans"), "codebook must be one of"),
    (dict(weighting="hessian"), "weighting must be one of"),
    (dict(key_stage="rotated"), "key_stage"),
    (dict(outlier_fraction=0.7), "outlier_fraction"),
    (dict(num_samples=0), "num_samples must be a positive int"),
    (dict(corpus="../shared/data/wikitext2/wiki.test.raw"), "TEST split"),
    (dict(seq_len=2, sink=1), "must exceed sink"),
])
def test_calibration_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        KC.CalibrationConfig(**kw)


def test_calibration_config_from_file_and_bad_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("k_bits: 2\nv_bits: 3\nsink: 0\n")
    c = KC.CalibrationConfig.from_file(f)
    assert (c.k_bits, c.v_bits, c.sink) == (2, 3, 0)
    f.write_text("k_bits: 2\nbogus: 1\n")
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        KC.CalibrationConfig.from_file(f)
    with pytest.raises(ValueError, match="windows of"):
        sample_starts(100, 8, 64, 0)
    with pytest.raises(ValueError, match="do not match the model"):
        KC.fit(_synthetic(), dataclasses.replace(CFG, num_kv_heads=1, num_heads=4), CONF)


@pytest.mark.slow
@pytest.mark.model
def test_cli_calibrate_real_model(tmp_path, monkeypatch, smollm):
    """`kvq calibrate` on SmolLM2-135M (WikiText-2 validation, tiny budget): artifact loads into the model."""
    from kvquant_jax.cli import main
    from kvquant_jax.data import data_dirs

    if not any((d / "wikitext2" / "wiki.valid.tokens").is_file() for d in data_dirs()):
        pytest.skip("WikiText-2 validation split not found (set KVQ_DATA_DIR)")
    cfg_file = tmp_path / "cal.yaml"
    cfg_file.write_text("num_samples: 2\nseq_len: 64\nbatch_size: 2\nk_bits: 3\nv_bits: 3\nkmeans_n_init: 1\n")
    assert main(["calibrate", str(cfg_file), "--out", str(tmp_path / "art")]) == 0
    cal = KC.load(tmp_path / "art", expect_model=smollm.cfg, expect_tokenizer_hash=smollm.tokenizer.hash)
    assert cal.manifest["corpus"]["split"] == "validation" and "wiki.valid" in cal.manifest["corpus"]["source"]
    a = cal.arrays
    assert a["k_scale"].shape == (30, 3, 64) and a["k_codebook"].shape == (30, 8)
    assert (a["fisher_k"] > 0).any() and 0 < float(a["k_outlier_rate"].mean()) < 0.05
