"""Mosaic GPU per-token INT2 / INT4 decode attention (pallas_kernels/decode_attention_mgpu_planar.py): CPU checks.

* ``prepare_token_planar_region`` stores the codes in the token-planar layout (K and V^T), the K scale row and
  its zero row (none when symmetric) and V's scale / zero transposed, in the region's qparam dtype.
* The plain-JAX twin of the kernel algebra (the planes read as the kernel reads them, ``s_t (u . q') + m_t sum q'``,
  the min of each zero convention formed per row) matches the float64 oracle on ragged, poisoned regions with
  the current token in the same softmax: INT2 / INT4, symmetric / offset / min zeros, V groups, D 64 / 128 / 256,
  GQA 1 / 3 / 4 / 8, float32 and fp16 qparams, float32 and bf16 queries.
* Mutations (a wrong zero convention, dropping the ``m_t sum q'`` term) are caught by the same comparison.
* The support matrix and the operand checks say why not.
The kernel itself runs only on a Hopper GPU (experiments/check_mgpu_planar.py); its lowering is checked in
tests/kernels/test_decode_attention_lowering.py.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.reference import unpack_codes
from kvquant_jax.abi.regions import KVFormat
from kvquant_jax.attention.synthetic import PRESETS, kivi_formats, random_region
from pallas_kernels import decode_attention_mgpu_kivi as mk
from pallas_kernels import decode_attention_mgpu_planar as mp

#: (bits, K zero, V zero, V group, D, GQA group)
PARITY_CASES = [(2, "symmetric", "symmetric", 0, 128, 4), (4, "offset", "offset", 0, 128, 4),
                (2, "min", "offset", 16, 64, 3), (4, "symmetric", "min", 64, 256, 8),
                (2, "offset", "symmetric", 32, 64, 1), (4, "min", "symmetric", 0, 64, 3)]
BOUND = 2e-6                      # max-abs-err / max-abs-ref vs the float64 oracle


def _max_rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _formats(bits, kz, vz, vg):
    return KVFormat(f"int{bits}", "token", kz), KVFormat(f"int{bits}", "token", vz, vg)


def _case(rng, bits, kz, vz, vg, d, g, *, b=3, hkv=2, t=512, qparam_dtype=jnp.float32, q_dtype=jnp.float32,
          poison=True):
    kf, vf = _formats(bits, kz, vz, vg)
    reg = random_region(rng, kf, vf, b, hkv, t, d, [0, 5, 130][:b], [300, 512, 131][:b], poison=poison,
                        qparam_dtype=qparam_dtype)
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float32)).astype(q_dtype)
    kn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    return q, reg, kn, vn


# ---------------------------------------------------------------------------------------------------------------
# Pack-time layout
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,kz,vz,vg", [(2, "symmetric", "symmetric", 0), (4, "offset", "min", 32)])
def test_prepare_codes_and_qparams(rng, bits, kz, vz, vg):
    d, b, hkv, t = 64, 2, 2, 256
    q, reg, _, _ = _case(rng, bits, kz, vz, vg, d, 2, b=b, hkv=hkv, t=t, poison=False, qparam_dtype=jnp.float16)
    ops = mp.prepare_token_planar_region(reg)
    bh = b * hkv
    uk = unpack_codes(np.asarray(reg.k.data), bits).reshape(bh, t, d)
    uv = unpack_codes(np.asarray(reg.v.data), bits).reshape(bh, t, d)
    np.testing.assert_array_equal(mk.unpack_token_planar(np.asarray(ops.k), bits), uk)
    np.testing.assert_array_equal(mk.unpack_token_planar(np.swapaxes(np.asarray(ops.v), 1, 2), bits), uv)
    ks = np.asarray(reg.k.scale).reshape(bh, t)
    kq = np.asarray(ops.k_qparams)
    assert ops.k_qparams.dtype == jnp.float16 and ops.v_scale.dtype == jnp.float16
    np.testing.assert_array_equal(kq[:, 0], ks)
    if kz == "symmetric":
        assert kq.shape == (bh, 1, t)
    else:
        assert kq.shape == (bh, 2, t)
        np.testing.assert_array_equal(kq[:, 1], np.asarray(reg.k.zero).reshape(bh, t))
    c = d // (vg or d)
    tr = lambda a: np.swapaxes(np.asarray(a).reshape(bh, t, c), 1, 2)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(ops.v_scale), tr(reg.v.scale))
    if vz == "symmetric":
        assert ops.v_zero is None
    else:
        np.testing.assert_array_equal(np.asarray(ops.v_zero), tr(reg.v.zero))
    assert (ops.bits, ops.v_group, ops.num_kv_heads, ops.rows, ops.k_zero, ops.v_zero_kind) == (
        bits, vg or d, hkv, t, kz, vz)


# ---------------------------------------------------------------------------------------------------------------
# The plain-JAX twin vs the float64 oracle
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,kz,vz,vg,d,g", PARITY_CASES, ids=lambda v: str(v))
def test_reference_twin_matches_oracle(rng, bits, kz, vz, vg, d, g):
    q, reg, kn, vn = _case(rng, bits, kz, vz, vg, d, g)
    out = mp.decode_attention_mgpu_planar_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    ref = mp.decode_attention_mgpu_planar_reference_f64(q, reg, k_new=kn, v_new=vn)
    out = np.asarray(out)
    assert out.shape == ref.shape == q.shape
    assert np.isfinite(out).all() and np.isfinite(ref).all()
    err = _max_rel(out, ref)
    assert err <= BOUND, err


def test_reference_twin_fp16_qparams_bf16_query(rng):
    q, reg, kn, vn = _case(rng, 4, "offset", "offset", 0, 128, 4, qparam_dtype=jnp.float16, q_dtype=jnp.bfloat16)
    assert reg.k.scale.dtype == jnp.float16 and q.dtype == jnp.bfloat16
    out = mp.decode_attention_mgpu_planar_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    ref = mp.decode_attention_mgpu_planar_reference_f64(q, reg, k_new=kn, v_new=vn)
    assert _max_rel(out, ref) <= BOUND
    assert mp.decode_attention_mgpu_planar_reference(q, reg, k_new=kn, v_new=vn).dtype == jnp.bfloat16


def test_interpret_entry_equals_reference_and_jits(rng):
    q, reg, kn, vn = _case(rng, 2, "symmetric", "symmetric", 0, 128, 4)
    ref = np.asarray(mp.decode_attention_mgpu_planar_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32))
    ops = mp.prepare_token_planar_region(reg)
    prep = mp.decode_attention_mgpu_planar_prepared(q, ops, k_new=kn, v_new=vn, interpret=True,
                                                    out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(prep), ref)
    jitted = jax.jit(lambda q, r, kn, vn: mp.decode_attention_mgpu_planar(
        q, r, k_new=kn, v_new=vn, interpret=True, out_dtype=jnp.float32))(q, reg, kn, vn)
    np.testing.assert_allclose(np.asarray(jitted), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mutation", ["k_zero_as_min", "v_zero_as_min", "no_qsum_term"])
def test_mutations_are_caught(rng, monkeypatch, mutation):
    """The oracle comparison is not vacuous: reading the offsets as mins, or dropping the ``m_t sum q'`` term of
    the logits, moves the output far past the bound."""
    q, reg, kn, vn = _case(rng, 4, "offset", "offset", 0, 128, 4)
    ops = mp.prepare_token_planar_region(reg)
    if mutation == "k_zero_as_min":
        ops = dataclasses.replace(ops, k_zero="min")
    elif mutation == "v_zero_as_min":
        ops = dataclasses.replace(ops, v_zero_kind="min")
    else:
        real = mp._min_form

        def no_min(scale, zero, kind, bits):
            s, m = real(scale, zero, kind, bits)
            return s, (m * 0.0 if scale.ndim == 2 else m)        # the K rows ([BH, T]) only
        monkeypatch.setattr(mp, "_min_form", no_min)
    out = mp.decode_attention_mgpu_planar_prepared(q, ops, k_new=kn, v_new=vn, interpret=True,
                                                   out_dtype=jnp.float32)
    ref = mp.decode_attention_mgpu_planar_reference_f64(q, reg, k_new=kn, v_new=vn)
    assert _max_rel(out, ref) > 100 * BOUND


# ---------------------------------------------------------------------------------------------------------------
# Support matrix and operand checks
# ---------------------------------------------------------------------------------------------------------------
def test_supported_formats_say_none(rng):
    for bits, kz, vz, vg, d, _ in PARITY_CASES:
        kf, vf = _formats(bits, kz, vz, vg)
        assert mp.token_formats_unsupported(kf, vf, d, 512) is None, (bits, kz, vz, vg, d)
    for name in ("int2", "qserve", "int4"):
        assert mp.token_formats_unsupported(*PRESETS[name], 128, 1024) is None, name
    kf, vf = PRESETS["int2"]
    reg = random_region(rng, kf, vf, 2, 2, 512, 128, [0, 0], [512, 100], poison=False)
    assert mp.token_planar_unsupported(reg, 128) is None
    assert "precision" in mp.token_planar_unsupported(reg, 128, mk.KiviMgpuConfig(precision="fp8"))


@pytest.mark.parametrize("kind,needle", [
    ("kivi", "per-token 2/4-bit keys"), ("int8", "per-token 2/4-bit keys"), ("k_grouped", "K group 32"),
    ("v_bits", "bit width"), ("v_group_8", "V group 8"), ("rows", "320 rows"), ("head_dim", "head_dim 96")])
def test_unsupported_formats_say_why(kind, needle):
    kf, vf = PRESETS["int2"]
    d, t = 128, 512
    if kind == "kivi":
        kf, vf = kivi_formats(2, 32, 32)
    elif kind == "int8":
        kf, vf = PRESETS["int8"]
    elif kind == "k_grouped":
        kf = KVFormat("int2", "token", "symmetric", 32)
    elif kind == "v_bits":
        vf = PRESETS["int4"][1]
    elif kind == "v_group_8":
        vf = KVFormat("int2", "token", "symmetric", 8)
    elif kind == "rows":
        t = 320
    else:
        d = 96
    why = mp.token_formats_unsupported(kf, vf, d, t)
    assert why is not None and needle in why, why


def test_entry_refuses_unsupported_region(rng):
    kf, vf = PRESETS["int2"]
    reg = random_region(rng, kf, vf, 2, 2, 320, 128, [0, 0], [320, 100], poison=False)
    q = jnp.ones((2, 8, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match="320 rows"):
        mp.decode_attention_mgpu_planar(q, reg, interpret=True)
    with pytest.raises(NotImplementedError, match="320 rows"):
        mp.prepare_token_planar_region(reg)


@pytest.mark.parametrize("kind,needle", [("k_rows", "k_qparams must be"), ("v_scale", "v_scale must be"),
                                         ("v_zero_missing", "v_zero must be None exactly"),
                                         ("zero_kind", "k_zero must be one of")])
def test_operand_checks_say_why(rng, kind, needle):
    q, reg, _, _ = _case(rng, 4, "offset", "offset", 0, 128, 4, b=2, poison=False)
    ops = mp.prepare_token_planar_region(reg)
    if kind == "k_rows":
        ops = dataclasses.replace(ops, k_qparams=ops.k_qparams[:, :1])
    elif kind == "v_scale":
        ops = dataclasses.replace(ops, v_scale=ops.v_scale[:, :, :256])
    elif kind == "v_zero_missing":
        ops = dataclasses.replace(ops, v_zero=None)
    else:
        ops = dataclasses.replace(ops, k_zero="channel")
    with pytest.raises(ValueError, match=needle):
        mp.decode_attention_mgpu_planar_partials(q, ops, interpret=True)


# ---------------------------------------------------------------------------------------------------------------
# The device check script on CPU
# ---------------------------------------------------------------------------------------------------------------
def test_gpu_check_script_parity_runs_on_cpu_and_fails_a_broken_kernel(tmp_path, monkeypatch):
    """experiments/check_mgpu_planar.py's parity (the plain-JAX twins on CPU) passes one case and writes its rows
    (bf16 kernel and s8 kernel); with the offset read as a min (a broken kernel, either one) it reports the failure
    and exits 1."""
    import json

    from experiment_scripts import load_experiment

    mod = load_experiment("check_mgpu_planar")
    assert mod.main(["--check-only", "--cases", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["ok"] and r["k_zero"] == "offset" for r in rows)
    s8_rows = [r for r in rows if r["precision"] == "s8"]     # the s8 kernel's rows (both query dtypes, 3 / 2 PV limbs)
    assert sorted((r["q"], r["pv_limbs"]) for r in s8_rows) == [("bf16", 2), ("bf16", 3), ("f32", 2), ("f32", 3)]
    from pallas_kernels import decode_attention_mgpu_planar_s8 as s8
    assert all(r["barriers"] == s8.PlanarS8Config().barriers for r in s8_rows)   # (on CPU: the twin, one mode)
    real = mp._partials_jnp
    monkeypatch.setattr(mp, "_partials_jnp", lambda q, ops, sm: real(q, dataclasses.replace(ops, k_zero="min"), sm))
    assert mod.main(["--check-only", "--cases", "1", "--impls", "mgpu", "--out", str(tmp_path / "broken")]) == 1
    rows = json.loads((tmp_path / "broken" / "results.json").read_text())["rows"]
    assert len(rows) == 4 and not any(r["ok"] for r in rows)
    real_s8 = s8._partials_jnp
    monkeypatch.setattr(s8, "_partials_jnp",
                        lambda q, ops, sm, sp: real_s8(q, dataclasses.replace(ops, k_zero="min"), sm, sp))
    assert mod.main(["--check-only", "--cases", "1", "--impls", "mgpu_s8", "--out", str(tmp_path / "broken_s8")]) == 1
    rows = json.loads((tmp_path / "broken_s8" / "results.json").read_text())["rows"]
    assert len(rows) == 4 and not any(r["ok"] for r in rows)


def test_gpu_check_script_refuses_unknown_formats_and_variants(tmp_path):
    from experiment_scripts import load_experiment

    mod = load_experiment("check_mgpu_planar")
    with pytest.raises(SystemExit, match=r"unknown formats \['int3'\]"):
        mod.main(["--formats", "int2,int3", "--skip-check", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        mod.main(["--variants", "offsets rows", "--skip-check", "--out", str(tmp_path)])
    assert not (tmp_path / "results.json").exists()
