"""Non-uniform (codebook) codes and the dense-and-sparse outlier split (design notes 0x07C, 0x07D)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvquant_jax.quant as Q
from quant_oracles import nearest_index, random_tensor


def random_codebook(rng, bits):
    cb = np.sort(rng.uniform(-1, 1, 2**bits)).astype(np.float32)
    return np.unique(cb) if np.unique(cb).size == cb.size else np.linspace(-1, 1, 2**bits, dtype=np.float32)


@given(seed=st.integers(0, 2**32 - 1), bits=st.integers(1, 5))
@settings(max_examples=25)
def test_nuq_encode_nearest_signpost(seed, bits):
    rng = np.random.default_rng(seed)
    cb = random_codebook(rng, bits)
    x = rng.uniform(-1.3, 1.3, (4, 33)).astype(np.float32)
    x[0, : cb.size] = cb                                                   # signposts encode to themselves
    codes = np.asarray(Q.nuq_encode(x, cb))
    want, gap = nearest_index(x, cb)
    tie = gap <= 1e-6 * (1 + np.abs(x))
    assert ((codes == want) | tie).all()
    np.testing.assert_array_equal(codes[0, : cb.size], np.arange(cb.size))
    np.testing.assert_array_equal(np.asarray(Q.nuq_decode(codes, cb)), cb[codes])


def test_nuq_ties_go_to_lower_index():
    cb = np.array([-1.0, -0.5, 0.0, 0.5], np.float32)
    x = np.array([-0.75, -0.25, 0.25, 2.0, -5.0], np.float32)               # exact midpoints, then outside
    np.testing.assert_array_equal(np.asarray(Q.nuq_encode(x, cb)), [0, 1, 2, 3, 0])


@given(seed=st.integers(0, 2**32 - 1), axis=st.sampled_from([1, 2]), dtype=st.sampled_from([jnp.float16,
                                                                                           jnp.float32]))
@settings(max_examples=20)
def test_quantize_nuq_round_trip(seed, axis, dtype):
    rng = np.random.default_rng(seed)
    cb = random_codebook(rng, 3)
    cb[0], cb[-1] = -1.0, 1.0                                                # cover the normalized range
    x = random_tensor(seed, (2, 8, 8), 0.0, 1.0, axis=axis)
    got = Q.quantize_nuq(x, cb, axis=axis, group_size=4, qparam_dtype=dtype)
    assert got.scale.dtype == dtype and got.scale.shape[axis] == 2
    back = np.asarray(Q.dequantize_nuq(*got, cb, axis=axis, group_size=4), np.float64)
    s = np.repeat(np.asarray(got.scale, np.float64), 4, axis=axis)
    o = np.repeat(np.asarray(got.offset, np.float64), 4, axis=axis)
    half_gap = np.max(np.diff(cb.astype(np.float64))) / 2
    # error <= half the widest codebook gap (scaled), plus qparam rounding that can push values outside [-1, 1]
    outside = np.maximum(np.abs((x - o) / s) - 1.0, 0.0)
    assert (np.abs(back - x) <= s * (half_gap + outside) * (1 + 1e-3) + 1e-6).all()
    want, gap = nearest_index(np.clip((x - o) / s, -2, 2), cb)
    assert ((np.asarray(got.codes) == want) | (gap <= 1e-5)).all()


def test_nuq_constant_group_exact_and_bad_codebooks():
    cb = np.array([-1.0, -0.3, 0.2, 1.0], np.float32)
    x = np.array([[0.75, 0.75, 0.75, 0.75], [0.0, 1.0, -1.0, 0.5]], np.float32)
    got = Q.quantize_nuq(x, cb, qparam_dtype=jnp.float32)
    assert float(got.scale[0, 0]) == 0.0
    np.testing.assert_array_equal(np.asarray(Q.dequantize_nuq(*got, cb))[0], x[0])
    for bad, match in [(cb[::-1], "increasing"), (cb[:3], "2\\*\\*bits"), (np.array([0.0, np.nan], np.float32),
                                                                             "non-finite"),
                       (np.array([0.0, 0.0], np.float32), "increasing")]:
        with pytest.raises(ValueError, match=match):
            Q.nuq_encode(x, bad)
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize_nuq(np.array([[np.nan, 1.0]], np.float32), cb)


# ------------------------------------------------------------------------------------------------ sparse
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(1, 5), axis=st.sampled_from([0, 1]))
@settings(max_examples=25)
def test_split_full_value_replacement_exact_holes(seed, capacity, axis):
    x = random_tensor(seed, (5, 12), 0.0, 1.0, axis=1 - axis)
    xm = np.moveaxis(x, axis, -1)
    t = np.quantile(np.abs(xm), 0.7, axis=-1, keepdims=True).astype(np.float32)     # per-vector thresholds
    lower, upper = np.moveaxis(-t, -1, axis), np.moveaxis(t, -1, axis)
    split = Q.split_dense_sparse(x, lower, upper, capacity, axis=axis)
    sp = split.sparse
    idx, val, cnt, ovf = (np.asarray(a) for a in sp)
    dm = np.moveaxis(np.asarray(split.dense_mask), axis, -1)
    dense = np.moveaxis(np.asarray(split.dense), axis, -1)
    for r in range(xm.shape[0]):
        out = np.flatnonzero(np.abs(xm[r]) > t[r, 0])
        kept_want = out[np.argsort(-np.abs(xm[r][out]), kind="stable")][:capacity]   # largest |x| first
        assert cnt[r] == kept_want.size and ovf[r] == out.size - kept_want.size
        np.testing.assert_array_equal(idx[r][: cnt[r]], np.sort(kept_want))            # ascending coordinates
        assert (idx[r][cnt[r]:] == -1).all() and (val[r][cnt[r]:] == 0).all()
        np.testing.assert_array_equal(val[r][: cnt[r]], xm[r][np.sort(kept_want)])     # FULL values
        assert (dm[r] == ~np.isin(np.arange(xm.shape[1]), kept_want)).all()
        assert (dense[r][kept_want] == 0).all() and (dense[r][dm[r]] == xm[r][dm[r]]).all()
    # dense path: quantize without the kept outliers; holes decode to exactly 0; merge restores exact values
    dq = Q.quantize_affine(split.dense, 3, axis=axis, qparam_dtype=jnp.float32, mask=split.dense_mask)
    dec = Q.dequantize_affine(*dq, axis=axis)
    holes = np.moveaxis(np.asarray(Q.apply_holes(dec, sp, axis=axis)), axis, -1)
    merged = np.moveaxis(np.asarray(Q.merge_dense_sparse(dec, sp, axis=axis)), axis, -1)
    assert (holes[~dm] == 0).all()
    np.testing.assert_array_equal(merged[~dm], xm[~dm])
    np.testing.assert_array_equal(merged[dm], np.moveaxis(np.asarray(dec), axis, -1)[dm])
    assert np.abs(merged - xm).max() <= np.abs(xm).max()                               # sanity: bounded


def test_overflow_policy_and_thresholds():
    x = np.array([[0.1, -9.0, 0.2, 5.0, -7.0, 0.0, 7.0, 0.3]], np.float32)
    split = Q.split_dense_sparse(x, -1.0, 1.0, capacity=2)
    np.testing.assert_array_equal(np.asarray(split.sparse.indices), [[1, 4]])   # |-9| then |-7| (tie: lower idx)
    np.testing.assert_array_equal(np.asarray(split.sparse.values), [[-9.0, -7.0]])
    assert int(split.sparse.count[0]) == 2 and int(split.sparse.overflow[0]) == 2
    np.testing.assert_array_equal(np.asarray(split.dense), np.float32([[0.1, 0, 0.2, 5.0, 0, 0.0, 7.0, 0.3]]))
    lo, hi = Q.magnitude_thresholds(x, 3)
    assert lo.shape == (1, 1) and float(hi[0, 0]) == 5.0 and float(lo[0, 0]) == -5.0
    assert int(Q.outlier_mask(x, lo, hi).sum()) == 3                   # strictly above the 4th largest |x|
    lo, hi = Q.magnitude_thresholds(x, 2)                                # 3rd largest |x| = 7 ties with the 2nd
    assert int(Q.outlier_mask(x, lo, hi).sum()) == 1                   # ties at the threshold stay dense
    np.testing.assert_array_equal(np.asarray(Q.sparse_to_dense(split.sparse, 8)), [[0, -9, 0, 0, -7, 0, 0, 0]])
    jitted = jax.jit(lambda a: Q.split_dense_sparse(a, -1.0, 1.0, capacity=2))(x)
    np.testing.assert_array_equal(np.asarray(jitted.sparse.indices), [[1, 4]])
    for kwargs, match in [(dict(capacity=0), "capacity"), (dict(capacity=9), "capacity")]:
        with pytest.raises(ValueError, match=match):
            Q.split_dense_sparse(x, -1.0, 1.0, **kwargs)
    with pytest.raises(ValueError, match="non-finite"):
        Q.split_dense_sparse(np.array([[np.inf, 1.0]], np.float32), -1.0, 1.0, capacity=1)
