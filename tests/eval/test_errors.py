"""K/V reconstruction and attention errors against a float64 NumPy oracle on the exact K/V of the model."""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.eval.errors import exact_qkv, kv_errors, probe_positions


def _int8_oracle(x):
    """Per-(token, head) symmetric INT8 with an fp16 scale, float64 (x: [..., D])."""
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (amax / 127.0).astype(np.float16).astype(np.float64)
    scale = np.where(scale == 0, 1.0, scale)
    return np.clip(np.rint(x / scale), -127, 127) * scale


def _softmax(s):
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def test_exact_qkv_matches_the_cache_contents(tiny, tokens):
    from kvquant_jax.cache.interface import init_cache, layer_state
    from kvquant_jax.models.llama import forward

    cfg, params = tiny
    toks = tokens(1, 24)
    q, k, v = exact_qkv(params, cfg, jnp.asarray(toks))
    assert q.shape == (cfg.num_layers, 1, 24, cfg.num_heads, cfg.head_dim)
    fp = make_scheme("fp32")
    cache = init_cache(fp, num_layers=cfg.num_layers, batch=1, capacity=24, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim)
    _, cache, _ = forward(params, cfg, jnp.asarray(toks), cache)
    for layer in range(cfg.num_layers):
        scheme, st = layer_state(cache, layer)
        kc, vc, _ = scheme.materialize_layer(st, cache.lengths)
        np.testing.assert_allclose(np.swapaxes(np.asarray(k[layer, 0]), 0, 1), np.asarray(kc[0]), atol=1e-5)
        np.testing.assert_allclose(np.swapaxes(np.asarray(v[layer, 0]), 0, 1), np.asarray(vc[0]), atol=1e-5)


def test_full_precision_has_zero_error(tiny, tokens):
    cfg, params = tiny
    r = kv_errors(params, cfg, tokens(1, 40)[0], make_scheme("fp32"), prefill=16, probes=3, position_bins=4)
    assert r["k_nmse"] == 0 and r["v_nmse"] == 0 and r["logit_rel_rms"] == 0
    assert r["out_rel"] < 1e-6 and r["attn_tv"] < 1e-6
    assert len(r["k_nmse_by_layer"]) == cfg.num_layers and len(r["k_nmse_by_pos"]) == 4


def test_int8_errors_match_numpy_oracle(tiny, tokens):
    cfg, params = tiny
    toks = tokens(1, 40, seed=5)[0]
    prefill, n_probes = 16, 3
    r = kv_errors(params, cfg, toks, make_scheme("int8"), prefill=prefill, probes=n_probes, position_bins=40)
    q, k, v = (np.asarray(a[:, 0], np.float64) for a in exact_qkv(params, cfg, jnp.asarray(toks[None])))
    probes = probe_positions(40, prefill, n_probes)
    assert probes.tolist() == r["probes"] == [16, 28, 39]
    t_max = probes[-1]
    d = cfg.head_dim
    g = cfg.num_heads // cfg.num_kv_heads
    k_nmse, out_rel = [], []
    for layer in range(cfg.num_layers):
        kx, vx = k[layer, :t_max], v[layer, :t_max]                     # [t, Hkv, D]
        kq, vq = _int8_oracle(kx), _int8_oracle(vx)
        k_nmse.append(((kq - kx) ** 2).mean() / (kx ** 2).mean())
        rel = []
        for t in probes:
            for h in range(cfg.num_heads):
                kv_h = h // g
                qt = q[layer, t, h]
                def out(kh, vh):
                    s = np.concatenate([kh[:t, kv_h] @ qt, [k[layer, t, kv_h] @ qt]]) / np.sqrt(d)
                    return _softmax(s) @ np.concatenate([vh[:t, kv_h], v[layer, t, kv_h][None]])
                kq_t, vq_t = _int8_oracle(k[layer, :t]), _int8_oracle(v[layer, :t])
                o, oq = out(k[layer], v[layer]), out(kq_t, vq_t)
                rel.append(np.linalg.norm(oq - o) / np.linalg.norm(o))
        out_rel.append(np.mean(rel))
    np.testing.assert_allclose(r["k_nmse_by_layer"], k_nmse, rtol=2e-3)
    np.testing.assert_allclose(r["k_nmse"], np.mean(k_nmse), rtol=2e-3)
    np.testing.assert_allclose(r["out_rel_by_layer"], out_rel, rtol=2e-2)
    # the position breakdown averages to the layer value (same denominator)
    assert len(r["k_nmse_by_pos"]) == t_max
    assert np.mean(r["k_nmse_by_pos"]) == pytest.approx(r["k_nmse"], rel=1e-3)


def test_kivi_residual_window_is_exact_at_the_end(tiny, tokens):
    """KIVI keeps the last rows in full precision: the error by position drops to ~fp16 rounding there."""
    cfg, params = tiny
    spec = "kivi2:group_size=8,residual=16,v_group_size=16,residual_dtype=fp32"
    r = kv_errors(params, cfg, tokens(1, 57, seed=6)[0], make_scheme(spec), prefill=16, probes=2, position_bins=56)
    # largest probe 56: K closes whole R-chunks (frontier 48), V rolls (frontier 56 - 16 = 40)
    k_pos, v_pos = r["k_nmse_by_pos"], r["v_nmse_by_pos"]
    assert len(k_pos) == 56
    assert max(k_pos[48:]) == 0 and max(v_pos[40:]) == 0
    assert min(k_pos[:48]) > 0 and min(v_pos[:40]) > 0 and r["k_nmse"] > 1e-3
