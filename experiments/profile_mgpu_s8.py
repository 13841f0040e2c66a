"""Where the s8 token-planar decode kernel's time goes, phase by phase (issue J): Mosaic GPU's in-kernel profiler.

    python experiments/profile_mgpu_s8.py --T 32768 --formats int2,int4 --variants "default,pv limbs 2" --out $OUT/prof

Per (format, variant): B 8, Hq 32, Hkv 8, D 128 (or --B/--hq/--hkv/--d), one random region prepared as the cache
stores it (``check_mgpu_planar.py``'s timing inputs, one set), the kernel
(``pallas_kernels/decode_attention_mgpu_planar_s8.py``) timed by the device clock without the profiler
(``experiments.timing.device_seconds``: the whole call, and the Mosaic kernel alone) and compared with the default
config's output on the same inputs (``vs default``: max |diff| / max |default|; exactly 0 for a variant that only
changes the ordering, e.g. ``barriers explicit``: a race would show here), then called once with
``PlanarS8Config.profile_dir`` set: the profiler stores ``%clock`` (SM cycles) at the start and the end of each
named phase of every pipeline step (``PROFILE_PHASES``: ``s8_qk`` the QK wgmmas and their wait, ``s8_softmax`` the
logits, online max, p and the V min term, ``s8_limbs`` the per-column scale and the limb stores, ``s8_copy`` the
16-bit -> int8 B-operand copy between two ``commit_smem``, ``s8_pv`` the PV wgmmas and their wait, ``s8_acc`` the
float accumulator update) on the first thread of each warpgroup, in issue order.  What falls between the phases
(``between``: the pipeline's barrier wait for the next TMA stage, its copy issue, the loop) is the CTA's span less
the phases.  The phases are what one warp's instruction stream spends between those points: a wgmma's or a
load's latency shows up where its result is waited for.

Rows: cycles per pipeline step (median over the CTAs' mean per step) per phase, ``between``, the step total, and the
share of each.  ``--variants``: ``check_mgpu_planar.py``'s s8 variant names (and ``default``).  Only a Hopper GPU
runs this (the profiler needs the kernel; nothing to do on CPU: it says so and exits 0 with ``--allow-cpu``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_decode_attention as bench  # noqa: E402
import check_mgpu_decode as cmd  # noqa: E402
import check_mgpu_planar as cmp_  # noqa: E402
from experiments.timing import device_seconds  # noqa: E402
from kvquant_jax.attention.synthetic import PRESETS  # noqa: E402
from pallas_kernels import decode_attention_mgpu_planar as mp  # noqa: E402
from pallas_kernels import decode_attention_mgpu_planar_s8 as s8  # noqa: E402


def phase_cycles(trace: dict, phases=s8.PROFILE_PHASES) -> dict:
    """One profiler trace (``{"traceEvents": [...]}``, ``ts`` in 1e3 cycles, one ``tid`` per warpgroup) -> per CTA
    the cycles of each phase summed, the number of steps (``s8_qk`` count), its span (first begin to last end) and
    ``between`` (span less the phases).  Returns ``{"ctas": n, "steps": [...], "per_step": {phase: [..per CTA]}}``
    with the per-step means per CTA (cycles)."""
    by_tid: dict = {}
    for e in trace["traceEvents"]:
        by_tid.setdefault(e["tid"], []).append(e)
    per_step = {p: [] for p in (*phases, "between", "step")}
    steps = []
    for evs in by_tid.values():
        open_at, depth = {}, dict.fromkeys(phases, 0)
        total, count = dict.fromkeys(phases, 0.0), dict.fromkeys(phases, 0)
        for e in evs:                          # (a phase recorded again inside itself counts once: the outer one)
            name, ts = e["name"], float(e["ts"]) * 1e3
            if name not in total:
                continue
            if e["ph"] == "B":
                depth[name] += 1
                if depth[name] == 1:
                    open_at[name] = ts
            elif depth[name] > 0:
                depth[name] -= 1
                if depth[name] == 0:
                    total[name] += ts - open_at.pop(name)
                    count[name] += 1
        n = count[phases[0]]
        if not n:
            continue
        span = float(evs[-1]["ts"]) * 1e3 - float(evs[0]["ts"]) * 1e3
        steps.append(n)
        for p in phases:
            per_step[p].append(total[p] / n)
        per_step["between"].append((span - sum(total.values())) / n)
        per_step["step"].append(span / n)
    return {"ctas": len(steps), "steps": steps, "per_step": per_step}


def summarize(pc: dict) -> dict:
    """Medians over the CTAs of :func:`phase_cycles`'s per-step cycles, and each one's share of the step."""
    med = {k: float(statistics.median(v)) if v else float("nan") for k, v in pc["per_step"].items()}
    share = {k: med[k] / med["step"] for k in med if k != "step"}
    return {"ctas": pc["ctas"], "steps_per_cta": int(statistics.median(pc["steps"])) if pc["steps"] else 0,
            "cycles_per_step": med, "share": share}


def variant_config(name: str, ops, g: int) -> s8.PlanarS8Config:
    dflt = s8.PlanarS8Config()
    if name == "default":
        return dflt
    every = cmp_.s8_variant_configs(dflt, s8._spec(ops, g, dflt).ns)
    if name not in every:
        raise SystemExit(f"unknown variant {name!r}; known: default, {', '.join(every)}")
    return every[name]


def case_inputs(a, fmt: str, t: int):
    """``(q, ops)``: the bf16 query and one random region of ``fmt`` prepared as the cache stores it."""
    kf, vf = PRESETS[fmt]
    key, q = cmd.timing_query(t, a.B, a.hq, a.d)
    reg = bench.device_region(jax.random.fold_in(key, 1000), kf, vf, a.B, a.hkv, t, a.d)
    return q, jax.block_until_ready(jax.jit(mp.prepare_token_planar_region)(reg))


def _entry(cfg):
    return jax.jit(lambda q, o: s8.decode_attention_mgpu_planar_s8_prepared(q, o, config=cfg, out_dtype=jnp.float32))


def run_case(a, fmt: str, variant: str, t: int, tmp: str, q, ops, ref) -> dict:
    """One (format, variant): device timing, the largest difference from the default config's output ``ref``
    (relative to its largest entry: 0 exactly where only the ordering changed), and the phase profile."""
    g = a.hq // a.hkv
    cfg = variant_config(variant, ops, g)
    row = dict(format=fmt, variant=variant, T=t, B=a.B, hq=a.hq, hkv=a.hkv, d=a.d, config=dataclasses.asdict(cfg),
               num_splits=s8._spec(ops, g, cfg).ns, read_bytes=cmd.mgpu_read_bytes(ops, q))
    fn = _entry(cfg)
    out = np.asarray(fn(q, ops))
    row["diff_vs_default"] = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    row["finite"] = bool(np.isfinite(out).all())
    dt = device_seconds(fn, q, ops, reps=a.reps)
    if dt is not None:
        row["call_us"] = dt.median * 1e6
        mosaic = {k: v for k, v in dt.kernels.items() if "mosaic" in k.lower()}
        row["kernel_us"] = sum(mosaic.values()) / a.reps if mosaic else None
    pdir = os.path.join(tmp, f"{fmt}_{variant.replace(' ', '_')}_{t}")
    os.makedirs(pdir, exist_ok=True)
    pfn = _entry(dataclasses.replace(cfg, profile_dir=pdir))
    for _ in range(2):                                        # the first call compiles; each call writes a trace
        jax.block_until_ready(pfn(q, ops))
    traces = sorted(glob.glob(os.path.join(pdir, "*-trace.json")))
    if not traces:
        row["profile"] = None
        return row
    with open(traces[-1]) as f:
        trace = json.load(f)
    row["profile"] = summarize(phase_cycles(trace))
    row["subprofile"] = summarize(phase_cycles(trace, SUBPHASES))
    return row


#: every sub-phase of ``PROFILE_SUBPHASES``, in order (their own table: ``rest`` = the step less the sub-phases)
SUBPHASES = tuple(n for subs in s8.PROFILE_SUBPHASES.values() for n in subs)


def table(rows, key: str = "profile") -> list[str]:
    """Markdown rows of ``rows``' ``key`` profile (``"profile"``: the phases; ``"subprofile"``: the sub-phases)."""
    cols = (*s8.PROFILE_PHASES, "between") if key == "profile" else (*SUBPHASES, "between")
    out = ["| format | variant | T | call µs | kernel µs | vs default | steps/CTA | "
           + " | ".join(c.removeprefix("s8_") for c in cols).replace("between", "between" if key == "profile"
                                                                    else "rest")
           + " | step cycles |", "|---" * (8 + len(cols)) + "|"]
    for r in rows:
        p = r.get(key) or {}
        cyc, sh = p.get("cycles_per_step", {}), p.get("share", {})
        cells = [f"{cyc[c]:.0f} ({100 * sh[c]:.0f} %)" if c in cyc else "-" for c in cols]
        out.append(f"| {r['format']} | {r['variant']} | {r['T']} | {r.get('call_us', float('nan')):.1f} | "
                   f"{(r.get('kernel_us') or float('nan')):.1f} | {r.get('diff_vs_default', float('nan')):.1e} | "
                   f"{p.get('steps_per_cta', '-')} | "
                   + " | ".join(cells) + f" | {cyc.get('step', float('nan')):.0f} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="32768")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--formats", default="int2,int4")
    ap.add_argument("--variants", default="default", help="comma separated: default and check_mgpu_planar's s8 names")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--allow-cpu", action="store_true", help="exit 0 on a machine without a GPU")
    a = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("profile_mgpu_s8: needs a Hopper GPU (the in-kernel profiler runs the kernel itself)")
        return 0 if a.allow_cpu else 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvq_s8_prof_") as tmp:
        for t in [int(x) for x in a.T.split(",")]:
            for fmt in a.formats.split(","):
                q, ops = case_inputs(a, fmt, t)
                ref = np.asarray(_entry(s8.PlanarS8Config())(q, ops))
                for variant in [v.strip() for v in a.variants.split(",")]:
                    row = run_case(a, fmt, variant, t, tmp, q, ops, ref)
                    rows.append(row)
                    print("\n".join(table([row])[2:]), flush=True)
    lines = table(rows) + ["", "Sub-phases (``rest``: the step less the sub-phases):", ""] + table(rows, "subprofile")
    print("\n".join(lines))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    device=str(jax.devices()[0].device_kind), jax=jax.__version__, argv=sys.argv[1:] if argv is None
                    else list(argv))
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(os.path.join(a.out, "table.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
