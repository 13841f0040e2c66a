"""Each integer step of the s8 planar kernel on a GPU, on its own (issue J).  H100, 2026-12-07: every step exact
except the 32-bit limb path's converting copy, which swaps 4-byte groups of the int8 B operand's rows (the kernel
then failed parity by 0.45-0.87; the 16-bit paths pass, and ``"i32"`` is refused: ``WRONG_LIMB_PATHS``).

    python3 experiments/debug_mgpu_s8.py --out $OUT/dbg          # Hopper GPU only

(1) Micro kernels, each against integer NumPy: the QK s8 wgmma (A int8 [64, 128] from registers in WGMMA_8BIT,
    plain and plane-masked; B int8 [24, 128] SMEM, K-major; also N 32 and two D chunks), the PV s8 wgmma (A
    [64, 64] swizzle 64, B [32, 64]), the limb path (int32 [64, 8] WGMMA registers -> limbs -> transposed 32-bit
    store -> converting copy -> swizzled int8 B operand; every path: the two 16-bit ones and the refused 32-bit
    one) followed by the PV wgmmas of two planes.
(2) The kernel's raw outputs ``o, z, m, l`` (one split) against float64 NumPy of the same decomposition, on parity
    inputs, with all planes under every limb path and with the codes of one plane only (K and
    V), so a wrong plane, a wrong side (QK: ``m, l``; V min term: ``z``; PV: ``o``) or a wrong limb path shows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import check_mgpu_kivi as ck  # noqa: E402
import check_mgpu_planar as cp  # noqa: E402
from kvquant_jax.abi.regions import KVFormat  # noqa: E402
from kvquant_jax.attention.synthetic import random_region  # noqa: E402
from pallas_kernels import decode_attention_mgpu_kivi as mk  # noqa: E402
from pallas_kernels import decode_attention_mgpu_planar as mp  # noqa: E402
from pallas_kernels import decode_attention_mgpu_planar_s8 as s8  # noqa: E402
from pallas_kernels.decode_attention_mgpu import _tile_transforms  # noqa: E402

ROWS: list[dict] = []
#: every limb path the kernel module can build: the public ones and the refused ones (to show their fault)
ALL_PATHS = s8.LIMB_PATHS + tuple(s8.WRONG_LIMB_PATHS)


def report(name, got, want, tol: float = 0.0, **extra):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    den = max(np.max(np.abs(want)), 1e-30)
    err = float(np.max(np.abs(got - want)) / den) if got.shape == want.shape else float("nan")
    row = dict(name=name, rel_err=err, ok=bool(err <= tol), tol=tol, **extra)
    if got.shape == want.shape and not row["ok"]:
        bad = np.argwhere(np.abs(got - want) > max(tol, 1e-12) * den)
        row["n_bad"] = int(len(bad))
        row["first_bad"] = [[int(i) for i in b] for b in bad[:8]]
        row["got_at"] = [float(got[tuple(b)]) for b in bad[:8]]
        row["want_at"] = [float(want[tuple(b)]) for b in bad[:8]]
    ROWS.append(row)
    print(f"{name:60s} rel err {err:.3e} {'OK' if row['ok'] else 'FAIL'}"
          + ("" if row["ok"] else f" ({row.get('n_bad')} bad, first {row.get('first_bad', [])[:3]}"
                                   f" got {row.get('got_at', [])[:3]} want {row.get('want_at', [])[:3]})"), flush=True)


def guarded(name, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (a failed lowering is a finding too)
        ROWS.append(dict(name=name, error=f"{type(e).__name__}: {e}"[:2000]))
        print(f"{name:60s} ERROR {type(e).__name__}: {str(e)[:600]}", flush=True)
        traceback.print_exc(limit=3)


# ------------------------------------------------------------------------------------------------------------
# (1) micro kernels
# ------------------------------------------------------------------------------------------------------------
def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def _run(fn, *args):
    """Compile and run a micro kernel -> NumPy outputs (tests pass a ``run`` that only lowers)."""
    out = jax.jit(fn)(*map(jnp.asarray, args))
    return [np.asarray(o) for o in out] if isinstance(out, (tuple, list)) else np.asarray(out)


def _s8_product(a_regs, b_smems, shape, split_a: bool = True):
    """Inside a kernel: ``sum_j a_j int8 @ b_smems[j][N, K].T`` on s8 wgmma into one accumulator -> int32 ``[64,
    N]`` registers; ``a_j = a_regs[:, j K:(j+1) K]`` (``split_a``: the kernel's QK over D chunks) or ``a_regs``
    for every ``j`` (the kernel's PV over planes, one V tile)."""
    plgpu = _plgpu()
    from jax.experimental import pallas as pl

    def mm(acc_ref):
        kc = a_regs.shape[1] // len(b_smems)
        for j, b_smem in enumerate(b_smems):
            a_j = a_regs[:, j * kc:(j + 1) * kc] if split_a and len(b_smems) > 1 else a_regs
            plgpu.wgmma(acc_ref, a_j, b_smem.T)
        return acc_ref[...]

    return pl.run_scoped(mm, plgpu.ACC(shape, jnp.int32))


def micro_qk(a, b, mask: int | None, run=None):
    """``(a & mask) [64, dq K] @ b[dq, N, K]`` (summed over the ``dq`` chunks; a 2-D ``b`` is one chunk) -> int32
    ``[64, N]`` on s8 wgmma, A from registers in ``WGMMA_8BIT`` (int8 A in the ``WGMMA`` layout does not lower),
    B the chunk ``j`` of one 3-D SMEM ref (the kernel's query limbs)."""
    plgpu = _plgpu()
    from jax.experimental import pallas as pl
    b = b if b.ndim == 3 else b[None]
    m, k = a.shape
    dq, n, kc = b.shape
    i8, i32 = jnp.int8, jnp.int32

    def body(a_ref, b_ref, o_ref):
        def scoped(a_smem, b_smem, o_smem, bar_a, bar_b):
            plgpu.copy_gmem_to_smem(a_ref, a_smem, bar_a)
            plgpu.copy_gmem_to_smem(b_ref, b_smem, bar_b)
            plgpu.barrier_wait(bar_a)
            plgpu.barrier_wait(bar_b)
            av = plgpu.load(a_smem, (), layout=plgpu.Layout.WGMMA_8BIT)
            if mask is not None:
                av = av & jnp.full(av.shape, mask, i8)
            o_smem[...] = _s8_product(av, [b_smem.at[j] for j in range(dq)], (m, n))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((m, k), i8, transforms=_tile_transforms(i8, k)),
                      plgpu.SMEM((dq, n, kc), i8, transforms=_tile_transforms(i8, kc)), plgpu.SMEM((m, n), i32),
                      plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1))

    fn = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), i32), grid=(1,), grid_names=("x",))
    return (run or _run)(fn, a, b)


def _limb_values(r: int = 0):
    t = np.arange(64)[:, None]
    c = np.arange(8)[None, :]
    return (t * 8 + c) * 4099 - 1_000_000 + 12345 * r          # int [64, 8], in [-LIM, LIM], all limbs busy


def _limb_rows(r: int):
    """The scratch rows [32, 64] plane ``r``'s limbs of :func:`_limb_values` take (24 rows of limbs, 8 of zeros)."""
    rows = np.zeros((32, 64), np.int64)
    for li, limb in enumerate(s8.limbs(_limb_values(r).astype(np.int64))):
        rows[li * 8:(li + 1) * 8] = limb.T
    return rows


def micro_limbs(v, path: str = "i16", run=None):
    """The kernel's limb path (``PlanarS8Config.limb_path``, through the kernel module's own helpers) for two
    planes' x = :func:`_limb_values` (made in registers from iotas), then the PV wgmmas of both planes with
    ``v int8 [64 ch, 64 tok]`` as A into one accumulator.  Returns (the scratch [64, 64] in its dtype, p_smem int8
    [64, 64], acc int32 [64, 32])."""
    plgpu = _plgpu()
    from jax.experimental import pallas as pl
    i8, i32 = jnp.int8, jnp.int32
    wg, w8 = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA_8BIT
    n, M, NP, rows = 8, 64, 32, 64

    def body(v_ref, xo_ref, po_ref, ao_ref):
        def scoped(v_smem, x_smem, p_smem, a_smem, bar):
            plgpu.copy_gmem_to_smem(v_ref, v_smem, bar)
            x_smem[...] = s8._limb_zeros(rows, path)
            plgpu.commit_smem()
            t_idx = plgpu.broadcasted_iota(i32, (M, n), 0, layout=wg)
            c_idx = plgpu.broadcasted_iota(i32, (M, n), 1, layout=wg)
            for r in range(2):
                x = (t_idx * 8 + c_idx) * 4099 - 1_000_000 + 12345 * r
                for li, limb in enumerate(s8.limbs(x)):
                    x_smem.at[pl.ds(r * NP + li * n, n)].T[...] = plgpu.layout_cast(
                        s8._limb_value(limb, path), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            p_smem[...] = s8._limb_scratch_to_i8(x_smem, path)
            plgpu.commit_smem()
            plgpu.barrier_wait(bar)
            vb = plgpu.load(v_smem, (), layout=w8)
            a_smem[...] = _s8_product(vb, [p_smem.at[pl.ds(0, NP)], p_smem.at[pl.ds(NP, NP)]], (M, NP),
                                      split_a=False)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_smem, xo_ref)
            plgpu.copy_smem_to_gmem(p_smem, po_ref)
            plgpu.copy_smem_to_gmem(a_smem, ao_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((M, M), i8, transforms=_tile_transforms(i8, M)), s8._limb_scratch(rows, path),
                      plgpu.SMEM((rows, M), i8, transforms=_tile_transforms(i8, M)), plgpu.SMEM((M, NP), i32),
                      plgpu.Barrier(num_arrivals=1))

    outs = (jax.ShapeDtypeStruct((rows, M), s8._LIMB_DTYPES[path]), jax.ShapeDtypeStruct((rows, M), i8),
            jax.ShapeDtypeStruct((M, NP), i32))
    fn = plgpu.kernel(body, out_type=outs, grid=(1,), grid_names=("x",))
    return (run or _run)(fn, v)


def micro_all(rng):
    a = rng.integers(-128, 128, (64, 128)).astype(np.int8)
    b = rng.integers(-128, 128, (24, 128)).astype(np.int8)
    for mask in (None, s8._plane_mask(0, 4), s8._plane_mask(1, 4), s8._plane_mask(3, 2)):
        am = a if mask is None else (a & np.int8(mask))
        want = am.astype(np.int64) @ b.astype(np.int64).T
        guarded(f"qk mask {mask}", lambda mask=mask, want=want: report(
            f"qk A[64,128] w8 mask {mask}", micro_qk(a, b, mask), want))
    b32q = rng.integers(-128, 128, (32, 128)).astype(np.int8)
    guarded("qk N 32", lambda: report("qk A[64,128] w8, B[32,128] (N 32)", micro_qk(a, b32q, None),
                                      a.astype(np.int64) @ b32q.astype(np.int64).T))
    a2 = rng.integers(-128, 128, (64, 256)).astype(np.int8)
    b2 = rng.integers(-128, 128, (2, 24, 128)).astype(np.int8)
    want2 = sum(a2[:, j * 128:(j + 1) * 128].astype(np.int64) @ b2[j].astype(np.int64).T for j in range(2))
    guarded("qk D 256", lambda: report("qk A[64,256] w8, B[2,24,128] (two D chunks)", micro_qk(a2, b2, None),
                                       want2))
    a64 = rng.integers(-128, 128, (64, 64)).astype(np.int8)
    b32 = rng.integers(-128, 128, (32, 64)).astype(np.int8)
    guarded("pv", lambda: report("pv A[64,64] w8 swizzle 64, B[32,64]", micro_qk(a64, b32, None),
                                 a64.astype(np.int64) @ b32.astype(np.int64).T))
    v = rng.integers(-128, 128, (64, 64)).astype(np.int8)

    lim = np.concatenate([_limb_rows(0), _limb_rows(1)])                       # [64, 64]: two planes' rows
    want_pv = v.astype(np.int64) @ (lim[:32] + lim[32:]).T
    for path in ALL_PATHS:
        def limb_check(path=path):
            xo, po, ao = micro_limbs(v, path)
            report(f"limbs {path}: scratch after the transposed store", np.asarray(xo, np.float64), lim)
            report(f"limbs {path}: p_smem after the converting copy", po.astype(np.int64), lim)
            report(f"limbs {path}: PV wgmmas (two planes) on p_smem", ao, want_pv)
            pp = po.astype(np.int64)
            report(f"limbs {path}: PV wgmmas on the p_smem it read back", ao,
                   v.astype(np.int64) @ (pp[:32] + pp[32:]).T)

        guarded(f"limbs {path}", limb_check)


# ------------------------------------------------------------------------------------------------------------
# (2) the kernel's raw outputs against float64 NumPy
# ------------------------------------------------------------------------------------------------------------
def raw_kernel(q, ops, limb_path: str = "i16", sm_scale=None):
    """The kernel's raw ``o [BH, 1, D, 8], z [BH, 1, C, 8], m, l [BH, 1, 8]`` (one split); any of
    :data:`ALL_PATHS`, the refused ones included."""
    sp = s8._spec(ops, q.shape[1] // ops.num_kv_heads, s8.PlanarS8Config(num_splits=1, limb_path=limb_path),
                  allow_wrong=True)
    return [np.asarray(o, np.float64) for o in s8._raw_outputs(q, ops, sm_scale, sp)]


def raw_reference(q, ops, sm_scale=None):
    """float64 NumPy of the same ``o, z, m, l`` (log2 ``m``; query padded to 8 columns as the kernel's)."""
    b, hq, d = q.shape
    hkv, bits, t, bt = ops.num_kv_heads, ops.bits, ops.rows, ops.block_t
    half = 2.0 ** (bits - 1)
    qp = np.asarray(mk._scaled_query_block(q, hkv, 8, 0, sm_scale), np.float64)            # [BH, 8, D]
    plane = (np.arange(t) % bt) // 64
    pscale = 2.0 ** (-bits * plane)
    top = np.asarray(mk._top_plane_rows(t, bits))
    uk = np.asarray(mk._masked_planes(ops.k, bits), np.float64)                             # [BH, T, D]
    uv = np.asarray(mk._masked_planes(jnp.swapaxes(ops.v, 1, 2), bits), np.float64)
    kq = np.asarray(ops.k_qparams, np.float64)
    st = kq[:, 0]
    kz = None if ops.k_zero == "symmetric" else kq[:, 1]
    sv = np.asarray(ops.v_scale, np.float64)
    zv = None if ops.v_zero is None else np.asarray(ops.v_zero, np.float64)
    rows = np.arange(t)[None, :]
    valid = np.repeat((rows >= np.asarray(ops.start)[:, None]) & (rows < np.asarray(ops.end)[:, None]), hkv, 0)
    with np.errstate(invalid="ignore", over="ignore"):
        mt = np.asarray(mk.zero_min(st, kz, ops.k_zero, bits)) + np.where(top, half, 0.0) * st
        kdeq = np.where(valid[..., None], uk * (st * pscale)[..., None] + mt[..., None], 0.0)
        s = np.einsum("xcd,xtd->xtc", qp, kdeq)
        s = np.where(valid[..., None], s, -np.inf)
        m = np.max(s, axis=1)                                                                 # [BH, 8]
        p = np.where(valid[..., None], np.exp2(s - m[:, None]), 0.0)
        mv = np.asarray(mk.zero_min(sv, zv, ops.v_zero_kind, bits)) + np.where(top, half, 0.0) * sv
        mv = np.where(valid[:, None], mv, 0.0)
        svp = np.where(valid[:, None], sv * pscale, 0.0)
    nvg, gv = sv.shape[1], ops.v_group
    z = np.einsum("xtc,xgt->xgc", p, mv)                                                      # [BH, C, 8]
    o = np.concatenate([np.einsum("xtc,xt,xtd->xdc", p, svp[:, ci], uv[:, :, ci * gv:(ci + 1) * gv])
                        for ci in range(nvg)], axis=1)                                        # [BH, D, 8]
    return o[:, None], z[:, None], m[:, None], p.sum(axis=1)[:, None]


def one_plane(ops, r: int):
    """``ops`` with the K and V codes of plane ``r`` only (the other planes' bits cleared)."""
    msk = np.int8(s8._plane_mask(r, ops.bits))
    return ops.replace(k=ops.k & msk, v=ops.v & msk)


def _inputs(rng, ci):
    """(case tuple, q, region): a parity case (int ``ci``: ragged, poisoned, B 3, Hkv 2, T 512) or a simple one
    (``"s2"`` / ``"s4"``: INT2 / INT4 symmetric, D 128, g 4, B 1, Hkv 1, two full blocks, float32 qparams)."""
    if isinstance(ci, str):
        bits = int(ci[1:])
        case = (bits, "symmetric", "symmetric", 0, 128, 4)
        kf = vf = KVFormat(f"int{bits}", "token", "symmetric")
        t = 2 * 64 * (8 // bits)
        reg = random_region(rng, kf, vf, 1, 1, t, 128, [0], [t], poison=False)
        q = jnp.asarray(rng.standard_normal((1, 4, 128)).astype(np.float32))
        return case, q, reg
    case = cp.PARITY_CASES[ci]
    bits, kz, vz, vg, d, g = case
    kf, vf = KVFormat(f"int{bits}", "token", kz), KVFormat(f"int{bits}", "token", vz, vg)
    reg, _, _, queries = ck.parity_inputs(rng, kf, vf, d, g)
    return case, queries[0][1], reg


def kernel_all(rng, cases):
    for ci in cases:
        (bits, kz, vz, vg, d, g), q, reg = _inputs(rng, ci)
        ops = mp.prepare_token_planar_region(reg)
        # every limb path on all planes, then the default path one plane at a time
        dflt = s8.PlanarS8Config().limb_path
        runs = [(lp, None) for lp in ALL_PATHS] + [(dflt, r) for r in range(8 // bits)]
        for lp, r in runs:
            o_ = ops if r is None else one_plane(ops, r)
            tag = (f"case {ci} int{bits} K {kz} V {vz} Gv={vg} D={d} g={g} limbs {lp} "
                   f"planes {'all' if r is None else r}")

            def go(o_=o_, tag=tag, lp=lp):
                got = raw_kernel(q, o_, lp)
                want = raw_reference(q, o_)
                for nm, gt, wt in zip("ozml", got, want):
                    sl = (slice(None),) * (gt.ndim - 1) + (slice(0, g),)
                    report(f"{tag} {nm}", gt[sl], wt[sl], tol=1e-4)

            guarded(tag, go)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="micro,kernel")
    ap.add_argument("--cases", default="s4,s2,5,0,3", help="parity case numbers, or s2 / s4 (simple inputs)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    parts = args.parts.split(",")
    if "micro" in parts:
        micro_all(rng)
    if "kernel" in parts:
        kernel_all(rng, [c if c.startswith("s") else int(c) for c in args.cases.split(",")])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "debug.json"), "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
