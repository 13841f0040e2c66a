"""The Gemma-3 components of the one decoder against an independent float64 NumPy oracle on a tiny random model:
QK-norm, post-attention / post-MLP norms, GeGLU, (offset + w) norms, per-layer RoPE base, sliding-window layers,
query scale, embedding scale, logit soft-capping; cached forwards through the window ring past the window."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.per_token import PerTokenScheme
from kvquant_jax.cache.window import WindowScheme
from kvquant_jax.models.cache_layout import init_model_cache, layer_schemes
from kvquant_jax.models.llama import forward, forward_nocache, project_qkv
from kvquant_jax.models.testing import random_params, tiny_config, tiny_gemma_config

from test_llama_oracle import np_rope


def np_gemma_forward(p, cfg, toks):
    """float64 oracle of the composed decoder: one sequence [T] -> logits [T, V] (written from the Gemma-3 /
    transformers definitions, independent of kvquant_jax.models.llama)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    t = len(toks)
    x = p["embed"][toks] * cfg.embed_scale
    pos = np.arange(t)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * (cfg.norm_offset + w)

    def gelu_tanh(z):
        return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))

    L = p["layers"]
    g = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim ** -0.5
    for i in range(cfg.num_layers):
        local = cfg.layer_types and cfg.layer_types[i] == "local"
        theta = cfg.rope_theta_local if local and cfg.rope_theta_local is not None else cfg.rope_theta
        h = norm(x, L["attn_norm"][i])
        q = (h @ L["wq"][i]).reshape(t, cfg.num_heads, cfg.head_dim)
        k = (h @ L["wk"][i]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ L["wv"][i]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = norm(q, L["q_norm"][i]), norm(k, L["k_norm"][i])
        q, k = np_rope(q, pos, theta, cfg.rope_pairing), np_rope(k, pos, theta, cfg.rope_pairing)
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("thd,shd->hts", q, k) * scale
        keep = pos[None, :] <= pos[:, None]
        if local:
            keep &= pos[None, :] > pos[:, None] - cfg.sliding_window
        s = np.where(keep[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", pr, v).reshape(t, -1) @ L["wo"][i]
        x = x + (norm(o, L["post_attn_norm"][i]) if cfg.post_norms else o)
        h = norm(x, L["ffn_norm"][i])
        gt = h @ L["w_gate"][i]
        act = gelu_tanh(gt) if cfg.mlp_activation == "gelu_tanh" else gt / (1 + np.exp(-gt))
        m = (act * (h @ L["w_up"][i])) @ L["w_down"][i]
        x = x + (norm(m, L["post_ffn_norm"][i]) if cfg.post_norms else m)
    logits = norm(x, p["final_norm"]) @ p["embed"].T
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * np.tanh(logits / cfg.final_logit_softcap)
    return logits


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


VARIANTS = {
    "gemma3": {},
    "hf_norm_convention_softcap": {"norm_offset": 1.0, "final_logit_softcap": 3.0},
    "uniform_theta_local_only": {"layer_types": ("local",) * 4, "rope_theta_local": None},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_nocache_matches_float64_oracle(variant):
    cfg = tiny_gemma_config(**VARIANTS[variant])
    params = random_params(cfg, seed=3)
    if cfg.norm_offset:        # transformers' convention: stored w = multiplier - 1
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: a - 1 if "norm" in jax.tree_util.keystr(path) else a, params)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, 40)          # 40 tokens: 5 windows
    want = np_gemma_forward(params, cfg, toks)
    for p in (params, {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], params["layers"])
                                                for i in range(cfg.num_layers))}):
        got = jax.jit(forward_nocache, static_argnums=1)(p, cfg, jnp.asarray([toks], jnp.int32))[0]
        assert _rel(got, want) < 2e-5


def test_window_matters():
    """The oracle with an unbounded window differs: the sliding window is really applied."""
    cfg = tiny_gemma_config()
    params = random_params(cfg, seed=3)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, 40)
    got = np.asarray(forward_nocache(params, cfg, jnp.asarray([toks], jnp.int32))[0])
    wide = np_gemma_forward(params, dataclasses.replace(cfg, sliding_window=1000), toks)
    assert _rel(got[:8], wide[:8]) < 2e-5 and _rel(got[8:], wide[8:]) > 1e-3


@pytest.mark.parametrize("ring", [True, False])
def test_incremental_decode_past_the_window_equals_full_forward(ring):
    """Prefill 11 rows, then decode one token at a time to 40 (the ring restarts blocks at 10, 12, ...), every
    step's logits equal to the oracle's; ``ring=False`` keeps full-length storage (the model masks the window)."""
    cfg = tiny_gemma_config()
    params = random_params(cfg, seed=5)
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, 40)
    want = np_gemma_forward(params, cfg, toks)
    cache = init_model_cache(cfg, FullPrecisionScheme(), batch=1, capacity=48, ring=ring)
    assert any(isinstance(s, WindowScheme) for s, _, _ in cache.schemes) == ring
    step = jax.jit(forward, static_argnums=1)
    lg, cache, ok = step(params, cfg, jnp.asarray([toks[:11]], jnp.int32), cache, None)
    assert bool(ok) and _rel(lg[0], want[:11]) < 2e-5
    for t in range(11, 40):
        lg, cache, ok = step(params, cfg, jnp.asarray([toks[t:t + 1]], jnp.int32), cache, None)
        assert bool(ok) and _rel(lg[0, 0], want[t]) < 2e-5, t
    ops.validate(cache)


def test_ragged_chunked_prefill_with_quantized_ring_equals_one_at_a_time():
    """Two sequences of different lengths fed in 6-token chunks (so chunks cross block and window boundaries)
    through an int8 ring equal each sequence alone (batched == one at a time), and the fp32 ring equals the
    oracle."""
    cfg = tiny_gemma_config()
    params = random_params(cfg, seed=7)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, cfg.vocab_size, n) for n in (29, 17)]
    step = jax.jit(forward, static_argnums=1)

    def run(scheme, batch_seqs):
        b = len(batch_seqs)
        cache = init_model_cache(cfg, scheme, batch=b, capacity=36)
        outs = [[] for _ in range(b)]
        for s in range(0, 30, 6):
            toks = np.zeros((b, 6), np.int32)
            num = np.zeros(b, np.int32)
            for i, q in enumerate(batch_seqs):
                part = q[s:s + 6]
                toks[i, :len(part)], num[i] = part, len(part)
            lg, cache, ok = step(params, cfg, jnp.asarray(toks), cache, jnp.asarray(num))
            assert bool(ok)
            for i in range(b):
                outs[i].append(np.asarray(lg[i, :num[i]]))
        return [np.concatenate(o) for o in outs]

    fp = run(FullPrecisionScheme(), seqs)
    for q, got in zip(seqs, fp):
        assert _rel(got, np_gemma_forward(params, cfg, q)) < 2e-5
    both = run(PerTokenScheme(bits=8), seqs)
    for i, q in enumerate(seqs):
        alone = run(PerTokenScheme(bits=8), [q])[0]
        np.testing.assert_allclose(both[i], alone, rtol=1e-5, atol=1e-5)


def test_layer_schemes_and_guards():
    cfg = tiny_gemma_config()
    per = layer_schemes(cfg, PerTokenScheme(bits=4))
    assert [type(s).__name__ for s in per] == ["WindowScheme", "WindowScheme", "PerTokenScheme", "WindowScheme"]
    assert per[0].body.rope_theta == 1e4 and per[2].rope_theta == 1e6 and per[0].window == 8
    assert layer_schemes(tiny_config(), PerTokenScheme(bits=4)) == (PerTokenScheme(bits=4),) * 3
    with pytest.raises(ValueError, match="layer 2 of tiny-gemma3 .global, window none. cannot use a 8-row window"):
        layer_schemes(cfg, WindowScheme(FullPrecisionScheme(), window=8))
    params = random_params(cfg)
    from kvquant_jax.cache.interface import init_cache
    bad = init_cache(WindowScheme(FullPrecisionScheme(), window=8), num_layers=4, batch=1, capacity=16,
                     num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="layer 2 has attention window unbounded but its cache keeps only the "
                                         "last 8 rows"):
        forward(params, cfg, jnp.zeros((1, 2), jnp.int32), bad)
    lp = jax.tree.map(lambda a: a[0], params["layers"])
    with pytest.raises(ValueError, match="different RoPE bases .* pass layer="):
        project_qkv(cfg, jnp.zeros((1, 2, 32)), lp, jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="local layers need sliding_window >= 1"):
        tiny_gemma_config(sliding_window=0)
    with pytest.raises(ValueError, match="layer_types: unknown types \\['sliding'\\]"):
        tiny_gemma_config(layer_types=("sliding",) * 4)
    with pytest.raises(ValueError, match="mlp_activation must be one of"):
        tiny_gemma_config(mlp_activation="relu")
