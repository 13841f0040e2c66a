"""Decode-attention benchmark on one GPU: cuDNN / XLA on bf16 K/V against our Pallas kernels on packed caches.

    python experiments/bench_decode_attention.py --out results/decode            # the table (GPU)
    python experiments/bench_decode_attention.py --tune --T 32768 --out tune    # config sweep at one T
    python experiments/bench_decode_attention.py --check-only                    # parity vs the float64 oracle
    python experiments/bench_decode_attention.py --T 32768 --formats kivi2,kivi2:kivi_update=block  # a variant

A format name may carry ``@precision`` and ``:field=value`` suffixes (KernelConfig fields, ints parsed), applied on
top of the config the format gets otherwise (``--configs`` / ``--tune`` entry, else the GPU ``default_config``), so
a variant is timed beside its base in the same run: ``kivi2:kivi_update=block`` is KIVI-2 with one online-softmax
update per block instead of per 32-token key group.

One query token per sequence, B=8, Hq=32, Hkv=8, D=128 by default, every sequence full (``lengths = T``).
Timing: each measured program runs ``n`` independent calls on ``n`` distinct input sets (rotated so the 60 MB L2
cannot serve them: the sets together hold >= 512 MB, at most 64 sets), inside one jitted executable, synchronized
with ``block_until_ready``; after warm-up, the median of ``--reps`` such programs divided by ``n`` is reported.
"Bytes" are the bytes the kernel must read (codes + qparams of the live rows + q), so TB/s is achieved
bandwidth on the bytes actually read.  Outputs are checked against the float32 JAX reference at every size and
against the float64 NumPy oracle on a small ragged case (``--check``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvquant_jax.abi.reference import decode_attention_jnp, decode_attention_reference  # noqa: E402
from kvquant_jax.abi.regions import KVFormat, KVOperand, Region  # noqa: E402
from kvquant_jax.attention.synthetic import PRESETS, kivi_formats, random_region  # noqa: E402
from pallas_kernels.decode_attention import KernelConfig, decode_attention  # noqa: E402
from experiments.timing import copy_tbps, device_seconds, read_tbps  # noqa: E402

FORMATS = {
    "bf16": PRESETS["bf16"], "e4m3": PRESETS["e4m3"], "int8": PRESETS["int8"], "int4": PRESETS["int4"],
    "int2": PRESETS["int2"], "qserve": PRESETS["qserve"], "kivi4": kivi_formats(4, 32, 32),
    "kivi2": kivi_formats(2, 32, 32),
}

# candidate configs for --tune: (block_t, num_splits, num_warps, num_stages, unpack, precision)
CANDIDATES = {
    "dense": [(64, 8, 4, 3, "magic", "bf16x2"), (64, 16, 4, 3, "magic", "bf16x2"), (32, 16, 4, 4, "magic", "bf16x2"),
              (128, 8, 4, 2, "magic", "bf16x2"), (128, 8, 8, 3, "magic", "bf16x2"), (64, 16, 4, 3, "magic", "bf16")],
    "int8": [(128, 8, 4, 3, "magic", "bf16x2"), (128, 16, 4, 3, "magic", "bf16x2"), (256, 8, 8, 3, "magic", "bf16x2"),
             (64, 16, 4, 4, "magic", "bf16x2"), (128, 16, 4, 3, "convert", "bf16x2"), (128, 16, 4, 3, "magic", "bf16")],
    "packed": [(128, 16, 4, 3, "asm", "bf16x2"), (256, 8, 4, 3, "asm", "bf16x2"), (256, 16, 8, 3, "asm", "bf16x2"),
               (128, 16, 4, 3, "magic", "bf16x2"), (64, 32, 4, 4, "asm", "bf16x2"), (128, 16, 4, 3, "asm", "bf16"),
               (128, 16, 4, 3, "convert", "bf16x2")],
    "kivi": [(128, 16, 4, 3, "asm", "bf16x2"), (256, 8, 4, 3, "asm", "bf16x2"), (64, 32, 4, 3, "asm", "bf16x2"),
             (128, 16, 4, 3, "magic", "bf16x2"), (128, 16, 8, 3, "asm", "bf16"), (256, 16, 8, 2, "asm", "bf16x2")],
}


def candidates_for(name):
    if name in ("bf16", "e4m3"):
        return CANDIDATES["dense"]
    if name == "int8":
        return CANDIDATES["int8"]
    if name.startswith("kivi"):
        return CANDIDATES["kivi"]
    return CANDIDATES["packed"]


def as_config(t):
    bt, ns, nw, st, up, pr = t
    return KernelConfig(block_t=bt, num_splits=ns, num_warps=nw, num_stages=st, unpack=up, precision=pr)


# ---------------------------------------------------------------------------------------------------------------
# inputs (generated on the device)
# ---------------------------------------------------------------------------------------------------------------
def device_operand(key, f: KVFormat, b, hkv, t, d, qdtype=jnp.float16):
    k1, k2, k3 = jax.random.split(key, 3)
    if not f.is_int:
        x = jax.random.normal(k1, (b, hkv, t, d), jnp.float32)
        if f.payload in ("e4m3", "e5m2"):
            data = (x * 4.0).astype({"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[f.payload])
            return KVOperand(data, jax.random.uniform(k2, (hkv,), jnp.float32, 0.1, 0.4), None, f)
        return KVOperand(x.astype(jnp.bfloat16), None, None, f)
    data = jax.random.bits(k1, (b, hkv, t, f.data_dim(d)), jnp.uint8)
    shape = (b, hkv, t, f.token_groups(d)) if f.scale == "token" else (b, hkv, t // f.group, d)
    levels = 2 ** f.bits - 1
    scale = (jax.random.uniform(k2, shape, jnp.float32, 0.5, 1.5) * (2.0 / levels)).astype(qdtype)
    zero = None
    if f.zero == "offset":
        zero = jax.random.uniform(k3, shape, jnp.float32, -2.0, levels + 2.0).astype(qdtype)
    elif f.zero == "min":
        zero = jax.random.uniform(k3, shape, jnp.float32, -1.5, -0.5).astype(qdtype)
    return KVOperand(data, scale, zero, f)


def device_region(key, kf, vf, b, hkv, t, d):
    ka, kb = jax.random.split(key)
    full = jnp.full((b,), t, jnp.int32)
    return Region(k=device_operand(ka, kf, b, hkv, t, d), v=device_operand(kb, vf, b, hkv, t, d),
                  start=jnp.zeros_like(full), end=full)


def region_sets(key, kf: KVFormat, vf: KVFormat, b, hkv, t, d) -> tuple[list, int]:
    """Distinct random regions, enough that together they exceed L2 (:func:`n_sets_for`), and the bytes one set
    must read (its arrays less the ``[B]`` start / end)."""
    one = device_region(jax.random.fold_in(key, 1000), kf, vf, b, hkv, t, d)
    set_bytes = nbytes(one) - 2 * b * 4
    sets = [one] + [device_region(jax.random.fold_in(key, 1000 + i), kf, vf, b, hkv, t, d)
                    for i in range(1, n_sets_for(set_bytes))]
    return sets, set_bytes


def nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


MAX_SETS = 64


def n_sets_for(set_bytes: int) -> int:
    return int(min(MAX_SETS, max(1, math.ceil(512e6 / max(set_bytes, 1)))))


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------
# "device" (default): a row's us / us_min / us_max are the kernels' device busy time per call from a profiler trace
# (timing.device_seconds; host wall where the trace has no device events, e.g. CPU); "host": host wall per call
# (what every run before 2026-12-04 13:30 UTC reported: it includes ~100-900 us of dispatch, launch gap and sync
# per call on the H200 host, experiments/probe_timing_gap.py).  --clock sets it.
CLOCK = {"clock": "device"}
LAST_TIMING: dict = {}
#: kernels (by name, largest first) whose device time per call a timed row keeps (``kernels_us``): enough for a
#: wrapper's small fusions to show beside the kernel
KERNELS_KEPT = 12


def timing_fields() -> dict:
    """The clock of the last :func:`time_program` and its other readings (host wall, device span, top kernels)."""
    return dict(LAST_TIMING)


def _spread(samples) -> tuple:
    """``(median, min, max)`` of ``samples``."""
    return statistics.median(samples), min(samples), max(samples)


def _host_samples(prog, q, sets, reps) -> list:
    """Host wall seconds per call of ``reps`` synchronized ``prog(q, sets)`` runs, after one warm-up run."""
    jax.block_until_ready(prog(q, sets))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(q, sets))
        samples.append((time.perf_counter() - t0) / len(sets))
    return samples


def time_program(fn, q, sets, reps):
    """Median seconds per call of ``fn(q, set)`` over ``len(sets)`` distinct sets run in one jitted program:
    ``(median, min, max, first_output)`` by :data:`CLOCK` (the other readings in :func:`timing_fields`; on the
    device clock ``host_us*`` are the host walls of the traced repetitions, no untraced loop is run)."""
    prog = jax.jit(lambda q, sets: [fn(q, s) for s in sets])
    first = jax.block_until_ready(prog(q, sets))[0]  # compile + warm-up
    LAST_TIMING.clear()
    dt = device_seconds(prog, q, sets, reps=reps, calls=len(sets)) if CLOCK["clock"] == "device" else None
    host = _spread(dt.host if dt is not None else _host_samples(prog, q, sets, reps))
    LAST_TIMING.update(clock="host", host_us=host[0] * 1e6, host_us_min=host[1] * 1e6, host_us_max=host[2] * 1e6)
    if dt is None:
        return host[0], host[1], host[2], first
    per = reps * len(sets)
    top = sorted(dt.kernels.items(), key=lambda kv: -kv[1])[:KERNELS_KEPT]
    LAST_TIMING.update(clock="device", span_us=statistics.median(dt.span) * 1e6,
                       kernels_us={n: round(us / per, 2) for n, us in top})
    return (*_spread(dt.busy), first)


def rel_err(out, ref):
    out = np.asarray(jax.device_get(out), np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def hbm_copy_tbps(reps=20):
    return copy_tbps(reps, clock=CLOCK["clock"])


def hbm_read_tbps(reps=20):
    return read_tbps(reps, clock=CLOCK["clock"])


# ---------------------------------------------------------------------------------------------------------------
# one size
# ---------------------------------------------------------------------------------------------------------------
def baseline_fns():
    def cudnn(q, kv):
        k, v = kv
        b, hq, d = q.shape
        o = jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")
        return o[:, 0]

    def xla(q, kv):
        k, v = kv                                      # [B, Hkv, T, D] bf16 (the cache layout)
        b, hq, d = q.shape
        hkv = k.shape[1]
        q4 = q.reshape(b, hkv, hq // hkv, d)
        s = jnp.einsum("bhgd,bhtd->bhgt", q4, k, preferred_element_type=jnp.float32) / math.sqrt(d)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhgt,bhtd->bhgd", p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32)
        return o.reshape(b, hq, d).astype(q.dtype)

    return {"cudnn": cudnn, "xla": xla}


class _Rows(list):
    """Row list that publishes every row to ``results`` and flushes the output files as it grows."""

    def __init__(self, args, results):
        super().__init__()
        self.args, self.results = args, results

    def append(self, row):
        super().append(row)
        self.results["rows"].append(row)
        flush(self.args, self.results)


def measure_row(args, t, impl, name, fn, ref_fn, q, sets, read, cfg, base, rows, log):
    """Time ``fn`` over the sets, check its first output against ``ref_fn`` (up to ``--check-t``), record a row."""
    med, lo, hi, out = time_program(fn, q, sets, args.reps)
    err = rel_err(out, np.asarray(jax.jit(ref_fn)(q, sets[0]))) if t <= args.check_t else None
    row = dict(T=t, impl=impl, format=name, us=med * 1e6, us_min=lo * 1e6, us_max=hi * 1e6, bytes=read,
               tbps=read / med / 1e12, sets=len(sets), rel_err_vs_f32_ref=err,
               config=dataclasses.asdict(cfg) if cfg else None, **timing_fields())
    if "cudnn" in base:
        row["speedup_vs_cudnn"] = base["cudnn"] / med
    rows.append(row)
    log(f"T={t:6d} {name:16s} {med * 1e6:9.1f} us  {read / med / 1e12:5.2f} TB/s  x{row.get('speedup_vs_cudnn', 0):.2f}"
        f"  err {err if err is None else f'{err:.1e}'}  (sets {len(sets)}) {cfg}")


def run_size(args, t, names, configs, results, log):
    b, hq, hkv, d = args.B, args.hq, args.hkv, args.d
    key = jax.random.PRNGKey(t)
    q = jax.random.normal(jax.random.fold_in(key, 1), (b, hq, d), jnp.float32).astype(jnp.bfloat16)
    bf16_bytes = 2 * b * hkv * t * d * 2
    rows = _Rows(args, results)
    n = n_sets_for(bf16_bytes)
    base = {}
    for bname, fn in baseline_fns().items():
        if bname not in args.baselines:
            continue
        try:
            sets = []
            for i in range(n):
                kk = jax.random.fold_in(key, 100 + i)
                shape = (b, t, hkv, d) if bname == "cudnn" else (b, hkv, t, d)
                sets.append((jax.random.normal(kk, shape, jnp.bfloat16),
                             jax.random.normal(jax.random.fold_in(kk, 7), shape, jnp.bfloat16)))
            med, lo, hi, _ = time_program(fn, q, sets, args.reps)
            base[bname] = med
            rows.append(dict(T=t, impl=bname, format="bf16", us=med * 1e6, us_min=lo * 1e6, us_max=hi * 1e6,
                             bytes=bf16_bytes, tbps=bf16_bytes / med / 1e12, sets=n, **timing_fields()))
            log(f"T={t:6d} {bname:16s} {med * 1e6:9.1f} us  {bf16_bytes / med / 1e12:5.2f} TB/s  (sets {n})")
            del sets
        except Exception as e:  # noqa: BLE001
            log(f"T={t:6d} {bname:16s} FAILED {type(e).__name__}: {str(e)[:300]}")
    for name in names:
        if name.endswith("+tail"):
            run_dispatch_kivi(args, t, name, q, configs, base, rows, log)
            continue
        base_name, *mods = name.split(":")
        base_name, _, prec = base_name.partition("@")
        kf, vf = FORMATS[base_name]
        cfg = configs.get(base_name)
        updates = config_updates(mods)
        if prec:
            updates["precision"] = prec
        if updates:
            from pallas_kernels.decode_attention import default_config
            cfg = dataclasses.replace(cfg or default_config(kf, t, b, hkv, backend="gpu", interpret=False),
                                      **updates)
        try:
            sets, set_bytes = region_sets(key, kf, vf, b, hkv, t, d)
            fn = lambda q, r, cfg=cfg: decode_attention(q, [r], config=cfg, out_dtype=jnp.float32)  # noqa: E731
            ref_fn = lambda q, r: decode_attention_jnp(q.astype(jnp.float32), [r])  # noqa: E731
            measure_row(args, t, "pallas", name, fn, ref_fn, q, sets, set_bytes + q.size * 2, cfg, base, rows, log)
            del sets
        except Exception as e:  # noqa: BLE001
            log(f"T={t:6d} {name:16s} FAILED {type(e).__name__}: {str(e)[:400]}")
            rows.append(dict(T=t, impl="pallas", format=name, error=f"{type(e).__name__}: {str(e)[:400]}"))
    return rows


def config_updates(mods) -> dict:
    """``["kivi_update=block", "block_t=128"]`` -> ``{"kivi_update": "block", "block_t": 128}`` (KernelConfig
    fields; a value of digits is an int)."""
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    out = {}
    for m in mods:
        key, eq, val = m.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"format suffix {m!r}: expected ':<KernelConfig field>=<value>', fields {sorted(fields)}")
        out[key] = int(val) if val.lstrip("-").isdigit() else val
    return out


def run_dispatch_kivi(args, t, name, q, configs, base, rows, log):
    """KIVI through the dispatcher on a synthetic layer state: quantized region + gathered residual tail + k_new."""
    from kvquant_jax.attention.dispatch import decode_attention as dispatch
    from kvquant_jax.cache.kivi import KIVILayerState, KIVIScheme

    bits = int(name[len("kivi"):name.index("+")])
    scheme = KIVIScheme(k_bits=bits, v_bits=bits, group_size=32, v_group_size=32, residual=128)
    b, hkv, d = args.B, args.hkv, args.d
    cfg = configs.get(f"kivi{bits}")
    kf, vf = FORMATS[f"kivi{bits}"]
    s_k, s_v = scheme.ring_sizes

    def state(i):
        key = jax.random.fold_in(jax.random.PRNGKey(t), 5000 + i)
        reg = device_region(key, kf, vf, b, hkv, t, d)
        kr = jax.random.normal(jax.random.fold_in(key, 1), (b, hkv, s_k, d), jnp.float16)
        vr = jax.random.normal(jax.random.fold_in(key, 2), (b, hkv, s_v, d), jnp.float16)
        return KIVILayerState(k_codes=reg.k.data, k_scale=reg.k.scale, k_min=reg.k.zero, v_codes=reg.v.data,
                              v_scale=reg.v.scale, v_min=reg.v.zero, k_res=kr, v_res=vr)

    try:
        one = state(0)
        n = n_sets_for(nbytes(one))
        sets = [one] + [state(i) for i in range(1, n)]
        lengths = jnp.full((b,), t - 37, jnp.int32)
        kn = jax.random.normal(jax.random.PRNGKey(1), (b, hkv, d), jnp.float32).astype(jnp.bfloat16)
        fn = lambda q, st, cfg=cfg: dispatch(q, scheme, st, lengths, kn, kn, impl="kernel", config=cfg,  # noqa: E731
                                             out_dtype=jnp.float32)
        ref_fn = lambda q, st: dispatch(q.astype(jnp.float32), scheme, st, lengths, kn, kn,  # noqa: E731
                                        impl="reference")
        measure_row(args, t, "pallas+dispatch", name, fn, ref_fn, q, sets, nbytes(one), cfg, base, rows, log)
    except Exception as e:  # noqa: BLE001
        log(f"T={t:6d} {name:16s} FAILED {type(e).__name__}: {str(e)[:400]}")
        rows.append(dict(T=t, impl="pallas+dispatch", format=name, error=f"{type(e).__name__}: {str(e)[:400]}"))


def tune(args, names, results, log):
    b, hkv, d, t = args.B, args.hkv, args.d, args.tune_t
    key = jax.random.PRNGKey(7)
    q = jax.random.normal(key, (b, args.hq, d), jnp.float32).astype(jnp.bfloat16)
    best = {}
    for name in names:
        if name not in FORMATS:
            continue
        kf, vf = FORMATS[name]
        one = device_region(jax.random.fold_in(key, 1), kf, vf, b, hkv, t, d)
        n = n_sets_for(nbytes(one))
        sets = [one] + [device_region(jax.random.fold_in(key, 1 + i), kf, vf, b, hkv, t, d) for i in range(1, n)]
        read = nbytes(one) + q.size * 2
        ref = jax.jit(lambda q, r: decode_attention_jnp(q.astype(jnp.float32), [r]))(q, sets[0])
        for cand in candidates_for(name):
            cfg = as_config(cand)
            fn = lambda q, r, cfg=cfg: decode_attention(q, [r], config=cfg, out_dtype=jnp.float32)  # noqa: E731
            try:
                t0 = time.perf_counter()
                med, lo, hi, out = time_program(fn, q, sets, args.reps)
                comp = time.perf_counter() - t0
                err = rel_err(out, np.asarray(ref))
                rec = dict(format=name, T=t, config=dataclasses.asdict(cfg), us=med * 1e6, us_min=lo * 1e6,
                           us_max=hi * 1e6, tbps=read / med / 1e12, rel_err=err, wall_s=comp)
                log(f"tune {name:8s} {cand} {med * 1e6:8.1f} us [{lo * 1e6:.1f}, {hi * 1e6:.1f}] "
                    f"{read / med / 1e12:5.2f} TB/s err {err:.1e} ({comp:.1f}s)")
                if err < 5e-3 and (name not in best or med < best[name][0]):
                    best[name] = (med, cfg)
            except Exception as e:  # noqa: BLE001
                rec = dict(format=name, T=t, config=dataclasses.asdict(cfg), error=f"{type(e).__name__}: {str(e)[:600]}")
                log(f"tune {name:8s} {cand} FAILED {type(e).__name__}: {str(e)[:600]}")
            results["tune"].append(rec)
            flush(args, results)
        del sets
    return {k: v[1] for k, v in best.items()}


def check_oracle(args, results, log):
    """Small ragged case vs the float64 NumPy oracle, every format, default configs + asm variant."""
    rng = np.random.default_rng(0)
    b, hkv, g, d, n = 3, 2, 4, args.check_d, args.check_n
    start = np.array([0, 100, 0], np.int32)
    end = np.array([n, n - 247, 33], np.int32)
    for name, (kf, vf) in FORMATS.items():
        reg = random_region(rng, kf, vf, b, hkv, n, d, start, end, qparam_dtype=jnp.float16)
        for qdt in (jnp.float32, jnp.bfloat16):
            q = jnp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float32)).astype(qdt)
            kn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
            vn = jnp.asarray(rng.standard_normal((b, hkv, d)).astype(np.float32))
            ref = decode_attention_reference(q.astype(jnp.float32), [reg], k_new=kn, v_new=vn)
            # 128-token blocks need 340 KB of shared memory at D 256 (the H200 refused it, 2026-12-04): 64 there
            bt = 128 if d <= 128 else 64
            cands = [None] if qdt == jnp.float32 else [None, (bt, 4, 4, 3, "magic", "bf16")]
            if kf.is_int and qdt != jnp.float32:
                cands.append((bt, 4, 4, 3, "asm", "bf16x2"))
            for cand in cands:
                cfg = None if cand is None else as_config(cand)
                try:
                    out = jax.jit(lambda q, r, kn, vn, cfg=cfg: decode_attention(
                        q, [r], k_new=kn, v_new=vn, config=cfg, out_dtype=jnp.float32))(q, reg, kn, vn)
                    err = rel_err(out.astype(jnp.float32), ref)
                    # 1e-3 with exact tensor-core operands; 4e-3 where the kernel rounds p to bf16 before p x V
                    # (precision "bf16": bf16's unit roundoff 2^-9 per rounded operand; the same rule as
                    # check_mgpu_decode.parity_tol; the H200 rows read 1.0-3.0e-3 at D 64 / 256, 2026-12-04)
                    tol = 4e-3 if cand is not None and cand[5] == "bf16" else 1e-3
                    ok = bool(np.isfinite(err) and err < tol)
                    log(f"check {name:7s} q={jnp.dtype(qdt).name:8s} {str(cand):40s} rel err {err:.2e} "
                        f"{'OK' if ok else 'HIGH'} (tol {tol:.0e})")
                    results["check"].append(dict(format=name, q_dtype=jnp.dtype(qdt).name, config=cand, rel_err=err,
                                                 tol=tol, ok=ok))
                except Exception as e:  # noqa: BLE001
                    log(f"check {name:7s} {cand} FAILED {type(e).__name__}: {str(e)[:600]}")
                    results["check"].append(dict(format=name, config=cand, error=f"{type(e).__name__}: {str(e)[:600]}"))
    flush(args, results)


def flush(args, results):
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(results))


def markdown(results) -> str:
    lines = [f"Device: {results['device']}; JAX {results['jax']}; {results['date']}; "
             f"B={results['shape']['B']} Hq={results['shape']['hq']} Hkv={results['shape']['hkv']} "
             f"D={results['shape']['d']}; HBM copy {results.get('hbm_copy_tbps', float('nan')):.2f} TB/s, read-only "
             f"{results.get('hbm_read_tbps', float('nan')):.2f} TB/s; clock: {results.get('clock', 'host')}", "",
             "| T | impl | format | median µs | bytes read (MB) | TB/s | % of copy BW | × vs cuDNN | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    copy = results.get("hbm_copy_tbps") or float("nan")
    lines += [timing_row(r, copy, err_key="rel_err_vs_f32_ref") for r in results["rows"]]
    return "\n".join(lines) + "\n"


def timing_row(r: dict, copy_tbps: float, *, err_key: str, variant: bool = False) -> str:
    """One markdown row of a kernel timing (``variant``: a variant column and the median's [min, max])."""
    lead = f"| {r['T']} | {r['impl']} | {r['format']} |" + (f" {r.get('variant', '')} |" if variant else "")
    if "error" in r:
        return lead + " failed | | | | | |"
    err = r.get(err_key)
    us = f"{r['us']:.1f}" + (f" [{r['us_min']:.0f}, {r['us_max']:.0f}]" if variant else "")
    return (f"{lead} {us} | {r['bytes'] / 1e6:.1f} | {r['tbps']:.2f} | {100 * r['tbps'] / copy_tbps:.0f}% | "
            f"{r.get('speedup_vs_cudnn', float('nan')):.2f} | {'' if err is None else f'{err:.1e}'} |")


def add_shape_args(ap, default_t: str) -> None:
    """The problem-shape flags every decode benchmark takes."""
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--T", default=default_t)


def add_clock_arg(ap) -> None:
    ap.add_argument("--clock", choices=("device", "host"), default="device",
                    help="device: kernel busy time per call from a profiler trace (host wall where there is none); "
                    "host: host wall per call (dispatch + launch gaps + sync included)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, "4096,16384,32768,131072")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--extra", default="", help="formats measured only at T == --tune-t (e.g. int4@bf16, kivi2+tail)")
    ap.add_argument("--baselines", default="cudnn,xla")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--check-t", type=int, default=32768, help="compare with the f32 reference up to this T")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-t", type=int, default=32768)
    ap.add_argument("--check", action="store_true", help="float64-oracle parity on a small ragged case first")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--configs", default="", help="JSON {format: KernelConfig fields} overriding the defaults "
                    "(fields left out take KernelConfig's class defaults, NOT default_config's: for a one-field "
                    "variant of the tuned defaults use a format suffix, e.g. kivi2:kivi_update=block)")
    ap.add_argument("--check-d", type=int, default=128)
    ap.add_argument("--check-n", type=int, default=1024)
    ap.add_argument("--max-sets", type=int, default=64)
    add_clock_arg(ap)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    global MAX_SETS
    MAX_SETS = args.max_sets
    CLOCK["clock"] = args.clock
    args.baselines = [x for x in args.baselines.split(",") if x]
    names = [x for x in args.formats.split(",") if x]
    dev = jax.devices()[0]
    results = dict(device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   shape=dict(B=args.B, hq=args.hq, hkv=args.hkv, d=args.d), argv=sys.argv[1:],
                   rows=[], tune=[], check=[])

    def log(msg):
        print(msg, flush=True)

    if args.check or args.check_only:
        check_oracle(args, results, log)
        if args.check_only:
            return results
    results["clock"] = args.clock
    results["hbm_copy_tbps"] = hbm_copy_tbps()
    results["hbm_read_tbps"] = hbm_read_tbps()
    log(f"HBM copy (read+write) {results['hbm_copy_tbps']:.2f} TB/s, read-only {results['hbm_read_tbps']:.2f} TB/s "
        f"({args.clock} clock)")
    configs = {k: KernelConfig(**v) for k, v in (json.loads(args.configs) if args.configs else {}).items()}
    if args.tune:
        best = tune(args, names, results, log)
        configs.update(best)
        results["best_configs"] = {k: dataclasses.asdict(v) for k, v in best.items()}
        log("best: " + json.dumps(results["best_configs"]))
        flush(args, results)
    extra = [x for x in args.extra.split(",") if x]
    for t in [int(x) for x in args.T.split(",") if x]:
        run_size(args, t, names + (extra if t == args.tune_t else []), configs, results, log)
        flush(args, results)
    log(markdown(results))
    return results


if __name__ == "__main__":
    main()
