"""The token-planar KIVI layout (kivi2_planar / kivi4_planar): bytes against an explicit-loop NumPy construction,
values against the layout-1 KIVI scheme given the same appends (same quantizer, frontiers, rings), the fused decode
operand's tail against the layout-1 tail region, decode through the fused Mosaic GPU entry point (its plain-JAX
partials on CPU) against the float64 oracle over the layout-1 regions, dispatch routing, schema and bad input."""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi import kivi_planar as kp
from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.attention import dispatch
from kvquant_jax.cache.kivi import KIVIScheme
from kvquant_jax.cache.kivi_planar import KIVIPlanarScheme
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.quant.packing import unpack_bits
from pallas_kernels import decode_attention_mgpu_kivi as mk

B, H = 3, 2

#: (bits, G, Gv, R, rule, plane_rows, D)
CASES = [(2, 4, 4, 8, "kivi", 4, 8), (4, 4, 0, 8, "synchronized", 4, 8), (2, 8, 4, 0, "kivi", 4, 16),
         (4, 2, 8, 4, "kivi", 2, 16)]


def _schemes(bits, g, gv, r, rule, plane_rows):
    kw = dict(k_bits=bits, v_bits=bits, group_size=g, v_group_size=gv, residual=r, residual_rule=rule)
    return KIVIPlanarScheme(plane_rows=plane_rows, **kw), KIVIScheme(**kw)


@functools.lru_cache(maxsize=None)      # states are immutable: the tests share them
def _appends(case, seed=0, chunks=((7, (7, 5, 0)), (1, (1, 1, 1)), (9, (9, 3, 8)), (1, (1, 0, 1)),
                                   (13, (13, 12, 11)), (1, (1, 1, 1)))):
    """Ragged multi-row and one-row appends (lengths cross plane, block and group boundaries) into the planar and
    the layout-1 scheme: ``(planar, ref, planar_state, ref_state, lengths, capacity)``."""
    bits, g, gv, r, rule, plane_rows, d = case
    rng = np.random.default_rng(seed)
    planar, ref = _schemes(bits, g, gv, r, rule, plane_rows)
    cap = 3 * planar.block_t
    cap = -(-sum(t for t, _ in chunks) // cap) * cap
    s_p, s_r = planar.init_layer(B, cap, H, d), ref.init_layer(B, cap, H, d)
    lengths = jnp.zeros((B,), jnp.int32)
    app_p, app_r = jax.jit(planar.append_layer), jax.jit(ref.append_layer)
    for t, nn in chunks:
        k = rng.normal(0.3, 1.5, (B, t, H, d)).astype(np.float32)
        v = rng.normal(-0.2, 0.7, (B, t, H, d)).astype(np.float32)
        nn = jnp.asarray(nn, jnp.int32)
        s_p, s_r = app_p(s_p, lengths, k, v, nn), app_r(s_r, lengths, k, v, nn)
        lengths = lengths + nn
    return planar, ref, s_p, s_r, lengths, cap


def _np_planar_bytes(u: np.ndarray, bits: int, plane_rows: int) -> np.ndarray:
    """Independent packing oracle, one code at a time: ``u [T, X]`` -> bytes ``[T * bits / 8, X]``."""
    p, bt = 8 // bits, plane_rows * 8 // bits
    out = np.zeros((u.shape[0] // p, u.shape[1]), np.int64)
    for t in range(u.shape[0]):
        block, within = divmod(t, bt)
        plane, row = divmod(within, plane_rows)
        for x in range(u.shape[1]):
            c = int(u[t, x])
            if plane == p - 1:
                c ^= 1 << (bits - 1)
            out[block * plane_rows + row, x] |= c << (bits * plane)
    return out.astype(np.uint8)


@pytest.mark.parametrize("bits,plane_rows", [(2, 4), (4, 3), (2, 64)])
def test_pack_matches_the_explicit_loop_and_round_trips(rng, bits, plane_rows):
    t = 2 * plane_rows * 8 // bits
    u = rng.integers(0, 2 ** bits, (t, 5))
    want = _np_planar_bytes(u, bits, plane_rows)
    np.testing.assert_array_equal(kp.pack_token_planar(u, bits, plane_rows, xp=np), want)
    np.testing.assert_array_equal(np.asarray(kp.pack_token_planar(jnp.asarray(u), bits, plane_rows)), want)
    np.testing.assert_array_equal(kp.unpack_token_planar(want, bits, plane_rows, xp=np), u)
    rows = np.asarray([[3, 0, t - 1, plane_rows]], np.int32)
    got = kp.take_planar(jnp.asarray(want)[None, None], jnp.asarray(rows), bits, plane_rows)
    np.testing.assert_array_equal(np.asarray(got)[0, 0], u[rows[0]])


@pytest.mark.parametrize("token_axis", [2, 3])
def test_write_planar_changes_only_the_written_codes(rng, token_axis):
    bits, plane_rows = 2, 4
    t = 2 * plane_rows * 4
    old = rng.integers(0, 4, (1, 1, t, 3))
    new = rng.integers(0, 4, (1, 1, 5, 3))
    rows = np.asarray([[1, 4, 9, 15, 30]], np.int32)
    keep = np.asarray([[True, True, False, True, True]])
    packed = kp.pack_token_planar(old, bits, plane_rows, xp=np)
    if token_axis == 3:
        packed = np.swapaxes(packed, 2, 3)
    got = kp.write_planar(jnp.asarray(packed), jnp.asarray(new), jnp.asarray(rows), jnp.asarray(keep), bits,
                          plane_rows, token_axis=token_axis)
    got = np.asarray(got)
    if token_axis == 3:
        got = np.swapaxes(got, 2, 3)
    want = old.copy()
    for j in range(5):
        if keep[0, j]:
            want[0, 0, rows[0, j]] = new[0, 0, j]
    np.testing.assert_array_equal(kp.unpack_token_planar(got, bits, plane_rows, xp=np), want)


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-G{c[1]}-Gv{c[2]}-R{c[3]}-{c[4]}" for c in CASES])
def test_codes_qparams_and_values_equal_the_layout_1_scheme(case):
    planar, ref, s_p, s_r, lengths, cap = _appends(case)
    bits, d = case[0], case[-1]
    # codes: the layout-1 codes (packed along D) re-packed token-planar by the NumPy oracle, on the sealed rows
    sealed = planar.sealed_rows(np.asarray(lengths))
    uk = np.asarray(unpack_bits(s_r.k_codes, bits, axis=-1, count=d))
    uv = np.asarray(unpack_bits(s_r.v_codes, bits, axis=-1, count=d))
    got_k = kp.unpack_token_planar(np.asarray(s_p.k_codes), bits, planar.plane_rows)
    got_v = kp.unpack_token_planar(np.swapaxes(np.asarray(s_p.v_codes), 2, 3), bits, planar.plane_rows)
    for b in range(B):
        np.testing.assert_array_equal(got_k[b, :, :sealed[b]], uk[b, :, :sealed[b]])
        np.testing.assert_array_equal(got_v[b, :, :sealed[b]], uv[b, :, :sealed[b]])
    np.testing.assert_array_equal(np.asarray(s_p.k_scale), np.asarray(s_r.k_scale))
    np.testing.assert_array_equal(np.swapaxes(np.asarray(s_p.v_min), 2, 3), np.asarray(s_r.v_min))
    for x, y in zip(planar.materialize_layer(s_p, lengths), ref.materialize_layer(s_r, lengths)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    planar.validate_layer(s_p, lengths)
    assert planar.layer_nbytes(s_p) == ref.layer_nbytes(s_r)
    assert planar.ledger_layer(B, H, d, cap, logical=False, capacity=cap) == ref.ledger_layer(
        B, H, d, cap, logical=False, capacity=cap)


@pytest.mark.parametrize("case", CASES[:2], ids=["kivi", "synchronized"])
def test_fused_operand_tail_is_the_layout_1_tail_region(case):
    planar, ref, s_p, s_r, lengths, _ = _appends(case, seed=1)
    fmt, op = planar.fused_decode_operand(s_p, lengths)
    regions, nt = ref.decode_regions(s_r, lengths)
    assert fmt == planar.kernel_format and op.tail_k.shape[2] == nt
    np.testing.assert_array_equal(np.asarray(op.end), np.asarray(regions[0].end))
    np.testing.assert_array_equal(np.asarray(op.tail_len), np.asarray(regions[1].end))
    live = np.arange(nt)[None, :] < np.asarray(op.tail_len)[:, None]
    for got, want in ((op.tail_k, regions[1].k.data), (op.tail_v, regions[1].v.data)):
        np.testing.assert_array_equal(np.asarray(got)[live[:, None].repeat(H, 1)],
                                      np.asarray(want)[live[:, None].repeat(H, 1)])


#: every rule / residual combination the tail's static ring-only shortcut (KIVIScheme._tail_decodes) covers
TAIL_CASES = CASES + [(2, 4, 4, 0, "synchronized", 4, 8), (4, 4, 4, 4, "kivi", 4, 8)]


@pytest.mark.parametrize("case", TAIL_CASES, ids=[f"b{c[0]}-G{c[1]}-R{c[3]}-{c[4]}" for c in TAIL_CASES])
def test_tail_rows_are_the_cache_values_after_every_append(case):
    """The dense tail (``KIVIScheme._tail``, behind both the layout-1 tail region and the planar operand) holds the
    cache's values at positions ``[lo, len)`` (``materialize_layer``, which reads every row below its frontier
    from codes and the rest from the rings) after each append of a ragged sequence: a side that
    ``_tail_decodes`` says never decodes really never sits below its frontier there, whatever the lengths."""
    bits, g, gv, r, rule, plane_rows, d = case
    rng = np.random.default_rng(5)
    for scheme in _schemes(bits, g, gv, r, rule, plane_rows):
        cap = -(-48 // scheme.block_t) * scheme.block_t if isinstance(scheme, KIVIPlanarScheme) else 48
        state, lengths = scheme.init_layer(B, cap, H, d), jnp.zeros((B,), jnp.int32)
        app = jax.jit(scheme.append_layer)
        for t, nn in ((5, (5, 3, 0)), (1, (1, 1, 1)), (7, (7, 2, 6)), (1, (0, 1, 1)), (9, (9, 9, 4)),
                      (1, (1, 1, 1)), (3, (3, 0, 2)), (1, (1, 1, 1))):
            k = rng.normal(0.3, 1.5, (B, t, H, d)).astype(np.float32)
            v = rng.normal(-0.2, 0.7, (B, t, H, d)).astype(np.float32)
            state = app(state, lengths, k, v, jnp.asarray(nn, jnp.int32))
            lengths = lengths + jnp.asarray(nn, jnp.int32)
            fk, fv = scheme.frontiers(lengths)
            lo = jnp.minimum(fk, fv)
            k_t, v_t, nt = scheme._tail(state, lo, fk, fv)
            k_all, v_all, _ = scheme.materialize_layer(state, lengths)
            for bi in range(B):
                lo_b, n_b = int(lo[bi]), int(lengths[bi] - lo[bi])
                assert 0 <= n_b <= nt
                np.testing.assert_array_equal(np.asarray(k_t)[bi, :, :n_b], np.asarray(k_all)[bi, :, lo_b:lo_b + n_b])
                np.testing.assert_array_equal(np.asarray(v_t)[bi, :, :n_b], np.asarray(v_all)[bi, :, lo_b:lo_b + n_b])


#: kernel-sized layouts (64-token planes): (bits, G, Gv, R, rule, D, GQA group)
KERNEL_CASES = [(2, 32, 32, 32, "kivi", 64, 3), (4, 16, 0, 32, "synchronized", 64, 4), (2, 64, 16, 0, "kivi", 128, 1)]


def _kernel_sized(case, seed):
    bits, g, gv, r, rule, d, _ = case
    chunks = ((300, (300, 131, 7)), (1, (1, 1, 1)), (190, (190, 125, 64)), (1, (1, 0, 1)))
    planar, ref, s_p, s_r, lengths, _ = _appends((bits, g, gv, r, rule, 64, d), seed=seed, chunks=chunks)
    return planar, ref, s_p, s_r, lengths


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"b{c[0]}-G{c[1]}-Gv{c[2]}-R{c[3]}" for c in KERNEL_CASES])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_matches_the_float64_oracle(case, q_dtype):
    planar, ref, s_p, s_r, lengths = _kernel_sized(case, seed=2)
    d, g = case[5], case[6]
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(0, 1, (B, H * g, d)), jnp.float32).astype(q_dtype)
    k_new = jnp.asarray(rng.normal(0, 1, (B, H, d)), jnp.float32)
    v_new = jnp.asarray(rng.normal(0, 1, (B, H, d)), jnp.float32)
    dispatch.SERVED.clear()
    out = dispatch.decode_attention(q, planar, s_p, lengths, k_new, v_new, impl="kernel", out_dtype=jnp.float32)
    assert {k[0] for k in dispatch.SERVED} == {"decode_attention_kivi_planar"}
    regions, _ = ref.decode_regions(s_r, lengths)
    want = decode_attention_reference(q, regions, k_new=k_new, v_new=v_new)
    err = np.abs(np.asarray(out, np.float64) - want).max() / np.abs(want).max()
    assert err < 2e-5, err


def test_fused_decode_without_its_tail_misses_the_ring_rows():
    """The tail joins the softmax: dropping it (tail_len 0) moves the output far past the bound above."""
    planar, ref, s_p, s_r, lengths = _kernel_sized(KERNEL_CASES[0], seed=4)
    q = jnp.asarray(np.random.default_rng(5).normal(0, 1, (B, H * 3, 64)), jnp.float32)
    fmt, op = planar.fused_decode_operand(s_p, lengths)
    cut = mk.decode_attention_kivi_planar(q, fmt, op.replace(tail_len=jnp.zeros_like(op.tail_len)), interpret=True)
    want = decode_attention_reference(q, ref.decode_regions(s_r, lengths)[0])
    assert np.abs(np.asarray(cut, np.float64) - want).max() / np.abs(want).max() > 1e-2


def test_dispatch_auto_on_cpu_serves_the_reference_and_says_why(caplog):
    planar, _, s_p, _, lengths = _kernel_sized(KERNEL_CASES[0], seed=6)
    q = jnp.ones((B, H * 3, 64), jnp.float32)
    dispatch.SERVED.clear()
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        out = dispatch.decode_attention(q, planar, s_p, lengths, impl="auto")
    assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
    (key,) = [k for k in dispatch.SERVED if "KiviPlanarFormat" in k[1]]
    assert key[0] == "reference" and "no native KiviPlanarFormat kernel on cpu" in dispatch.SERVED[key]


def test_kernel_refusals_name_the_shape():
    planar = KIVIPlanarScheme(plane_rows=4, group_size=4, v_group_size=4, residual=8)
    st = planar.init_layer(1, 32, 1, 64)
    fmt, op = planar.fused_decode_operand(st, jnp.zeros((1,), jnp.int32))
    q = jnp.ones((1, 2, 64), jnp.float32)
    assert "plane_rows 4" in mk.kivi_planar_layout_unsupported(q, fmt, op)
    planar = KIVIPlanarScheme(group_size=8, v_group_size=32, residual=16)
    st = planar.init_layer(1, 256, 1, 64)
    fmt, op = planar.fused_decode_operand(st, jnp.zeros((1,), jnp.int32))
    assert "K group 8" in mk.kivi_planar_layout_unsupported(q, fmt, op)
    assert "Hopper" in mk.kivi_planar_unsupported(q, fmt, op)          # this CPU
    with pytest.raises(NotImplementedError, match="K group 8"):
        mk.decode_attention_kivi_planar(q, fmt, op, interpret=True)


def test_schema_differs_from_layout_1_and_names_the_layout():
    a, b = make_scheme("kivi2_planar").schema, make_scheme("kivi2").schema
    assert a != b and a.scheme == "kivi_planar" and dict(a.extra)["physical_layout"] == kp.LAYOUT_TAG
    assert a.kernel_family == "mosaic_gpu_kivi" and (a.key, a.value) == (b.key, b.value)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="k_bits and v_bits must be equal and 2 or 4"):
        KIVIPlanarScheme(k_bits=2, v_bits=4)
    with pytest.raises(ValueError, match="k_bits and v_bits must be equal and 2 or 4"):
        KIVIPlanarScheme(k_bits=8, v_bits=8)
    with pytest.raises(ValueError, match="capacity 300 must be a multiple of the 256-token block"):
        KIVIPlanarScheme().init_layer(1, 300, 1, 64)
    with pytest.raises(ValueError, match="plane_rows must be >= 1"):
        KIVIPlanarScheme(plane_rows=0)


def test_gpu_check_script_parity_runs_on_cpu_and_fails_a_broken_route(tmp_path, monkeypatch):
    """experiments/check_kivi_planar_gpu.py's parity (the plain-JAX twin on CPU) passes one case, writes its rows,
    and reports a failure when the served route drops the ring tail."""
    import json

    from experiment_scripts import load_experiment

    mod = load_experiment("check_kivi_planar_gpu")
    assert mod.main(["--check-only", "--cases", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["ok"] and r["served"] == [mod.KERNEL] for r in rows)
    real = mk.decode_attention_kivi_planar

    def decode_attention_kivi_planar(q, fmt, op, *a, **kw):          # the served name, without the tail
        return real(q, fmt, op.replace(tail_len=jnp.zeros_like(op.tail_len)), *a, **kw)

    monkeypatch.setitem(dispatch.FUSED_KERNELS, kp.KiviPlanarFormat,
                        (decode_attention_kivi_planar, ("gpu",), mk.kivi_planar_unsupported))
    assert mod.main(["--check-only", "--cases", "2", "--out", str(tmp_path / "broken")]) == 1
    rows = json.loads((tmp_path / "broken" / "results.json").read_text())["rows"]
    assert all(r["served"] == [mod.KERNEL] and r["rel_err"] > mod.BOUND for r in rows)


def test_gpu_check_script_refuses_an_unknown_impl(tmp_path):
    """experiments/check_kivi_planar_gpu.py --impls takes triton / mosaic / bare; a misspelt name is refused by name
    before anything runs (it used to time nothing, silently)."""
    from experiment_scripts import load_experiment

    mod = load_experiment("check_kivi_planar_gpu")
    with pytest.raises(SystemExit, match=r"unknown \['mosiac'\]; known: triton, mosaic, bare"):
        mod.main(["--impls", "mosaic,mosiac", "--skip-check", "--out", str(tmp_path)])
    assert not (tmp_path / "results.json").exists()
