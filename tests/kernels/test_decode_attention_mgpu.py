"""Mosaic GPU decode attention (pallas_kernels/decode_attention_mgpu.py) vs the float64 oracle.

CPU (always): the pack-time layout conversion (layout_version 1 -> mgpu layout) round-trips against a NumPy oracle
on random codes, and the plain-JAX twin of the kernel on the converted operands matches the float64 oracle.
GPU (Hopper only): the kernel itself, ragged poisoned cases with the current token in the same softmax.
Mosaic GPU's CPU interpreter does not model the wgmma register fragments this kernel uses, so CI cannot run the
kernel; ``interpret=True`` runs the plain-JAX twin instead (tested here).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.reference import decode_attention_reference, unpack_codes
from kvquant_jax.abi.regions import KVFormat, KVOperand, Region
from kvquant_jax.attention.synthetic import PRESETS, random_region
from pallas_kernels import decode_attention_mgpu as mg

FORMATS = ("bf16", "int8", "int4", "e4m3")


def _rel(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _case(rng, name, b=3, hkv=2, g=4, d=128, n=256, poison=True):
    kf, vf = PRESETS[name]
    start = np.array([0, 70, 0][:b], np.int32)
    end = np.array([n, n - 57, 1][:b], np.int32)
    reg = random_region(rng, kf, vf, b, hkv, n, d, start, end, poison=poison and kf.payload != "bf16",
                        qparam_dtype=jnp.float16)
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float32))
    kn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    return q, reg, kn, vn


# ---------------------------------------------------------------------------------------------------------------
# CPU: layout conversion
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("transposed", [False, True])
def test_prepare_codes_round_trip(rng, bits, transposed):
    b, hkv, t, d = 2, 3, 64, 32
    data = rng.integers(0, 256, (b, hkv, t, d * bits // 8), dtype=np.uint8)
    u = unpack_codes(data, bits)                                           # NumPy oracle [B, Hkv, T, D]
    fmt = KVFormat(f"int{bits}", "token", "symmetric")
    sc = jnp.asarray(rng.uniform(0.5, 1.5, (b, hkv, t, 1)).astype(np.float32))
    op = KVOperand(data=jnp.asarray(data), scale=sc, fmt=fmt)
    reg = Region(k=op, v=op, start=jnp.zeros((b,), jnp.int32), end=jnp.full((b,), t, jnp.int32))
    ops = mg.prepare_region(reg)
    codes = ops.v if transposed else ops.k
    assert codes.dtype == (jnp.int8 if bits == 8 else jnp.int4)
    c = np.asarray(codes.astype(jnp.int32))
    want = (u.astype(np.int32) - 2 ** (bits - 1)).reshape(b * hkv, t, d)
    np.testing.assert_array_equal(np.swapaxes(c, 1, 2) if transposed else c, want)
    back = mg.unprepare_codes(c, bits, transposed, b, hkv)
    np.testing.assert_array_equal(back, data)
    np.testing.assert_array_equal(np.asarray(ops.k_scale), np.asarray(sc).reshape(b * hkv, t))


def test_int4_bitcast_is_little_endian():
    """XLA's int4 packing (the bytes the kernel's TMA reads) puts element 0 in the low nibble = layout v1."""
    x = jnp.asarray(np.array([0x21, 0xF3], np.uint8))
    y = np.asarray(jax.lax.bitcast_convert_type(x, jnp.int4).astype(jnp.int32)).ravel()
    np.testing.assert_array_equal(y, [1, 2, 3, -1])


@pytest.mark.parametrize("name", FORMATS)
def test_reference_twin_matches_oracle(rng, name):
    q, reg, kn, vn = _case(rng, name)
    ref = decode_attention_reference(q, [reg], k_new=kn, v_new=vn)
    out = mg.decode_attention_mgpu_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    assert np.isfinite(np.asarray(out)).all()
    assert _rel(out, ref) < 1e-5
    out2 = mg.decode_attention_mgpu(q, reg, k_new=kn, v_new=vn, interpret=True, out_dtype=jnp.float32)
    assert _rel(out2, ref) < 1e-5
    ref64 = mg.decode_attention_mgpu_reference_f64(q, reg, k_new=kn, v_new=vn)
    np.testing.assert_allclose(ref64, ref)


def test_unsupported_formats_say_why(rng):
    for name in ("int2", "qserve"):
        _, reg, _, _ = _case(rng, name, n=128)
        assert mg.mgpu_unsupported(reg, 128)
    _, reg, _, _ = _case(rng, "int4", n=96)
    assert "block_t" in mg.mgpu_unsupported(reg, 128)
    _, reg, _, _ = _case(rng, "int4", n=256)
    assert mg.mgpu_unsupported(reg, 128) is None


def test_spec_swap_ab_shapes(rng):
    """GQA 4 -> N = 8 with the hi/lo duplicate (not padded to 16), GQA 8 -> N = 16, 'bf16' precision -> N = 8."""
    _, reg, _, _ = _case(rng, "int4", n=512)
    ops = mg.prepare_region(reg)
    assert mg._spec_for(ops, 4, mg.MgpuConfig()).n == 8
    assert mg._spec_for(ops, 8, mg.MgpuConfig()).n == 16
    assert mg._spec_for(ops, 4, mg.MgpuConfig(precision="bf16")).n == 8
    assert mg._spec_for(ops, 4, mg.MgpuConfig(num_splits=2)).nbs == 2


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernel
# ---------------------------------------------------------------------------------------------------------------
def _hopper():
    try:
        dev = jax.devices()[0]
    except Exception:  # noqa: BLE001
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


gpu = pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernel needs a Hopper (sm_90) GPU; CPU runs only the "
                                               "layout conversion and the plain-JAX twin")


@gpu
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("precision", ["bf16x2", "bf16"])
def test_kernel_parity(rng, name, precision):
    q, reg, kn, vn = _case(rng, name, n=512)
    q = q.astype(jnp.bfloat16)
    ref = decode_attention_reference(q.astype(jnp.float32), [reg], k_new=kn, v_new=vn)
    out = jax.jit(lambda q, r, kn, vn: mg.decode_attention_mgpu(
        q, r, k_new=kn, v_new=vn, config=mg.MgpuConfig(precision=precision, num_splits=2),
        out_dtype=jnp.float32))(q, reg, kn, vn)
    assert np.isfinite(np.asarray(out)).all()
    assert _rel(out, ref) < 1e-3


@gpu
@pytest.mark.parametrize("g,d", [(8, 128), (4, 64), (4, 256), (3, 64)])
def test_kernel_shapes(rng, g, d):
    q, reg, kn, vn = _case(rng, "int4", b=2, hkv=2, g=g, d=d, n=256)
    q = q.astype(jnp.bfloat16)
    ref = decode_attention_reference(q.astype(jnp.float32), [reg], k_new=kn, v_new=vn)
    out = mg.decode_attention_mgpu(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    assert _rel(out, ref) < 1e-3
