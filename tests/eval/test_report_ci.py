"""Every number a sweep report prints with a Δ or an accuracy says how certain it is (issue P): the model-transform
table's Δ carries its CI or "(1 segment: no CI)", the passkey mean carries a Wilson interval over all the point's
trials, the task line lists only the metrics the sweep ran; and every committed report.md is what the generator
writes today from the committed rows (``kvq sweep --report-only`` rewrites it without computing anything)."""
import math
import shutil
from pathlib import Path

import pytest
import yaml

from kvquant_jax.config import load_config
from kvquant_jax.eval import report as R
from kvquant_jax.eval.runner import sweep_baseline, sweep_name
from kvquant_jax.eval.stats import wilson_interval

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
FOLDERS = sorted(p.parent for p in RESULTS.glob("**/sweep.yaml"))


def _loaded(folder):
    meta = yaml.safe_load((folder / "sweep.yaml").read_text())
    return meta, load_config(REPO / meta["config_file"], meta.get("overrides") or [], meta.get("sizes"))


def _entries(folder):
    meta, loaded = _loaded(folder)
    return R.collect(R._load(folder / "results.jsonl"), loaded.points(), sweep_baseline(loaded),
                     meta.get("metrics")), sweep_baseline(loaded)


def _table_rows(lines):
    return {ln.split(" | ")[0].strip("| "): ln.strip("| ").split(" | ")
            for ln in lines if ln.startswith("| ") and "---" not in ln}


def test_model_transform_delta_of_one_segment_says_no_ci():
    """CPU W8A8 sweep: serving ppl scores one segment, so the transform's serving Δ has no interval and says so
    (it used to print a bare +0.305); the fast-path Δ over 4 segments keeps its CI."""
    entries, baseline = _entries(RESULTS / "w8a8_sweep")
    rows = _table_rows(R._model_transform_table(entries, baseline))
    assert rows["W8A8"][4] == "+0.305 (1 segment: no CI)"
    assert rows["W8A8"][2].endswith("]")
    for cells in rows.values():
        if cells[0] == "model of point":
            continue
        assert cells[4].endswith("(1 segment: no CI)"), cells


def test_model_transform_delta_of_several_segments_has_its_ci():
    x, b = [3.0, 3.2, 3.1, 3.3], [2.9, 3.0, 3.0, 3.1]
    ci = R.ppl_delta_ci(x, b)
    assert R._ci_suffix(ci, x, b) == f" [{R._fmt(ci.lo, 3, True)}, {R._fmt(ci.hi, 3, True)}]"
    assert R._ci_suffix(None, [3.0], [2.9]) == " (1 segment: no CI)"
    assert R._ci_suffix(None, None, None) == ""


@pytest.mark.parametrize("sub", ["policy/sweep", "policy/gemma3/sweep"])
def test_task_line_and_planned_rows_follow_the_sweeps_metrics(sub, tmp_path):
    """These sweeps ran ``--metrics ppl,bytes``: the report lists only those tasks and plans only their rows."""
    folder = RESULTS / sub
    meta, loaded = _loaded(folder)
    assert meta["metrics"] == ["ppl", "bytes"]
    shutil.copy(folder / "results.jsonl", tmp_path / "results.jsonl")
    text = R.write_report(tmp_path, points=loaded.points(), sweep_name=sweep_name(loaded),
                          baseline=sweep_baseline(loaded), command=meta["command"],
                          metrics=meta["metrics"]).read_text()
    tasks = next(ln for ln in text.splitlines() if ln.startswith("- tasks: "))
    done = next(ln for ln in text.splitlines() if ln.startswith("- rows: "))
    assert tasks.startswith("- tasks: fast ppl ") and tasks.rstrip().endswith(" tokens")
    for dropped in ("serving", "K/V error", "greedy", "passkey"):
        assert dropped not in tasks, tasks
    n = len(loaded.points())
    assert done.startswith(f"- rows: {2 * n} of {2 * n} planned") and "incomplete" not in done, done
    cfg = loaded.points()[0].config.to_dict()
    assert "serving ppl" in R._task_line(cfg) and "serving ppl" not in R._task_line(cfg, ("ppl", "bytes"))


def test_passkey_mean_has_a_wilson_interval_over_all_trials():
    """Committed passkey sweep: 2 lengths × 3 depths × 1 trial; the mean column's interval is the Wilson interval
    of the successes over those 6 trials (the per-cell interval code, applied to the pooled count)."""
    entries, baseline = _entries(RESULTS / "passkey")
    rows = _table_rows(R._main_table(entries, baseline))
    for e in entries:
        v = e["passkey"]["values"]
        trials = e["point"].config.tasks.passkey.trials
        cells = [a for accs in v["accuracy"] for a in accs]
        k, n = sum(round(a * trials) for a in cells), trials * len(cells)
        lo, hi = wilson_interval(k, n)
        assert math.isclose(v["mean"], k / n)
        assert rows[e["point"].label][-1] == f"{v['mean']:.2f} [{lo:.2f}, {hi:.2f}]"
    assert rows["**baseline** `fp32`"][-1] == "0.83 [0.44, 0.97]"        # 5 of 6
    assert rows["scheme=int2"][-1] == "0.00 [0.00, 0.39]"                 # 0 of 6


def test_passkey_mean_cell_pools_cells_times_trials():
    row = {"values": {"mean": 0.75, "accuracy": [[1.0, 0.5], [0.5, 1.0]]}, "config": {"tasks": {"passkey": {"trials": 4}}}}
    lo, hi = wilson_interval(12, 16)
    assert R._passkey_mean_cell(row) == f"0.75 [{lo:.2f}, {hi:.2f}]"
    assert R._passkey_mean_cell(None) == "–"


@pytest.mark.parametrize("folder", FOLDERS, ids=[str(f.relative_to(RESULTS)) for f in FOLDERS])
def test_committed_report_is_what_the_generator_writes(folder, tmp_path):
    """``kvq sweep CONFIG --out DIR --report-only`` on the committed rows reproduces the committed report.md."""
    meta, loaded = _loaded(folder)
    shutil.copy(folder / "results.jsonl", tmp_path / "results.jsonl")
    path = R.write_report(tmp_path, points=loaded.points(), sweep_name=sweep_name(loaded),
                          baseline=sweep_baseline(loaded), command=meta.get("command"), metrics=meta.get("metrics"),
                          owed=meta.get("owed"))
    assert path.read_text() == (folder / "report.md").read_text()
