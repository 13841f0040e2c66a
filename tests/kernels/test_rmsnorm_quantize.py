"""Fused RMSNorm -> INT8 (Pallas) vs an independent float64 NumPy oracle; CPU generic and TPU interpreters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rmsnorm_quantize as rq

BACKENDS = [("gpu", True), ("tpu", True)]


def _oracle(x, w, eps, qdtype):
    """Design §0x02D in float64: returns (y, codes, stored scale) for finite inputs."""
    x = np.asarray(x, np.float64)
    y = (x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)) * np.asarray(w, np.float64)
    amax = np.abs(y).max(axis=1)
    zero = amax == 0
    with np.errstate(over="ignore", under="ignore"):
        scale = np.where(zero, 1.0, amax / 127).astype(qdtype)
    eff = scale.astype(np.float64)
    codes = np.clip(np.rint(y / eff[:, None]), -127, 127)
    codes[zero] = 0
    return y, codes.astype(np.int64), scale


def _check_rows(codes, scale, status, x, w, eps, qdtype):
    """Parity with explicit tolerances: stored scale within one qparam ulp (float32 arithmetic inside the kernel);
    codes equal to the oracle's encoding with the kernel's own stored scale except at float32 rounding ties."""
    y, codes_o, scale_o = _oracle(x, w, eps, qdtype)
    codes = np.asarray(codes, np.int64)
    scale = np.asarray(scale)
    assert scale.dtype == np.dtype(qdtype)
    np.testing.assert_array_equal(np.asarray(status), 0)
    itype = np.int16 if np.dtype(qdtype) == np.float16 else np.int32
    ulps = np.abs(scale.view(itype).astype(np.int64) - scale_o.view(itype).astype(np.int64))
    assert ulps.max() <= (1 if np.dtype(qdtype) == np.float16 else 8), f"scale off by {ulps.max()} ulp"
    # encode the float64 y with the kernel's stored scale: must match except where y/s is within float32 noise of
    # a .5 tie.
    v = y / scale.astype(np.float64)[:, None]
    codes_k = np.clip(np.rint(v), -127, 127).astype(np.int64)
    diff = codes != codes_k
    assert np.abs(codes - codes_k).max() <= 1
    if diff.any():
        near_tie = np.abs(np.abs(v - np.trunc(v)) - 0.5) <= 1e-5 * np.maximum(np.abs(v), 1.0)
        assert (near_tie | ~diff).all(), "code mismatch away from a rounding tie"
    # and against the oracle's own codes: at most one step apart (the two scales may differ by one ulp)
    assert np.abs(codes - codes_o).max() <= 1
    assert np.mean(codes != codes_o) < 0.02


CASES = [  # (M, K, block_rows, x dtype): M tail, K not a power of two / not a multiple of 128
    (37, 96, 8, "float32"),
    (16, 256, None, "bfloat16"),
    (5, 1000, 4, "float16"),
]


@pytest.mark.parametrize("one_pass", [True, False], ids=["onepass", "twopass"])
@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize("qdtype", [np.float16, np.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_parity(backend, interpret, qdtype, case, one_pass, rng):
    m, k, br, xdtype = CASES[case]
    if backend == "tpu" and br is not None:
        br = 32 if m > 32 else None
    x = rng.normal(size=(m, k)) * rng.uniform(0.05, 20.0, (m, 1))
    x[min(2, m - 1)] = 0.0  # an all-zero row
    xj = jnp.asarray(x, getattr(jnp, xdtype))
    w = jnp.asarray(rng.uniform(0.2, 2.0, k), jnp.bfloat16 if xdtype == "bfloat16" else jnp.float32)
    codes, scale, status = rq.rmsnorm_quantize(xj, w, eps=1e-5, qparam_dtype=qdtype, block_rows=br, backend=backend,
                                               interpret=interpret, one_pass=one_pass)
    assert codes.dtype == jnp.int8 and codes.shape == (m, k) and status.dtype == jnp.int32
    xin = np.asarray(xj.astype(jnp.float32))
    _check_rows(codes, scale, status, xin, np.asarray(w.astype(jnp.float32)), 1e-5, qdtype)
    zr = min(2, m - 1)
    assert np.asarray(scale)[zr] == 1 and not np.asarray(codes)[zr].any()


@pytest.mark.parametrize("m,k,br,nprog,one_pass", [(37, 96, 8, 2, True), (5, 1000, 1, 3, False)])
def test_persistent_variant(m, k, br, nprog, one_pass, rng):
    """GPU-path persistent kernel (each program loops over row blocks, prefetching the next one)."""
    x = rng.normal(size=(m, k)) * rng.uniform(0.05, 20.0, (m, 1))
    x[1] = 0.0
    xj = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.2, 2.0, k), jnp.float32)
    codes, scale, status = rq.rmsnorm_quantize(xj, w, qparam_dtype=np.float16, block_rows=br, num_programs=nprog,
                                               backend="gpu", interpret=True, one_pass=one_pass)
    _check_rows(codes, scale, status, np.asarray(xj.astype(jnp.float32)), np.asarray(w), 1e-6, np.float16)


@pytest.mark.parametrize("one_pass", [True, False], ids=["onepass", "twopass"])
@pytest.mark.parametrize("m,k,br", [(37, 96, 8), (16, 256, None), (5, 1000, 4)])
def test_reload_variant_and_reference_agreement(m, k, br, one_pass, rng):
    """reload=True (x, w re-read for the encode step) gives the same results as keeping them live, and the kernel
    agrees with rmsnorm_quantize_reference under the same one_pass flag (exactly, up to float32 reduction order)."""
    x = rng.normal(size=(m, k)) * rng.uniform(0.05, 20.0, (m, 1))
    x[1] = 0.0
    xj = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.2, 2.0, k), jnp.float32)
    kw = dict(qparam_dtype=np.float16, block_rows=br, backend="gpu", interpret=True, one_pass=one_pass)
    live = rq.rmsnorm_quantize(xj, w, **kw)
    rel = rq.rmsnorm_quantize(xj, w, reload=True, **kw)
    for a, b in zip(live, rel):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref = rq.rmsnorm_quantize_reference(xj, w, qparam_dtype=np.float16, one_pass=one_pass)
    np.testing.assert_array_equal(np.asarray(live[2]), np.asarray(ref[2]))
    s_k, s_r = np.asarray(live[1]), np.asarray(ref[1])
    assert np.abs(s_k.view(np.int16).astype(int) - s_r.view(np.int16).astype(int)).max() <= 1
    assert np.abs(np.asarray(live[0], int) - np.asarray(ref[0], int)).max() <= 1
    assert np.mean(np.asarray(live[0]) != np.asarray(ref[0])) < 0.01
    _check_rows(*live, np.asarray(xj.astype(jnp.float32)), np.asarray(w), 1e-6, np.float16)


def test_one_pass_vs_two_pass_scales_within_one_ulp(rng):
    """The two amax formulations agree to float32 rounding: stored fp32 scales within a few ulps, codes within 1."""
    x = jnp.asarray(rng.normal(size=(64, 512)) * rng.uniform(0.05, 20.0, (64, 1)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.2, 2.0, 512), jnp.float32)
    a = rq.rmsnorm_quantize_reference(x, w, one_pass=True)
    b = rq.rmsnorm_quantize_reference(x, w, one_pass=False)
    ulps = np.abs(np.asarray(a[1]).view(np.int32).astype(np.int64) - np.asarray(b[1]).view(np.int32).astype(np.int64))
    assert ulps.max() <= 4
    assert np.abs(np.asarray(a[0], int) - np.asarray(b[0], int)).max() <= 1


def test_reload_rejected_outside_grid_kernel():
    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    for kw in (dict(backend="tpu"), dict(backend="gpu", num_programs=2)):
        with pytest.raises(ValueError, match="reload=True"):
            rq.rmsnorm_quantize(x, w, reload=True, interpret=True, **kw)


def test_reference_matches_oracle_and_leading_dims(rng):
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    for fn in (rq.rmsnorm_quantize_reference, rq.rmsnorm_quantize):
        codes, scale, status = fn(jnp.asarray(x), jnp.asarray(w), qparam_dtype=jnp.float16, interpret=True)
        assert codes.shape == (2, 3, 64) and scale.shape == (2, 3) and status.shape == (2, 3)
        _check_rows(np.asarray(codes).reshape(6, 64), np.asarray(scale).reshape(6), np.asarray(status).reshape(6),
                    x.reshape(6, 64), w, 1e-6, np.float16)


def test_rint_half_even():
    v = np.concatenate([np.arange(-130, 131) + 0.5, np.arange(-130, 131) + 0.0,
                        np.random.default_rng(3).uniform(-130, 130, 2000),
                        np.nextafter(np.arange(-10, 11) + 0.5, 100), np.nextafter(np.arange(-10, 11) + 0.5, -100)])
    v = v.astype(np.float32)
    expected = np.rint(v).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(rq._rint_to_int32)(jnp.asarray(v))), expected)
    np.testing.assert_array_equal(np.asarray(rq._rint_to_int32(jnp.asarray(v))), expected)


def test_jit_returns_status_without_raising(rng):
    x = rng.normal(size=(6, 128)).astype(np.float32)
    x[4, 7] = np.nan
    w = np.ones(128, np.float32)
    f = jax.jit(lambda a, b: rq.rmsnorm_quantize(a, b, interpret=True))
    codes, scale, status = f(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(status), [0, 0, 0, 0, rq.STATUS_NONFINITE, 0])
    assert np.isnan(np.asarray(scale)[4]) and not np.asarray(codes)[4].any()


# ---------------------------------------------------------------------------------------------------------------
# bad rows: non-finite, FTZ-unsafe scales
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("one_pass", [True, False], ids=["onepass", "twopass"])
@pytest.mark.parametrize("backend,interpret", BACKENDS)
def test_nonfinite_rows(backend, interpret, one_pass, rng):
    m, k = 8, 128
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[1, 5] = np.nan
    x[3, 0] = np.inf
    x[6, :] = 1e20  # finite, but sum(x^2) overflows float32
    w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    with pytest.raises(ValueError, match=r"3 non-finite row\(s\).*\[1, 3, 6\]"):
        rq.rmsnorm_quantize(jnp.asarray(x), jnp.asarray(w), backend=backend, interpret=interpret, one_pass=one_pass)
    codes, scale, status = rq.rmsnorm_quantize(jnp.asarray(x), jnp.asarray(w), backend=backend, interpret=interpret,
                                               check=False, one_pass=one_pass)
    st = np.asarray(status)
    np.testing.assert_array_equal(st, [0, 1, 0, 1, 0, 0, 1, 0])
    bad = st != 0
    assert np.isnan(np.asarray(scale)[bad]).all() and not np.asarray(codes)[bad].any()
    good = ~bad
    _check_rows(np.asarray(codes)[good], np.asarray(scale)[good], st[good], x[good], w, 1e-6, np.float32)


@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize("qdtype,gamma,what", [
    (np.float16, 1e-6, "underflow to subnormal/zero"),
    (np.float16, 1e7, "overflow"),
    (np.float32, 1e-37, "float32 subnormal"),
])
def test_ftz_unsafe_scales(backend, interpret, qdtype, gamma, what, rng):
    m, k = 4, 128
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = np.ones(k, np.float32)
    w_bad = w * np.float32(gamma)
    with pytest.raises(ValueError, match=r"FTZ-unsafe stored scale"):
        rq.rmsnorm_quantize(jnp.asarray(x), jnp.asarray(w_bad), qparam_dtype=qdtype, backend=backend,
                            interpret=interpret)
    codes, scale, status = rq.rmsnorm_quantize(jnp.asarray(x), jnp.asarray(w_bad), qparam_dtype=qdtype,
                                               backend=backend, interpret=interpret, check=False)
    np.testing.assert_array_equal(np.asarray(status), rq.STATUS_FTZ_UNSAFE)
    assert np.isnan(np.asarray(scale, np.float32)).all() and not np.asarray(codes).any()
    # an all-zero row stays valid (scale 1, codes 0) even with the tiny gamma
    x[2] = 0
    _, scale, status = rq.rmsnorm_quantize(jnp.asarray(x), jnp.asarray(w_bad), qparam_dtype=qdtype, backend=backend,
                                           interpret=interpret, check=False)
    assert np.asarray(status)[2] == 0 and np.asarray(scale)[2] == 1


# ---------------------------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(x=np.ones((4, 8), np.int8)), "x must be float32/bfloat16/float16"),
    (dict(x=np.ones((8,), np.float32)), "ndim >= 2"),
    (dict(x=np.ones((0, 8), np.float32)), "non-empty"),
    (dict(w=np.ones((7,), np.float32)), r"weight must be a float \[8\]"),
    (dict(w=np.ones((8,), np.int32)), "weight must be a float"),
    (dict(w=np.full((8,), np.nan, np.float32)), "weight has non-finite"),
    (dict(qparam_dtype=jnp.bfloat16), "qparam_dtype must be float16 or float32"),
    (dict(eps=0.0), "eps must be finite and > 0"),
    (dict(eps=float("nan")), "eps must be finite and > 0"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_arguments(kwargs, match):
    args = dict(x=np.ones((4, 8), np.float32), w=np.ones((8,), np.float32), qparam_dtype=jnp.float32, eps=1e-6,
                backend=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rq.rmsnorm_quantize(jnp.asarray(args["x"]), jnp.asarray(args["w"]), qparam_dtype=args["qparam_dtype"],
                            eps=args["eps"], backend=args["backend"], interpret=True)


@pytest.mark.parametrize("one_pass", [True, False], ids=["onepass", "twopass"])
@pytest.mark.parametrize("qdtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_codes_saturate_at_127_without_a_clip(one_pass, qdtype, rng):
    """The encode has no clip (|y / s_eff| <= 127.07 by construction): every non-zero row reaches exactly +-127 at
    its absmax element, nothing lies outside [-127, 127] (-128 never appears), on rows with extreme outliers and
    with scales that round down in fp16."""
    m, k = 64, 300
    x = rng.normal(size=(m, k)) * rng.uniform(1e-3, 1e3, (m, 1))
    x[np.arange(m), rng.integers(0, k, m)] *= rng.uniform(1, 1e3, m)          # one outlier per row
    w = rng.uniform(0.01, 3.0, k)
    codes, scale, status = rq.rmsnorm_quantize(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                                               qparam_dtype=qdtype, backend="gpu", interpret=True, one_pass=one_pass)
    c = np.asarray(codes, np.int64)
    np.testing.assert_array_equal(np.asarray(status), 0)
    assert c.min() >= -127 and c.max() <= 127
    np.testing.assert_array_equal(np.abs(c).max(axis=1), 127)
