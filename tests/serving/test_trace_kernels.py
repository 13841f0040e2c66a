"""``experiments/trace_kernels.py``: device time summed by kernel name from a Perfetto trace, stream lines only."""
import json

import pytest

from experiment_scripts import load_experiment
from perfetto_traces import STREAM, complete, write_trace


@pytest.fixture(scope="module")
def tk():
    return load_experiment("trace_kernels")


def test_sums_stream_kernels_by_name_without_double_counting(tk, tmp_path):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    x = lambda pid, tid, name, dur: complete(pid, tid, name, 0, dur)  # noqa: E731
    write_trace(d / "perfetto_trace.json.gz", [
        x(1, 10, "paged_decode_attention_int4", 30.0), x(1, 10, "paged_decode_attention_int4", 20.0),
        x(1, 10, "gemm_fusion_dot_1", 25.0),
        x(1, 11, "paged_decode_attention_int4", 50.0),      # the same kernels on the ops line: not counted again
        x(2, 20, "host_step", 1000.0),                      # host: not device time
        dict(ph="i", pid=1, tid=10, name="marker", ts=0)])  # not a complete event
    (s,) = [tk.summarize(str(p), top=10) for p in tmp_path.rglob("perfetto_trace.json.gz")]
    assert s["device_us"] == 75.0 and s["device_processes"] == ["/device:GPU:0"]
    assert s["device_lines_us"] == {"XLA Ops": 50.0, STREAM: 75.0}
    assert [(k["name"], k["us"], k["count"]) for k in s["kernels"]] == [
        ("paged_decode_attention_int4", 50.0, 2), ("gemm_fusion_dot_1", 25.0, 1)]
    assert s["kernels"][0]["share"] == pytest.approx(2 / 3, abs=1e-4)
    tk.main([str(tmp_path), "--json", str(tmp_path / "k.json")])
    assert json.loads((tmp_path / "k.json").read_text())[0]["device_us"] == 75.0


def test_no_trace_is_an_error_naming_the_directory(tk, tmp_path):
    with pytest.raises(SystemExit, match="no perfetto_trace.json.gz under"):
        tk.main([str(tmp_path)])
