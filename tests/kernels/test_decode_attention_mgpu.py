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


def _emulated_launch(start, end, lscale, qb, k, v, ks, vs, sp):
    """The kernel's launch contract (``_mgpu_call``'s docstring) in float64 NumPy: program ``pid`` reads the bounds
    of sequence ``pid // Hkv`` and the logit scale of head ``pid % Hkv``; split ``sid`` covers its ``nbs`` blocks;
    ``m`` in log2 units; with the hi/lo duplicate the hi columns carry p and the lo columns 0 (their sum is p)."""
    f64 = lambda a: None if a is None else np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)  # noqa: E731
    start, end = np.asarray(start), np.asarray(end)
    lscale, qb, k, v, ks, vs = (f64(a) for a in (lscale, qb, k, v, ks, vs))
    bh, n, d, chunk = qb.shape[0], sp.n, sp.d, sp.nbs * sp.bt
    o = np.zeros((bh, sp.ns, d, n))
    m = np.full((bh, sp.ns, n), -1e30)
    l = np.zeros((bh, sp.ns, n))
    for pid in range(bh):
        lo, hi, lsc = start[pid // sp.hkv], end[pid // sp.hkv], lscale[pid % sp.hkv]
        vt = v[pid] if sp.v_regs else v[pid].T                                 # [D, T]
        for sid in range(sp.ns):
            rows = np.arange(sid * chunk, (sid + 1) * chunk)
            s = k[pid, rows] @ qb[pid].sum(axis=0).T * lsc                     # [rows, N] log2 units
            if ks is not None:
                s = s * ks[pid, rows][:, None]
            live = (rows >= lo) & (rows < hi)
            if not live.any():
                continue
            m[pid, sid] = s[live].max(axis=0)
            p = np.where(live[:, None], np.exp2(s - m[pid, sid]), 0.0)
            l[pid, sid] = p.sum(axis=0)
            if vs is not None:
                p = np.where(live[:, None], p * vs[pid, rows][:, None], 0.0)
            if sp.dup:
                p[:, sp.dup:] = 0.0
            o[pid, sid] = np.where(live[None, :], vt[:, rows], 0.0) @ p         # dead rows may hold NaN
    return tuple(jnp.asarray(a, jnp.float32) for a in (o, m, l))


@pytest.mark.parametrize("name", FORMATS)
def test_wrapper_launch_contract(rng, name):
    """``_kernel_partials`` + ``_merge_partials`` around an emulated launch (float64) match the float64 oracle:
    per-sequence bounds (ragged, different per sequence, 3 sequences x 2 KV heads so ``pid // Hkv`` and ``pid``
    differ), the per-head logit / V scales of FP8, two splits, the hi/lo query duplicate and the current token.
    Fails if the wrapper hands the launch per-program arrays the kernel would index by sequence, or the merge
    drops a partial."""
    q, reg, kn, vn = _case(rng, name, n=512)
    if name == "e4m3":
        hs = jnp.asarray([0.75, 1.5], jnp.float32)
        reg = Region(k=KVOperand(reg.k.data, hs, None, reg.k.fmt), v=KVOperand(reg.v.data, hs[::-1], None, reg.v.fmt),
                     start=reg.start, end=reg.end)
    mma = jnp.float16 if name == "e4m3" else jnp.bfloat16
    q = q.astype(mma).astype(jnp.float32)                                      # exact in the MMA dtype
    ops = mg.prepare_region(reg)
    sp = mg._spec_for(ops, 4, mg.MgpuConfig(num_splits=2), q.dtype)
    assert sp.hkv == 2 and sp.ns == 2
    part = mg._kernel_partials(_emulated_launch, q, ops, sp, None)
    out = mg._merge_partials(q, part, ops.num_kv_heads, None, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    ref = mg.decode_attention_mgpu_reference_f64(q, reg, k_new=kn, v_new=vn)
    assert _rel(out, ref) < 1e-5


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


@gpu
@pytest.mark.parametrize("impl", ["mgpu", "mgpu_ws"])
def test_dense_layer_served_in_place_through_dispatch(rng, monkeypatch, impl):
    """A bf16 full-precision layer (ragged lengths, the current token) through ``attention.dispatch`` under jit,
    routed to the Mosaic kernel (the table's choice forced to ``impl``): the kernel reads the cache in place and
    matches the float64 oracle over the same rows."""
    from kvquant_jax.attention import dispatch
    from kvquant_jax.cache.full import FullPrecisionScheme

    monkeypatch.setattr(dispatch.decode_tuning, "choose", lambda *a, **k: (impl, {}, f"forced {impl}"))
    b, hkv, g, d, cap = 3, 2, 4, 128, 1024
    scheme = FullPrecisionScheme(dtype="bf16")
    st = scheme.init_layer(b, cap, hkv, d)
    lengths = jnp.zeros((b,), jnp.int32)
    fill = jnp.asarray([cap - 128, 700, 5], jnp.int32)
    k = jnp.asarray(rng.standard_normal((b, cap, hkv, d)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((b, cap, hkv, d)).astype(np.float32))
    st = scheme.append_layer(st, lengths, k, v, fill)
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float32)).astype(jnp.bfloat16)
    kn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    dispatch.SERVED.clear()
    out = jax.jit(lambda q, st, ln, kn, vn: dispatch.decode_attention(q, scheme, st, ln, kn, vn,
                                                                       out_dtype=jnp.float32))(q, st, fill, kn, vn)
    served = [key[0] for key in dispatch.SERVED]
    assert served == [{"mgpu": "decode_attention_mgpu", "mgpu_ws": "decode_attention_mgpu_ws"}[impl]], served
    regions, _ = scheme.decode_regions(st, fill)
    ref = decode_attention_reference(q.astype(jnp.float32), regions, k_new=kn, v_new=vn)
    assert np.isfinite(np.asarray(out)).all()
    assert _rel(out, ref) < 1e-3
