"""KVQuant runtime cache (design notes 0x07A-0x07F): encode/decode vs a float64 NumPy oracle, pre-RoPE storage,
dense-and-sparse outliers with exact holes and the overflow policy, the sink, calibration install, state ops."""
from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import init_cache, layer_state
from kvquant_jax.cache.kvquant import (KVQuantScheme, default_outlier_counts, key_outlier_overflow,
                                       load_calibration, normalize_values)
from kvquant_jax.cache.schema import IncompatibleSchemaError
from kvquant_jax.quant.nuq import nuq_encode

import kvquant_oracle as O

L, B, H, D, C = 2, 2, 2, 16, 16
THETA = 10000.0

# jitted views (a scheme is hashable: one compilation per scheme and shape, not one per eager op)
decode_stored = jax.jit(lambda s, st, lengths: s.decode_stored(st, lengths), static_argnums=0)
materialize = jax.jit(lambda s, st, lengths: s.materialize_layer(st, lengths), static_argnums=0)
append_status = jax.jit(lambda s, st, lengths, k, v, n: s.append_layer_with_status(st, lengths, k, v, n),
                        static_argnums=0)


def scheme(**kw):
    base = dict(k_bits=3, v_bits=3, k_sparse_capacity=2, v_outliers=1, sink=1, rope_theta=THETA,
                calibration_id="test-cal")
    base.update(kw)
    return KVQuantScheme(**base)


def calibration(s: KVQuantScheme, seed=0):
    """A synthetic calibration (random per-channel ranges, random sorted codebooks) for ``s``."""
    rng = np.random.default_rng(seed)

    def cb(bits):
        c = np.sort(rng.uniform(-1, 1, (L, 2 ** bits)), axis=1)
        c[:, 0], c[:, -1] = -0.95, 0.9
        return c.astype(np.float32)

    arrays = {"k_scale": rng.uniform(0.3, 1.5, (L, H, D)).astype(np.float32),
              "k_zero": rng.uniform(-0.5, 0.5, (L, H, D)).astype(np.float32),
              "k_codebook": cb(s.k_bits), "v_codebook": cb(s.v_bits)}
    return types.SimpleNamespace(schema=s.calibration_schema(), arrays=arrays)


def calibrated_cache(s, cal=None, batch=B, capacity=C):
    cache = init_cache(s, num_layers=L, batch=batch, capacity=capacity, num_kv_heads=H, head_dim=D)
    return load_calibration(cache, cal or calibration(s))


def model_rows(rng, t, pos0=0, pairing="half_split", outliers=True):
    """Pre-RoPE keys (float64), the post-RoPE keys a model would append (float32) and values, ``[B, T, H, D]``."""
    k_pre = rng.normal(0, 0.6, (B, t, H, D))
    v = rng.normal(0, 1.0, (B, t, H, D))
    if outliers:
        k_pre[:, :, :, 3] += 4.0                        # a channel beyond its calibrated range: K outliers
        v[:, :, 1, 5] *= 8                              # a large value coordinate: V outliers
    pos = pos0 + np.arange(t)
    k_post = O.rope64(k_pre, pos[None, :, None], THETA, pairing).astype(np.float32)
    return k_pre, k_post, v.astype(np.float32)


def test_append_matches_float64_oracle():
    """Stored rows decode (raw arrays, oracle decoder) to the oracle's encode of the pre-RoPE keys / values."""
    rng = np.random.default_rng(1)
    s = scheme()
    cal = calibration(s)
    cache = calibrated_cache(s, cal)
    k_pre, k_post, v = model_rows(rng, 9)
    lengths = np.array([9, 6])
    cache = ops.append(cache, [(k_post, v)] * L, lengths)
    ops.validate(cache)
    for layer in range(L):
        sch, st = layer_state(cache, layer)
        k_dec, v_dec = O.decode_state(st, k_bits=3, v_bits=3, sink=1, lengths=lengths)
        k_jax, v_jax, valid, pos = decode_stored(sch, st, cache.lengths)
        np.testing.assert_allclose(np.asarray(k_jax), k_dec, rtol=0, atol=1e-5)   # JAX decoder == oracle decoder
        np.testing.assert_allclose(np.asarray(v_jax), v_dec, rtol=0, atol=1e-5)
        a = cal.arrays
        n_sparse = 0
        for b in range(B):
            np.testing.assert_array_equal(np.asarray(pos)[b, :lengths[b]], np.arange(lengths[b]))
            for t in range(lengths[b]):
                for h in range(H):
                    if t < 1:      # sink: exact up to fp16 storage
                        np.testing.assert_array_equal(k_dec[b, h, t], O.f16(np.float32(O.rope64(
                            k_post[b, t, h].astype(np.float64), t, THETA, "half_split", inverse=True))))
                        np.testing.assert_array_equal(v_dec[b, h, t], O.f16(v[b, t, h]))
                        continue
                    want_k, tie_k = O.encode_key_row(k_pre[b, t, h], a["k_zero"][layer, h], a["k_scale"][layer, h],
                                                     a["k_codebook"][layer], 2)
                    want_v, tie_v = O.encode_value_row(v[b, t, h].astype(np.float64), a["v_codebook"][layer], 1)
                    ok_k = np.isclose(k_dec[b, h, t], want_k, rtol=0, atol=2e-5 + 1e-3 * np.abs(want_k)) | tie_k
                    ok_v = np.isclose(v_dec[b, h, t], want_v, rtol=0, atol=1e-4) | tie_v
                    assert ok_k.all(), (b, t, h, k_dec[b, h, t][~ok_k], want_k[~ok_k])
                    assert ok_v.all(), (b, t, h, v_dec[b, h, t][~ok_v], want_v[~ok_v])
                    n_sparse += int((np.asarray(st.k_sp_idx)[b, h, t] != 255).sum())
        assert n_sparse > 0                        # the planted channel really went through the sparse path


@pytest.mark.parametrize("pairing", ["half_split", "interleaved"])
def test_pre_rope_storage_and_post_rope_materialize(pairing):
    """Stored keys are PRE-RoPE; materialize returns them rotated at their stored positions, which equals the
    post-RoPE row the model appended when the pre-RoPE row is exactly representable (a lossless row)."""
    s = scheme(rope_pairing=pairing, k_sparse_capacity=0, v_outliers=0, sink=0)
    cal = calibration(s)
    a = cal.arrays
    rng = np.random.default_rng(2)
    t = 7
    codes = rng.integers(0, 8, (L, B, t, H, D))
    k_pre = np.stack([a["k_codebook"][i][codes[i]].astype(np.float64) * a["k_scale"][i] + a["k_zero"][i]
                      for i in range(L)])
    cache = calibrated_cache(s, cal)
    # two appends at different offsets: positions must follow lengths + t
    pos = np.arange(t)
    k_post = O.rope64(k_pre, pos[None, None, :, None], THETA, pairing).astype(np.float32)
    v = rng.normal(size=(B, t, H, D)).astype(np.float32)
    cache = ops.append(cache, [(k_post[i][:, :4], v[:, :4]) for i in range(L)], 4)
    cache = ops.append(cache, [(k_post[i][:, 4:], v[:, 4:]) for i in range(L)], 3)
    for i in range(L):
        sch, st = layer_state(cache, i)
        k_st, _, _, pos_st = decode_stored(sch, st, cache.lengths)
        np.testing.assert_allclose(np.asarray(k_st)[:, :, :t].transpose(0, 2, 1, 3), k_pre[i], atol=2e-5)  # pre
        k_mat, _, valid = materialize(sch, st, cache.lengths)
        np.testing.assert_allclose(np.asarray(k_mat)[:, :, :t].transpose(0, 2, 1, 3), k_post[i], atol=2e-5)  # post
        want = O.rope64(np.asarray(k_st, np.float64), np.asarray(pos_st)[:, None, :], THETA, pairing)
        np.testing.assert_allclose(np.asarray(k_mat), np.where(np.asarray(valid)[:, None, :, None], want, 0),
                                   atol=2e-5)


def test_post_rope_stage_stores_rotated_keys():
    s = scheme(key_stage="post_rope", k_sparse_capacity=0, v_outliers=0, sink=0)
    assert s.schema.key_stage == "post_rope"
    cache = calibrated_cache(s)
    rng = np.random.default_rng(3)
    _, k_post, v = model_rows(rng, 5, outliers=False)
    cache = ops.append(cache, [(k_post, v)] * L, 5)
    sch, st = layer_state(cache, 0)
    k_st, _, _, _ = decode_stored(sch, st, cache.lengths)
    k_mat, _, _ = materialize(sch, st, cache.lengths)
    np.testing.assert_array_equal(np.asarray(k_st), np.asarray(k_mat))          # no rotation anywhere
    a = calibration(s).arrays
    want, tie = O.encode_key_row(k_post[0, 2, 1].astype(np.float64), a["k_zero"][0, 1], a["k_scale"][0, 1],
                                 a["k_codebook"][0], 0)
    assert (np.isclose(np.asarray(k_st)[0, 1, 2], want, atol=1e-5) | tie).all()


def test_exact_holes_and_key_overflow_policy():
    """A kept outlier decodes to its fp16 value whatever its dense code holds (exact hole); outliers beyond the
    row capacity stay dense and clip to the end signposts, largest |x| kept first."""
    s = scheme(k_sparse_capacity=2, v_outliers=1, sink=0)
    cal = calibration(s)
    a = cal.arrays
    cache = calibrated_cache(s, cal, batch=1)
    z, sc, cb = a["k_zero"][0, 0], a["k_scale"][0, 0], a["k_codebook"][0]
    k_pre = z.astype(np.float64).copy()
    k_pre[[1, 4, 9, 12]] = z[[1, 4, 9, 12]] + sc[[1, 4, 9, 12]] * np.array([3.0, -5.0, 1.5, -4.0])
    k = np.zeros((1, 1, H, D), np.float32)
    k[0, 0, :] = k_pre.astype(np.float32)                 # position 0: post-RoPE == pre-RoPE
    v = np.linspace(-1, 1, D, dtype=np.float32)[None, None, None].repeat(H, 2)
    v[0, 0, 0, 7] = 37.0
    cache = ops.append(cache, [(k, v)] * L, 1)
    sch, st = layer_state(cache, 0)
    idx = np.asarray(st.k_sp_idx)[0, 0, 0]
    np.testing.assert_array_equal(idx, [4, 12])           # |x| 5 and 4 kept, ascending channel order
    assert int(key_outlier_overflow(jnp.asarray(k_pre[None]), z, sc, 2)[0]) == 2
    kd, vd, _, _ = decode_stored(sch, st, cache.lengths)
    kd, vd = np.asarray(kd)[0, 0, 0], np.asarray(vd)[0, 0, 0]
    np.testing.assert_array_equal(kd[[4, 12]], O.f16(k_pre[[4, 12]]))
    np.testing.assert_allclose(kd[1], cb[-1] * sc[1] + z[1], rtol=1e-6)      # overflowed +3: clipped to top
    np.testing.assert_allclose(kd[9], cb[-1] * sc[9] + z[9], rtol=1e-6)      # overflowed +1.5
    assert np.asarray(st.v_sp_idx)[0, 0, 0, 0] == 7 and vd[7] == 37.0
    # the dense code under a hole is irrelevant: rewrite every code byte of the row and decode again
    st2 = st.replace(k_codes=st.k_codes.at[0, 0, 0].set(jnp.uint8(0xB6)), v_codes=st.v_codes.at[0, 0, 0].set(
        jnp.uint8(0x5A)))
    kd2, vd2, _, _ = decode_stored(sch, st2, cache.lengths)
    assert np.asarray(kd2)[0, 0, 0, 4] == kd[4] and np.asarray(vd2)[0, 0, 0, 7] == 37.0
    assert np.asarray(kd2)[0, 0, 0, 0] != kd[0]          # ... while a dense coordinate does change


def test_sink_is_full_precision_and_only_position_zero():
    rng = np.random.default_rng(4)
    _, k_post, v = model_rows(rng, 3)
    k_post[:, 0] *= 50                                    # a huge first token
    for sink in (0, 1):
        s = scheme(sink=sink)
        cache = ops.append(calibrated_cache(s), [(k_post, v)] * L, 3)
        sch, st = layer_state(cache, 0)
        k_mat, v_mat, _ = materialize(sch, st, cache.lengths)
        err0 = np.abs(np.asarray(k_mat)[:, :, 0] - k_post[:, 0].astype(np.float64)).max()
        if sink:
            assert err0 < 2e-2 * np.abs(k_post[:, 0]).max() / 50 + 0.05      # fp16 storage only
            np.testing.assert_array_equal(np.asarray(v_mat)[:, :, 0], O.f16(v[:, 0]))
        else:
            assert err0 > 1.0                                                # clipped by the K range


def test_one_row_appends_equal_prefill():
    """Row-by-row decode appends produce the same state as one multi-row append (path independence)."""
    rng = np.random.default_rng(5)
    s = scheme()
    _, k_post, v = model_rows(rng, 6)
    full = ops.append(calibrated_cache(s), [(k_post, v)] * L, 6)
    step = calibrated_cache(s)
    for t in range(6):
        step = ops.append(step, [(k_post[:, t:t + 1], v[:, t:t + 1])] * L, 1)
    for layer in range(L):
        sch, a = layer_state(full, layer)
        _, b = layer_state(step, layer)
        for x, y in zip(decode_stored(sch, a, full.lengths), decode_stored(sch, b, step.lengths)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_fork_truncate_and_calibrated_state_shared():
    rng = np.random.default_rng(6)
    s = scheme()
    _, k_post, v = model_rows(rng, 6)
    cache = ops.append(calibrated_cache(s), [(k_post, v)] * L, 6)
    child = ops.fork(cache, [1, 1, 0])
    np.testing.assert_array_equal(np.asarray(child.groups[0].k_scale), np.asarray(cache.groups[0].k_scale))
    sch, st = layer_state(child, 0)
    _, st0 = layer_state(cache, 0)
    np.testing.assert_array_equal(np.asarray(materialize(sch, st, child.lengths)[0])[2],
                                  np.asarray(materialize(sch, st0, cache.lengths)[0])[0])
    short = ops.truncate(cache, 3)
    fresh = ops.append(calibrated_cache(s), [(k_post[:, :3], v[:, :3])] * L, 3)
    for x, y in zip(ops.decode_reference(short, 1), ops.decode_reference(fresh, 1)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_normalize_values_is_the_runtime_population():
    """The calibration's normalized V values encode to exactly the runtime's stored V codes."""
    rng = np.random.default_rng(7)
    s = scheme(sink=0)
    cal = calibration(s)
    _, k_post, v = model_rows(rng, 5)
    cache = ops.append(calibrated_cache(s, cal), [(k_post, v)] * L, 5)
    _, st = layer_state(cache, 0)
    x, inlier = normalize_values(jnp.asarray(v), s.v_outliers, s.qparam_dtype)
    want = np.asarray(nuq_encode(x, cal.arrays["v_codebook"][0]))
    got = O.unpack(np.asarray(st.v_codes)[:, :, :5], 3, D).transpose(0, 2, 1, 3)
    inl = np.asarray(inlier)
    np.testing.assert_array_equal(got[inl], want[inl])
    assert (~inl).sum() == B * 5 * H * s.v_outliers                           # exactly one outlier per row


def test_nonfinite_and_unencodable_rows_rejected():
    rng = np.random.default_rng(8)
    s = scheme()
    cache = calibrated_cache(s)
    _, k_post, v = model_rows(rng, 3)
    bad = v.copy()
    bad[1, 2, 0, 3] = np.nan
    with pytest.raises(ValueError, match="layer 0 V has non-finite"):
        ops.append(cache, [(k_post, bad)] * L, 3)
    huge = v.copy()
    huge[0, 1, 1, 2] = 1e6                                  # a V outlier whose fp16 value overflows
    with pytest.raises(ValueError, match="could not be encoded"):
        ops.append(cache, [(k_post, huge)] * L, 3)
    st = jax.tree.map(lambda a: a[0], cache.groups[0])
    _, ok = append_status(s, st, cache.lengths, jnp.asarray(k_post), jnp.asarray(huge),
                          jnp.array([3, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(ok), [False, True])


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="k_bits"):
        KVQuantScheme(k_bits=5)
    with pytest.raises(ValueError, match="v_outliers"):
        KVQuantScheme(v_outliers=-1)
    with pytest.raises(ValueError, match="sparse_dtype"):
        KVQuantScheme(sparse_dtype="fp8")
    with pytest.raises(ValueError, match="key_stage"):
        KVQuantScheme(key_stage="rotated")
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        init_cache(scheme(), num_layers=1, batch=1, capacity=4, num_kv_heads=1, head_dim=12)
    with pytest.raises(ValueError, match="outlier_fraction"):
        default_outlier_counts(1.5, 64)
    assert default_outlier_counts(0.01, 64) == (2, 1) and default_outlier_counts(0.0, 64) == (0, 0)


def test_load_calibration_checks_schema_shapes_and_emptiness():
    s = scheme()
    cal = calibration(s)
    other = scheme(k_bits=2, sink=0)
    cache = init_cache(other, num_layers=L, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    with pytest.raises(IncompatibleSchemaError) as e:
        load_calibration(cache, cal)
    msg = str(e.value)
    assert "key.payload: 'nuq2' != 'nuq3'" in msg and "sink: 0 != 1" in msg
    cache = init_cache(s, num_layers=L, batch=B, capacity=C, num_kv_heads=H, head_dim=D)
    short = types.SimpleNamespace(schema=cal.schema, arrays={**cal.arrays, "k_scale": cal.arrays["k_scale"][:, :1]})
    with pytest.raises(ValueError, match="k_scale has shape"):
        load_calibration(cache, short)
    unsorted = types.SimpleNamespace(schema=cal.schema, arrays={**cal.arrays,
                                                                "v_codebook": cal.arrays["v_codebook"][:, ::-1]})
    with pytest.raises(ValueError, match="strictly increasing"):
        load_calibration(cache, unsorted)
    rng = np.random.default_rng(9)
    _, k_post, v = model_rows(rng, 2)
    used = ops.append(load_calibration(cache, cal), [(k_post, v)] * L, 2)
    with pytest.raises(ValueError, match="already holds rows"):
        load_calibration(used, cal)


def test_validate_detects_corruption_and_ledger_categories():
    rng = np.random.default_rng(10)
    s = scheme()
    _, k_post, v = model_rows(rng, 4)
    cache = ops.append(calibrated_cache(s), [(k_post, v)] * L, 4)
    ops.validate(cache)
    g = cache.groups[0]
    for field, fix in (("pos", lambda a: a.at[:, 1, 2].set(7)),
                       ("k_sp_idx", lambda a: a.at[:, 0, 0, 2, 0].set(D + 3)),
                       ("v_scale", lambda a: a.at[:, 1, 1, 3, 0].set(-1.0))):
        bad = cache.replace(groups=(g.replace(**{field: fix(getattr(g, field))}),))
        with pytest.raises(ValueError, match="validate: layer 0"):
            ops.validate(bad)
    nb = s.layer_nbytes(g)
    assert set(nb) == {"codes", "qparams", "sparse", "sink_prefix", "metadata"}
    assert nb["codes"] == L * B * H * C * 2 * (D * 3 // 8)
    assert nb["sparse"] == L * B * H * C * (2 + 1) * (1 + 2)                    # uint8 index + fp16 value


def test_model_forward_appends_pre_rope_rows_at_the_right_positions():
    """Through llama.forward (prefill, then decode steps), the stored keys are the PRE-RoPE keys of positions
    ``lengths + t`` (within the quantization error) and materialize returns them rotated at those positions."""
    from kvquant_jax.eval.errors import exact_qkv
    from kvquant_jax.models.llama import forward
    from kvquant_jax.models.testing import random_params, tiny_config

    cfg = tiny_config(head_dim=16, num_heads=4, num_kv_heads=2, hidden_size=32, num_layers=2)
    params = random_params(cfg, seed=1)
    s = KVQuantScheme(k_bits=4, v_bits=4, k_sparse_capacity=2, v_outliers=1, sink=1, rope_theta=cfg.rope_theta,
                      calibration_id="test-cal")
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, cfg.vocab_size, (1, 12)).astype(np.int32)
    _, k_exact, _ = exact_qkv(params, cfg, jnp.asarray(tokens))                  # post-RoPE [L, 1, T, H, D]
    k_post = np.asarray(k_exact, np.float64)[:, 0]
    k_pre = O.rope64(k_post, np.arange(12)[:, None], cfg.rope_theta, cfg.rope_pairing, inverse=True)
    lo, hi = k_pre.min(axis=1), k_pre.max(axis=1)                               # per-channel ranges [L, H, D]
    cb = np.linspace(-1, 1, 16, dtype=np.float32)
    cal = types.SimpleNamespace(schema=s.calibration_schema(), arrays={
        "k_scale": ((hi - lo) / 2).astype(np.float32), "k_zero": ((hi + lo) / 2).astype(np.float32),
        "k_codebook": np.stack([cb, cb]), "v_codebook": np.stack([cb, cb])})
    cache = load_calibration(init_cache(s, num_layers=2, batch=1, capacity=16, num_kv_heads=2, head_dim=16), cal)
    fwd = jax.jit(forward, static_argnames=("cfg",))
    _, cache, ok = fwd(params, cfg, jnp.asarray(tokens[:, :8]), cache)
    for t in range(8, 12):
        _, cache, ok = fwd(params, cfg, jnp.asarray(tokens[:, t:t + 1]), cache)
        assert bool(ok)
    half_step = (hi - lo) / 30 + 1e-4
    # layer 0 keys depend only on the tokens; layer 1 keys after the prefill read quantized layer-0 history
    for layer, rows in ((0, slice(1, 12)), (1, slice(1, 8))):
        sch, st = layer_state(cache, layer)
        k_st, _, _, pos = decode_stored(sch, st, cache.lengths)
        np.testing.assert_array_equal(np.asarray(pos)[0, :12], np.arange(12))
        err = np.abs(np.asarray(k_st)[0, :, :12].transpose(1, 0, 2) - k_pre[layer])[rows]
        assert (err <= half_step[layer]).all(), err.max()
        k_mat, _, _ = materialize(sch, st, cache.lengths)
        err_post = np.abs(np.asarray(k_mat)[0, :, :12].transpose(1, 0, 2) - k_post[layer])[rows]
        assert err_post.max() <= np.sqrt(2) * half_step[layer].max()


def test_scheme_config_round_trip():
    s = scheme(kernel_family="pallas_kvquant_v1")
    cfg = s.config()
    assert cfg["family"] == "kvquant"
    cfg.pop("family")
    assert KVQuantScheme(**cfg) == s
    assert s.calibration_schema() == dataclasses.replace(s, kernel_family="x", k_sparse_capacity=9) \
        .calibration_schema()
