"""Benchmark: Pallas W8A8 / W4A8 GEMM (+ fused epilogue) vs XLA, and the fused RMSNorm->INT8 producer.

Usage (GPU, e.g. the H200)::

    PYTHONPATH=. python experiments/bench_w8a8.py --out /tmp/bench_w8a8        # writes .json and .md

Phases:
  1. ``check``: GPU parity of every kernel variant (compiled, not interpreted) against float64 NumPy oracles on odd
     shapes (M, N not multiples of the block, K needing a smaller block_k / padding).
  2. ``gemm``: M in {16, 256, 4096, 16384} x (K, N) in {(4096, 4096), (4096, 14336), (8192, 8192)}:
     XLA bf16 matmul (bf16 out, fp32 accumulation), XLA int8 dot (preferred_element_type=int32, cuBLASLt) alone and
     with the separate float32 epilogue (y = acc*s_x*s_w + bias -> bf16), our Pallas W8A8 (default tiles and a
     small sweep), Pallas W4A8 and the affine-zero-point variant.
  3. ``rmsnorm``: fused RMSNorm->INT8 achieved bandwidth (bytes = read x + w, write codes + scale + status),
     against the unfused XLA reference and a device copy.
  Default order: check, sanity (XLA bf16/int8 at 8192^3), gemm_large (M >= 4096), rmsnorm, gemm_small (M <= 256);
  ``--budget-s`` skips whatever remains once that many seconds have passed (results are written incrementally).
  4. ``tune`` (not in the default list): copy ceilings (XLA bf16/fp32, Pallas), the persistent RMSNorm variants,
     W4A8 decode modes and extra large-M tiles, with on-device checks of the new variants first.
  5. ``rms_variants`` (not in the default list): RMSNorm formulations side by side in one run (two-pass vs one-pass
     amax, reload of x/w for the encode step, warps/rows), after on-device oracle checks of each, with the copy
     ceilings; M in ``--rms-variant-ms``, K in {4096, 8192}. ``--phases check,rms_variants`` for the RMSNorm work.

Timing: each measured function is jitted over R distinct input sets (R rotating buffers, so weights/activations do
not sit in the 60 MB L2 between launches), one call launches R kernels back to back; time = median over
``--iters`` device-synchronised calls (after warmup) / R. R is chosen so a call is >= ~1.5 ms, bounding the
per-call launch/sync overhead (~20-40 us) to a few percent.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform as _platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels import rmsnorm_quantize as rq  # noqa: E402
from pallas_kernels import w8a8_matmul as wm  # noqa: E402

NT = (((1,), (1,)), ((), ()))
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
def time_multi(fn, sets, iters, warmup=2):
    """Median seconds per single invocation of fn over the rotating input sets."""
    multi = jax.jit(lambda s: [fn(*a) for a in s])
    jax.block_until_ready(multi(sets))  # compile + first run
    for _ in range(warmup):
        jax.block_until_ready(multi(sets))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(multi(sets))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / len(sets), (max(ts) - min(ts)) / statistics.median(ts)


def device_time(fn, sets, iters):
    """Device-side timing from a profiler trace: run the same jitted multi-call as ``time_multi`` ``iters`` times
    under ``jax.profiler.trace`` and read the GPU kernel records (CUPTI) from the Perfetto export.

    Returns ``(kernel_s, info)``: summed kernel time per single invocation of fn (the busy time of the R launches,
    without the gaps between them), and the kernel names / per-trace-line totals seen (for the log).
    """
    import glob
    import gzip
    import tempfile

    multi = jax.jit(lambda s: [fn(*a) for a in s])
    jax.block_until_ready(multi(sets))
    jax.block_until_ready(multi(sets))
    d = tempfile.mkdtemp(prefix="kvq_trace_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(iters):
            jax.block_until_ready(multi(sets))
    path = sorted(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", "")) and "host" not in
                str(e.get("args", {}).get("name", "")).lower()}
    kern = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and float(e.get("dur", 0)) > 0]
    if not kern:
        raise RuntimeError(f"no GPU kernel events in the trace (pids {sorted(gpu_pids)})")
    # a GPU process can show both stream and per-op (XLA-op) lines for the same kernel: keep one line per name,
    # the thread with the most time in total
    by_tid = {}
    for e in kern:
        by_tid.setdefault(e["tid"], []).append(e)
    tid = max(by_tid, key=lambda t: sum(float(e["dur"]) for e in by_tid[t]))
    total_us = sum(float(e["dur"]) for e in by_tid[tid])
    names = sorted({e["name"] for e in by_tid[tid]})[:6]
    lines = {f"{pid_tid}": (len(v), round(sum(float(e["dur"]) for e in v)), sorted({e["name"] for e in v})[:3])
             for pid_tid, v in by_tid.items()}
    return total_us * 1e-6 / (iters * len(sets)), dict(names=names, per_line=lines)


def n_sets(est_s, per_set_bytes, target_s=1.5e-3, max_sets=32, mem_budget=24e9):
    r = max(2, min(max_sets, math.ceil(target_s / max(est_s, 1e-7))))
    return max(2, min(r, int(mem_budget // max(per_set_bytes, 1))))


# ----------------------------------------------------------------------------------------------------------------
# correctness on the device (compiled kernels)
# ----------------------------------------------------------------------------------------------------------------
def oracle_gemm(xq, sx, wq, sw, bias, zp):
    acc = xq.astype(np.int64) @ wq.astype(np.int64).T
    if zp is not None:
        acc = acc - zp.astype(np.int64)[:, None] * wq.astype(np.int64).sum(1)[None, :]
    y = acc * sx.astype(np.float64)[:, None] * sw.astype(np.float64)[None, :]
    if bias is not None:
        y = y + bias.astype(np.float64)[None, :]
    return y, np.abs(acc * sx.astype(np.float64)[:, None] * sw.astype(np.float64)[None, :]) + (
        0 if bias is None else np.abs(bias.astype(np.float64))[None, :])


def oracle_rmsnorm(x, w, eps, qdtype):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * np.asarray(w, np.float64)
    amax = np.abs(y).max(1)
    scale = np.where(amax == 0, 1.0, amax / 127).astype(qdtype)
    codes = np.clip(np.rint(y / scale.astype(np.float64)[:, None]), -127, 127)
    return codes, scale


def run_checks(results):
    rng = np.random.default_rng(1)
    out = []
    for (m, n, k) in [(70, 200, 384), (300, 520, 1000), (1, 64, 256)]:
        xq = rng.integers(-127, 128, (m, k), dtype=np.int8)
        wq = rng.integers(-127, 128, (n, k), dtype=np.int8)
        w4 = rng.integers(-7, 8, (n, k), dtype=np.int8)
        sx = rng.uniform(0.01, 0.1, m).astype(np.float32)
        sw = rng.uniform(0.001, 0.01, n).astype(np.float32)
        b = rng.normal(size=n).astype(np.float32)
        zp = rng.integers(-128, 128, m, dtype=np.int32)
        for name, wmat, zz, od in [("w8a8", wq, None, jnp.float32), ("w8a8", wq, None, jnp.bfloat16),
                                   ("w8a8_affine", wq, zp, jnp.float32), ("w4a8", w4, None, jnp.float32),
                                   ("w4a8_affine", w4, zp, jnp.bfloat16)]:
            try:
                if name.startswith("w4a8"):
                    y = wm.w4a8_matmul(jnp.asarray(xq), jnp.asarray(sx), wm.pack_int4(jnp.asarray(wmat)),
                                       jnp.asarray(sw), jnp.asarray(b),
                                       x_zero_point=None if zz is None else jnp.asarray(zz), out_dtype=od)
                else:
                    y = wm.w8a8_matmul(jnp.asarray(xq), jnp.asarray(sx), jnp.asarray(wmat), jnp.asarray(sw),
                                       jnp.asarray(b), x_zero_point=None if zz is None else jnp.asarray(zz),
                                       out_dtype=od)
                ref, mag = oracle_gemm(xq, sx, wmat, sw, b, zz)
                y = np.asarray(y.astype(jnp.float32), np.float64)
                err = float(np.max(np.abs(y - ref) / (mag + 1e-30)))
                tol = 1e-5 if od == jnp.float32 else 8e-3
                ok = bool(np.isfinite(y).all() and err <= tol)
            except Exception as e:  # noqa: BLE001
                err, ok = repr(e)[:300], False
            out.append(dict(kernel=name, m=m, n=n, k=k, out=jnp.dtype(od).name, max_rel_err=err, ok=ok))
            log("check", out[-1])
    for (m, k) in [(37, 5120), (300, 4096), (5, 96)]:
        x = (rng.normal(size=(m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        x[1] = 0
        xb = jnp.asarray(x, jnp.bfloat16)
        w = rng.uniform(0.5, 1.5, k).astype(np.float32)
        for qd in (np.float16, np.float32):
            try:
                c, s, st = rq.rmsnorm_quantize(xb, jnp.asarray(w), qparam_dtype=qd)
                codes, scale = oracle_rmsnorm(np.asarray(xb.astype(jnp.float32)), w, 1e-6, qd)
                cd = int(np.abs(np.asarray(c, np.int32) - codes).max())
                srel = float(np.max(np.abs(np.asarray(s, np.float64) - scale.astype(np.float64)) / scale))
                ok = cd <= 1 and srel <= (1e-3 if qd == np.float16 else 1e-5) and int(np.asarray(st).max()) == 0
                ok = ok and float(np.mean(np.asarray(c, np.int32) != codes)) < 1e-3
            except Exception as e:  # noqa: BLE001
                cd, srel, ok = repr(e)[:300], None, False
            out.append(dict(kernel="rmsnorm_quantize", m=m, k=k, qparam=np.dtype(qd).name, max_code_diff=cd,
                            scale_rel_err=srel, ok=bool(ok)))
            log("check", out[-1])
        # status on the device: a NaN row and FTZ-unsafe fp16 scales (tiny gamma) must be flagged, not encoded
        try:
            xs = np.asarray(xb.astype(jnp.float32)).copy()
            xs[0, 3] = np.nan
            _, _, st = rq.rmsnorm_quantize(jnp.asarray(xs, jnp.bfloat16), jnp.asarray(w), qparam_dtype=np.float16,
                                           check=False)
            st = np.asarray(st)
            _, s2, st2 = rq.rmsnorm_quantize(xb, jnp.asarray(w * np.float32(1e-7)), qparam_dtype=np.float16,
                                             check=False)
            st2 = np.asarray(st2)
            ok = (st[0] == rq.STATUS_NONFINITE and (st[1:] == 0).all() and st2[1] == 0
                  and (st2[np.arange(m) != 1] == rq.STATUS_FTZ_UNSAFE).all())
            out.append(dict(kernel="rmsnorm_quantize_status", m=m, k=k, status_nan=st[:4].tolist(),
                            status_ftz=st2[:4].tolist(), ok=bool(ok)))
        except Exception as e:  # noqa: BLE001
            out.append(dict(kernel="rmsnorm_quantize_status", m=m, k=k, error=repr(e)[:300], ok=False))
        log("check", out[-1])
    # the model path: a tiny random LLaMA prefill with the W8A8 policy on the compiled Pallas kernels (fused
    # RMSNorm -> INT8 producer shared by q/k/v and gate/up, W8A8 GEMMs) vs the same policy on XLA
    try:
        from kvquant_jax.models import llama
        from kvquant_jax.models import w8a8 as W
        from kvquant_jax.models.testing import random_params, tiny_config

        cfg = tiny_config(num_layers=2)
        qp = W.quantize_params(random_params(cfg), W.W8A8Policy())
        tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 48)), jnp.int32)
        fwd = jax.jit(llama.forward_nocache, static_argnames=("cfg", "linear"))
        y_p = np.asarray(fwd(qp, cfg, tok, linear=W.W8A8Policy(impl="pallas")), np.float64)
        y_x = np.asarray(fwd(qp, cfg, tok, linear=W.W8A8Policy(impl="xla")), np.float64)
        rel = float(np.abs(y_p - y_x).max() / np.abs(y_x).max())
        out.append(dict(kernel="model_w8a8_fused_norm_pallas_vs_xla", rel_err=rel,
                        ok=bool(np.isfinite(y_p).all() and rel < 1e-3)))
    except Exception as e:  # noqa: BLE001
        out.append(dict(kernel="model_w8a8_fused_norm_pallas_vs_xla", error=repr(e)[:300], ok=False))
    log("check", out[-1])
    results["checks"] = out


# ----------------------------------------------------------------------------------------------------------------
# GEMM benchmark
# ----------------------------------------------------------------------------------------------------------------
def sweep_configs(m):
    if m <= 16:
        return [wm.GemmConfig(16, 32, 512, 4, 4), wm.GemmConfig(16, 128, 256, 4, 4)]
    if m <= 256:
        return [wm.GemmConfig(128, 128, 128, 4, 4)]
    return [wm.GemmConfig(128, 128, 128, 4, 4), wm.GemmConfig(256, 128, 128, 8, 3),
            wm.GemmConfig(128, 256, 64, 8, 4)]


def cfg_str(c):
    return f"{c.block_m}x{c.block_n}x{c.block_k}/w{c.num_warps}s{c.num_stages}"


def sanity(results, args):
    """XLA bf16 and int8 at 8192^3 against the reference figures (665 TFLOP/s, 762 TOPS)."""
    m = n = k = 8192
    key = jax.random.PRNGKey(7)
    sb, s8 = [], []
    for i in range(2):
        k1, k2, key = jax.random.split(key, 3)
        x = jax.random.randint(k1, (m, k), -127, 128, jnp.int32).astype(jnp.int8)
        w = jax.random.randint(k2, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
        s8.append((x, w))
        sb.append((x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
    out = {}
    for name, fn, sets in [("xla_bf16", lambda x, w: lax.dot_general(x, w, NT, preferred_element_type=jnp.bfloat16),
                            sb),
                           ("xla_int8", lambda x, w: lax.dot_general(x, w, NT, preferred_element_type=jnp.int32),
                            s8)]:
        t, _ = time_multi(fn, sets, args.iters)
        out[name] = 2.0 * m * n * k / t / 1e12
        log(f"sanity 8192^3 {name}: {out[name]:.0f} T/s")
    results["sanity_8192"] = out


def gemm_bench(results, args, ms):
    rows = results.setdefault("gemm", [])
    kns = [tuple(int(t) for t in s.split("x")) for s in args.kns.split(",")]
    for (k, n) in kns:
        for m in ms:
            if time.time() - T0 > args.budget_s:
                log("budget exhausted; skipping", m, k, n)
                continue
            flops = 2.0 * m * n * k
            est = max(flops / 7e14, (n * k + m * k + 2 * m * n) / 3.5e12)
            r = n_sets(est, n * k * 3 + m * k * 3 + m * n * 8)
            key = jax.random.PRNGKey(m * 7 + k * 13 + n)
            sets8, setsbf, sets4 = [], [], []
            for i in range(r):
                k1, k2, k3, k4, k5, key = jax.random.split(key, 6)
                x = jax.random.randint(k1, (m, k), -127, 128, jnp.int32).astype(jnp.int8)
                w = jax.random.randint(k2, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
                sx = jax.random.uniform(k3, (m,), jnp.float32, 0.01, 0.1)
                sw = jax.random.uniform(k4, (n,), jnp.float32, 0.001, 0.01)
                b = jax.random.normal(k5, (n,), jnp.float32)
                sets8.append((x, sx, w, sw, b))
                setsbf.append((x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
                sets4.append((x, sx, jax.random.bits(k2, (n, k // 2), jnp.uint8), sw, b))
            jax.block_until_ready((sets8, setsbf, sets4))
            row = dict(m=m, k=k, n=n, sets=r)

            def rec(name, fn, sets, ops=flops, ref=None):
                if time.time() - T0 > args.budget_s:
                    return
                try:
                    t, spread = time_multi(fn, sets, args.iters)
                    row[name] = dict(us=t * 1e6, tops=ops / t / 1e12, spread=spread)
                    if ref is not None:  # validate the timed kernel at this shape against the XLA reference
                        a = fn(*sets[0]).astype(jnp.float32)
                        b_ = ref(*sets[0]).astype(jnp.float32)
                        row[name]["rel_err_vs_xla"] = float(jnp.max(jnp.abs(a - b_)) / jnp.max(jnp.abs(b_)))
                    log(f"M={m} K={k} N={n} {name}: {t * 1e6:9.1f} us  {ops / t / 1e12:7.1f} T/s  "
                        f"(spread {spread:.2f})")
                except Exception as e:  # noqa: BLE001
                    row[name] = dict(error=repr(e)[:400])
                    log(f"M={m} K={k} N={n} {name}: ERROR {e!r}"[:600])

            rec("xla_bf16", lambda x, w: lax.dot_general(x, w, NT, preferred_element_type=jnp.bfloat16), setsbf)
            rec("xla_int8_dot", lambda x, sx, w, sw, b: lax.dot_general(x, w, NT, preferred_element_type=jnp.int32),
                sets8)
            rec("xla_int8_epi", lambda x, sx, w, sw, b: wm.w8a8_matmul_reference(x, sx, w, sw, b), sets8)
            ref8 = wm.w8a8_matmul_reference
            rec("pallas_w8a8", lambda x, sx, w, sw, b: wm.w8a8_matmul(x, sx, w, sw, b), sets8, ref=ref8)
            row.setdefault("pallas_w8a8", {})["cfg"] = cfg_str(wm.default_config(m, n, k, backend="gpu"))
            if not args.no_sweep and m in [int(v) for v in args.sweep_ms.split(",")]:
                for c in sweep_configs(m):
                    name = "sweep_" + cfg_str(c)
                    rec(name, lambda x, sx, w, sw, b, c=c: wm.w8a8_matmul(
                        x, sx, w, sw, b, block_m=c.block_m, block_n=c.block_n, block_k=c.block_k,
                        num_warps=c.num_warps, num_stages=c.num_stages), sets8, ref=ref8)
            rec("pallas_w4a8", lambda x, sx, w, sw, b: wm.w4a8_matmul(x, sx, w, sw, b), sets4,
                ref=wm.w4a8_matmul_reference)
            if m in [int(v) for v in args.affine_ms.split(",")]:
                zp = jnp.full((m,), 3, jnp.int32)
                wsums = [jnp.sum(s[2].astype(jnp.int32), axis=1) for s in sets8]
                rec("pallas_w8a8_affine", lambda x, sx, w, sw, b, ws: wm.w8a8_matmul(
                    x, sx, w, sw, b, x_zero_point=zp, w_sum=ws), [s + (ws,) for s, ws in zip(sets8, wsums)],
                    ref=lambda x, sx, w, sw, b, ws: wm.w8a8_matmul_reference(x, sx, w, sw, b, x_zero_point=zp,
                                                                             w_sum=ws))
            best = None
            for name, v in row.items():
                if (name == "pallas_w8a8" or name.startswith("sweep_")) and isinstance(v, dict) and "us" in v:
                    if best is None or v["us"] < row[best]["us"]:
                        best = name
            row["pallas_best"] = best
            rows.append(row)
            del sets8, setsbf, sets4
            write(results, args.out)


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm-quant bandwidth
# ----------------------------------------------------------------------------------------------------------------
HBM_COPY_REFERENCE_GBPS = 4300.0  # the guide's H200 device-to-device copy figure (2026-11-29), the 80 % target's base


def rms_bench(results, args):
    """Fused RMSNorm -> INT8 at M in --rms-ms, K in {4096, 8192}: the default kernel (one-pass), the two-pass body and
    the unfused XLA reference; host timing always, kernel (profiler) timing with
    --device-timing. Fractions are of the guide's 4.3 TB/s copy and of the same run's copy ceilings."""
    rows = []
    ceil = copy_ceilings(args, log)
    results["copy_GBps"] = ceil
    for k in (8192, 4096):
        for m in sorted((int(v) for v in args.rms_ms.split(",")), reverse=True):
            if time.time() - T0 > args.budget_s:
                continue
            nbytes = m * k * 2 + k * 2 + m * k + m * 2 + m * 4
            r = n_sets(nbytes / 3.5e12, m * k * 3)
            sets = []
            for i in range(r):
                kx, kw = jax.random.split(jax.random.PRNGKey(1000 + i))
                sets.append((jax.random.normal(kx, (m, k), jnp.bfloat16),
                             jax.random.uniform(kw, (k,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)))
            row = dict(m=m, k=k, bytes=nbytes, sets=r)
            for name, fn in [
                ("pallas_fused", lambda x, w: rq.rmsnorm_quantize(x, w, qparam_dtype=jnp.float16, check=False)),
                ("pallas_twopass", lambda x, w: rq.rmsnorm_quantize(x, w, qparam_dtype=jnp.float16, check=False,
                                                                    one_pass=False)),
                ("xla_unfused_ref", lambda x, w: rq.rmsnorm_quantize_reference(x, w, qparam_dtype=jnp.float16,
                                                                               check=False)),
            ]:
                if time.time() - T0 > args.budget_s:
                    continue
                try:
                    t, spread = time_multi(fn, sets, args.iters)
                    row[name] = dict(us=t * 1e6, GBps=nbytes / t / 1e9)
                    msg = f"rmsnorm M={m} K={k} {name}: host {t * 1e6:8.1f} us {nbytes / t / 1e9:7.0f} GB/s"
                    if args.device_timing:
                        try:
                            td, _ = device_time(fn, sets, args.iters)
                            row[name].update(dev_us=td * 1e6, dev_GBps=nbytes / td / 1e9,
                                             frac_hbm=nbytes / td / 1e9 / HBM_COPY_REFERENCE_GBPS)
                            msg += f" | kernel {td * 1e6:8.1f} us {nbytes / td / 1e9:7.0f} GB/s"
                        except Exception as e:  # noqa: BLE001  (the host-timed figure stands)
                            msg += f" | kernel timing failed: {e!r}"[:300]
                    log(msg)
                except Exception as e:  # noqa: BLE001
                    row[name] = dict(error=repr(e)[:400])
                    log(f"rmsnorm M={m} K={k} {name}: ERROR {e!r}"[:600])
            rows.append(row)
            results["rmsnorm"] = rows
            write(results, args.out)
    results["rmsnorm"] = rows


# ----------------------------------------------------------------------------------------------------------------
# tuning follow-ups (second device run): copy ceilings, persistent RMSNorm, W4A8 decode modes, more GEMM tiles
# ----------------------------------------------------------------------------------------------------------------
def _pallas_copy(x, block=8192):
    """Bandwidth probe: y = x + 1 (bf16) as a plain Pallas Triton kernel with large vectorized blocks."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    def kern(x_ref, o_ref):
        o_ref[...] = x_ref[...] + jnp.asarray(1, x_ref.dtype)

    return pl.pallas_call(kern, grid=(x.shape[0] // block,), in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
                          out_specs=pl.BlockSpec((block,), lambda i: (i,)),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=plt.CompilerParams(num_warps=8, num_stages=1))(x)


TUNE_RMS_K, TUNE_RMS_M = (4096, 8192), (4096, 16384)
TUNE_CHECKS = [(37, 5120, 1, 8), (300, 4096, 2, 16), (1000, 8192, 1, 528)]
TUNE_GEMM = [(16, 4096, 14336), (16, 8192, 8192), (4096, 4096, 14336), (16384, 8192, 8192)]


def copy_ceilings(args, log, with_f32: bool = False) -> dict:
    """In-framework copy ceilings (GB/s, read + write) on ``args.copy_elems``-element arrays: XLA and Pallas bf16
    ``x + 1`` (and XLA fp32 with ``with_f32``); a failing entry records its exception text."""
    ceil = {}
    xs = [jax.random.normal(jax.random.PRNGKey(i), (args.copy_elems,), jnp.bfloat16) for i in range(2)]
    entries = [("xla_bf16_add", lambda a: a + jnp.bfloat16(1), [(a,) for a in xs], 2 * xs[0].nbytes),
               ("pallas_bf16_add", _pallas_copy, [(a,) for a in xs], 2 * xs[0].nbytes)]
    if with_f32:
        half = args.copy_elems // 2
        entries.append(("xla_f32_add", lambda a: a + jnp.float32(1), [(a.astype(jnp.float32)[:half],) for a in xs],
                        2 * 4 * half))
    for name, fn, sets, nbytes in entries:
        try:
            t, _ = time_multi(fn, sets, args.iters)
            ceil[name] = nbytes / t / 1e9
            if getattr(args, "device_timing", False):
                try:
                    td, info = device_time(fn, sets, args.iters)
                    ceil[name + "_device"] = nbytes / td / 1e9
                    log("ceiling (device timing)", name, ceil[name + "_device"], info)
                except Exception as e:  # noqa: BLE001
                    log("ceiling (device timing) failed", name, repr(e)[:300])
        except Exception as e:  # noqa: BLE001
            ceil[name] = repr(e)[:300]
        log("ceiling", name, ceil[name])
    return ceil


def tune(results, args):
    out = results.setdefault("tune", {})
    rng = np.random.default_rng(5)
    # correctness of the new variants on the device first
    chk = []
    for (m, k, br, nprog) in TUNE_CHECKS:
        x = (rng.normal(size=(m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        x[1] = 0
        xb = jnp.asarray(x, jnp.bfloat16)
        w = rng.uniform(0.5, 1.5, k).astype(np.float32)
        c, s_, st = rq.rmsnorm_quantize(xb, jnp.asarray(w), qparam_dtype=np.float16, block_rows=br, num_programs=nprog,
                                        num_warps=4, check=False)
        codes, scale = oracle_rmsnorm(np.asarray(xb.astype(jnp.float32)), w, 1e-6, np.float16)
        cd = int(np.abs(np.asarray(c, np.int32) - codes).max())
        ok = cd <= 1 and bool((np.asarray(s_) == scale).mean() > 0.99) and int(np.asarray(st).max()) == 0
        chk.append(dict(kernel="rmsnorm_persistent", m=m, k=k, max_code_diff=cd, ok=bool(ok)))
        log("tune check", chk[-1])
    for (m, n, k) in [(70, 200, 384), (300, 520, 1000)]:
        xq = rng.integers(-127, 128, (m, k), dtype=np.int8)
        w4 = rng.integers(-7, 8, (n, k), dtype=np.int8)
        sx = rng.uniform(0.01, 0.1, m).astype(np.float32)
        sw = rng.uniform(0.001, 0.01, n).astype(np.float32)
        b = rng.normal(size=n).astype(np.float32)
        zp = rng.integers(-128, 128, m, dtype=np.int32)
        y = wm.w4a8_matmul(jnp.asarray(xq), jnp.asarray(sx), wm.pack_int4(jnp.asarray(w4)), jnp.asarray(sw),
                           jnp.asarray(b), x_zero_point=jnp.asarray(zp), out_dtype=jnp.float32, w4_mode="planes")
        ref, mag = oracle_gemm(xq, sx, w4, sw, b, zp)
        err = float(np.max(np.abs(np.asarray(y, np.float64) - ref) / (mag + 1e-30)))
        chk.append(dict(kernel="w4a8_planes_affine", m=m, n=n, k=k, max_rel_err=err, ok=err <= 1e-5))
        log("tune check", chk[-1])
    out["checks"] = chk
    out["copy_GBps"] = copy_ceilings(args, log, with_f32=True)
    # RMSNorm variants
    rms = []
    variants = [("grid_default", {}), ("grid_r1w4", dict(block_rows=1, num_warps=4)),
                ("pers_r1w4_p528", dict(block_rows=1, num_warps=4, num_programs=528)),
                ("pers_r1w4_p1056", dict(block_rows=1, num_warps=4, num_programs=1056)),
                ("pers_r1w8_p528", dict(block_rows=1, num_warps=8, num_programs=528)),
                ("pers_r2w8_p264", dict(block_rows=2, num_warps=8, num_programs=264))]
    for k in TUNE_RMS_K:
        for m in TUNE_RMS_M:
            nbytes = m * k * 2 + k * 2 + m * k + m * 4 + m * 4
            r = n_sets(nbytes / 3.5e12, m * k * 3)
            sets = [(jax.random.normal(jax.random.PRNGKey(50 + i), (m, k), jnp.bfloat16),
                     jax.random.uniform(jax.random.PRNGKey(90 + i), (k,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16))
                    for i in range(r)]
            row = dict(m=m, k=k)
            for name, kw in variants:
                if time.time() - T0 > args.budget_s:
                    continue
                try:
                    t, _ = time_multi(lambda x, w, kw=kw: rq.rmsnorm_quantize(x, w, qparam_dtype=jnp.float16,
                                                                              check=False, **kw), sets, args.iters)
                    row[name] = dict(us=t * 1e6, GBps=nbytes / t / 1e9)
                except Exception as e:  # noqa: BLE001
                    row[name] = dict(error=repr(e)[:300])
                log("tune rms", m, k, name, row[name])
            rms.append(row)
            out["rmsnorm"] = rms
            write(results, args.out)
    # W4A8 decode modes and extra W8A8 tiles
    gem = []
    for (m, k, n) in TUNE_GEMM:
        if time.time() - T0 > args.budget_s:
            continue
        flops = 2.0 * m * n * k
        r = n_sets(max(flops / 7e14, n * k / 3.5e12), n * k * 2 + m * k * 2 + m * n * 4)
        key = jax.random.PRNGKey(m + k + n)
        s8, s4 = [], []
        for i in range(r):
            k1, k2, k3, key = jax.random.split(key, 4)
            x = jax.random.randint(k1, (m, k), -127, 128, jnp.int32).astype(jnp.int8)
            sx = jnp.full((m,), 0.01, jnp.float32)
            sw = jnp.full((n,), 0.01, jnp.float32)
            b = jnp.zeros((n,), jnp.float32)
            s8.append((x, sx, jax.random.randint(k2, (n, k), -127, 128, jnp.int32).astype(jnp.int8), sw, b))
            s4.append((x, sx, jax.random.bits(k3, (n, k // 2), jnp.uint8), sw, b))
        row = dict(m=m, k=k, n=n)
        cands = [("w4a8_interleave", s4, dict(w4_mode="interleave"), True),
                 ("w4a8_planes", s4, dict(w4_mode="planes"), True),
                 ("w8a8_default", s8, {}, False)]
        if m >= 4096:
            cands += [("w8a8_128x256x128w8s4", s8, dict(block_m=128, block_n=256, block_k=128, num_warps=8,
                                                         num_stages=4), False),
                      ("w8a8_256x128x128w8s4", s8, dict(block_m=256, block_n=128, block_k=128, num_warps=8,
                                                         num_stages=4), False),
                      ("w8a8_128x256x64w8s5", s8, dict(block_m=128, block_n=256, block_k=64, num_warps=8,
                                                        num_stages=5), False)]
        else:
            cands += [("w4a8_planes_16x32x512", s4, dict(w4_mode="planes", block_n=32, block_k=512), True),
                      ("w8a8_16x32x512s3", s8, dict(block_m=16, block_n=32, block_k=512, num_stages=3), False)]
        for name, sets, kw, is4 in cands:
            if time.time() - T0 > args.budget_s:
                continue
            fn = (lambda *a, kw=kw: wm.w4a8_matmul(*a, **kw)) if is4 else (lambda *a, kw=kw: wm.w8a8_matmul(*a, **kw))
            try:
                t, _ = time_multi(fn, sets, args.iters)
                row[name] = dict(us=t * 1e6, tops=flops / t / 1e12)
                ref = (wm.w4a8_matmul_reference if is4 else wm.w8a8_matmul_reference)(*sets[0]).astype(jnp.float32)
                row[name]["rel_err_vs_xla"] = float(jnp.max(jnp.abs(fn(*sets[0]).astype(jnp.float32) - ref))
                                                    / jnp.max(jnp.abs(ref)))
            except Exception as e:  # noqa: BLE001
                row[name] = dict(error=repr(e)[:300])
            log("tune gemm", m, k, n, name, row[name])
        gem.append(row)
        out["gemm"] = gem
        del s8, s4
        write(results, args.out)


RMS_VARIANTS = [  # (name, kwargs); the first is the old default (two-pass, 1 row / 4 warps)
    ("twopass_r1w4", dict(one_pass=False, block_rows=1, num_warps=4)),
    ("onepass_r1w4", dict(one_pass=True, block_rows=1, num_warps=4)),
    ("onepass_reload_r1w4", dict(one_pass=True, reload=True, block_rows=1, num_warps=4)),
    ("twopass_reload_r1w4", dict(one_pass=False, reload=True, block_rows=1, num_warps=4)),
    ("onepass_r1w8", dict(one_pass=True, block_rows=1, num_warps=8)),
    ("twopass_r1w8", dict(one_pass=False, block_rows=1, num_warps=8)),
    ("onepass_reload_r1w8", dict(one_pass=True, reload=True, block_rows=1, num_warps=8)),
    ("onepass_r2w8", dict(one_pass=True, block_rows=2, num_warps=8)),
    ("onepass_r1w2", dict(one_pass=True, block_rows=1, num_warps=2)),
    ("onepass_r2w4", dict(one_pass=True, block_rows=2, num_warps=4)),
    ("onepass_r4w8", dict(one_pass=True, block_rows=4, num_warps=8)),
    ("onepass_r4w16", dict(one_pass=True, block_rows=4, num_warps=16)),
    ("onepass_r2w2", dict(one_pass=True, block_rows=2, num_warps=2)),
]


def rms_variants(results, args):
    out = results.setdefault("rms_variants", {})
    rng = np.random.default_rng(7)
    chk = []
    variants = [(n, kw) for n, kw in RMS_VARIANTS if not args.rms_variants or n in args.rms_variants.split(",")]
    for (m, k) in [(37, 5120), (300, 4096), (5, 96), (64, 8192)] if not args.rms_variant_nocheck else []:
        x = (rng.normal(size=(m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        x[1] = 0
        xb = jnp.asarray(x, jnp.bfloat16)
        w = rng.uniform(0.5, 1.5, k).astype(np.float32)
        codes, scale = oracle_rmsnorm(np.asarray(xb.astype(jnp.float32)), w, 1e-6, np.float16)
        for name, kw in variants:
            try:
                c, s_, st = rq.rmsnorm_quantize(xb, jnp.asarray(w), qparam_dtype=np.float16, check=False, **kw)
                ref = rq.rmsnorm_quantize_reference(xb, jnp.asarray(w), qparam_dtype=np.float16, check=False,
                                                     one_pass=kw["one_pass"])
                cd = int(np.abs(np.asarray(c, np.int32) - codes).max())
                sulp = int(np.abs(np.asarray(s_).view(np.int16).astype(int) - scale.view(np.int16).astype(int)).max())
                ref_cd = int(np.abs(np.asarray(c, np.int32) - np.asarray(ref[0], np.int32)).max())
                ok = (cd <= 1 and sulp <= 1 and int(np.asarray(st).max()) == 0 and ref_cd <= 1
                      and float(np.mean(np.asarray(c, np.int32) != codes)) < 1e-3)
                chk.append(dict(kernel="rmsnorm_" + name, m=m, k=k, max_code_diff=cd, scale_ulps=sulp,
                                vs_reference_code_diff=ref_cd, ok=bool(ok)))
            except Exception as e:  # noqa: BLE001
                chk.append(dict(kernel="rmsnorm_" + name, m=m, k=k, error=repr(e)[:300], ok=False))
            log("variant check", chk[-1])
    out["checks"] = chk
    out["copy_GBps"] = copy_ceilings(args, log)
    rows = []
    for k in (8192, 4096):  # largest shapes first: they are the ones the bandwidth target is about
        for m in sorted((int(v) for v in args.rms_variant_ms.split(",")), reverse=True):
            nbytes = m * k * 2 + k * 2 + m * k + m * 4 + m * 4
            r = n_sets(nbytes / 3.5e12, m * k * 3)
            sets = [(jax.random.normal(jax.random.PRNGKey(300 + i), (m, k), jnp.bfloat16),
                     jax.random.uniform(jax.random.PRNGKey(400 + i), (k,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16))
                    for i in range(r)]
            row = dict(m=m, k=k, bytes=nbytes, sets=r)
            # --rounds > 1: the variants are timed in interleaved rounds (A B C A B C ...) and the median round is
            # reported, so slow drifts of the clock/thermal state hit every variant alike
            per = {name: [] for name, _ in variants}
            dev = {name: [] for name, _ in variants}
            for rnd in range(args.rounds):
                for name, kw in variants:
                    if time.time() - T0 > args.budget_s:
                        continue
                    fn = functools.partial(rq.rmsnorm_quantize, qparam_dtype=jnp.float16, check=False, **kw)
                    try:
                        t, spread = time_multi(fn, sets, args.iters)
                        per[name].append(t)
                        log(f"rms variant M={m} K={k} {name} round {rnd}: {t * 1e6:.1f} us "
                            f"{nbytes / t / 1e9:.0f} GB/s spread {spread:.2f}")
                        if args.device_timing:
                            try:
                                td, info = device_time(fn, sets, args.iters)
                                dev[name].append(td)
                                log(f"   device timing: {td * 1e6:.1f} us {nbytes / td / 1e9:.0f} GB/s {info}"[:400])
                            except Exception as e:  # noqa: BLE001
                                log(f"   device timing failed: {e!r}"[:300])
                    except Exception as e:  # noqa: BLE001
                        row[name] = dict(error=repr(e)[:300])
                        log(f"rms variant M={m} K={k} {name}: {row[name]}"[:500])
            for name, ts in per.items():
                if ts:
                    t = statistics.median(ts)
                    row[name] = dict(us=t * 1e6, GBps=nbytes / t / 1e9, rounds_us=[v * 1e6 for v in ts])
                    if dev[name]:
                        td = statistics.median(dev[name])
                        row[name].update(dev_us=td * 1e6, dev_GBps=nbytes / td / 1e9)
            rows.append(row)
            out["rmsnorm"] = rows
            write(results, args.out)
            del sets


# ----------------------------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------------------------
def fmt(v, key="us", f="{:.1f}"):
    if not isinstance(v, dict):
        return "-"
    if "error" in v:
        return "ERR"
    return f.format(v[key])


def markdown(results):
    lines = [f"Device: {results['device']}; JAX {results['jax']}; {results['date']}", ""]
    if "checks" in results:
        bad = [c for c in results["checks"] if not c["ok"]]
        lines.append(f"GPU parity checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} passed")
        for c in bad:
            lines.append(f"- FAILED: {c}")
        lines.append("")
    if results.get("sanity_8192"):
        lines += [f"Sanity 8192^3: XLA bf16 {results['sanity_8192'].get('xla_bf16', 0):.0f} TFLOP/s, XLA int8 "
                  f"{results['sanity_8192'].get('xla_int8', 0):.0f} TOPS (reference 665 / 762)", ""]
    if results.get("gemm"):
        lines += ["| M | K | N | XLA bf16 us (TFLOP/s) | XLA int8 dot us (TOPS) | XLA int8+epi us | Pallas W8A8 us "
                  "(TOPS) [default tiles] | best Pallas us (TOPS) [tiles] | best / bf16 | best / int8+epi | "
                  "W4A8 us | affine W8A8 us |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["gemm"]:
            b = r.get("xla_bf16", {})
            e = r.get("xla_int8_epi", {})
            best = r.get(r.get("pallas_best") or "", {})
            bname = r.get("pallas_best") or "-"
            bcfg = r.get("pallas_w8a8", {}).get("cfg", "") if bname == "pallas_w8a8" else bname.replace("sweep_", "")
            sp_bf = f"{b['us'] / best['us']:.2f}x" if "us" in b and "us" in best else "-"
            sp_e = f"{e['us'] / best['us']:.2f}x" if "us" in e and "us" in best else "-"
            lines.append(
                f"| {r['m']} | {r['k']} | {r['n']} | {fmt(b)} ({fmt(b, 'tops', '{:.0f}')}) | "
                f"{fmt(r.get('xla_int8_dot'))} ({fmt(r.get('xla_int8_dot'), 'tops', '{:.0f}')}) | {fmt(e)} | "
                f"{fmt(r.get('pallas_w8a8'))} ({fmt(r.get('pallas_w8a8'), 'tops', '{:.0f}')}) "
                f"[{r.get('pallas_w8a8', {}).get('cfg', '')}] | {fmt(best)} ({fmt(best, 'tops', '{:.0f}')}) [{bcfg}] | "
                f"{sp_bf} | {sp_e} | {fmt(r.get('pallas_w4a8'))} | {fmt(r.get('pallas_w8a8_affine'))} |")
        lines.append("")
    if results.get("rmsnorm"):
        names = ["pallas_fused", "pallas_twopass", "xla_unfused_ref"]
        lines += [f"Copy ceilings (GB/s, read + write): {results.get('copy_GBps')}", "",
                  "µs (GB/s), host timing / kernel timing; % = kernel GB/s of 4.3 TB/s", "",
                  "| M | K | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for r in results["rmsnorm"]:
            cells = []
            for n in names:
                v = r.get(n)
                c = f"{fmt(v)} ({fmt(v, 'GBps', '{:.0f}')})"
                if isinstance(v, dict) and "dev_us" in v:
                    c += f" / {fmt(v, 'dev_us')} ({fmt(v, 'dev_GBps', '{:.0f}')}, {fmt(v, 'frac_hbm', '{:.0%}')})"
                cells.append(c)
            lines.append(f"| {r['m']} | {r['k']} | " + " | ".join(cells) + " |")
    rv = results.get("rms_variants", {})
    if rv.get("rmsnorm"):
        names = [n for n, _ in RMS_VARIANTS if any(n in r for r in rv["rmsnorm"])]
        bad = [c for c in rv.get("checks", []) if not c["ok"]]
        lines += ["", f"RMSNorm variant checks: {len(rv.get('checks', [])) - len(bad)}/{len(rv.get('checks', []))} "
                  f"passed; copy ceilings (GB/s): {rv.get('copy_GBps')}"]
        lines += [f"- FAILED: {c}" for c in bad]
        lines += ["", "| M | K | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for r in rv["rmsnorm"]:
            lines.append(f"| {r['m']} | {r['k']} | " + " | ".join(
                f"{fmt(r.get(n))} ({fmt(r.get(n), 'GBps', '{:.0f}')})"
                + (f" dev {fmt(r.get(n), 'dev_us')} ({fmt(r.get(n), 'dev_GBps', '{:.0f}')})"
                   if isinstance(r.get(n), dict) and "dev_us" in r.get(n) else "") for n in names) + " |")
    return "\n".join(lines) + "\n"


def write(results, out):
    base = out[:-5] if out.endswith(".json") else out
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(markdown(results))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="output path prefix (writes PREFIX.json and PREFIX.md)")
    p.add_argument("--phases", default="check,sanity,gemm_large,rmsnorm,gemm_small",
                   help="gemm_large: M in --large-ms; gemm_small: M in --small-ms")
    p.add_argument("--large-ms", default="4096,16384")
    p.add_argument("--small-ms", default="16,256")
    p.add_argument("--sweep-ms", default="16,256,4096,16384", help="M values that get the tile sweep")
    p.add_argument("--affine-ms", default="4096", help="M values that get the affine-zero-point variant")
    p.add_argument("--rms-ms", default="16,256,4096,16384")
    p.add_argument("--rms-variant-ms", default="4096,16384", help="M values of the rms_variants phase")
    p.add_argument("--rms-variants", default="", help="comma list of RMS_VARIANTS names to run (default: all)")
    p.add_argument("--rms-variant-nocheck", action="store_true", help="skip the variants' on-device oracle checks")
    p.add_argument("--device-timing", action="store_true",
                   help="rmsnorm / rms_variants / copy ceilings: also time from a profiler trace (GPU kernel time, "
                        "no host gaps)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds per variant (rms_variants)")
    p.add_argument("--copy-elems", type=int, default=1 << 30, help="bf16 elements of the copy-bandwidth probe")
    p.add_argument("--kns", default="4096x4096,4096x14336,8192x8192")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip remaining measurements after this many s")
    args = p.parse_args()
    dev = jax.devices()[0]
    import jaxlib

    results = dict(device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__, jaxlib=jaxlib.__version__,
                   python=_platform.python_version(),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   argv=sys.argv)
    log(results)
    phases = args.phases.split(",")
    try:
        if "check" in phases:
            run_checks(results)
            write(results, args.out)
            phases.remove("check")
        for ph in phases:
            if ph == "tune":
                tune(results, args)
            elif ph == "sanity":
                sanity(results, args)
            elif ph == "gemm_large":
                gemm_bench(results, args, [int(v) for v in args.large_ms.split(",")])
            elif ph == "gemm_small":
                gemm_bench(results, args, [int(v) for v in args.small_ms.split(",")])
            elif ph == "rmsnorm":
                rms_bench(results, args)
            elif ph == "rms_variants":
                rms_variants(results, args)
            write(results, args.out)
    except Exception:  # noqa: BLE001
        results["fatal"] = traceback.format_exc()
        log(results["fatal"])
    write(results, args.out)
    print(markdown(results))


if __name__ == "__main__":
    main()
