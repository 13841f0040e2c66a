"""Sweep runner: one results row per (config point, metric), appended durably, resumable.

``DIR/results.jsonl`` rows (one JSON object per line)::

    key          sha256 of (role, metric, the resolved config blocks the metric depends on)
    sweep, point, point_index, role ("point" | "baseline"), metric, overrides, cache_policy
    values       the metric's values;  delta: differences to the baseline row (ppl, serving_ppl, passkey)
    baseline_key the key of that baseline row
    config       the full resolved config of the point
    provenance   model + corpus name/sha256, git commit (+ dirty), JAX version, backend, device, date (UTC)
    seconds      wall time of the row

Durability: each row is written whole with one ``write`` then ``flush`` + ``fsync``; a run stopped at any moment
(Ctrl-C, kill) leaves every completed row intact, and at most a torn last line.  Loading keeps every valid row
and moves lines that do not parse (reported with their line numbers) to ``results.jsonl.rejected``; the file is only
ever rewritten through write-new-then-rename.  One process at a time writes a directory (``DIR/.kvq.lock``, see
:mod:`kvquant_jax.eval.lock`); a second ``kvq sweep`` on the same ``--out`` is refused naming the first one.
Resume: rows whose key is already in the file are skipped (their baseline values are read back from the file),
so an interrupted and resumed run writes the same rows in the same order as an uninterrupted one (the volatile
fields are ``seconds`` and ``provenance.date``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import jax

from kvquant_jax.config import METRICS, ExperimentConfig, LoadedConfig, Point, SchemeSpec
from kvquant_jax.eval import metrics as M
from kvquant_jax.eval.lock import output_lock
from kvquant_jax.eval.report import write_report
from kvquant_jax.eval.rows import KEY_STABLE_ADDITIONS, USES_DATA, parse_rows, read_rows, row_key  # noqa: F401

VOLATILE = ("seconds", "provenance.date")


def git_info(repo: Path | None = None) -> dict:
    repo = repo or Path(__file__).resolve().parents[2]

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return {"git_commit": commit or "unknown", "git_dirty": dirty}


def environment() -> dict:
    dev = jax.devices()[0]
    return {"jax_version": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)), "device_count": jax.device_count(),
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            **git_info()}


class ResultsFile:
    """Append-only JSONL with per-row fsync.  Loading keeps every valid row; lines that do not parse (a torn last
    line from a killed run, a damaged line anywhere) are reported with their line numbers and moved, byte for byte,
    to ``results.jsonl.rejected`` (appended and fsync'd first), then the file is rewritten as its valid lines
    through write-new-then-rename, so no completed row is ever lost."""

    def __init__(self, path: Path, log: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.rows: dict[str, dict] = {}
        self.log = log or (lambda msg: print(f"[kvq] {msg}", file=sys.stderr))
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        self.rows, bad, dups = parse_rows(data, self.path)
        for n, why in bad:
            self.log(f"{self.path}:{n}: skipping a line that is not a results row ({why}); moved to "
                     f"{self.path.name}.rejected")
        if dups:
            self.log(f"{self.path}: {dups} duplicate row(s) (the first row of each key is used)")
        if not bad and (not data or data.endswith(b"\n")):
            return
        lines = data.split(b"\n")
        bad_n = {n for n, _ in bad}
        rejected = self.path.with_name(self.path.name + ".rejected")
        if bad_n:
            with open(rejected, "ab") as f:
                f.write(b"".join(lines[n - 1] + b"\n" for n in sorted(bad_n)))
                f.flush()
                os.fsync(f.fileno())
        kept = b"".join(ln + b"\n" for n, ln in enumerate(lines, start=1) if ln.strip() and n not in bad_n)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def append(self, row: dict) -> None:
        line = json.dumps(row, sort_keys=True, allow_nan=True) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.rows[row["key"]] = row


@dataclasses.dataclass
class RunSummary:
    out_dir: Path | None
    rows: list                # rows of this run's points (computed or resumed), in order
    computed: int
    skipped: int
    seconds: float


def _enabled(cfg: ExperimentConfig, only: tuple[str, ...] | None) -> list[str]:
    return [m for m in METRICS if getattr(cfg.tasks, m).enabled and (only is None or m in only)]


def run_points(points: list[Point], *, sweep_name: str, baseline: SchemeSpec, out_dir: Path | None,
               metrics: tuple[str, ...] | None = None, progress: bool = True,
               on_row: Callable[[dict], None] | None = None, log: Callable[[str], None] | None = None,
               session: M.Session | None = None) -> RunSummary:
    """Compute every enabled metric of every point (plus the baselines deltas need), appending rows.

    ``session``: caches to share with other runs of this process (model, corpora, the serving-path reference of
    the baseline); its observed calibration artifacts are then saved in ``out_dir`` of this run."""
    log = log or (lambda msg: print(f"[kvq] {msg}", file=sys.stderr))
    if out_dir is not None:
        with output_lock(out_dir, "kvq sweep"):
            return _run_points(points, sweep_name=sweep_name, baseline=baseline, out_dir=out_dir, metrics=metrics,
                               progress=progress, on_row=on_row, log=log, session=session)
    return _run_points(points, sweep_name=sweep_name, baseline=baseline, out_dir=out_dir, metrics=metrics,
                       progress=progress, on_row=on_row, log=log, session=session)


def _run_points(points, *, sweep_name, baseline, out_dir, metrics, progress, on_row, log, session) -> RunSummary:
    results = ResultsFile(out_dir / "results.jsonl", log=log) if out_dir is not None else None
    if session is None:
        session = M.Session(artifact_dir=out_dir, log=log)
    else:
        session.artifact_dir, session.log = out_dir, log
    env = None
    memory: dict[str, dict] = {}
    plan = [(p, m) for p in points for m in _enabled(p.config, metrics)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan), unit="row", dynamic_ncols=True, file=sys.stderr)
    rows, computed, skipped = [], 0, 0
    t_start = time.perf_counter()

    def existing(key):
        if results is not None and key in results:
            return results.rows[key]
        return memory.get(key)

    def write(row):
        nonlocal computed
        if results is not None:
            results.append(row)
        memory[row["key"]] = row
        computed += 1
        if on_row is not None:
            on_row(row)

    def make_row(point, cfg, metric, role, key, values, seconds, extra):
        nonlocal env
        if env is None:
            env = environment()
        mdl = session.model(cfg)
        prov = {**env, "model": cfg.model.name, "model_path": mdl.path, "model_sha256": mdl.sha256,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if metric in USES_DATA:
            c = session.corpus(cfg)
            prov.update(corpus=c.name, corpus_source=c.source, corpus_sha256=c.sha256)
        return {"key": key, "sweep": sweep_name, "point": point.label if role == "point" else f"baseline {baseline}",
                "point_index": point.index if role == "point" else -1, "role": role, "metric": metric,
                "overrides": dict(point.overrides) if role == "point" else {},
                "cache_policy": session.policy(cfg).describe(), "values": values, **extra,
                "config": cfg.to_dict(), "provenance": prov, "seconds": round(seconds, 3)}

    try:
        for point, metric in plan:
            cfg = point.config
            if bar is not None:
                bar.set_description(f"{point.label[:40]} | {metric}")
            extra = {}
            if metric in M.DELTA_FIELDS:
                bcfg = M.baseline_config(cfg, baseline)
                bkey = row_key(bcfg, metric, "baseline", baseline)
                brow = existing(bkey)
                if brow is None:
                    t0 = time.perf_counter()
                    bvals = M.compute(session, bcfg, metric, baseline=baseline)
                    brow = make_row(point, bcfg, metric, "baseline", bkey, bvals, time.perf_counter() - t0, {})
                    write(brow)
                extra = {"baseline_key": bkey}
            key = row_key(cfg, metric, "point", baseline)
            row = existing(key)
            if row is None:
                t0 = time.perf_counter()
                vals = M.compute(session, cfg, metric, baseline=baseline)
                if metric in M.DELTA_FIELDS:
                    extra["delta"] = M.deltas(metric, vals, brow["values"])
                row = make_row(point, cfg, metric, "point", key, vals, time.perf_counter() - t0, extra)
                write(row)
            else:
                skipped += 1
            rows.append(row)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return RunSummary(out_dir=out_dir, rows=rows, computed=computed, skipped=skipped,
                      seconds=time.perf_counter() - t_start)


def run_sweep(loaded: LoadedConfig, out_dir: str | Path | None, *, metrics=None, progress: bool = True,
              on_row=None, log=None, command: str | None = None, report: bool = True,
              session: M.Session | None = None) -> RunSummary:
    """Run every point of ``loaded`` (its ``sweep`` block; one point without one) into ``out_dir``
    (``session``: see :func:`run_points`)."""
    points = loaded.points()
    name, baseline = sweep_name(loaded), sweep_baseline(loaded)
    out = Path(out_dir) if out_dir is not None else None
    with output_lock(out, "kvq sweep") if out is not None else contextlib.nullcontext():
        if out is not None:
            _write_manifest(out, loaded, points, command, metrics)
        try:
            summary = run_points(points, sweep_name=name, baseline=baseline, out_dir=out,
                                 metrics=tuple(metrics) if metrics else None, progress=progress, on_row=on_row,
                                 log=log, session=session)
        finally:
            if out is not None and report and (out / "results.jsonl").exists():
                write_report(out, points=points, sweep_name=name, baseline=baseline, command=command,
                             metrics=metrics)
    return summary


def planned_keys(points: list[Point], baseline: SchemeSpec, metrics=None) -> set[str]:
    """Keys of every row the points need (their own rows and the baseline rows their deltas use)."""
    keys = set()
    for p in points:
        for m in _enabled(p.config, metrics):
            keys.add(row_key(p.config, m, "point", baseline))
            if m in M.DELTA_FIELDS:
                keys.add(row_key(M.baseline_config(p.config, baseline), m, "baseline", baseline))
    return keys


def prune(out_dir: str | Path, points: list[Point], baseline: SchemeSpec) -> int:
    """Drop rows of ``out_dir/results.jsonl`` that no current point uses (after a config change); returns how many.
    The file is rewritten atomically."""
    path = Path(out_dir) / "results.jsonl"
    if not path.exists():
        return 0
    keep = planned_keys(points, baseline)
    with output_lock(out_dir, "kvq sweep --prune"):
        ResultsFile(path)                      # moves lines that do not parse to results.jsonl.rejected
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln)["key"] in keep]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        os.replace(tmp, path)
    return len(lines) - len(kept)


def sweep_name(loaded: LoadedConfig) -> str:
    sw = loaded.config.sweep
    return (sw.name if sw and sw.name else loaded.config.name) or Path(loaded.path).stem


def sweep_baseline(loaded: LoadedConfig) -> SchemeSpec:
    sw = loaded.config.sweep
    return sw.baseline if sw else SchemeSpec("fp32")


def _write_manifest(out: Path, loaded: LoadedConfig, points: list[Point], command: str | None,
                    metrics=None) -> None:
    import yaml

    manifest = {"config_file": loaded.path, "command": command, "sizes": loaded.sizes,
                "metrics": list(metrics) if metrics else None,
                "overrides": [list(o) for o in loaded.overrides],
                "points": [{"index": p.index, "label": p.label, "overrides": dict(p.overrides)} for p in points],
                "config": loaded.config.to_dict()}
    tmp = out / "sweep.yaml.tmp"
    tmp.write_text(yaml.safe_dump(manifest, sort_keys=False))
    os.replace(tmp, out / "sweep.yaml")


def strip_volatile(row: dict) -> dict:
    """A copy of ``row`` without the fields that legitimately differ between two runs of the same sweep."""
    r = json.loads(json.dumps(row))
    for path in VOLATILE:
        node = r
        parts = path.split(".")
        for p in parts[:-1]:
            node = node.get(p, {})
        node.pop(parts[-1], None)
    return r
