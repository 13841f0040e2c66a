"""W8A8 live activations in the model: the quantized linear vs a float64 oracle, bad inputs, the policy, phases,
Orbax round trip (tiny random models; one SmolLM2 check)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.models import llama
from kvquant_jax.models import w8a8 as W
from kvquant_jax.models.testing import random_params, tiny_config

FWD = jax.jit(llama.forward_nocache, static_argnames=("cfg", "linear"))


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer tiny random model, its params and the default-policy quantized params (built once)."""
    cfg = tiny_config(num_layers=2)
    p = random_params(cfg)
    return cfg, p, W.quantize_params(p, W.W8A8Policy())


def _oracle_w8a8(x, w):
    """float64 NumPy oracle of per-token x per-output-channel symmetric INT8 (round half to even)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)                       # [K, N]
    sx = np.abs(x).max(axis=1) / 127.0
    sw = np.abs(w).max(axis=0) / 127.0
    qx = np.clip(np.rint(x / sx[:, None]), -127, 127)
    qw = np.clip(np.rint(w / sw[None, :]), -127, 127)
    return (qx @ qw) * sx[:, None] * sw[None, :], qx, qw, sx, sw


@pytest.mark.parametrize("m,k,n", [(5, 48, 24), (33, 96, 17)])
def test_w8a8_dense_matches_float64_oracle(m, k, n):
    rng = np.random.default_rng(m)
    x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal(k))).astype(np.float32)   # outlier channels
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    qw = W.quantize_weight(jnp.asarray(w))
    ref, _, qw_np, _, sw = _oracle_w8a8(x, w)
    # weights: codes identical to the float64 oracle except exact .5 ties (none expected on random data)
    assert qw.codes.dtype == jnp.int8 and qw.codes.shape == (n, k) and qw.scale.shape == (n,)
    np.testing.assert_array_equal(np.asarray(qw.codes, np.float64), qw_np.T)
    np.testing.assert_allclose(np.asarray(qw.scale, np.float64), sw, rtol=1e-7)
    y = np.asarray(W.w8a8_dense(jnp.asarray(x), qw), np.float64)
    # int32 accumulation is exact; the only differences are float32 scale rounding (<~1e-6 relative)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * scale)
    # vs the float product: the quantization error itself, bounded (loose, sanity)
    assert np.abs(y - x.astype(np.float64) @ w).max() < 0.05 * scale
    # the Pallas kernel (interpreter on CPU) computes the same int32 sums
    yp = np.asarray(W.w8a8_dense(jnp.asarray(x), qw, impl="pallas", interpret=True), np.float64)
    np.testing.assert_allclose(yp, y, rtol=0, atol=1e-6 * scale)


def test_w8a16_matches_dequantized_weights():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 1, 40)).astype(np.float32)
    w = rng.standard_normal((40, 12)).astype(np.float32)
    qw = W.quantize_weight(jnp.asarray(w))
    wh = np.asarray(qw.codes, np.float64).T * np.asarray(qw.scale, np.float64)[None, :]
    y = np.asarray(W.w8a16_dense(jnp.asarray(x), qw), np.float64)
    np.testing.assert_allclose(y, x.astype(np.float64) @ wh, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(W.dequantize_weight(qw), np.float64), wh, rtol=1e-7)


def test_bad_activations_raise_naming_the_problem():
    w = W.quantize_weight(jnp.ones((8, 4), jnp.float32))
    x = np.ones((3, 8), np.float32)
    x[1, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        W.w8a8_dense(jnp.asarray(x), w)
    x = np.ones((3, 8), np.float32)
    x[2] = 1e-40                                                 # subnormal row: scale underflows (FTZ-unsafe)
    with pytest.raises(ValueError, match="underflow|subnormal"):
        W.w8a8_dense(jnp.asarray(x), w)
    # under jit the rejected row is poisoned with NaN (never silently zero), the others are fine
    y, status = jax.jit(W.w8a8_dense_with_status)(jnp.asarray(x), w)
    assert np.isnan(np.asarray(y[2])).all() and np.isfinite(np.asarray(y[:2])).all()
    assert list(np.asarray(status) != 0) == [False, False, True]
    with pytest.raises(ValueError, match="non-finite"):
        W.quantize_weight(jnp.full((4, 4), jnp.inf, jnp.float32))
    with pytest.raises(ValueError, match="expected x"):
        W.w8a8_dense(jnp.ones((2, 5), jnp.float32), w)


def test_policy_defaults_skip_embeddings_and_head(tiny):
    pol = W.W8A8Policy()
    assert set(pol.linears) == set(W.LINEARS) and "lm_head" not in pol.linears
    for tie in (True, False):
        cfg, p, qp = tiny
        if not tie:
            cfg = tiny_config(num_layers=2, tie_embeddings=False)
            p = random_params(cfg)
            qp = W.quantize_params(p, pol)
        assert "lm_head_q" not in qp
        np.testing.assert_array_equal(np.asarray(qp["embed"]), np.asarray(p["embed"]))
        if not tie:
            np.testing.assert_array_equal(np.asarray(qp["lm_head"]), np.asarray(p["lm_head"]))
        for n, key in W.PARAM_NAME.items():
            assert isinstance(qp["layers"][key], W.QuantLinear)
            assert qp["layers"][key].codes.shape == (cfg.num_layers,) + p["layers"][key].shape[:0:-1]
        for key in ("attn_norm", "ffn_norm"):
            assert qp["layers"][key] is p["layers"][key]
    with pytest.raises(ValueError, match="embeddings are never quantized"):
        W.W8A8Policy(linears=("q", "embed"))
    with pytest.raises(ValueError, match="prefill"):
        W.W8A8Policy(prefill="int4")
    # a named head is quantized (as a separate leaf; the embedding lookup stays float)
    cfg, p, _ = tiny
    qp = W.quantize_params(p, W.W8A8Policy(linears=("q", "lm_head")))
    assert isinstance(qp["lm_head_q"], W.QuantLinear) and qp["lm_head_q"].codes.shape == (cfg.vocab_size,
                                                                                          cfg.hidden_size)
    assert not isinstance(qp["layers"]["wk"], W.QuantLinear)
    tok = jnp.arange(6, dtype=jnp.int32)[None]
    assert np.isfinite(np.asarray(FWD(qp, cfg, tok, linear=W.W8A8Policy(linears=("q", "lm_head"))))).all()


def test_prefill_and_decode_phases_choose_documented_paths(monkeypatch, tiny):
    pol = W.W8A8Policy()
    assert pol.mode(7) == "w8a8" and pol.mode(1) == "w8a16"
    calls = []
    real8, real16 = W.w8a8_dense, W.w8a16_dense
    monkeypatch.setattr(W, "w8a8_dense", lambda *a, **k: calls.append("w8a8") or real8(*a, **k))
    monkeypatch.setattr(W, "w8a16_dense", lambda *a, **k: calls.append("w8a16") or real16(*a, **k))
    cfg, _, qp = tiny
    from kvquant_jax.cache.full import FullPrecisionScheme as FullScheme
    from kvquant_jax.cache.interface import init_cache

    cache = init_cache(FullScheme(), num_layers=cfg.num_layers, batch=1, capacity=16, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim)
    real_norm = W.norm_w8a8_dense
    monkeypatch.setattr(W, "norm_w8a8_dense", lambda x, nw, eps, ws, **k: calls.append(f"norm+w8a8 x{len(ws)}")
                        or real_norm(x, nw, eps, ws, **k))
    # unfused: RMSNorm in float, one activation quantization per projection
    unfused = dataclasses.replace(pol, fuse_norm=False)
    step = jax.jit(lambda p, t, c: llama.forward(p, cfg, t, c, linear=unfused))   # fresh jit: the hook is traced
    cache0 = cache
    _, _, ok = step(qp, jnp.arange(5, dtype=jnp.int32)[None], cache)
    assert bool(ok) and calls == ["w8a8"] * 7
    # default (fused): q/k/v share one fused RMSNorm -> INT8 call, gate/up another; o and down quantize their own
    calls.clear()
    step = jax.jit(lambda p, t, c: llama.forward(p, cfg, t, c, linear=pol))
    _, cache, ok = step(qp, jnp.arange(5, dtype=jnp.int32)[None], cache0)
    assert bool(ok) and calls == ["norm+w8a8 x3", "w8a8", "norm+w8a8 x2", "w8a8"]
    calls.clear()
    _, cache, ok = step(qp, jnp.array([[5]], jnp.int32), cache)
    assert bool(ok) and calls == ["w8a16"] * 7
    # a non-finite activation in a W8A8 prefill under jit: its rows are poisoned (NaN, not zero codes), so K/V are
    # non-finite and the cache rejects the step (ok False, lengths unchanged)
    bad = {**qp, "embed": qp["embed"].at[3].set(jnp.nan)}
    _, cache2, ok = step(bad, jnp.array([[3, 4]], jnp.int32), cache)
    assert not bool(ok) and int(cache2.lengths[0]) == int(cache.lengths[0]) == 6


def test_model_w8a8_close_to_float(tiny):
    cfg, p, qp = tiny
    pol = W.W8A8Policy()
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    ref = np.asarray(FWD(p, cfg, tok))
    y = np.asarray(FWD(qp, cfg, tok, linear=pol))
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert 0 < rel < 0.1
    # "float" everywhere == W8A16 (dequantized weights) : the weight-only error alone is smaller
    y16 = np.asarray(FWD(qp, cfg, tok, linear=dataclasses.replace(pol, prefill="w8a16")))
    assert np.abs(y16 - ref).max() / np.abs(ref).max() < rel
    with pytest.raises(ValueError, match="quantize_params"):
        FWD(p, cfg, tok, linear=pol)
    # no policy: the exact float path (llama.dense) -- bit-identical to calling with linear=None explicitly
    np.testing.assert_array_equal(np.asarray(FWD(p, cfg, tok, linear=llama.dense)), ref)


def test_orbax_round_trip_bit_exact(tmp_path):
    cfg = tiny_config(tie_embeddings=False, num_layers=2)
    p = random_params(cfg)
    pol = W.W8A8Policy(linears=("q", "k", "v", "o", "gate", "up", "down", "lm_head"), decode="w8a8")
    qp = W.quantize_params(p, pol)
    W.save(qp, pol, tmp_path / "ck", model_sha256="abc")
    got, pol2 = W.restore(tmp_path / "ck")
    assert pol2 == pol
    a, ta = jax.tree_util.tree_flatten(qp)
    b, tb = jax.tree_util.tree_flatten(got)
    assert ta == tb
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tok = jnp.arange(7, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(FWD(got, cfg, tok, linear=pol2)),
                                  np.asarray(FWD(qp, cfg, tok, linear=pol)))
    with pytest.raises(FileExistsError):
        W.save(qp, pol, tmp_path / "ck")
    with pytest.raises(ValueError, match="manifest"):
        W.restore(tmp_path)


def _oracle_norm_w8a8(x, nw, eps, ws, qdtype):
    """float64: RMSNorm, per-token symmetric INT8 of the normalized rows with the scale stored in ``qdtype`` (the
    codes use the stored scale), per-channel INT8 weights, exact integer sums."""
    x = np.asarray(x, np.float64)
    h = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * np.asarray(nw, np.float64)
    sx = (np.abs(h).max(axis=1) / 127.0).astype(qdtype).astype(np.float64)
    qx = np.clip(np.rint(h / sx[:, None]), -127, 127)
    out = []
    for w in ws:
        w = np.asarray(w, np.float64)
        sw = np.abs(w).max(axis=0) / 127.0
        qw = np.clip(np.rint(w / sw[None, :]), -127, 127)
        out.append((qx @ qw) * sx[:, None] * sw[None, :])
    return out, h


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("qdtype", ["fp32", "fp16"])
def test_norm_w8a8_dense_matches_float64_oracle(impl, qdtype):
    """The fused group path (one RMSNorm -> INT8 producer call, three GEMMs reading its codes) vs float64."""
    rng = np.random.default_rng(11)
    m, k, ns = 29, 96, (24, 8, 8)
    x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal(k)) * rng.uniform(0.1, 30, (m, 1))).astype(
        np.float32)
    nw = rng.uniform(0.2, 2.0, k).astype(np.float32)
    ws = [(rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32) for n in ns]
    qws = [W.quantize_weight(jnp.asarray(w)) for w in ws]
    refs, h = _oracle_norm_w8a8(x, nw, 1e-5, ws, np.float32 if qdtype == "fp32" else np.float16)
    ys = W.norm_w8a8_dense(jnp.asarray(x), jnp.asarray(nw), 1e-5, qws, impl=impl, interpret=True,
                           act_qparam_dtype=qdtype)
    for y, ref, w in zip(ys, refs, ws):
        y = np.asarray(y, np.float64)
        assert y.shape == ref.shape and np.isfinite(y).all()
        scale = np.abs(ref).max()
        # same integer sums up to float32 rounding of the scales
        np.testing.assert_allclose(y, ref, rtol=0, atol=3e-6 * scale)
        assert np.abs(y - h @ w).max() < 0.05 * scale          # the quantization error itself, bounded
    # and the unfused path (float RMSNorm, quantize per projection) agrees to float32 rounding
    from kvquant_jax.models.llama import rms_norm

    hu = rms_norm(jnp.asarray(x), jnp.asarray(nw), 1e-5)
    for y, qw in zip(ys, qws):
        yu = np.asarray(W.w8a8_dense(hu, qw, act_qparam_dtype=qdtype), np.float64)
        np.testing.assert_allclose(np.asarray(y, np.float64), yu, rtol=0, atol=3e-6 * np.abs(yu).max())


def test_norm_w8a8_bad_rows_raise_or_poison():
    qw = [W.quantize_weight(jnp.ones((8, 4), jnp.float32)), W.quantize_weight(jnp.ones((8, 2), jnp.float32))]
    nw = jnp.ones((8,), jnp.float32)
    x = np.ones((3, 8), np.float32)
    x[1, 2] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        W.norm_w8a8_dense(jnp.asarray(x), nw, 1e-6, qw)
    ys, status = jax.jit(W.norm_w8a8_dense_with_status, static_argnums=2)(jnp.asarray(x), nw, 1e-6, qw)
    for y in ys:                                   # the rejected row is NaN in every output, the others finite
        assert np.isnan(np.asarray(y[1])).all() and np.isfinite(np.asarray(y)[[0, 2]]).all()
    assert list(np.asarray(status) != 0) == [False, True, False]
    # a normalized row whose fp16 scale underflows (a tiny RMSNorm weight): FTZ-unsafe, named
    with pytest.raises(ValueError, match="subnormal"):
        W.norm_w8a8_dense(jnp.ones((2, 8), jnp.float32), jnp.full((8,), 1e-7, jnp.float32), 1e-6, qw,
                          act_qparam_dtype="fp16")
    with pytest.raises(ValueError, match="expected x"):
        W.norm_w8a8_dense(jnp.ones((2, 5), jnp.float32), jnp.ones((5,), jnp.float32), 1e-6, qw)


def test_fused_and_unfused_model_agree(tiny):
    """Default policy (fused producer) vs fuse_norm=False: the same model up to float32 rounding of the amax (a code
    may flip at a tie), far inside the W8A8 error; per-layer float layers still reproduce float exactly."""
    cfg, p, qp = tiny
    pol = W.W8A8Policy()
    tok = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    ref = np.asarray(FWD(p, cfg, tok))
    yf = np.asarray(FWD(qp, cfg, tok, linear=pol))
    yu = np.asarray(FWD(qp, cfg, tok, linear=dataclasses.replace(pol, fuse_norm=False)))
    err_q = np.abs(yu - ref).max()
    assert np.abs(yf - yu).max() < 0.05 * err_q
    pol_f = W.W8A8Policy(float_layers=(0, 1))
    qpf = W.quantize_params(p, pol_f)
    np.testing.assert_allclose(np.asarray(FWD(qpf, cfg, tok, linear=pol_f)), ref, rtol=0, atol=1e-6 * np.abs(ref).max())
