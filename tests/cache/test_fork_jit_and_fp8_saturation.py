"""Issue Q.7: fork under jit clamps and flags (never lengths of -2^31), eager fork raises on out-of-range or float
indices; FP8 saturation of finite values is counted in the append's status (and in the kv_error metric)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import init_cache
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.status import append_with_status, try_append_with_status
from kvquant_jax.quant.fp8 import fp8_max

L, B, C, H, D = 2, 3, 16, 2, 8


def _cache(spec, batch=B, rows=5, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    cache = init_cache(make_scheme(spec), num_layers=L, batch=batch, capacity=C, num_kv_heads=H, head_dim=D)
    pairs = [(rng.standard_normal((batch, rows, H, D)).astype(np.float32) * scale,
              rng.standard_normal((batch, rows, H, D)).astype(np.float32) * scale) for _ in range(L)]
    return ops.append(cache, pairs, np.array([rows, rows - 2, rows - 4][:batch]))


def _seq(cache, b):
    return [tuple(np.asarray(x)[b] for x in kvv) for kvv in ops.decode_all(cache)]


@pytest.mark.parametrize("spec", ["int4", "fp8_e4m3", "kivi2:group_size=4,residual=4,v_group_size=4"])
def test_try_fork_under_jit_clamps_and_flags(spec):
    cache = _cache(spec)
    jf = jax.jit(ops.try_fork)
    good, ok = jf(cache, jnp.array([2, 0, 0, 1], jnp.int32))
    assert bool(ok)
    want = ops.fork(cache, np.array([2, 0, 0, 1]))
    for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for idx in ([0, 3], [-1, 1], [7, -9, 2]):
        bad, ok = jf(cache, jnp.array(idx, jnp.int32))
        assert not bool(ok)
        ops.validate(bad)                                   # every length is a real parent's
        clamped = np.clip(idx, 0, B - 1)
        np.testing.assert_array_equal(np.asarray(bad.lengths), np.asarray(cache.lengths)[clamped])
        for c, p in enumerate(clamped):
            for (k1, v1, m1), (k2, v2, m2) in zip(_seq(bad, c), _seq(cache, p)):
                np.testing.assert_array_equal(k1, k2)
                np.testing.assert_array_equal(v1, v2)
                np.testing.assert_array_equal(m1, m2)


def test_fork_eager_raises_and_refuses_jit():
    cache = _cache("int8")
    for idx in ([0, 3], [-1], [0, 1, 3]):
        with pytest.raises(ValueError, match="out of range"):
            ops.fork(cache, np.array(idx))
    for idx in (np.array([0.0, 1.7]), [1.0], np.array([True, False])):
        with pytest.raises(TypeError, match="must be integers"):
            ops.fork(cache, idx)
    with pytest.raises(TypeError, match="must be integers"):
        jax.jit(ops.try_fork)(cache, jnp.array([0.0, 1.7]))
    with pytest.raises(TypeError, match="try_fork"):
        jax.jit(ops.fork)(cache, jnp.array([0, 1], jnp.int32))
    re, ok = jax.jit(ops.try_reorder)(cache, jnp.array([2, 1, 5], jnp.int32))
    assert not bool(ok) and np.asarray(re.lengths).tolist() == np.asarray(cache.lengths)[[2, 1, 2]].tolist()


@pytest.mark.parametrize("spec, fmt", [("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2"),
                                       ("fp8_e4m3:scale_axis=head,scales=warmup", "e4m3")])
def test_fp8_saturation_is_counted(spec, fmt):
    rng = np.random.default_rng(11)
    cache = init_cache(make_scheme(spec), num_layers=L, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    t = 6
    num_new = np.array([6, 4, 1])
    pairs = []
    for _ in range(L):
        k = rng.standard_normal((B, t, H, D)).astype(np.float32) * 3
        v = rng.standard_normal((B, t, H, D)).astype(np.float32) * 3
        pairs.append((k, v))
    cache, st0 = append_with_status(cache, pairs, num_new)
    assert st0.total_saturated == 0                    # warm-up scale fits the first batch; 1.0 fits N(0, 9)
    scale_k = [np.asarray(g.k_scale) for g in cache.groups][0][0]     # [H] of layer 0 (same for every layer here)
    scale_v = [np.asarray(g.v_scale) for g in cache.groups][0][0]
    big = []
    for layer in range(L):
        k = rng.standard_normal((B, 2, H, D)).astype(np.float32)
        v = rng.standard_normal((B, 2, H, D)).astype(np.float32)
        k[0, 0, 1, 3] = 2.7e6
        k[1, 1, 0, 0] = -1.0e7
        v[2, 0, 0, 5] = 9.9e5
        v[2, 1, 1, 1] = 3.3e6                          # row 1 of sequence 2 is padding below: not counted
        big.append((k, v))
    nn = np.array([2, 2, 1])
    new, status = append_with_status(cache, big, nn)
    hi = fp8_max(fmt)
    for layer, (k, v) in enumerate(big):
        valid = (np.arange(2)[None, :] < nn[:, None])[:, :, None, None]
        want_k = (valid & (np.abs(k) / scale_k[None, None, :, None] > hi)).sum(axis=(1, 2, 3))
        want_v = (valid & (np.abs(v) / scale_v[None, None, :, None] > hi)).sum(axis=(1, 2, 3))
        np.testing.assert_array_equal(status.saturated[layer], np.stack([want_k, want_v], axis=-1))
    if fmt == "e4m3" and "warmup" not in spec:
        assert status.saturated[:, :, 0].sum() == 2 * L and status.saturated[:, :, 1].sum() == L
        k0 = np.asarray(ops.decode_reference(new, 0)[0])
        assert k0[0, 1, 6, 3] == 448.0                 # 2.7e6 was stored as the format's max: the count says so
    # the jit form agrees
    _, ok, sat = jax.jit(try_append_with_status)(cache, tuple((jnp.asarray(k), jnp.asarray(v)) for k, v in big),
                                                 jnp.asarray(nn, jnp.int32))
    assert bool(ok)
    np.testing.assert_array_equal(np.asarray(sat), status.saturated)


def test_integer_schemes_reject_instead_of_saturating():
    cache = _cache("int4")
    k = np.ones((B, 1, H, D), np.float32)
    k[0, 0, 0, 0] = 2.7e6
    pairs = [(k * (i + 1), k.copy()) for i in range(L)]
    with pytest.raises(ValueError, match="could not be encoded"):
        append_with_status(cache, pairs, np.array([1, 1, 1]))
    ok_pairs = [(np.full((B, 1, H, D), 0.5, np.float32), np.full((B, 1, H, D), -0.25, np.float32))] * L
    _, status = append_with_status(cache, ok_pairs, np.array([1, 1, 1]))
    assert status.ok and status.total_saturated == 0 and status.saturated.shape == (L, B, 2)


def test_kv_error_metric_and_report_show_fp8_saturation():
    import types

    from kvquant_jax.eval.errors import layer_errors
    from kvquant_jax.eval.report import _error_tables

    rng = np.random.default_rng(5)
    t, hq, hkv, d, prefill = 12, 4, 2, 8, 6
    probes = np.array([6, 9, 11], np.int32)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    k[2, 1, 3], k[8, 0, 0], k[11, 0, 1] = 2.7e6, -600.0, 5e6      # position 11 is not below the last probe
    v[10, 1, 7] = 1e5
    for spec, want in (("fp8_e4m3", [2, 1]), ("fp8_e5m2", [1, 1]), ("int8", [0, 0])):
        scheme = make_scheme(spec)
        state = scheme.init_layer(len(probes), t, hkv, d)
        out = layer_errors(scheme, state, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(probes),
                           prefill=prefill)
        assert np.asarray(out["saturated"]).tolist() == want, spec
    vals = {"k_nmse_by_layer": [0.1], "v_nmse_by_layer": [0.2], "k_nmse_by_pos": [0.1], "v_nmse_by_pos": [0.2],
            "logit_rel_rms": 0.0, "attn_tv": 0.0, "out_rel": 0.0, "k_saturated": 2, "v_saturated": 1}
    text = "\n".join(_error_tables([{"point": types.SimpleNamespace(label="fp8 point"), "kv_error": {"values": vals}}]))
    assert "Saturated values" in text and "fp8 point: K 2, V 1" in text
