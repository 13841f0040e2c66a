"""Mosaic GPU KIVI decode attention (issue J): float64-oracle parity + timing against cuDNN and the Triton kernel.

    python experiments/check_mgpu_kivi.py --out $OUT/kivi                 # (a) parity, (b) timing at 4K, 32K
    python experiments/check_mgpu_kivi.py --check-only
    python experiments/check_mgpu_kivi.py --T 32768 --variants --repeat 3
    python experiments/check_mgpu_kivi.py --T 32768 --variants "inflight 0,prec bf16" --skip-check

(a) Small ragged cases (B=3, Hkv=2, T=512, poisoned dead rows: NaN qparams of dead K groups / V rows, the current
    token ``k_new / v_new`` in the same softmax) against the float64 NumPy oracle: KIVI-2 / KIVI-4, K groups 16 / 32
    / 64, V groups 16 / 32 / D, D 64 / 128 / 256, GQA 1 / 3 / 4 / 8, bf16 and float32 queries, both precisions.
    Bounds: ``bf16x2`` 5e-5 relative (max-abs / max-abs), ``bf16`` 4e-3.
(b) B=8, Hq=32, Hkv=8, D=128 at each --T: cuDNN bf16, the Triton kernel on the layout-v1 region and the Mosaic
    kernel on the prepared (kivi mgpu layout) operands -- converted outside the timed program, as a cache would
    store them -- in ONE process, with ``experiments/bench_decode_attention.py``'s rotating input sets and device
    clock (``--clock``).  Bytes = the prepared arrays (codes, scales, mins) + the query; ``x`` = speed vs cuDNN.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_decode_attention as bench  # noqa: E402
from bench_decode_attention import (CLOCK, add_clock_arg, baseline_fns, hbm_copy_tbps, hbm_read_tbps,  # noqa: E402
                                    n_sets_for, rel_err, time_program, timing_fields)
from check_mgpu_decode import cudnn_sets, mgpu_read_bytes, timing_query, triton_fn  # noqa: E402
from kvquant_jax.abi.reference import decode_attention_jnp  # noqa: E402
from kvquant_jax.attention.synthetic import kivi_formats, random_region  # noqa: E402
from pallas_kernels import decode_attention_mgpu_kivi as mk  # noqa: E402

#: (bits, K group, V group, D, GQA group) of the parity cases
PARITY_CASES = [(2, 32, 32, 128, 4), (4, 32, 32, 128, 4), (2, 16, 0, 64, 3), (2, 64, 64, 256, 8),
                (4, 64, 16, 64, 1), (2, 32, 128, 128, 4)]
BOUND = {"bf16x2": 5e-5, "bf16": 4e-3}


def variant_configs(dflt: mk.KiviMgpuConfig, s0: int) -> dict[str, mk.KiviMgpuConfig]:
    """--variants: name -> the KiviMgpuConfig it times (changes from ``dflt``; ``s0`` = the default's splits)."""
    rep = dataclasses.replace
    return {"stages 3": rep(dflt, max_concurrent_steps=3), "stages 4": rep(dflt, max_concurrent_steps=4),
            "splits x2": rep(dflt, num_splits=2 * s0), "splits /2": rep(dflt, num_splits=max(1, s0 // 2)),
            "prec bf16": rep(dflt, precision="bf16"),
            **{f"inflight {k}": rep(dflt, wgmma_inflight=k) for k in (0, 1, 2, 4)},
            **{f"qk batch {k}": rep(dflt, qk_plane_batch=k) for k in (1, 2)},
            "qk batch 1 inflight 0": rep(dflt, qk_plane_batch=1, wgmma_inflight=0),
            **{f"offsets {m}": rep(dflt, offsets=m) for m in mk.OFFSETS if m != dflt.offsets},
            **{f"barriers {b}": rep(dflt, barriers=b) for b in mk.BARRIER_MODES if b != dflt.barriers}}


#: names of --variants (timed in the first repeat)
VARIANTS = tuple(variant_configs(mk.KiviMgpuConfig(), 1))
LOG: list[str] = []


def log(msg: str) -> None:
    msg = f"[{datetime.datetime.now(datetime.timezone.utc):%H:%M:%S}] {msg}"
    print(msg, flush=True)
    LOG.append(msg)


def flush(args, results) -> None:
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, "log.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")


def parity_row(args, results, row: dict, serve, ref: np.ndarray, bound: float, label: str) -> bool:
    """One parity row: ``serve() -> (out, extra, extra_ok)``; ``out`` is compared with the float64 ``ref``
    (max-abs / max-abs <= ``bound``, all finite, and ``extra_ok``); ``extra`` (e.g. which kernel served) joins the
    row and the log line.  An exception fails the row with its message.  Appends, logs, flushes; returns ok."""
    try:
        out, extra, extra_ok = serve()
        out = np.asarray(out, np.float64)
        err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
        row.update(rel_err=err, **extra, ok=bool(np.isfinite(out).all() and err <= bound and extra_ok))
    except Exception as e:  # noqa: BLE001
        extra = {}
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
        traceback.print_exc()
    results["rows"].append(row)
    said = "".join(f" {k} {row[k]}" for k in extra)
    log(f"parity {label}: " + (f"rel err {row['rel_err']:.2e}{said} {'OK' if row['ok'] else 'FAIL'}"
                               if "rel_err" in row else f"FAILED {row['error'][:300]}"))
    flush(args, results)
    return row["ok"]


def parity_inputs(rng, kf, vf, d: int, g: int):
    """One parity case's inputs: a ragged region (B 3, Hkv 2, T 512, live ``[0, 300) / [5, 512) / [130, 131)``, dead
    rows poisoned, fp16 qparams) in ``kf / vf``, the current token ``k_new, v_new [3, 2, D]`` and the queries
    ``[("f32", q), ("bf16", q)]`` of GQA group ``g``."""
    hkv = 2
    reg = random_region(rng, kf, vf, 3, hkv, 512, d, [0, 5, 130], [300, 512, 131], poison=True,
                        qparam_dtype=jnp.float16)
    kn = jnp.asarray(rng.standard_normal((3, hkv, d)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((3, hkv, d)).astype(np.float32))
    q32 = jnp.asarray(rng.standard_normal((3, hkv * g, d)).astype(np.float32))
    return reg, kn, vn, (("f32", q32), ("bf16", q32.astype(jnp.bfloat16)))


def parity(args, results) -> bool:
    rng = np.random.default_rng(0)
    interp = jax.devices()[0].platform != "gpu"      # CPU: the plain-JAX twin
    ok_all = True
    for ci, (bits, kg, vg, d, g) in enumerate(PARITY_CASES):
        if args.cases is not None and ci not in args.cases:
            continue
        reg, kn, vn, queries = parity_inputs(rng, *kivi_formats(bits, kg, vg), d, g)
        for qname, q in queries:
            ref = mk.decode_attention_mgpu_kivi_reference_f64(q, reg, k_new=kn, v_new=vn)
            for prec in ("bf16x2", "bf16"):
                cfg = mk.KiviMgpuConfig(precision=prec, num_splits=2)
                row = dict(kind="parity", case=ci, bits=bits, k_group=kg, v_group=vg, d=d, g=g, q=qname,
                           precision=prec)
                serve = lambda q=q, cfg=cfg: (jax.jit(lambda q, r, kn, vn: mk.decode_attention_mgpu_kivi(  # noqa: E731
                    q, r, k_new=kn, v_new=vn, config=cfg, out_dtype=jnp.float32, interpret=interp))(
                    q, reg, kn, vn), {}, True)
                ok_all &= parity_row(args, results, row, serve, ref, BOUND[prec],
                                     f"case {ci} bits={bits} G={kg} Gv={vg} D={d} g={g} q={qname} {prec}")
    return ok_all


def timing_row(results, args, widths=(8, 6, 14), **row):
    """Keep one timing row (with the clock's other readings), flush the results and log it (``widths``: of the
    impl, format and variant columns)."""
    if row.get("us") is not None:
        row = {**row, **timing_fields()}
    results["rows"].append(row)
    flush(args, results)
    us = row.get("us")
    wi, wf, wv = widths
    log(f"T={row['T']:6d} {row['impl']:{wi}s} {row['format']:{wf}s} {row.get('variant', ''):{wv}s} "
        + (f"{us:9.1f} us {row['tbps']:5.2f} TB/s x{row.get('speedup_vs_cudnn', float('nan')):.2f} "
           f"err {row.get('rel_err')}" if us else f"FAILED {row.get('error', '')[:800]}"))


def timing(args, results, t, rep: int):
    """KIVI-2 / KIVI-4 (``kivi<bits>`` names, K groups 32, V groups 32) at one T: :func:`timing_formats`."""
    timing_formats(args, results, t, rep, lambda name: kivi_formats(int(name[len("kivi"):]), 32, 32),
                   mk.prepare_kivi_region, mk.decode_attention_mgpu_kivi_prepared, variant_configs)


@dataclasses.dataclass(frozen=True)
class MosaicImpl:
    """One Mosaic kernel the timing runs on the prepared operands: ``entry(q, ops, config=, out_dtype=)``, its
    ``default`` config, ``splits(ops, g, config)`` (the default's split count, for the variants) and
    ``variants(default, splits) -> {name: config}`` (None: no variants)."""

    entry: Any
    default: Any
    splits: Any
    variants: Any = None


def timing_formats(args, results, t, rep: int, formats_of, prepare, prepared_entry, variants_of, extra=None):
    """One T of the timing: cuDNN bf16, then per ``args.formats`` name (``formats_of(name) -> (kf, vf)``) the
    Triton kernel on the layout-v1 regions and the Mosaic kernel on ``prepare(region)`` (converted outside the
    timed program) through ``prepared_entry(q, ops, config=, out_dtype=)``, its default config and, in the first
    repeat, ``variants_of(default, splits)``'s configs named by ``--variants``.  ``extra``: ``{impl name:
    MosaicImpl}`` timed on the same prepared operands when ``args.impls`` names them."""
    b, hq, hkv, d = args.B, args.hq, args.hkv, args.d
    key, q = timing_query(t, b, hq, d)
    tag = f" r{rep}" if args.repeat > 1 else ""
    base = {}
    bf16_bytes = 2 * b * hkv * t * d * 2
    try:
        sets = cudnn_sets(key, b, hkv, t, d, n_sets_for(bf16_bytes))
        med, lo, hi, _ = time_program(baseline_fns()["cudnn"], q, sets, args.reps)
        base["cudnn"] = med
        timing_row(results, args, T=t, impl="cudnn", format="bf16", variant=tag, us=med * 1e6, us_min=lo * 1e6,
                   us_max=hi * 1e6, bytes=bf16_bytes, tbps=bf16_bytes / med / 1e12, speedup_vs_cudnn=1.0)
        del sets
    except Exception as e:  # noqa: BLE001
        timing_row(results, args, T=t, impl="cudnn", format="bf16", error=f"{type(e).__name__}: {e}"[:800])
    for name in args.formats:
        kf, vf = formats_of(name)
        regs, set_bytes = bench.region_sets(key, kf, vf, b, hkv, t, d)
        ref = np.asarray(jax.jit(lambda q, r: decode_attention_jnp(q.astype(jnp.float32), [r]))(q, regs[0]))
        if "triton" in args.impls:
            try:
                med, lo, hi, out = time_program(triton_fn(), q, regs, args.reps)
                read = set_bytes + q.size * 2
                timing_row(results, args, T=t, impl="triton", format=name, variant=tag, us=med * 1e6,
                           us_min=lo * 1e6, us_max=hi * 1e6, bytes=read, tbps=read / med / 1e12,
                           rel_err=rel_err(out, ref), speedup_vs_cudnn=base.get("cudnn", float("nan")) / med)
            except Exception as e:  # noqa: BLE001
                timing_row(results, args, T=t, impl="triton", format=name, error=f"{type(e).__name__}: {e}"[:800])
        impls = {"mgpu": MosaicImpl(prepared_entry, mk.KiviMgpuConfig(),
                                    lambda ops, g, cfg: mk._spec_for(ops, g, cfg).ns, variants_of), **(extra or {})}
        impls = {k: v for k, v in impls.items() if k in args.impls}
        if not impls:
            continue
        sets = [jax.block_until_ready(jax.jit(prepare)(r)) for r in regs]
        del regs
        read = mgpu_read_bytes(sets[0], q)
        for impl, mi in impls.items():
            variants = {"default": mi.default}
            if args.variants and rep == 0 and mi.variants is not None:
                every = mi.variants(mi.default, mi.splits(sets[0], hq // hkv, mi.default))
                variants.update(every if args.variants == "all" else {v: every[v] for v in args.variants if v in every})
            for vname, cfg in variants.items():
                try:
                    fn = lambda q, o, cfg=cfg, e=mi.entry: e(q, o, config=cfg, out_dtype=jnp.float32)  # noqa: E731
                    med, lo, hi, out = time_program(fn, q, sets, args.reps)
                    timing_row(results, args, T=t, impl=impl, format=name, variant=vname + tag, us=med * 1e6,
                               us_min=lo * 1e6, us_max=hi * 1e6, bytes=read, tbps=read / med / 1e12,
                               rel_err=rel_err(out, ref), speedup_vs_cudnn=base.get("cudnn", float("nan")) / med,
                               config=dataclasses.asdict(cfg))
                except Exception as e:  # noqa: BLE001
                    timing_row(results, args, T=t, impl=impl, format=name, variant=vname,
                               error=f"{type(e).__name__}: {e}"[:1500])
        del sets


def parse_args(argv, doc: str, impls: str, impls_help: str = "", variants: bool = True, hlo: bool = False,
               variants_only: bool = False):
    """The CLI this script and ``check_kivi_planar_gpu.py`` share (shape, formats, impls, repeats, parity cases,
    clock, --out), parsed: formats a list, impls a set, cases a set or None; sets the benchmark clock."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="4096,32768")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--formats", default="kivi2,kivi4")
    ap.add_argument("--impls", default=impls, help=impls_help or None)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="time every T this many times (keep every run)")
    if variants:
        ap.add_argument("--variants", nargs="?", const="all", default=None,
                        help="time config variants too (first repeat): all, or a comma list of their names")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--cases", default=None, help="parity case indices to run (comma list; default all)")
    ap.add_argument("--skip-check", action="store_true")
    if variants_only:
        ap.add_argument("--variants-only", action="store_true",
                        help="parity: the --variants configs beside the default alone (not the other fixed configs)")
    if hlo:
        ap.add_argument("--hlo", action="store_true",
                        help="write the compiled (optimized) HLO of one dispatch call per format (first repeat; "
                        "an extra compile) to OUT/hlo_<format>_T<T>.txt: which fusions the wrapper costs")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    add_clock_arg(ap)
    args = ap.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    args.impls = set(args.impls.split(","))
    args.cases = None if args.cases is None else {int(c) for c in args.cases.split(",")}
    if getattr(args, "variants", None) not in (None, "all"):
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(args.variants) - set(VARIANTS))
        if unknown:
            ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    CLOCK["clock"] = args.clock
    return args


def run(args, parity_fn, timing_fn) -> tuple[bool, bool]:
    """Parity (unless --skip-check), then the copy / read probes and ``timing_fn(args, results, t, rep)`` for every
    repeat and T; results and log under --out.  Returns ``(parity ok, stopped after the check)``."""
    results = {"argv": sys.argv, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
               "device": str(jax.devices()[0].device_kind), "clock": args.clock, "rows": []}
    log(f"{results['date']} jax {jax.__version__} on {results['device']}, clock {args.clock}")
    ok = True
    if not args.skip_check:
        ok = parity_fn(args, results)
        log(f"parity: {'ALL OK' if ok else 'FAILURES'}")
        if args.check_only:
            flush(args, results)
            return ok, True
    results["copy_tbps"] = hbm_copy_tbps()
    results["read_tbps"] = hbm_read_tbps()
    log(f"copy probe {results['copy_tbps']:.2f} TB/s, read probe {results['read_tbps']:.2f} TB/s")
    for rep in range(args.repeat):
        for t in [int(x) for x in args.T.split(",")]:
            timing_fn(args, results, t, rep)
    flush(args, results)
    return ok, False


def main(argv=None):
    ok, checked_only = run(parse_args(argv, __doc__, "triton,mgpu"), parity, timing)
    return (0 if ok else 1) if checked_only else 0


if __name__ == "__main__":
    sys.exit(main())
