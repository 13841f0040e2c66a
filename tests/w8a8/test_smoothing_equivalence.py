"""SmoothQuant and SmoothAttention folds leave the float model unchanged; the RoPE pair constraint is necessary."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.calibration import smoothattention as SA
from kvquant_jax.calibration import smoothquant as SQ
from kvquant_jax.models import llama
from kvquant_jax.models.testing import random_params, tiny_config

FWD = jax.jit(llama.forward_nocache, static_argnames=("cfg",))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def _tokens(cfg, n=2, t=10, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (n, t)), jnp.int32)


@pytest.fixture(scope="module", params=["half_split", "interleaved"])
def model(request):
    cfg = tiny_config(num_layers=2, rope_pairing=request.param)
    p = random_params(cfg, seed=3)
    tok = _tokens(cfg)
    return cfg, p, tok, SQ.collect_stats(p, cfg, tok, batch=2), FWD(p, cfg, tok)


def test_stats_shapes_and_first_layer_value(model):
    cfg, p, tok, st, _ = model
    l, h, f, hq, hkv, d = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, \
        cfg.head_dim
    assert st["q"].shape == (l, h) and st["gate"].shape == (l, h) and st["down"].shape == (l, f)
    assert st["o"].shape == (l, hq * d) and st["k_post_rope"].shape == (l, hkv, d) == st["k_pre_rope"].shape
    x0 = llama.rms_norm(p["embed"][tok], p["layers"]["attn_norm"][0], cfg.rms_eps)
    np.testing.assert_allclose(st["q"][0], np.abs(np.asarray(x0)).max(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_array_equal(st["q"], st["k"])


@pytest.mark.parametrize("alpha,sites", [(0.5, ("qkv", "gate_up")), (0.8, SQ.SITES)])
def test_smoothquant_fold_keeps_float_model(model, alpha, sites):
    cfg, p, tok, st, ref = model
    cfgq = SQ.SmoothQuantConfig(alpha=alpha, sites=sites)
    scales = SQ.smooth_scales(p, cfg, st, cfgq)
    assert all(float(jnp.max(jnp.abs(jnp.log(s)))) > 0.05 for s in scales.values())   # non-trivial scales
    sp = SQ.apply_smoothing(p, cfg, scales)
    assert _rel(FWD(sp, cfg, tok), ref) < 1e-5
    # the smoothed input of q/k/v has per-channel absmax  max|X_j|^(1-alpha) * max|W_j|^(1-alpha)
    st2 = SQ.collect_stats(sp, cfg, tok, batch=2)
    np.testing.assert_allclose(st2["q"], st["q"] / np.asarray(scales["qkv"]), rtol=1e-4)


def test_smoothquant_config_errors():
    with pytest.raises(ValueError, match="alpha"):
        SQ.SmoothQuantConfig(alpha=1.5)
    with pytest.raises(ValueError, match="site"):
        SQ.SmoothQuantConfig(sites=("qk",))
    s = SQ.smoothing_scale(jnp.array([0.0, 4.0, 4.0]), jnp.array([1.0, 0.0, 1.0]), 0.5)
    np.testing.assert_allclose(np.asarray(s), [1.0, 1.0, 2.0])


def test_smoothattention_fold_keeps_float_model(model):
    cfg, p, tok, st, ref = model
    for stage in ("post_rope", "pre_rope"):
        lam = SA.smooth_attention_lambda(st[f"k_{stage}"], cfg.rope_pairing)
        SA.check_pairs_equal(lam, cfg.rope_pairing)
        assert float(jnp.max(lam) / jnp.min(lam)) > 1.1          # non-trivial
        sp = SA.smooth_attention(p, cfg, st, key_stage=stage)
        assert _rel(FWD(sp, cfg, tok), ref) < 1e-5
    # keys really are divided by lam (post-RoPE statistics of the smoothed model)
    st2 = SQ.collect_stats(SA.smooth_attention(p, cfg, st), cfg, tok, batch=2)
    lam = np.asarray(SA.smooth_attention_lambda(st["k_post_rope"], cfg.rope_pairing))
    np.testing.assert_allclose(st2["k_post_rope"], st["k_post_rope"] / lam, rtol=1e-4)


def test_unequal_scales_inside_a_rope_pair_break_equivalence(model):
    cfg, p, tok, _, ref = model
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    paired = SA.pair_max(jnp.asarray(np.exp(rng.standard_normal(shape)), jnp.float32), cfg.rope_pairing)
    assert _rel(FWD(SA.apply_smooth_attention(p, cfg, paired), cfg, tok), ref) < 1e-5
    # perturb ONE coordinate of every pair: the rescale no longer commutes with the RoPE rotation
    d = cfg.head_dim
    first = np.arange(d) < d // 2 if cfg.rope_pairing == "half_split" else np.arange(d) % 2 == 0
    unpaired = paired * jnp.where(jnp.asarray(first), jnp.float32(2.0), jnp.float32(1.0))
    with pytest.raises(ValueError, match="RoPE pair"):
        SA.apply_smooth_attention(p, cfg, unpaired)
    assert _rel(FWD(SA.apply_smooth_attention(p, cfg, unpaired, check=False), cfg, tok), ref) > 1e-3


def test_lambda_pairing_rules():
    m = jnp.array([[[1.0, 0.0, 9.0, 0.0]]], jnp.float32)            # D = 4
    np.testing.assert_allclose(np.asarray(SA.smooth_attention_lambda(m, "half_split"))[0, 0], [3, 1, 3, 1])
    np.testing.assert_allclose(np.asarray(SA.smooth_attention_lambda(m, "interleaved"))[0, 0], [1, 1, 3, 3])
    np.testing.assert_allclose(np.asarray(SA.smooth_attention_lambda(jnp.zeros((1, 1, 4)), "interleaved")), 1.0)
    with pytest.raises(ValueError, match="pairing"):
        SA.pair_max(m, "neox")


@pytest.mark.model
def test_smollm2_folds_keep_logits(smollm):
    cfg, p = smollm.cfg, smollm.params
    tok = jnp.asarray(smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")[:12], jnp.int32)[None]
    ref = FWD(p, cfg, tok)
    st = SQ.collect_stats(p, cfg, tok)
    sp = SQ.smooth_params(p, cfg, st, SQ.SmoothQuantConfig(alpha=0.5))
    sp = SA.smooth_attention(sp, cfg, st)
    assert _rel(FWD(sp, cfg, tok), ref) < 1e-5
