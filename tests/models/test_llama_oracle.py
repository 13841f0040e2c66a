"""The JAX LLaMA forward against an independent float64 NumPy oracle on a tiny random model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.models.llama import forward, forward_nocache
from kvquant_jax.abi.rope import apply_rope, pairing_permutation
from kvquant_jax.models.testing import random_params, tiny_config


def np_rope(x, pos, theta, pairing):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[..., None].astype(np.float64) * inv            # [T, d/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if pairing == "half_split":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def np_forward(p, cfg, toks):
    """float64 oracle: one sequence [T] -> logits [T, V]."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    t = len(toks)
    x = p["embed"][toks]
    pos = np.arange(t)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * w

    L = p["layers"]
    g = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        h = norm(x, L["attn_norm"][i])
        q = (h @ L["wq"][i]).reshape(t, cfg.num_heads, cfg.head_dim)
        k = (h @ L["wk"][i]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ L["wv"][i]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = np_rope(q, pos, cfg.rope_theta, cfg.rope_pairing), np_rope(k, pos, cfg.rope_theta, cfg.rope_pairing)
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(cfg.head_dim)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", pr, v).reshape(t, -1)
        x = x + a @ L["wo"][i]
        h = norm(x, L["ffn_norm"][i])
        gt = h @ L["w_gate"][i]
        x = x + ((gt / (1 + np.exp(-gt))) * (h @ L["w_up"][i])) @ L["w_down"][i]
    return norm(x, p["final_norm"]) @ p["embed"].T


@pytest.mark.parametrize("pairing", ["half_split", "interleaved"])
def test_forward_nocache_matches_float64_oracle(pairing):
    cfg = tiny_config(rope_pairing=pairing)
    params = random_params(cfg, seed=1)
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, 23)
    got = np.asarray(forward_nocache(params, cfg, jnp.asarray(toks[None], jnp.int32)))[0]
    want = np_forward(params, cfg, toks)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_incremental_decode_equals_full_forward():
    cfg = tiny_config()
    params = random_params(cfg, seed=3)
    toks = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 19)).astype(np.int32)
    full = np.asarray(forward_nocache(params, cfg, jnp.asarray(toks)))
    cache = init_cache(FullPrecisionScheme(), num_layers=cfg.num_layers, batch=2, capacity=32,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    step = jax.jit(lambda c, t: forward(params, cfg, t, c)[:2])
    logits, cache = step(cache, jnp.asarray(toks[:, :11]))
    outs = [np.asarray(logits)]
    for i in range(11, 19):
        logits, cache = step(cache, jnp.asarray(toks[:, i:i + 1]))
        outs.append(np.asarray(logits))
    inc = np.concatenate(outs, axis=1)
    assert np.asarray(cache.lengths).tolist() == [19, 19]
    assert np.abs(inc - full).max() / np.abs(full).max() < 1e-5


def test_ragged_prefill_matches_per_sequence():
    cfg = tiny_config()
    params = random_params(cfg, seed=5)
    rng = np.random.default_rng(6)
    lens = [7, 12]
    toks = np.zeros((2, 16), np.int32)
    for b, n in enumerate(lens):
        toks[b, :n] = rng.integers(3, cfg.vocab_size, n)
    cache = init_cache(FullPrecisionScheme(), num_layers=cfg.num_layers, batch=2, capacity=24,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    logits, cache, ok = forward(params, cfg, jnp.asarray(toks), cache, jnp.asarray(lens, jnp.int32))
    assert bool(ok) and np.asarray(cache.lengths).tolist() == lens
    for b, n in enumerate(lens):
        want = np_forward(params, cfg, toks[b, :n])
        got = np.asarray(logits)[b, :n]
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_nonfinite_kv_publishes_nothing():
    cfg = tiny_config()
    params = random_params(cfg, seed=7)
    cache = init_cache(FullPrecisionScheme(), num_layers=cfg.num_layers, batch=1, capacity=16,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    _, cache, ok = forward(params, cfg, jnp.asarray([[5, 6, 7]], jnp.int32), cache)
    assert bool(ok)
    bad = dict(params)
    bad["layers"] = dict(params["layers"])
    bad["layers"]["wv"] = params["layers"]["wv"].at[2, 0, 0].set(jnp.float32(jnp.nan))  # NaN only in layer 2's V
    before = jax.tree.map(np.asarray, cache)
    _, cache2, ok2 = forward(bad, cfg, jnp.asarray([[8]], jnp.int32), cache)
    assert not bool(ok2)
    assert np.asarray(cache2.lengths).tolist() == [3]          # nothing published
    k_old, v_old, _ = cache.schemes[0][0].materialize_layer(jax.tree.map(lambda a: a[2], cache2.groups[0]),
                                                            cache2.lengths)
    k_ref, v_ref, _ = cache.schemes[0][0].materialize_layer(jax.tree.map(lambda a: a[2], before.groups[0]),
                                                            before.lengths)
    np.testing.assert_array_equal(np.asarray(v_old), np.asarray(v_ref))
    np.testing.assert_array_equal(np.asarray(k_old), np.asarray(k_ref))


def test_rope_pairing_permutation_and_inverse():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    pos = np.arange(5, dtype=np.int32) * 37
    perm = pairing_permutation(16, "interleaved", "half_split")
    a = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), 1e5, "interleaved"))
    b = np.asarray(apply_rope(jnp.asarray(x[..., perm]), jnp.asarray(pos), 1e5, "half_split"))
    np.testing.assert_allclose(a[..., perm], b, rtol=0, atol=1e-5)
    np.testing.assert_allclose(a, np_rope(x.astype(np.float64), pos, 1e5, "interleaved"), atol=1e-5)
    back = np.asarray(apply_rope(jnp.asarray(a), jnp.asarray(pos), 1e5, "interleaved", inverse=True))
    np.testing.assert_allclose(back, x, atol=1e-5)
