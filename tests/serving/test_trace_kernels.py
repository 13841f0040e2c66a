"""``experiments/trace_kernels.py``: device time summed by kernel name from a Perfetto trace, stream lines only."""
import gzip
import json

import pytest

from experiment_scripts import load_experiment


@pytest.fixture(scope="module")
def tk():
    return load_experiment("trace_kernels")


def _trace(path, events):
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
            dict(ph="M", name="thread_name", pid=1, tid=10, args=dict(name="Stream #14(MemcpyH2D,Compute)")),
            dict(ph="M", name="thread_name", pid=1, tid=11, args=dict(name="XLA Ops")),
            dict(ph="M", name="thread_name", pid=2, tid=20, args=dict(name="python"))]
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=meta + events), f)


def test_sums_stream_kernels_by_name_without_double_counting(tk, tmp_path):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    x = lambda pid, tid, name, dur: dict(ph="X", pid=pid, tid=tid, name=name, ts=0, dur=dur)  # noqa: E731
    _trace(d / "perfetto_trace.json.gz", [
        x(1, 10, "paged_decode_attention_int4", 30.0), x(1, 10, "paged_decode_attention_int4", 20.0),
        x(1, 10, "gemm_fusion_dot_1", 25.0),
        x(1, 11, "paged_decode_attention_int4", 50.0),      # the same kernels on the ops line: not counted again
        x(2, 20, "host_step", 1000.0),                      # host: not device time
        dict(ph="i", pid=1, tid=10, name="marker", ts=0)])  # not a complete event
    (s,) = [tk.summarize(str(p), top=10) for p in tmp_path.rglob("perfetto_trace.json.gz")]
    assert s["device_us"] == 75.0 and s["device_processes"] == ["/device:GPU:0"]
    assert s["device_lines_us"] == {"XLA Ops": 50.0, "Stream #14(MemcpyH2D,Compute)": 75.0}
    assert [(k["name"], k["us"], k["count"]) for k in s["kernels"]] == [
        ("paged_decode_attention_int4", 50.0, 2), ("gemm_fusion_dot_1", 25.0, 1)]
    assert s["kernels"][0]["share"] == pytest.approx(2 / 3, abs=1e-4)
    tk.main([str(tmp_path), "--json", str(tmp_path / "k.json")])
    assert json.loads((tmp_path / "k.json").read_text())[0]["device_us"] == 75.0


def test_no_trace_is_an_error_naming_the_directory(tk, tmp_path):
    with pytest.raises(SystemExit, match="no perfetto_trace.json.gz under"):
        tk.main([str(tmp_path)])
