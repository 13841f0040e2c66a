"""Timing helpers shared by the GPU benchmarks: host wall clock and device (kernel) time.

``median_seconds(fn, *args, reps)``: compile + one warm-up call, then the median of ``reps`` timed calls, each
synchronized with ``block_until_ready`` (host wall: it includes dispatch, launch gaps and the sync).
``device_seconds(fn, *args, reps, calls, keep_dir)``: the same calls under a ``jax.profiler`` trace, each inside a
host annotation ``kvq_rep_<i>``; per call the union of the device kernel intervals that fall in its annotation ("busy",
what ncu's ``gpu__time_duration`` sums) and their first-start-to-last-end span.  ``None`` where the trace has no
device events (CPU); ``keep_dir`` keeps the trace there (else a temporary directory, removed).
``read_trace(path)`` (``trace_events`` / ``device_events`` / ``stream_kernels``): the one parser of those traces,
also ``trace_kernels.py``'s and ``probe_timing_gap.py``'s.
``copy_tbps()`` / ``read_tbps()``: the same run's bandwidth probes, an elementwise pass over a 2 GiB bf16 buffer
(bytes read + written) and a column sum over 4 GiB (bytes read); ``clock="device"`` times their kernels.

Why device time (issue J, 2026-12-04): on the H200 a 242 us decode kernel (ncu and the trace agree) read as
400-580 us host wall per call (min 240-406, max 770-1205), because the host dispatch, a ~75 us launch gap inside
the program and the sync are in the host number (``experiments/probe_timing_gap.py``).
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Optional

import jax
import jax.numpy as jnp

REP_PREFIX = "kvq_rep_"


def median_seconds(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class DeviceTiming:
    """Per-call device times (seconds) of ``reps`` traced repetitions of ``calls`` calls each.

    ``busy``: union length of the kernel intervals of a repetition / ``calls``; ``span``: first kernel start to last
    kernel end of the repetition / ``calls``; ``host``: host wall of the repetition / ``calls``; ``kernels``: total
    device microseconds per kernel name over all repetitions."""

    busy: tuple
    span: tuple
    host: tuple
    kernels: dict

    @property
    def median(self) -> float:
        return statistics.median(self.busy)


def _union_length(intervals) -> float:
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def trace_files(directory: str) -> list:
    """The ``perfetto_trace.json.gz`` files under ``directory`` (any depth), sorted (the newest run's last)."""
    return sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True))


def trace_events(path: str) -> list:
    """The events of one ``perfetto_trace.json.gz`` (its ``traceEvents``, or the bare list)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events) -> tuple[dict, list]:
    """``(processes, dev)``: the device processes' names by pid (``/device:GPU:0`` ...) and their complete events
    (``ph == "X"``) in trace order, each as ``(line, name, ts_us, end_us)`` (``line``: its thread line's name)."""
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {pid: n for pid, n in pname.items() if "/device:GPU" in n or "/device:TPU" in n}
    dev = [(tname.get((e["pid"], e.get("tid")), ""), e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
           for e in events if e.get("ph") == "X" and e.get("pid") in processes and "dur" in e]
    return processes, dev


def stream_kernels(dev) -> list:
    """The kernels ``(name, ts_us, end_us)`` of :func:`device_events`, in trace order: the events of the
    ``Stream...`` lines (of every line where none is so named); the other device lines (modules, XLA ops) would
    count them twice."""
    lines = {line for line, _, _, _ in dev}
    streams = {n for n in lines if n.startswith("Stream")} or lines
    return [(name, a, b) for line, name, a, b in dev if line in streams]


def read_trace(path: str) -> tuple[list, list]:
    """``(annotations, kernels)`` of one ``perfetto_trace.json.gz``: host events named ``kvq_rep_<i>`` as
    ``(i, ts_us, end_us)`` and the device stream events as ``(name, ts_us, end_us)`` (:func:`stream_kernels`)."""
    events = trace_events(path)
    processes, dev = device_events(events)
    reps = [(int(e["name"][len(REP_PREFIX):]), float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
            if e.get("ph") == "X" and e.get("pid") not in processes and "dur" in e
            and str(e.get("name", "")).startswith(REP_PREFIX) and e["name"][len(REP_PREFIX):].isdigit()]
    return sorted(reps), stream_kernels(dev)


def split_by_rep(reps, kernels, calls: int = 1) -> Optional[DeviceTiming]:
    """Assign each kernel to the repetition whose host annotation contains its start; per-call times (seconds).
    None when there is no repetition, or a repetition has no kernel (no device events: CPU)."""
    if not reps:
        return None
    busy, span, host, per_name = [], [], [], {}
    for _, t0, t1 in reps:
        mine = [(a, b) for _, a, b in kernels if t0 <= a <= t1]
        if not mine:
            return None
        busy.append(_union_length(mine) * 1e-6 / calls)
        span.append((max(b for _, b in mine) - min(a for a, _ in mine)) * 1e-6 / calls)
        host.append((t1 - t0) * 1e-6 / calls)
    for name, a, b in kernels:
        if any(t0 <= a <= t1 for _, t0, t1 in reps):
            per_name[name] = per_name.get(name, 0.0) + (b - a)
    return DeviceTiming(busy=tuple(busy), span=tuple(span), host=tuple(host), kernels=per_name)


def device_seconds(fn, *args, reps: int = 20, calls: int = 1, keep_dir: Optional[str] = None) -> Optional[DeviceTiming]:
    """Device time per call of the jitted ``fn(*args)`` (which makes ``calls`` calls of the timed function):
    compile + one warm-up call untraced, then ``reps`` synchronized calls under a profiler trace.  None where
    the trace has no device kernels (CPU).  ``keep_dir``: the directory the trace is written to and left in (else a
    temporary one, removed)."""
    jax.block_until_ready(fn(*args))
    tdir = keep_dir or tempfile.mkdtemp(prefix="kvq_trace_")
    try:
        with jax.profiler.trace(tdir, create_perfetto_trace=True):
            for i in range(reps):
                with jax.profiler.TraceAnnotation(f"{REP_PREFIX}{i}"):
                    jax.block_until_ready(fn(*args))
        paths = trace_files(tdir)
        if not paths:
            return None
        reps_, kernels = read_trace(paths[-1])
        if len(reps_) != reps:
            return None
        return split_by_rep(reps_, kernels, calls)
    finally:
        if keep_dir is None:
            shutil.rmtree(tdir, ignore_errors=True)


def _probe_seconds(fn, x, reps: int, clock: str) -> float:
    if clock == "device":
        dt = device_seconds(fn, x, reps=reps)
        if dt is not None:
            return dt.median
    return median_seconds(fn, x, reps=reps)


def copy_tbps(reps: int = 20, clock: str = "host") -> float:
    """Read + write bandwidth (TB/s) of ``x * 1.0001`` over a 2 GiB bf16 buffer (16 MiB on CPU); ``clock="device"``:
    by the kernel's device time (host wall where the trace has none)."""
    n = (1 << 30) if jax.default_backend() != "cpu" else (1 << 23)
    x = jnp.ones((n,), jnp.bfloat16)
    return 2 * x.nbytes / _probe_seconds(jax.jit(lambda x: x * jnp.bfloat16(1.0001)), x, reps, clock) / 1e12


def read_tbps(reps: int = 20, clock: str = "host") -> float:
    """Read-only bandwidth (TB/s): a float32 column sum over a 4 GiB bf16 buffer (32 MiB on CPU)."""
    n = (1 << 31) if jax.default_backend() != "cpu" else (1 << 24)
    x = jnp.ones((n // 4096, 4096), jnp.bfloat16)
    return x.nbytes / _probe_seconds(jax.jit(lambda x: jnp.sum(x, axis=0, dtype=jnp.float32)), x, reps, clock) / 1e12
