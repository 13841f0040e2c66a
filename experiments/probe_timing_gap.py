"""Why does a decode kernel take ~2x longer in the benchmark's timed program than in one ncu launch? (issue J)

Nsight Compute (``ncu_decode.py``, 2026-12-04) read cuDNN bf16 at T = 32K (B 8, Hq 32, Hkv 8, D 128) as 244 us at
4.40 TB/s, where ``bench_decode_attention.time_program`` has read 431-560 us for the same call.  This probe times
the same programs four ways in one process, per kernel (cuDNN bf16, Mosaic v1 bf16 / INT8 / INT4):

  harness   ``time_program`` as the benchmarks use it (host wall per call, one call per jitted program, synced)
  chained   ``--chain`` calls inside ONE jitted program on distinct outputs (host wall / chain)
  trace     the device time of each kernel in a ``jax.profiler`` trace of ``--trace-calls`` harness calls
            (``timing.device_seconds``, its trace kept under ``--out``; ``trace_kernels.summarize``), per call:
            what the GPU spent, separated by kernel name, and the busy time (union of the kernel intervals)
  ncu       (not here: ``ncu_decode.py``)

and records ``nvidia-smi`` (clocks, throttle reasons, other processes) before and after.

    python3 experiments/probe_timing_gap.py --out $OUT/gap
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "-q", "-d", "CLOCK,PERFORMANCE,UTILIZATION,POWER"], capture_output=True,
                              text=True, timeout=30).stdout + subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
            capture_output=True, text=True, timeout=30).stdout
    except Exception as e:  # noqa: BLE001
        return f"nvidia-smi failed: {e}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--trace-calls", type=int, default=5)
    ap.add_argument("--kernels", default="cudnn,v1_bf16,v1_int8,v1_int4")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    import jax
    import bench_decode_attention as bench
    import check_mgpu_decode as cmd
    import trace_kernels
    from timing import device_seconds, read_tbps, trace_files
    from kvquant_jax.attention.synthetic import PRESETS
    from pallas_kernels.decode_attention_mgpu import default_mgpu_config

    os.makedirs(a.out, exist_ok=True)
    res = dict(args=vars(a), jax=jax.__version__, device=str(jax.devices()[0]),
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), smi_before=smi(), rows=[])
    b, hq, hkv, d, t = a.B, a.hq, a.hkv, a.d, a.T
    key, q = cmd.timing_query(t, b, hq, d)
    res["copy_tbps"] = bench.hbm_copy_tbps()
    res["read_tbps"] = read_tbps()
    print(f"copy {res['copy_tbps']:.2f} TB/s, read {res['read_tbps']:.2f} TB/s", flush=True)

    for name in [x for x in a.kernels.split(",") if x]:
        if name == "cudnn":
            fn = bench.baseline_fns()["cudnn"]
            arg = cmd.cudnn_sets(key, b, hkv, t, d, 1)[0]
            nbytes = 2 * b * hkv * t * d * 2
        else:
            fmt = name.split("_", 1)[1]
            kf, vf = PRESETS[fmt]
            regs, _ = bench.region_sets(key, kf, vf, b, hkv, t, d)
            arg = cmd.prepared_sets(regs[:1])[0]
            del regs
            fn = cmd.mgpu_fn(default_mgpu_config(kf))
            nbytes = cmd.mgpu_read_bytes(arg, q)
        clock = bench.CLOCK["clock"]
        bench.CLOCK["clock"] = "host"          # the harness column is the host wall (the reading under study)
        try:
            med, lo, hi, _ = bench.time_program(fn, q, [arg], a.reps)
        finally:
            bench.CLOCK["clock"] = clock
        chained = jax.jit(lambda q, s: [fn(q + jax.numpy.asarray(i * 1e-3, q.dtype), s) for i in range(a.chain)])
        jax.block_until_ready(chained(q, arg))
        cw = []
        for _ in range(max(3, a.reps // 4)):
            t0 = time.perf_counter()
            jax.block_until_ready(chained(q, arg))
            cw.append((time.perf_counter() - t0) / a.chain)
        tdir = os.path.join(a.out, f"trace_{name}")
        dt = device_seconds(jax.jit(lambda q, s: fn(q, s)), q, arg, reps=a.trace_calls, keep_dir=tdir)
        kern = []
        paths = trace_files(tdir)
        if paths:
            s = trace_kernels.summarize(paths[-1], 10)
            kern = [dict(k, us_per_call=k["us"] / a.trace_calls) for k in s["kernels"]]
        row = dict(kernel=name, bytes=nbytes, harness_us=med * 1e6, harness_min_us=lo * 1e6,
                   harness_max_us=hi * 1e6, chained_us=statistics.median(cw) * 1e6, trace_kernels=kern,
                   trace_device_us_per_call=sum(k["us_per_call"] for k in kern),
                   trace_busy_us_per_call=None if dt is None else dt.median * 1e6)
        res["rows"].append(row)
        print(f"{name:10s} harness {row['harness_us']:8.1f} us [{lo * 1e6:.1f}, {hi * 1e6:.1f}]  chained "
              f"{row['chained_us']:8.1f}  trace device {row['trace_device_us_per_call']:8.1f} us/call  "
              f"({nbytes / 1e6:.1f} MB)", flush=True)
        for k in kern[:6]:
            print(f"    {k['us_per_call']:9.1f} us/call x{k['count'] // a.trace_calls}  {k['name'][:90]}", flush=True)
    res["smi_after"] = smi()
    with open(os.path.join(a.out, "probe_timing_gap.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(res["smi_after"][-3000:])


if __name__ == "__main__":
    main()
