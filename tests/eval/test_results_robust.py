"""Issue Q.2: a damaged results.jsonl never loses finished rows; one writer per output directory."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvquant_jax.config import load_config
from kvquant_jax.eval.runner import ResultsFile, run_sweep

from eval_helpers import tiny_yaml

BYTES_ONLY = {"tasks": {"kv_error": {"enabled": False}, "serving_ppl": {"enabled": False},
                        "agreement": {"enabled": False}, "ppl": {"enabled": False}},
              "sweep": {"name": "r", "zip": {"cache.scheme": ["int4", "int8"]}}}


def _row(key, v):
    return json.dumps({"key": key, "values": {"x": v}}, sort_keys=True)


def test_corrupt_middle_line_keeps_every_valid_row(tmp_path):
    p = tmp_path / "results.jsonl"
    good = [_row(f"k{i}", i * 1.5 + 0.25) for i in range(5)]
    lines = [good[0], good[1], '{"key": "k9", "values": {"x": 1', good[2], '[1, 2]', '{"values": {}}', good[3],
             good[4]]
    p.write_text("\n".join(lines) + "\n")
    logs = []
    rf = ResultsFile(p, log=logs.append)
    assert sorted(rf.rows) == [f"k{i}" for i in range(5)]
    assert [rf.rows[f"k{i}"]["values"]["x"] for i in range(5)] == [i * 1.5 + 0.25 for i in range(5)]
    text = "\n".join(logs)
    for n in (3, 5, 6):                                  # 1-based line numbers of the bad lines
        assert f"results.jsonl:{n}:" in text, text
    # the file now holds exactly the valid rows, the bad lines are kept byte for byte next to it
    assert p.read_text().splitlines() == good
    assert (tmp_path / "results.jsonl.rejected").read_text().splitlines() == [lines[2], lines[4], lines[5]]
    # a second load is clean and changes nothing
    logs.clear()
    assert sorted(ResultsFile(p, log=logs.append).rows) == sorted(rf.rows) and not logs


def test_torn_last_line_is_moved_not_lost(tmp_path):
    p = tmp_path / "results.jsonl"
    p.write_text(_row("a", 1.0) + "\n" + '{"key": "b", "val')
    rf = ResultsFile(p, log=lambda m: None)
    assert list(rf.rows) == ["a"]
    assert p.read_text() == _row("a", 1.0) + "\n"
    assert (tmp_path / "results.jsonl.rejected").read_text() == '{"key": "b", "val\n'
    rf.append(json.loads(_row("c", 2.0)))
    assert [json.loads(x)["key"] for x in p.read_text().splitlines()] == ["a", "c"]


def test_report_survives_rows_without_key_and_duplicates(tmp_path):
    from kvquant_jax.eval.report import _load

    p = tmp_path / "results.jsonl"
    p.write_text("\n".join([_row("a", 1.0), '{"values": 3}', _row("a", 9.0), "garbage", _row("b", 2.0)]) + "\n")
    rows = _load(p)
    assert sorted(rows) == ["a", "b"] and rows["a"]["values"]["x"] == 1.0


@pytest.fixture
def bytes_cfg(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(tiny_yaml(**BYTES_ONLY))
    return p


def test_resume_after_middle_corruption_recomputes_only_the_lost_row(bytes_cfg, tmp_path):
    out = tmp_path / "out"
    first = run_sweep(load_config(bytes_cfg), out, progress=False, report=False)
    assert first.computed == 2
    p = out / "results.jsonl"
    a, b = p.read_text().splitlines()
    p.write_text(a[: len(a) // 2] + "\n" + b + "\n")     # the first row damaged in place
    again = run_sweep(load_config(bytes_cfg), out, progress=False, report=False)
    assert again.computed == 1 and again.skipped == 1
    keys = [json.loads(x)["key"] for x in p.read_text().splitlines()]
    assert sorted(keys) == sorted({json.loads(a)["key"], json.loads(b)["key"]})


def test_second_writer_is_refused_naming_the_first(bytes_cfg, tmp_path):
    from kvquant_jax import cli
    from kvquant_jax.eval.lock import OutputLockedError

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom kvquant_jax.eval.lock import output_lock\n"
         "with output_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n", str(out)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
            run_sweep(load_config(bytes_cfg), out, progress=False)
        assert not (out / "results.jsonl").exists()
        assert cli.main(["sweep", str(bytes_cfg), "--out", str(out), "--no-progress"]) == 2
    finally:
        holder.kill()
        holder.wait()
    t0 = time.time()
    assert run_sweep(load_config(bytes_cfg), out, progress=False, report=False).computed == 2   # released on exit
    assert time.time() - t0 < 120
