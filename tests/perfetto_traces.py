"""Synthetic ``perfetto_trace.json.gz`` files for the trace-reading tests (``experiments/timing.py``,
``experiments/trace_kernels.py``): one device process (pid 1: a stream line, tid 10, and an XLA-ops line, tid 11,
which repeats the stream's kernels) and one host process (pid 2, tid 20)."""
import gzip
import json

STREAM = "Stream #14(MemcpyH2D,Compute)"
META = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
        dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
        dict(ph="M", name="thread_name", pid=1, tid=10, args=dict(name=STREAM)),
        dict(ph="M", name="thread_name", pid=1, tid=11, args=dict(name="XLA Ops")),
        dict(ph="M", name="thread_name", pid=2, tid=20, args=dict(name="python3"))]


def complete(pid, tid, name, ts, dur) -> dict:
    """A complete event (``ph == "X"``); ``ts`` and ``dur`` in microseconds."""
    return dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur)


def write_trace(path, events) -> None:
    """Write :data:`META` + ``events`` to ``path`` as a gzipped ``{"traceEvents": [...]}``."""
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=META + events), f)
