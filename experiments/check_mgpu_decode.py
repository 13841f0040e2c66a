"""Mosaic GPU decode attention (issue J, first kernel): float64-oracle parity + timing against cuDNN and Triton.

    python experiments/check_mgpu_decode.py                       # (a) parity, (b) timing; JSON/markdown to $OUT
    python experiments/check_mgpu_decode.py --check-only
    python experiments/check_mgpu_decode.py --T 32768 --formats int4 --variants

(a) Small ragged random cases (B=3, Hkv=2, G=4, T=512, D=128, poisoned dead rows where the format allows, the
    current token k_new/v_new in the same softmax) against the float64 NumPy oracle, for every implemented format,
    both precisions, f32 and bf16 queries; plus GQA 8 (N=16), D=64 and D=256 shapes.
(b) B=8, Hq=32, Hkv=8, D=128 at each --T: cuDNN bf16 (``jax.nn.dot_product_attention(implementation="cudnn")``),
    the Triton kernel ``pallas_kernels.decode_attention.decode_attention`` and the Mosaic GPU kernel on the same
    formats, in ONE process, with the rotating-input-set method and the copy probe of
    ``experiments/bench_decode_attention.py`` (imported, not copied).  The Mosaic GPU operands are converted to
    its pack-time layout OUTSIDE the timed program (a cache would store them so); bytes = what the kernel reads
    (jnp.int4 arrays counted at 4 bits: their itemsize is 1).  At most --max-sets (8) rotating sets per program
    (still >= 4x the 60 MB L2 at every size here); ``--variants`` adds split / stage / block / precision / upcast
    variants at the largest T; ``--repeat`` re-times the defaults (the lent GPU is noisy: keep every run's table).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_decode_attention as bench  # noqa: E402
from bench_decode_attention import (baseline_fns, device_region, hbm_copy_tbps, n_sets_for, rel_err,  # noqa: E402
                                    time_program)
from kvquant_jax.abi.reference import decode_attention_jnp, decode_attention_reference  # noqa: E402
from kvquant_jax.attention.synthetic import PRESETS, random_region  # noqa: E402
from pallas_kernels.decode_attention import decode_attention as triton_decode  # noqa: E402
from pallas_kernels.decode_attention_mgpu import (MgpuConfig, _spec_for, decode_attention_mgpu,  # noqa: E402
                                                  decode_attention_mgpu_prepared, default_mgpu_config,
                                                  prepare_region)


def nbytes(tree) -> int:
    """Bytes of the arrays in ``tree`` counting sub-byte dtypes by their bits (jnp.int4 has itemsize 1)."""
    tot = 0
    for x in jax.tree.leaves(tree):
        bits = 4 if x.dtype in (jnp.int4, jnp.uint4) else x.dtype.itemsize * 8
        tot += x.size * bits // 8
    return int(tot)

MGPU_FORMATS = ("bf16", "int8", "int4", "e4m3")
TRITON_FORMATS = ("bf16", "int8", "int4", "int2", "e4m3")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def flush(args, results):
    out = args.out or os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "check_mgpu_decode.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, "check_mgpu_decode.md"), "w") as f:
        f.write(markdown(results))


# ---------------------------------------------------------------------------------------------------------------
# (a) parity
# ---------------------------------------------------------------------------------------------------------------
def check(args, results):
    rng = np.random.default_rng(int(time.time()) % 100000)     # fresh inputs every run
    cases = [dict(b=3, hkv=2, g=4, d=128, n=512)]
    if not args.quick:
        cases += [dict(b=2, hkv=1, g=8, d=128, n=512), dict(b=2, hkv=2, g=4, d=64, n=256),
                  dict(b=2, hkv=1, g=4, d=256, n=256), dict(b=2, hkv=3, g=3, d=64, n=256)]
    for ci, c in enumerate(cases):
        b, hkv, g, d, n = c["b"], c["hkv"], c["g"], c["d"], c["n"]
        start = np.array([0, 100, 0][:b], np.int32)
        end = np.array([n, n - 147, 33][:b], np.int32)
        for name in args.formats:
            if name not in MGPU_FORMATS or (ci and name not in ("bf16", "int4")):
                continue
            kf, vf = PRESETS[name]
            # bf16 V is read by wgmma straight from SMEM: dead rows must be finite (module docstring)
            reg = random_region(rng, kf, vf, b, hkv, n, d, start, end, poison=kf.payload != "bf16",
                                qparam_dtype=jnp.float16)
            kn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
            vn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
            for qdt in (jnp.bfloat16, jnp.float32):
                if ci and qdt == jnp.float32:
                    continue
                q = jnp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float32)).astype(qdt)
                ref = decode_attention_reference(q.astype(jnp.float32), [reg], k_new=kn, v_new=vn)
                for prec in ("bf16x2", "bf16", "bf16x2+upcast"):
                    if (ci and prec != "bf16x2") or (prec.endswith("upcast") and not kf.is_int):
                        continue
                    cfg = MgpuConfig(precision=prec.split("+")[0], num_splits=2, upcast=prec.endswith("upcast"))
                    rec = dict(case=c, format=name, q_dtype=jnp.dtype(qdt).name, precision=prec)
                    try:
                        fn = jax.jit(lambda q, r, kn, vn, cfg=cfg: decode_attention_mgpu(
                            q, r, k_new=kn, v_new=vn, config=cfg, out_dtype=jnp.float32))
                        out = np.asarray(fn(q, reg, kn, vn))
                        err = rel_err(out, ref)
                        rec.update(rel_err=err, finite=bool(np.isfinite(out).all()),
                                   ok=bool(np.isfinite(err) and err < 1e-3))
                        log(f"check {str(c):45s} {name:5s} q={rec['q_dtype']:8s} {prec:13s} rel err {err:.2e} "
                            f"{'OK' if rec['ok'] else 'HIGH'}")
                    except Exception as e:  # noqa: BLE001
                        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                        log(f"check {str(c):45s} {name:5s} {prec} FAILED {rec['error'][:1500]}")
                        if args.traceback:
                            traceback.print_exc()
                    results["check"].append(rec)
                    flush(args, results)


# ---------------------------------------------------------------------------------------------------------------
# (b) timing
# ---------------------------------------------------------------------------------------------------------------
def _row(results, args, **row):
    results["rows"].append(row)
    flush(args, results)
    us = row.get("us")
    log(f"T={row['T']:6d} {row['impl']:8s} {row['format']:6s} {row.get('variant', ''):18s} "
        + (f"{us:9.1f} us {row['tbps']:5.2f} TB/s x{row.get('speedup_vs_cudnn', float('nan')):.2f} "
           f"err {row.get('rel_err')}" if us else f"FAILED {row.get('error', '')[:800]}"))


def timing(args, results, t, variants_here=True, tag=""):
    b, hq, hkv, d = args.B, args.hq, args.hkv, args.d
    key = jax.random.PRNGKey(t)
    q = jax.random.normal(jax.random.fold_in(key, 1), (b, hq, d), jnp.float32).astype(jnp.bfloat16)
    base = {}
    bf16_bytes = 2 * b * hkv * t * d * 2
    n = n_sets_for(bf16_bytes)
    fns = baseline_fns()
    try:
        sets = []
        for i in range(n):
            kk = jax.random.fold_in(key, 100 + i)
            shape = (b, t, hkv, d)
            sets.append((jax.random.normal(kk, shape, jnp.bfloat16),
                         jax.random.normal(jax.random.fold_in(kk, 7), shape, jnp.bfloat16)))
        med, lo, hi, _ = time_program(fns["cudnn"], q, sets, args.reps)
        base["cudnn"] = med
        _row(results, args, T=t, impl="cudnn", format="bf16", variant=tag, us=med * 1e6, us_min=lo * 1e6,
             us_max=hi * 1e6,
             bytes=bf16_bytes, tbps=bf16_bytes / med / 1e12, sets=n, speedup_vs_cudnn=1.0)
        del sets
    except Exception as e:  # noqa: BLE001
        _row(results, args, T=t, impl="cudnn", format="bf16", error=f"{type(e).__name__}: {e}"[:800])

    for name in args.formats:
        kf, vf = PRESETS[name]
        try:
            regs, set_bytes = bench.region_sets(key, kf, vf, b, hkv, t, d)
            n = len(regs)
        except Exception as e:  # noqa: BLE001
            _row(results, args, T=t, impl="data", format=name, error=f"{type(e).__name__}: {e}"[:800])
            continue
        ref = np.asarray(jax.jit(lambda q, r: decode_attention_jnp(q.astype(jnp.float32), [r]))(q, regs[0]))
        read = set_bytes + q.size * 2
        if name in TRITON_FORMATS and "triton" in args.impls:
            try:
                fn = lambda q, r: triton_decode(q, [r], out_dtype=jnp.float32)  # noqa: E731
                med, lo, hi, out = time_program(fn, q, regs, args.reps)
                _row(results, args, T=t, impl="triton", format=name, variant=tag, us=med * 1e6, us_min=lo * 1e6,
                     us_max=hi * 1e6, bytes=read, tbps=read / med / 1e12, sets=n, rel_err=rel_err(out, ref),
                     speedup_vs_cudnn=base.get("cudnn", float("nan")) / med)
            except Exception as e:  # noqa: BLE001
                _row(results, args, T=t, impl="triton", format=name, error=f"{type(e).__name__}: {e}"[:800])
        if name in MGPU_FORMATS and "mgpu" in args.impls:
            try:
                sets = [jax.block_until_ready(jax.jit(prepare_region)(r)) for r in regs]
            except Exception as e:  # noqa: BLE001
                _row(results, args, T=t, impl="mgpu", format=name, error=f"prepare: {type(e).__name__}: {e}"[:800])
                continue
            del regs
            mread = nbytes(sets[0]) - 2 * b * 4 + q.size * 2
            dflt = default_mgpu_config(PRESETS[name][0])
            s0 = _spec_for(sets[0], hq // hkv, dflt).ns
            variants = {"default" + tag: dflt}
            if args.variants and variants_here:
                alt_bt = 128 if dflt.block_t == 64 else 64
                variants.update({
                    "splits x2": dataclasses.replace(dflt, num_splits=2 * s0),
                    "splits x4": dataclasses.replace(dflt, num_splits=4 * s0),
                    "stages -1": dataclasses.replace(dflt, max_concurrent_steps=dflt.max_concurrent_steps - 1),
                    "stages +1": dataclasses.replace(dflt, max_concurrent_steps=dflt.max_concurrent_steps + 1),
                    f"bt {alt_bt}": dataclasses.replace(dflt, block_t=alt_bt, max_concurrent_steps=3),
                    "prec bf16": dataclasses.replace(dflt, precision="bf16")})
                if PRESETS[name][0].is_int:
                    variants["upcast"] = dataclasses.replace(dflt, upcast=True)
                    variants["upcast splits x2"] = dataclasses.replace(dflt, upcast=True, num_splits=2 * s0)
            for vname, cfg in variants.items():
                try:
                    fn = lambda q, o, cfg=cfg: decode_attention_mgpu_prepared(  # noqa: E731
                        q, o, config=cfg, out_dtype=jnp.float32)
                    med, lo, hi, out = time_program(fn, q, sets, args.reps)
                    _row(results, args, T=t, impl="mgpu", format=name, variant=vname, us=med * 1e6,
                         us_min=lo * 1e6, us_max=hi * 1e6, bytes=mread, tbps=mread / med / 1e12, sets=len(sets),
                         rel_err=rel_err(out, ref), speedup_vs_cudnn=base.get("cudnn", float("nan")) / med,
                         config=dataclasses.asdict(cfg))
                except Exception as e:  # noqa: BLE001
                    _row(results, args, T=t, impl="mgpu", format=name, variant=vname,
                         error=f"{type(e).__name__}: {e}"[:1500])
            del sets
        else:
            del regs


def markdown(results) -> str:
    copy = results.get("hbm_copy_tbps") or float("nan")
    lines = [f"Device: {results['device']}; JAX {results['jax']}; {results['date']}; "
             f"B={results['shape']['B']} Hq={results['shape']['hq']} Hkv={results['shape']['hkv']} "
             f"D={results['shape']['d']}; HBM copy probe {copy:.2f} TB/s", ""]
    if results["check"]:
        lines += ["| case | format | q | precision | rel err vs f64 | ok |", "|---|---|---|---|---|---|"]
        for r in results["check"]:
            c = r["case"]
            cs = f"B{c['b']} Hkv{c['hkv']} G{c['g']} D{c['d']} T{c['n']}"
            if "error" in r:
                lines.append(f"| {cs} | {r['format']} | {r['q_dtype']} | {r['precision']} | failed | |")
            else:
                lines.append(f"| {cs} | {r['format']} | {r['q_dtype']} | {r['precision']} | {r['rel_err']:.1e} | "
                             f"{'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    lines += ["| T | impl | format | variant | median µs [min, max] | bytes read (MB) | TB/s | % of copy | "
              "× vs cuDNN | rel err vs f32 |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [bench.timing_row(r, copy, err_key="rel_err", variant=True) for r in results["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_shape_args(ap, "4096,32768")
    ap.add_argument("--formats", default="bf16,int8,int4,e4m3,int2")
    ap.add_argument("--impls", default="mgpu,triton")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--quick", action="store_true", help="parity on the main shape only")
    ap.add_argument("--variants", action="store_true", help="a few Mosaic config variants at the largest T")
    ap.add_argument("--traceback", action="store_true")
    ap.add_argument("--max-sets", type=int, default=8, help="rotating input sets per program (>= 4x L2 anyway)")
    ap.add_argument("--repeat", type=int, default=1, help="re-time the defaults at the largest T this many times")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.T = [int(x) for x in args.T.split(",") if x]
    args.formats = [x for x in args.formats.split(",") if x]
    args.impls = [x for x in args.impls.split(",") if x]
    dev = jax.devices()[0]
    results = dict(device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   shape=dict(B=args.B, hq=args.hq, hkv=args.hkv, d=args.d), argv=sys.argv[1:], rows=[], check=[])
    log(f"device {results['device']} jax {jax.__version__}")
    if not args.no_check:
        check(args, results)
    if not args.check_only:
        results["hbm_copy_tbps"] = hbm_copy_tbps()
        log(f"HBM copy probe (read+write) {results['hbm_copy_tbps']:.2f} TB/s")
        bench.MAX_SETS = args.max_sets
        for t in args.T:
            timing(args, results, t, variants_here=t == max(args.T))
        for r in range(1, args.repeat):
            timing(args, results, max(args.T), variants_here=False, tag=f" (rep {r + 1})")
    flush(args, results)
    print(markdown(results), flush=True)
    return results


if __name__ == "__main__":
    main()
