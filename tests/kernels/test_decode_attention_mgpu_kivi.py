"""Mosaic GPU KIVI decode attention (pallas_kernels/decode_attention_mgpu_kivi.py): CPU checks.

* The token-planar pack (``pack_token_planar`` / ``unpack_token_planar``) round-trips, and its bytes match an
  explicit-loop NumPy construction of the documented layout (top plane stored XOR 2^(bits-1)).
* The plain-JAX twin of the kernel algebra (``decode_attention_mgpu_kivi_reference``: the prepared operands read as
  the kernel reads them, K's top plane shifted back to ``u`` in the read and V's re-centring folded into the V
  mins) matches the float64 oracle on ragged, poisoned regions with the current token in the same softmax.
* The route's epilogue (``_merge_partials``: split partials + dense tail + current token, one softmax, no
  concatenation) matches a float64 softmax over the same logits, empty splits and all-dead inputs included.
* ``interpret=True`` runs that twin; the support matrix says why not; a mutation of the top-plane correction is
  caught by the oracle comparison (so the parity bound is not vacuous).
The kernel itself needs an H200 (experiments/check_mgpu_kivi.py); its lowering is checked in
tests/kernels/test_decode_attention_lowering.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.reference import unpack_codes
from kvquant_jax.attention.synthetic import PRESETS, kivi_formats, random_region
from pallas_kernels import decode_attention_mgpu_kivi as mk

#: (bits, K group, V group, D, GQA group)
PARITY_CASES = [(2, 32, 32, 128, 4), (4, 32, 32, 128, 4), (2, 16, 0, 64, 3), (2, 64, 64, 256, 8),
                (4, 64, 16, 64, 1)]
BOUND = 2e-6                      # max-abs-err / max-abs-ref vs the float64 oracle


def _max_rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _case(rng, bits, kg, vg, d, g, *, b=3, hkv=2, t=512, start=(0, 5, 130), end=(300, 512, 131),
          qparam_dtype=jnp.float32, q_dtype=jnp.float32, poison=True):
    kf, vf = kivi_formats(bits, kg, vg)
    reg = random_region(rng, kf, vf, b, hkv, t, d, list(start[:b]), list(end[:b]), poison=poison,
                        qparam_dtype=qparam_dtype)
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float32)).astype(q_dtype)
    kn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
    return q, reg, kn, vn


# ---------------------------------------------------------------------------------------------------------------
# Pack-time layout
# ---------------------------------------------------------------------------------------------------------------
def _expected_planar_bytes(u: np.ndarray, bits: int) -> np.ndarray:
    """Explicit loops over the documented layout: byte row ``b*64 + i`` holds token ``b*64P + 64r + i`` at bits
    ``bits*r``; the top plane (``r = P-1``) is stored XOR 2^(bits-1).  ``u``: ``[L, T, X]`` -> uint8 ``[L, T/P, X]``."""
    p = 8 // bits
    lead, t, x = u.shape
    out = np.zeros((lead, t // p, x), np.uint8)
    for lo in range(lead):
        for blk in range(t // (64 * p)):
            for i in range(64):
                for c in range(x):
                    byte = 0
                    for r in range(p):
                        code = int(u[lo, blk * 64 * p + 64 * r + i, c])
                        if r == p - 1:
                            code ^= 2 ** (bits - 1)
                        byte |= code << (bits * r)
                    out[lo, blk * 64 + i, c] = byte
    return out


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_token_planar_layout_and_round_trip(rng, bits):
    p = 8 // bits
    lead, t, x = 2, 2 * 64 * p, 5
    u = rng.integers(0, 2 ** bits, (lead, t, x), dtype=np.uint8)
    want = _expected_planar_bytes(u, bits)

    packed_np = mk.pack_token_planar(u, bits, xp=np)
    packed_jnp = mk.pack_token_planar(jnp.asarray(u), bits)
    assert packed_np.dtype == np.int8 and packed_np.shape == (lead, t // p, x)
    assert packed_jnp.dtype == jnp.int8 and packed_jnp.shape == (lead, t // p, x)
    np.testing.assert_array_equal(packed_np.view(np.uint8), want)
    np.testing.assert_array_equal(np.asarray(packed_jnp).view(np.uint8), want)

    for back in (mk.unpack_token_planar(packed_np, bits, xp=np),
                 np.asarray(mk.unpack_token_planar(packed_jnp, bits, xp=jnp))):
        assert back.shape == u.shape
        np.testing.assert_array_equal(back, u.astype(np.int32))


@pytest.mark.parametrize("bits", [2, 4])
def test_kernel_plane_read_is_recentred_code(rng, bits):
    """The kernel's read of a plane (``byte & mask`` as a signed byte, times 2^(-bits*r)) is ``u`` on the low
    planes and ``u - 2^(bits-1)`` on the top plane (the V read, what the V-min correction assumes); with
    ``unshift_top`` (the K read: ``+ _TOP_SHIFT`` on the top plane) it is ``u`` on every plane."""
    p = 8 // bits
    t, x = 64 * p, 3
    u = rng.integers(0, 2 ** bits, (1, t, x), dtype=np.uint8)
    packed = mk.pack_token_planar(jnp.asarray(u), bits)
    got = np.asarray(mk._planes_as_kernel(packed, bits))
    want = u.astype(np.float64)
    want[:, 64 * (p - 1):] -= 2 ** (bits - 1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(mk._planes_as_kernel(packed, bits, unshift_top=True)), u)


def test_prepare_kivi_region_codes_and_qparams(rng):
    bits, kg, vg, d = 2, 32, 32, 64
    q, reg, _, _ = _case(rng, bits, kg, vg, d, 2, b=2, t=256, poison=False)
    ops = mk.prepare_kivi_region(reg)
    bh, t = 4, 256
    uk = unpack_codes(np.asarray(reg.k.data), bits).reshape(bh, t, d)
    uv = unpack_codes(np.asarray(reg.v.data), bits).reshape(bh, t, d)
    np.testing.assert_array_equal(mk.unpack_token_planar(np.asarray(ops.k), bits), uk)
    np.testing.assert_array_equal(mk.unpack_token_planar(np.swapaxes(np.asarray(ops.v), 1, 2), bits), uv)
    np.testing.assert_array_equal(np.asarray(ops.k_scale), np.asarray(reg.k.scale).reshape(bh, t // kg, d))
    np.testing.assert_array_equal(np.asarray(ops.v_min), np.swapaxes(np.asarray(reg.v.zero).reshape(bh, t, -1), 1, 2))
    assert (ops.bits, ops.k_group, ops.v_group, ops.num_kv_heads, ops.rows, ops.block_t) == (2, 32, 32, 2, 256, 256)


# ---------------------------------------------------------------------------------------------------------------
# The plain-JAX twin vs the float64 oracle
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,kg,vg,d,g", PARITY_CASES, ids=lambda v: str(v))
def test_reference_twin_matches_oracle(rng, bits, kg, vg, d, g):
    q, reg, kn, vn = _case(rng, bits, kg, vg, d, g)
    out = mk.decode_attention_mgpu_kivi_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    ref = mk.decode_attention_mgpu_kivi_reference_f64(q, reg, k_new=kn, v_new=vn)
    out = np.asarray(out)
    assert out.shape == ref.shape == q.shape
    assert np.isfinite(out).all()
    assert np.isfinite(ref).all()
    err = _max_rel(out, ref)
    assert err <= BOUND, err


def test_reference_twin_fp16_qparams_bf16_query(rng):
    q, reg, kn, vn = _case(rng, 2, 32, 32, 128, 4, qparam_dtype=jnp.float16, q_dtype=jnp.bfloat16)
    assert reg.k.scale.dtype == jnp.float16 and q.dtype == jnp.bfloat16
    out = mk.decode_attention_mgpu_kivi_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    ref = mk.decode_attention_mgpu_kivi_reference_f64(q, reg, k_new=kn, v_new=vn)    # same bf16 query
    out = np.asarray(out)
    assert np.isfinite(out).all()
    err = _max_rel(out, ref)
    assert err <= BOUND, err
    # default out_dtype follows the query
    assert mk.decode_attention_mgpu_kivi_reference(q, reg, k_new=kn, v_new=vn).dtype == jnp.bfloat16


def test_interpret_entry_equals_reference(rng):
    q, reg, kn, vn = _case(rng, 4, 32, 32, 128, 4)
    ref = np.asarray(mk.decode_attention_mgpu_kivi_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32))
    out = np.asarray(mk.decode_attention_mgpu_kivi(q, reg, k_new=kn, v_new=vn, interpret=True,
                                                   out_dtype=jnp.float32))
    np.testing.assert_array_equal(out, ref)
    ops = mk.prepare_kivi_region(reg)
    prep = mk.decode_attention_mgpu_kivi_prepared(q, ops, k_new=kn, v_new=vn, interpret=True, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(prep), ref)
    jitted = jax.jit(lambda q, r, kn, vn: mk.decode_attention_mgpu_kivi(
        q, r, k_new=kn, v_new=vn, interpret=True, out_dtype=jnp.float32))(q, reg, kn, vn)
    np.testing.assert_allclose(np.asarray(jitted), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Support matrix
# ---------------------------------------------------------------------------------------------------------------
def _region(rng, kf, vf, t=512, d=128):
    return random_region(rng, kf, vf, 2, 2, t, d, [0, 0], [t, 100], poison=False)


def test_supported_region_says_none(rng):
    for bits, kg, vg, d, _ in PARITY_CASES:
        kf, vf = kivi_formats(bits, kg, vg)
        assert mk.kivi_mgpu_unsupported(_region(rng, kf, vf, d=d), d) is None, (bits, kg, vg, d)
        assert mk.kivi_formats_unsupported(kf, vf, d, 512) is None
    kf, vf = kivi_formats(2, 32, 32)
    assert mk.kivi_mgpu_unsupported(_region(rng, kf, vf), 128, mk.KiviMgpuConfig(precision="bf16")) is None


@pytest.mark.parametrize("kind", ["not_kivi", "v_bits", "k_group_128", "v_group_8", "rows_320", "head_dim_96"])
def test_unsupported_region_says_why(rng, kind):
    kf, vf = kivi_formats(2, 32, 32)
    t, d = 512, 128
    if kind == "not_kivi":
        kf, vf = PRESETS["int4"]
        needle = "KIVI"
    elif kind == "v_bits":
        vf = kivi_formats(4, 32, 32)[1]
        needle = "bit width"
    elif kind == "k_group_128":
        kf = kivi_formats(2, 128, 32)[0]
        needle = "K group 128"
    elif kind == "v_group_8":
        vf = kivi_formats(2, 32, 8)[1]
        needle = "V group 8"
    elif kind == "rows_320":
        t = 320
        needle = "320 rows"
    else:
        d = 96
        needle = "head_dim 96"
    reg = _region(rng, kf, vf, t=t, d=d)
    why = mk.kivi_mgpu_unsupported(reg, d)
    assert why and needle in why, why
    assert mk.kivi_formats_unsupported(kf, vf, d, t) == why
    if kind == "rows_320":
        assert "256" in why                    # the 2-bit block
    q = jnp.zeros((2, 8, d), jnp.float32)
    with pytest.raises(NotImplementedError, match="decode_attention_mgpu_kivi"):
        mk.decode_attention_mgpu_kivi(q, reg, interpret=True)
    with pytest.raises(NotImplementedError):
        mk.prepare_kivi_region(reg)


def test_bad_precision_says_why(rng):
    kf, vf = kivi_formats(2, 32, 32)
    reg = _region(rng, kf, vf)
    cfg = mk.KiviMgpuConfig(precision="fp8")
    why = mk.kivi_mgpu_unsupported(reg, 128, cfg)
    assert why and "precision" in why and "fp8" in why
    ops = mk.prepare_kivi_region(reg)
    with pytest.raises(ValueError, match="precision"):
        mk._spec_for(ops, 4, cfg)
    with pytest.raises(NotImplementedError, match="precision"):
        mk.decode_attention_mgpu_kivi(jnp.zeros((2, 8, 128), jnp.float32), reg, config=cfg)
    # the spec of the supported configs (swap-AB N: 2g rounded up to 8 with bf16x2, g rounded up to 8 with bf16)
    assert mk._spec_for(ops, 4, mk.KiviMgpuConfig()).n == 8
    assert mk._spec_for(ops, 8, mk.KiviMgpuConfig()).n == 16
    assert mk._spec_for(ops, 4, mk.KiviMgpuConfig(precision="bf16")).n == 8


@pytest.mark.parametrize("field", ["wgmma_inflight", "qk_plane_batch"])
@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_bad_register_knobs_say_why(rng, field, value):
    kf, vf = kivi_formats(2, 32, 32)
    reg = _region(rng, kf, vf)
    cfg = mk.KiviMgpuConfig(**{field: value})
    why = mk.kivi_mgpu_unsupported(reg, 128, cfg)
    assert why and field in why and repr(value) in why
    with pytest.raises(ValueError, match=field):
        mk._spec_for(mk.prepare_kivi_region(reg), 4, cfg)
    good = mk._spec_for(mk.prepare_kivi_region(reg), 4, mk.KiviMgpuConfig(wgmma_inflight=2, qk_plane_batch=1))
    assert (good.inflight, good.qk_batch) == (2, 1)


@pytest.mark.parametrize("bits, inflight", [(2, 2), (4, 0)])
def test_default_inflight_is_per_bit_width(rng, bits, inflight):
    """wgmma_inflight=None (the default) resolves to the H100-measured value of the bit width; an explicit value
    wins over it."""
    kf, vf = kivi_formats(bits, 32, 32)
    ops = mk.prepare_kivi_region(_region(rng, kf, vf))
    assert mk.KiviMgpuConfig().wgmma_inflight is None
    assert mk._spec_for(ops, 4, mk.KiviMgpuConfig()).inflight == inflight == mk.DEFAULT_INFLIGHT[bits]
    assert mk._spec_for(ops, 4, mk.KiviMgpuConfig(wgmma_inflight=1)).inflight == 1


# ---------------------------------------------------------------------------------------------------------------
# Mutation: the parity test is sensitive to the top-plane correction
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mutation", ["no_k_top_shift", "no_top_plane_rows"])
def test_parity_catches_top_plane_mutation(rng, monkeypatch, mutation):
    q, reg, kn, vn = _case(rng, 2, 32, 32, 128, 4)
    ref = mk.decode_attention_mgpu_kivi_reference_f64(q, reg, k_new=kn, v_new=vn)
    good = mk.decode_attention_mgpu_kivi_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32)
    assert _max_rel(good, ref) <= BOUND
    if mutation == "no_k_top_shift":   # K's top plane read as u - 2^(bits-1), with nothing to correct it
        monkeypatch.setattr(mk, "_TOP_SHIFT", 0.0)
    else:   # forget V's top-plane re-centring (the V mins)
        monkeypatch.setattr(mk, "_top_plane_rows", lambda t, bits, group=1: np.zeros(len(range(0, t, group)), bool))
    bad = np.asarray(mk.decode_attention_mgpu_kivi_reference(q, reg, k_new=kn, v_new=vn, out_dtype=jnp.float32))
    err = _max_rel(bad, ref)
    assert err > 1e-3, err


def test_cancellation_probe_names_the_split_sums():
    """experiments/probe_kivi_cancellation.py: the kernel's two-sum V algebra is exact in float64, and in float32 its
    error against the float64 dequantize-first output grows with T (the cancellation the device rows show), while
    dequantizing first stays small; re-centred codes shrink it."""
    from experiment_scripts import load_experiment

    rows = load_experiment("probe_kivi_cancellation").probe([256, 8192], seed=1)
    err = {(r["T"], r["sum"]): r["rel_err"] for r in rows}
    assert max(err[(t, "split f64")] for t in (256, 8192)) < 1e-10
    assert err[(8192, "split f32")] > 4 * err[(256, "split f32")]
    assert err[(8192, "split f32")] > 10 * err[(8192, "dequant f32")]
    assert err[(8192, "centred bf16x2")] < err[(8192, "split bf16x2")]


def test_check_script_parity_runs_on_cpu_and_fails_a_broken_kernel(tmp_path, monkeypatch):
    """experiments/check_mgpu_kivi.py's parity (the plain-JAX twin on CPU) passes one case at both precisions and
    both query dtypes, writes its rows, and fails rows (with their error, not a crash) when the kernel is off by a
    small factor or raises."""
    import json

    from experiment_scripts import load_experiment

    mod = load_experiment("check_mgpu_kivi")
    assert mod.main(["--check-only", "--cases", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["ok"] and 0 < r["rel_err"] <= mod.BOUND[r["precision"]] for r in rows)
    real = mk.decode_attention_mgpu_kivi

    def off_by_a_little(*a, **kw):
        if kw["config"].precision == "bf16":
            raise RuntimeError("lowering failed")
        return real(*a, **kw) * 1.001

    monkeypatch.setattr(mk, "decode_attention_mgpu_kivi", off_by_a_little)
    assert mod.main(["--check-only", "--cases", "1", "--out", str(tmp_path / "broken")]) == 1
    rows = json.loads((tmp_path / "broken" / "results.json").read_text())["rows"]
    assert [r["ok"] for r in rows] == [False] * 4
    assert all(r["rel_err"] > mod.BOUND["bf16x2"] for r in rows if r["precision"] == "bf16x2")
    assert all("RuntimeError: lowering failed" in r["error"] for r in rows if r["precision"] == "bf16")


def test_check_script_variants_are_valid_configs_that_differ_from_the_default():
    """Every --variants name of experiments/check_mgpu_kivi.py maps to a config the kernel accepts and that changes
    at least one field of the default; an unknown name is refused by the CLI."""
    from experiment_scripts import load_experiment

    mod = load_experiment("check_mgpu_kivi")
    dflt = mk.KiviMgpuConfig()
    every = mod.variant_configs(dflt, 4)
    assert tuple(every) == mod.VARIANTS and len(set(every.values())) == len(every)
    assert all(cfg != dflt and mk._config_unsupported(cfg) is None for cfg in every.values())
    assert (every["splits x2"].num_splits, every["splits /2"].num_splits) == (8, 2)
    with pytest.raises(SystemExit):
        mod.main(["--skip-check", "--variants", "inflight 3"])


# ---------------------------------------------------------------------------------------------------------------
# The route's epilogue: split partials + dense tail + current token in one softmax
# ---------------------------------------------------------------------------------------------------------------
def _partials_of(logits, values, splits):
    """float64 split partials of ``logits [B, H, G, T]`` over ``values [B, H, T, D]`` in ``splits`` equal chunks
    (natural-log m; an all-masked chunk (-inf logits) gives m = -1e30, l = 0, acc = 0), as float32."""
    b, h, g, t = logits.shape
    acc, m, l = [], [], []
    for c in np.split(np.arange(t), splits):
        s = logits[..., c]
        mc = np.max(s, axis=-1)
        dead = ~np.isfinite(mc)
        mc = np.where(dead, -1e30, mc)
        p = np.where(np.isfinite(s), np.exp(s - mc[..., None]), 0.0)
        acc.append(np.einsum("bhgt,bhtd->bhgd", p, values[:, :, c]))
        m.append(mc)
        l.append(p.sum(-1))
    return tuple(jnp.asarray(np.stack(x, axis=2), jnp.float32) for x in (acc, m, l))


@pytest.mark.parametrize("case", ["all", "no_tail_rows_live", "no_current_token", "only_splits", "nothing_live",
                                  "tail_dominates"])
def test_merge_partials_matches_float64_softmax(rng, case):
    """``_merge_partials`` (no concatenation) against a float64 softmax over the concatenated logits: the splits'
    rows (one split empty), the tail's live rows (ragged ``live``) and the current token; zeros where nothing is
    live.  Catches a dropped term, a wrong scale, a max taken over dead rows, and (``tail_dominates``: tail logits
    ~hundreds above the splits') a running max that leaves the tail out (exp overflows)."""
    b, hkv, g, d, t, nt, splits = 2, 2, 3, 16, 24, 5, 4
    scale = 0.3
    q = rng.standard_normal((b, hkv * g, d))
    kr, vr = rng.standard_normal((b, hkv, t, d)), rng.standard_normal((b, hkv, t, d))
    tk, tv = rng.standard_normal((b, hkv, nt, d)), rng.standard_normal((b, hkv, nt, d))
    if case == "tail_dominates":
        tk = tk * 200.0
    kn, vn = rng.standard_normal((b, hkv, d)), rng.standard_normal((b, hkv, d))
    q4 = q.reshape(b, hkv, g, d) * scale
    logits = np.einsum("bhgd,bhtd->bhgt", q4, kr)
    logits[..., t // splits: 2 * t // splits] = -np.inf                 # split 1 holds no live row
    live = np.array([[True, False, True, True, False], [False, True, False, False, True]])
    if case in ("no_tail_rows_live", "nothing_live"):
        live[:] = False
    if case == "nothing_live":
        logits[:] = -np.inf
    parts = _partials_of(logits, vr, splits)
    with_tail = case not in ("only_splits",)
    with_cur = case in ("all", "no_tail_rows_live")
    s_all = [logits]
    v_all = [vr]
    if with_tail:
        s_all.append(np.where(live[:, None, None, :], np.einsum("bhgd,bhnd->bhgn", q4, tk), -np.inf))
        v_all.append(tv)
    if with_cur:
        s_all.append(np.einsum("bhgd,bhd->bhg", q4, kn)[..., None])
        v_all.append(vn[:, :, None, :])
    s = np.concatenate(s_all, -1)
    v = np.concatenate(v_all, 2)
    mx = np.max(s, -1, keepdims=True)
    p = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    den = p.sum(-1)
    want = np.where(den[..., None] > 0, np.einsum("bhgn,bhnd->bhgd", p, v) / np.where(den > 0, den, 1)[..., None],
                    0.0).reshape(b, hkv * g, d)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    got = mk._merge_partials(f32(q), parts, hkv, scale,
                             tail=(f32(tk), f32(tv), jnp.asarray(live)) if with_tail else None,
                             k_new=f32(kn) if with_cur else None, v_new=f32(vn) if with_cur else None)
    assert got.dtype == jnp.float32 and got.shape == (b, hkv * g, d)
    if case == "nothing_live":
        np.testing.assert_array_equal(np.asarray(got), 0.0)
    else:
        assert np.abs(want).max() > 0.1
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-6 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------------------------
# The logit offsets c = q'.mn: KiviMgpuConfig.offsets
# ---------------------------------------------------------------------------------------------------------------
def _offsets_case(rng, mn_dtype):
    """``q' [BH, N, D]`` float32 of a softmax-scaled query (log2 units), ``mn [BH, T/G, D]`` K minima of
    magnitude ~1-4 with a few channel outliers (x20), stored in ``mn_dtype``."""
    qb = (rng.standard_normal((6, 8, 128)) * (1.4427 / np.sqrt(128))).astype(np.float32)
    mn = -np.abs(rng.standard_normal((6, 16, 128))) * rng.uniform(1, 4, (6, 16, 1))
    mn[:, :, rng.choice(128, 4, replace=False)] *= 20
    return jnp.asarray(qb), jnp.asarray(mn.astype(np.float32)).astype(mn_dtype)


def _offsets_err(qb, mn, c) -> float:
    """max |c - c64| / max sum_d |q'_d mn_d| (the error a float32-accumulated product must stay under)."""
    q64, m64 = np.asarray(qb, np.float64), np.asarray(mn.astype(jnp.float32), np.float64)
    ref = np.einsum("xnd,xgd->xgn", q64, m64)
    mag = np.einsum("xnd,xgd->xgn", np.abs(q64), np.abs(m64)).max()
    return float(np.abs(np.asarray(c, np.float64) - ref).max() / mag)


@pytest.mark.parametrize("mn_dtype", [jnp.float16, jnp.float32], ids=["fp16", "f32"])
@pytest.mark.parametrize("method,bound", [("highest", 1e-6), ("rows", 1e-6), ("bf16x3", 2e-5)])
def test_group_offsets_methods_match_float64(rng, mn_dtype, method, bound):
    qb, mn = _offsets_case(rng, mn_dtype)
    c = mk._group_offsets(qb, mn, method)
    assert c.shape == (6, 16, 8) and c.dtype == jnp.float32
    assert _offsets_err(qb, mn, c) <= bound


def test_one_bf16_pass_would_fail_the_offsets_bound(rng):
    """The bf16x3 bound is tight enough to refuse the one-pass bf16 product (qh . mh) it improves on."""
    qb, mn = _offsets_case(rng, jnp.float16)
    one = jnp.einsum("xnd,xgd->xgn", qb.astype(jnp.bfloat16), mn.astype(jnp.bfloat16),
                     preferred_element_type=jnp.float32)
    assert _offsets_err(qb, mn, one) > 2e-5


@pytest.mark.parametrize("method,bound", [("rows", BOUND), ("bf16x3", 8e-6)])
def test_offsets_methods_through_the_interpret_entry(rng, method, bound):
    """Every offsets method, end to end (the twin's algebra, interpret=True) against the float64 oracle; bf16x3
    adds ~1e-6 (measured 0.7-1.6e-6 over three seeds), well inside the device bound of the bf16x2 kernel (5e-5)."""
    q, reg, kn, vn = _case(rng, 2, 32, 32, 128, 4, qparam_dtype=jnp.float16)
    ref = mk.decode_attention_mgpu_kivi_reference_f64(q, reg, k_new=kn, v_new=vn)
    out = mk.decode_attention_mgpu_kivi(q, reg, k_new=kn, v_new=vn, interpret=True, out_dtype=jnp.float32,
                                        config=mk.KiviMgpuConfig(offsets=method))
    assert np.isfinite(np.asarray(out)).all()
    assert _max_rel(out, ref) <= bound


def test_bad_offsets_method_says_why(rng):
    kf, vf = kivi_formats(2, 32, 32)
    reg = _region(rng, kf, vf)
    cfg = mk.KiviMgpuConfig(offsets="tf32")
    why = mk.kivi_mgpu_unsupported(reg, 128, cfg)
    assert why and "offsets" in why and "'tf32'" in why and "bf16x3" in why
    ops = mk.prepare_kivi_region(reg)
    with pytest.raises(ValueError, match="offsets"):
        mk._spec_for(ops, 4, cfg)
    with pytest.raises(ValueError, match="offsets"):
        mk.decode_attention_mgpu_kivi_prepared(jnp.zeros((2, 8, 128), jnp.float32), ops, config=cfg, interpret=True)
    with pytest.raises(ValueError, match="offsets"):
        mk._group_offsets(jnp.zeros((1, 8, 128)), jnp.zeros((1, 2, 128)), "tf32")


@pytest.mark.parametrize("kind", ["kivi", "token_planar"])
def test_barrier_mode_is_checked_and_lowers(rng, kind):
    """``KiviMgpuConfig.barriers``: an unknown mode is refused by name; ``"explicit"`` (the kernel's own
    ``commit_smem`` calls instead of Pallas's barriers around every SMEM store) lowers for ``cuda`` to another
    kernel than the default's, for the KIVI kernel and the token-planar one it also runs."""
    from pallas_kernels import decode_attention_mgpu_planar as mp

    if kind == "kivi":
        kf, vf = kivi_formats(2, 32, 32)
        reg = _region(rng, kf, vf, t=1024)
        prep, entry = mk.prepare_kivi_region, mk.decode_attention_mgpu_kivi_prepared
        assert "barriers must be one of ('auto', 'explicit'), got 'none'" in mk.kivi_mgpu_unsupported(
            reg, 128, mk.KiviMgpuConfig(barriers="none"))
    else:
        kf, vf = PRESETS["qserve"]
        reg = _region(rng, kf, vf, t=1024)
        prep, entry = mp.prepare_token_planar_region, mp.decode_attention_mgpu_planar_prepared
    ops = prep(reg)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)).astype(np.float32)).astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="barriers must be one of"):
        entry(q, ops, config=mk.KiviMgpuConfig(barriers="none"), interpret=True)
    texts = {b: jax.jit(lambda q, o, b=b: entry(q, o, config=mk.KiviMgpuConfig(num_splits=2, barriers=b),
                                                 interpret=False)).trace(q, ops).lower(
        lowering_platforms=("cuda",)).as_text() for b in mk.BARRIER_MODES}
    assert all("mosaic_gpu" in t for t in texts.values()) and len(set(texts.values())) == len(mk.BARRIER_MODES)
