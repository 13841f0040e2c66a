"""Sum the device-side time of a JAX profiler trace by kernel name (issue M: where an engine step's time goes).

Reads every ``perfetto_trace.json.gz`` under DIR (as written by ``jax.profiler.trace(..., create_perfetto_trace=True)``,
e.g. ``probe_engine_step.py --trace DIR``), keeps complete events (``ph == "X"``) of the processes whose name names a
device (``/device:GPU:0`` ...), and prints, per trace, the total microseconds and share of each kernel name, largest
first, with the count of launches.  Host-side (TraceMe) events are left out.

    python experiments/trace_kernels.py /tmp/probe-trace --top 30 --json /tmp/kernels.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def summarize(path: str, top: int) -> dict:
    """Return ``{"trace": path, "device_us": float, "device_lines_us": {line: us}, "kernels": [{"name", "us", "share", "count"}...]}``."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, n in pname.items() if "/device:GPU" in n or "/device:TPU" in n}
    timed = [(tname.get((e["pid"], e.get("tid")), ""), e) for e in events
             if e.get("ph") == "X" and e.get("pid") in device and "dur" in e]
    lines = collections.Counter()
    for line, e in timed:
        lines[line] += float(e["dur"])
    # kernels run on the stream lines; other device lines (modules, ops) would count them twice
    streams = {n for n in lines if n.startswith("Stream")} or set(lines)
    us = collections.Counter()
    count = collections.Counter()
    for line, e in timed:
        if line in streams:
            us[e["name"]] += float(e["dur"])
            count[e["name"]] += 1
    total = sum(us.values())
    rows = [{"name": n, "us": round(t, 1), "share": round(t / total, 4) if total else 0.0, "count": count[n]}
            for n, t in us.most_common(top)]
    return {"trace": path, "device_us": round(total, 1), "device_processes": sorted(pname[p] for p in device),
            "device_lines_us": {n: round(t, 1) for n, t in lines.most_common()},
            "kernels": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(a.dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise SystemExit(f"no perfetto_trace.json.gz under {a.dir}")
    out = [summarize(p, a.top) for p in paths]
    for s in out:
        if not s["device_processes"]:
            print(f"{s['trace']}: no device process (a CPU trace?)")
        print(f"{s['trace']}: {s['device_us'] / 1e3:.1f} ms device time ({', '.join(s['device_processes'])})")
        for r in s["kernels"]:
            print(f"  {r['us'] / 1e3:9.2f} ms {100 * r['share']:5.1f}% x{r['count']:<5d} {r['name'][:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
