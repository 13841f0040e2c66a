"""W8A8 / W4A8 Pallas GEMM vs an independent float64 NumPy oracle (CPU: generic interpreter and TPU interpreter)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import w8a8_matmul as wm

# (backend, interpret) pairs runnable on CPU: the Triton-structured kernel in the generic interpreter, and the
# Mosaic-TPU-structured kernel in the TPU interpreter (pltpu.InterpretParams()).
BACKENDS = [("gpu", True), ("tpu", True)]

# Relative error bound against sum of |terms| (|s_x s_w acc| + |bias|): float32 epilogue rounding is a few 2^-24;
# a bf16 / fp16 output adds one rounding of 2^-9 / 2^-12 relative.
RTOL = {"float32": 1e-6, "bfloat16": 5e-3, "float16": 1e-3}


def _np_unpack_int4(packed):
    packed = np.asarray(packed, dtype=np.uint8)
    q = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.int64)
    q[..., 0::2] = (packed & 0x0F).astype(np.int64) - 8
    q[..., 1::2] = (packed >> 4).astype(np.int64) - 8
    return q


def _oracle(xq, sx, wq, sw, bias, zp):
    """float64 oracle; wq already int64 [N, K]. Returns (y, magnitude of the summed terms)."""
    x = np.asarray(xq, np.int64)
    acc = x @ wq.T
    if zp is not None:
        acc = acc - np.asarray(zp, np.int64)[:, None] * wq.sum(axis=1)[None, :]
    scaled = acc * np.asarray(sx, np.float64)[:, None] * np.asarray(sw, np.float64)[None, :]
    mag = np.abs(scaled)
    if bias is not None:
        scaled = scaled + np.asarray(bias, np.float64)[None, :]
        mag = mag + np.abs(np.asarray(bias, np.float64))[None, :]
    return scaled, mag


def _inputs(rng, m, n, k, w4, with_bias=True, with_zp=False, scale_dtype=np.float32):
    xq = rng.integers(-128, 128, (m, k), dtype=np.int8)
    if w4:
        w = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)  # any byte is a valid pair of nibbles
        wq = _np_unpack_int4(w)
    else:
        w = rng.integers(-127, 128, (n, k), dtype=np.int8)
        wq = w.astype(np.int64)
    sx = rng.uniform(0.005, 0.05, m).astype(scale_dtype)
    sw = rng.uniform(0.001, 0.02, n).astype(scale_dtype)
    bias = rng.normal(size=n).astype(np.float32) if with_bias else None
    zp = rng.integers(-128, 128, m, dtype=np.int32) if with_zp else None
    return xq, sx, w, wq, sw, bias, zp


def _call(fn, xq, sx, w, sw, bias, zp, **kw):
    return fn(jnp.asarray(xq), jnp.asarray(sx), jnp.asarray(w), jnp.asarray(sw),
              None if bias is None else jnp.asarray(bias),
              x_zero_point=None if zp is None else jnp.asarray(zp), **kw)


def _assert_close(y, ref, mag, out_dtype):
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    assert y.shape == ref.shape
    assert np.isfinite(y).all()
    err = np.abs(y - ref)
    bound = RTOL[out_dtype] * mag + 1e-30
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"max err/bound {np.max(err / bound):.3g} at {worst}"


# ---------------------------------------------------------------------------------------------------------------
# parity
# ---------------------------------------------------------------------------------------------------------------
# (M, N, K, blocks): M and N not multiples of the block; K=384 -> 3 K-steps; K=200 needs K padding.
CASES = [
    (70, 200, 384, dict(block_m=32, block_n=64, block_k=128)),
    (33, 130, 200, dict(block_m=16, block_n=64, block_k=128)),
    (1, 64, 256, {}),
]


@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize("w4", [False, True], ids=["w8a8", "w4a8"])
@pytest.mark.parametrize("affine", [False, True], ids=["sym", "affine"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_parity(backend, interpret, w4, affine, case, rng):
    m, n, k, blocks = CASES[case]
    if backend == "tpu":
        blocks = {key: (v * 2 if key == "block_k" else v) for key, v in blocks.items()}
        if "block_n" in blocks:
            blocks["block_n"] = 128
    out_dtype = ["float32", "bfloat16", "float16"][(case + int(w4) + 2 * int(affine)) % 3]
    xq, sx, w, wq, sw, bias, zp = _inputs(rng, m, n, k, w4, with_bias=case != 2, with_zp=affine)
    fn = wm.w4a8_matmul if w4 else wm.w8a8_matmul
    y = _call(fn, xq, sx, w, sw, bias, zp, out_dtype=getattr(jnp, out_dtype), backend=backend, interpret=interpret,
              **blocks)
    assert y.dtype == jnp.dtype(out_dtype)
    ref, mag = _oracle(xq, sx, wq, sw, bias, zp)
    _assert_close(y, ref, mag, out_dtype)


@pytest.mark.parametrize("case,affine", [(0, True), (1, False)])
def test_w4a8_interleave_decode(case, affine, rng):
    """The alternative GPU W4A8 decode (weight tile unpacked to K order by join + reshape, one dot); the default
    "planes" decode is covered by test_parity."""
    m, n, k, blocks = CASES[case]
    xq, sx, w, wq, sw, bias, zp = _inputs(rng, m, n, k, True, with_zp=affine)
    y = _call(wm.w4a8_matmul, xq, sx, w, sw, bias, zp, out_dtype=jnp.float32, backend="gpu", interpret=True,
              w4_mode="interleave", **blocks)
    ref, mag = _oracle(xq, sx, wq, sw, bias, zp)
    _assert_close(y, ref, mag, "float32")


@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize("w4", [False, True], ids=["w8a8", "w4a8"])
def test_integer_accumulation_is_exact(backend, interpret, w4, rng):
    """Unit scales, no bias, K=256: |acc| < 2**24, so a float32 output must equal the int64 oracle exactly."""
    m, n, k = 40, 72, 256
    xq, _, w, wq, _, _, zp = _inputs(rng, m, n, k, w4, with_bias=False, with_zp=True)
    ones_m, ones_n = np.ones(m, np.float32), np.ones(n, np.float32)
    fn = wm.w4a8_matmul if w4 else wm.w8a8_matmul
    # affine: exactness of the raw dot and of the int32 zero-point correction (|acc - z*w_sum| < 2**24 here)
    y = _call(fn, xq, ones_m, w, ones_n, None, zp, out_dtype=jnp.float32, backend=backend, interpret=interpret,
              block_m=32, block_n=64 if backend == "gpu" else 128, block_k=128 if backend == "gpu" else 256)
    ref, _ = _oracle(xq, ones_m, wq, ones_n, None, zp)
    np.testing.assert_array_equal(np.asarray(y, np.float64), ref)


def test_fp16_bf16_scales_and_precomputed_wsum(rng):
    m, n, k = 24, 48, 128
    xq, sx, w, wq, sw, bias, zp = _inputs(rng, m, n, k, False, with_zp=True, scale_dtype=np.float16)
    wsum = jnp.asarray(wq.sum(axis=1).astype(np.int32))
    y = wm.w8a8_matmul(jnp.asarray(xq), jnp.asarray(sx), jnp.asarray(w), jnp.asarray(sw).astype(jnp.bfloat16),
                       jnp.asarray(bias), x_zero_point=jnp.asarray(zp), w_sum=wsum, out_dtype=jnp.float32,
                       interpret=True)
    sw_bf = np.asarray(jnp.asarray(sw).astype(jnp.bfloat16).astype(jnp.float32))
    ref, mag = _oracle(xq, sx, wq, sw_bf, bias, zp)
    _assert_close(y, ref, mag, "float32")


@pytest.mark.parametrize("w4", [False, True], ids=["w8a8", "w4a8"])
def test_reference_matches_oracle_and_jit(w4, rng):
    m, n, k = 19, 40, 96
    xq, sx, w, wq, sw, bias, zp = _inputs(rng, m, n, k, w4, with_zp=True)
    ref_fn = wm.w4a8_matmul_reference if w4 else wm.w8a8_matmul_reference
    fn = wm.w4a8_matmul if w4 else wm.w8a8_matmul
    ref, mag = _oracle(xq, sx, wq, sw, bias, zp)
    _assert_close(_call(ref_fn, xq, sx, w, sw, bias, zp, out_dtype=jnp.float32), ref, mag, "float32")
    jitted = jax.jit(lambda *a: fn(*a[:5], x_zero_point=a[5], out_dtype=jnp.float32, interpret=True))
    y = jitted(*(jnp.asarray(v) for v in (xq, sx, w, sw, bias, zp)))
    _assert_close(y, ref, mag, "float32")


def test_pack_int4_layout():
    q = np.array([[-8, 7, 0, -1, 3, -7]], dtype=np.int8)
    packed = np.asarray(wm.pack_int4(jnp.asarray(q)))
    # element k at bit offset 4*(k % 2) of byte k // 2, offset-binary u = q + 8
    expected = np.array([[0 | (15 << 4), 8 | (7 << 4), 11 | (1 << 4)]], dtype=np.uint8)
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(np.asarray(wm.unpack_int4(jnp.asarray(packed))), q)
    np.testing.assert_array_equal(_np_unpack_int4(packed), q.astype(np.int64))


# ---------------------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------------------
def _good(m=8, n=16, k=32):
    return dict(
        x_q=jnp.zeros((m, k), jnp.int8) + 1, x_scale=jnp.ones((m,), jnp.float32),
        w_q=jnp.ones((n, k), jnp.int8), w_scale=jnp.ones((n,), jnp.float32), bias=jnp.zeros((n,), jnp.float32))


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(x_q=a["x_q"].astype(jnp.float32)), "x_q must be int8"),
    (lambda a: a.update(x_q=a["x_q"][0]), "x_q must be int8"),
    (lambda a: a.update(w_q=a["w_q"].astype(jnp.uint8)), "w_q must be int8"),
    (lambda a: a.update(w_q=a["w_q"][:, :16]), "K dimension"),
    (lambda a: a.update(x_scale=a["x_scale"][:3]), "x_scale must be float"),
    (lambda a: a.update(x_scale=a["x_scale"].astype(jnp.int32)), "x_scale must be float"),
    (lambda a: a.update(w_scale=a["w_scale"].at[2].set(jnp.nan)), "w_scale has non-finite"),
    (lambda a: a.update(x_scale=a["x_scale"].at[1].set(jnp.inf)), "x_scale has non-finite"),
    (lambda a: a.update(w_scale=a["w_scale"].at[0].set(0.0)), "w_scale must be > 0"),
    (lambda a: a.update(bias=a["bias"][:4]), "bias must be float"),
    (lambda a: a.update(bias=a["bias"].at[3].set(jnp.nan)), "bias has non-finite"),
])
def test_bad_inputs_w8a8(mutate, match):
    a = _good()
    mutate(a)
    with pytest.raises(ValueError, match=match):
        wm.w8a8_matmul(a["x_q"], a["x_scale"], a["w_q"], a["w_scale"], a["bias"], interpret=True)


def test_bad_inputs_misc():
    a = _good()
    args = (a["x_q"], a["x_scale"], a["w_q"], a["w_scale"])
    with pytest.raises(ValueError, match="out_dtype"):
        wm.w8a8_matmul(*args, out_dtype=jnp.int8, interpret=True)
    with pytest.raises(ValueError, match="x_zero_point must lie in"):
        wm.w8a8_matmul(*args, x_zero_point=jnp.full((8,), 300, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="x_zero_point must be int32"):
        wm.w8a8_matmul(*args, x_zero_point=jnp.zeros((8,), jnp.int8), interpret=True)
    with pytest.raises(ValueError, match="w_sum is only used"):
        wm.w8a8_matmul(*args, w_sum=jnp.zeros((16,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        wm.w8a8_matmul(*args, block_m=24, interpret=True)
    with pytest.raises(ValueError, match="exceeds"):
        big = jnp.zeros((1, wm.MAX_K + 2), jnp.int8)
        wm.w8a8_matmul(big, jnp.ones((1,), jnp.float32), big, jnp.ones((1,), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="backend"):
        wm.w8a8_matmul(*args, backend="cuda", interpret=True)
    # W4A8 shapes / dtypes
    xs, sx = a["x_q"], a["x_scale"]
    with pytest.raises(ValueError, match="w_packed must be uint8"):
        wm.w4a8_matmul(xs, sx, jnp.zeros((16, 16), jnp.int8), a["w_scale"], interpret=True)
    with pytest.raises(ValueError, match="does not match"):
        wm.w4a8_matmul(xs, sx, jnp.zeros((16, 32), jnp.uint8), a["w_scale"], interpret=True)
    with pytest.raises(ValueError, match="even"):
        wm.w4a8_matmul(jnp.zeros((8, 31), jnp.int8), sx, jnp.zeros((16, 15), jnp.uint8), a["w_scale"],
                       interpret=True)
    with pytest.raises(ValueError, match="w4_mode"):
        wm.w4a8_matmul(xs, sx, jnp.zeros((16, 16), jnp.uint8), a["w_scale"], w4_mode="bogus", interpret=True)
    with pytest.raises(ValueError, match="even K"):
        wm.pack_int4(jnp.zeros((2, 3), jnp.int8))
