"""Sum the device-side time of a JAX profiler trace by kernel name (issue M: where an engine step's time goes).

Reads every ``perfetto_trace.json.gz`` under DIR (as written by ``jax.profiler.trace(..., create_perfetto_trace=True)``,
e.g. ``probe_engine_step.py --trace DIR``), keeps complete events (``ph == "X"``) of the processes whose name names a
device (``/device:GPU:0`` ...), and prints, per trace, the total microseconds and share of each kernel name, largest
first, with the count of launches.  Host-side (TraceMe) events are left out.  The parsing is ``timing.py``'s
(``device_events`` / ``stream_kernels``, what ``timing.read_trace`` gives the device clock).

    python experiments/trace_kernels.py /tmp/probe-trace --top 30 --json /tmp/kernels.json
"""
from __future__ import annotations

import argparse
import collections
import json

import timing  # experiments/timing.py: the one trace parser (run as a script, experiments/ is on sys.path)


def kernel_rows(kernels, top: int) -> tuple[float, list]:
    """``(total_us, rows)`` of ``(name, ts_us, end_us)`` kernels (:func:`timing.read_trace`'s list): the device
    microseconds summed by kernel name, the ``top`` largest as ``{"name", "us", "share", "count"}``."""
    us = collections.Counter()
    count = collections.Counter()
    for name, a, b in kernels:
        us[name] += b - a
        count[name] += 1
    total = sum(us.values())
    rows = [{"name": n, "us": round(t, 1), "share": round(t / total, 4) if total else 0.0, "count": count[n]}
            for n, t in us.most_common(top)]
    return total, rows


def summarize(path: str, top: int) -> dict:
    """Return ``{"trace": path, "device_us": float, "device_lines_us": {line: us}, "kernels": [{"name", "us", "share", "count"}...]}``."""
    processes, dev = timing.device_events(timing.trace_events(path))
    lines = collections.Counter()
    for line, _, a, b in dev:
        lines[line] += b - a
    total, rows = kernel_rows(timing.stream_kernels(dev), top)
    return {"trace": path, "device_us": round(total, 1), "device_processes": sorted(processes.values()),
            "device_lines_us": {n: round(t, 1) for n, t in lines.most_common()},
            "kernels": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    paths = timing.trace_files(a.dir)
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
