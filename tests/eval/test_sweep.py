"""Sweep runner: rows with provenance, report, resume after an interruption == an uninterrupted run."""
import json

import pytest

from kvquant_jax.config import SchemeSpec, load_config
from kvquant_jax.eval.runner import prune, run_sweep, strip_volatile

from eval_helpers import tiny_yaml

SWEEP = {"sweep": {"name": "t", "zip": {"cache.scheme": ["int4", "kivi2:group_size=8,residual=16,v_group_size=16"]}},
         "tasks": {"kv_error": {"enabled": False}, "serving_ppl": {"enabled": False}, "agreement": {"enabled": False}}}


@pytest.fixture(scope="module")
def sweep_cfg(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "sweep.yaml"
    p.write_text(tiny_yaml(**SWEEP))
    return p


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(sweep_cfg, tmp_path_factory):
    out = tmp_path_factory.mktemp("a")
    summary = run_sweep(load_config(sweep_cfg), out, progress=False, command="kvq sweep test")
    return out, summary


def test_rows_carry_config_and_provenance(uninterrupted):
    out, summary = uninterrupted
    rs = rows(out / "results.jsonl")
    # 2 points x (ppl, bytes) + the fp32 baseline row that ppl's delta needs
    assert [(r["role"], r["metric"]) for r in rs] == [("baseline", "ppl"), ("point", "ppl"), ("point", "bytes"),
                                                      ("point", "ppl"), ("point", "bytes")]
    assert summary.computed == 5 and summary.skipped == 0
    assert len({r["key"] for r in rs}) == 5
    for r in rs:
        pv = r["provenance"]
        for k in ("model_sha256", "git_commit", "jax_version", "backend", "date"):
            assert pv[k], k
        assert r["config"]["cache"]["scheme"]["name"] in ("fp32", "int4", "kivi2")
    ppl = [r for r in rs if r["metric"] == "ppl"]
    assert ppl[0]["provenance"]["corpus_sha256"] and ppl[1]["baseline_key"] == ppl[0]["key"]
    assert ppl[1]["delta"]["delta_ppl"] == pytest.approx(ppl[1]["values"]["ppl"] - ppl[0]["values"]["ppl"])
    report = (out / "report.md").read_text()
    assert "kvq sweep test" in report and "| int4 |" in report.replace("scheme=", "")
    assert (out / "delta_ppl_vs_bits.png").stat().st_size > 1000


def test_interrupted_then_resumed_equals_uninterrupted(sweep_cfg, uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    seen = []

    def stop_after_three(row):
        seen.append(row["key"])
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(load_config(sweep_cfg), tmp_path, progress=False, on_row=stop_after_three, command="kvq sweep test")
    assert len(rows(tmp_path / "results.jsonl")) == 3
    # a torn last line (killed mid-write) is dropped on resume
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"key": "torn", "values": {"pp')
    summary = run_sweep(load_config(sweep_cfg), tmp_path, progress=False, command="kvq sweep test")
    assert summary.skipped == 2 and summary.computed == 2          # 3 done rows (1 of them the baseline) reused
    got = [strip_volatile(r) for r in rows(tmp_path / "results.jsonl")]
    want = [strip_volatile(r) for r in rows(ref_dir / "results.jsonl")]
    assert got == want
    # a third run computes nothing
    again = run_sweep(load_config(sweep_cfg), tmp_path, progress=False, command="kvq sweep test")
    assert again.computed == 0 and again.skipped == 4


def test_changed_settings_recompute_only_affected_rows(sweep_cfg, uninterrupted, tmp_path):
    import shutil

    ref_dir, _ = uninterrupted
    shutil.copy(ref_dir / "results.jsonl", tmp_path / "results.jsonl")
    changed = load_config(sweep_cfg, ["tasks.bytes.length=32"])
    summary = run_sweep(changed, tmp_path, progress=False)
    assert summary.computed == 2 and summary.skipped == 2            # only the two bytes rows
    assert len(rows(tmp_path / "results.jsonl")) == 7
    assert prune(tmp_path, changed.points(), SchemeSpec("fp32")) == 2  # the two stale bytes rows
    assert [r["values"]["length"] for r in rows(tmp_path / "results.jsonl") if r["metric"] == "bytes"] == [32, 32]


def test_cli_sweep_and_eval(sweep_cfg, tmp_path, capsys, monkeypatch):
    from kvquant_jax import cli

    assert cli.main(["sweep", str(sweep_cfg), "--out", str(tmp_path), "--metrics", "bytes", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"report: {tmp_path / 'report.md'}" in out
    assert [r["metric"] for r in rows(tmp_path / "results.jsonl")] == ["bytes", "bytes"]

    def tasks_and_rows():
        lines = (tmp_path / "report.md").read_text().splitlines()
        return (next(ln for ln in lines if ln.startswith("- tasks: ")),
                next(ln for ln in lines if ln.startswith("- rows: ")))

    # the report covers the metrics the sweep ran (--metrics), not every task the config enables; --report-only
    # takes them from the recorded sweep.yaml
    for again in (False, True):
        if again:
            (tmp_path / "report.md").unlink()
            assert cli.main(["sweep", str(sweep_cfg), "--out", str(tmp_path), "--report-only"]) == 0
        tasks, done = tasks_and_rows()
        assert tasks.startswith("- tasks: bytes at ") and "ppl" not in tasks, tasks
        assert done.startswith("- rows: 2 of 2 planned") and "incomplete" not in done, done
    assert cli.main(["eval", str(sweep_cfg), "--metrics", "bytes", "--no-progress",
                     "--set", "cache.scheme=int8"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["metric"] == "bytes" and line["bits_per_element"] > 8
    assert cli.main(["sweep", str(sweep_cfg), "--out", str(tmp_path), "--set", "tasks.ppl.chunk=x"]) == 2
    assert "tasks.ppl.chunk" in capsys.readouterr().err

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvquant_jax.eval.runner.run_sweep", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["sweep", str(sweep_cfg), "--out", str(tmp_path), "--no-progress"])
    assert e.value.code == 130
    assert "Run the same command again to resume" in capsys.readouterr().err


def test_cli_sweep_of_several_configs_shares_one_model_load(tmp_path, capsys, monkeypatch):
    """`kvq sweep A B --out DIR`: each config into DIR/<sweep name>, rows equal to separate runs, the model loaded
    once; two configs with one sweep name are refused before anything runs."""
    from kvquant_jax import cli
    from kvquant_jax.eval import metrics as M

    cfgs = []
    for name, scheme in (("a", "int4"), ("b", "int8")):
        p = tmp_path / f"{name}.yaml"
        p.write_text(tiny_yaml(**{**SWEEP, "sweep": {"name": name, "zip": {"cache.scheme": [scheme]}}}))
        cfgs.append(str(p))
    loads = []
    real = M.load_eval_model
    monkeypatch.setattr(M, "load_eval_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    assert cli.main(["sweep", *cfgs, "--out", str(tmp_path / "all"), "--metrics", "ppl", "--no-progress"]) == 0
    assert len(loads) == 1
    for name, cfg in zip("ab", cfgs):
        alone = tmp_path / f"alone_{name}"
        assert cli.main(["sweep", cfg, "--out", str(alone), "--metrics", "ppl", "--no-progress"]) == 0
        both = [strip_volatile(r) for r in rows(tmp_path / "all" / name / "results.jsonl")]
        assert both == [strip_volatile(r) for r in rows(alone / "results.jsonl")] and len(both) == 2
    twin = tmp_path / "twin.yaml"
    twin.write_text((tmp_path / "a.yaml").read_text())
    assert cli.main(["sweep", cfgs[0], str(twin), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "share a sweep name" in capsys.readouterr().err and not (tmp_path / "x").exists()
