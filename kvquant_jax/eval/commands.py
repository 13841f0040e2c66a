"""``kvq eval CONFIG`` and ``kvq sweep CONFIG --out DIR`` (registered by ``kvquant_jax.cli``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from kvquant_jax import sharding as S
from kvquant_jax.config import METRICS, load_config
from kvquant_jax.eval import runner
from kvquant_jax.eval.metrics import Session
from kvquant_jax.eval.report import write_report


def add_parsers(sub) -> None:
    p = sub.add_parser("eval", help="evaluate one config (its sweep block ignored): ppl, serving ppl, passkey, "
                                    "K/V + attention error, greedy agreement, bytes")
    _common(p)
    p.add_argument("--out", default=None, help="also write DIR/results.jsonl and DIR/report.md")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("sweep", help="run a config's sweep block into DIR (results.jsonl, report.md, plots); "
                                     "rerunning resumes. Several configs: each into DIR/<sweep name>, in one "
                                     "process sharing the model, corpora and baseline references")
    _common(p, several=True)
    p.add_argument("--out", required=True, help="output directory (several configs: their parent directory)")
    p.add_argument("--report-only", action="store_true", help="only rewrite report.md and plots from results.jsonl")
    p.add_argument("--list", action="store_true", help="print the resolved points and exit")
    p.add_argument("--prune", action="store_true",
                   help="first drop rows of DIR/results.jsonl that no current point uses (after a config change)")
    p.set_defaults(func=cmd_sweep)


def _common(p, several: bool = False) -> None:
    if several:
        p.add_argument("config", nargs="+", help="YAML config(s) (configs/...)")
    else:
        p.add_argument("config", help="YAML config (configs/...)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value: dotted key, YAML value (repeatable)")
    p.add_argument("--sizes", default=None, metavar="PRESET|FILE",
                   help="task-size preset applied after inheritance, before --set: cpu (configs/sweep_sizes.yaml), "
                        "gpu (configs/sweep_sizes_gpu.yaml) or a YAML file (overrides the config's sizes key)")
    p.add_argument("--metrics", default=None,
                   help=f"comma-separated subset of the enabled metrics ({','.join(METRICS)})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--mesh", default=None, help="device mesh 'data=D,model=M' (overrides the config's mesh key); "
                                                "every metric's batch must divide by D")


def _metrics(arg):
    if not arg:
        return None
    ms = tuple(m.strip() for m in arg.split(",") if m.strip())
    bad = [m for m in ms if m not in METRICS]
    if bad:
        raise ValueError(f"--metrics: unknown {bad}; known: {list(METRICS)}")
    return ms


def _command() -> str:
    return "kvq " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _summary(row: dict) -> dict:
    v = row["values"]
    keep = {"ppl": ("ppl", "nll", "tokens"), "serving_ppl": ("ppl", "nll", "tokens"), "passkey": ("mean", "accuracy"),
            "kv_error": ("k_nmse", "v_nmse", "logit_rel_rms", "attn_tv", "out_rel"),
            "agreement": ("match", "top1", "mean_first_divergence"),
            "bytes": ("bits_per_element", "bytes_per_token", "measured_bytes", "simulated")}[row["metric"]]
    out = {"point": row["point"], "metric": row["metric"], **{k: v[k] for k in keep if k in v}}
    out.update(row.get("delta", {}))
    return out


def _mesh(loaded, args):
    """The run's device mesh: ``--mesh``, else the config's top-level ``mesh`` key, else None."""
    spec = args.mesh if args.mesh is not None else loaded.config.mesh
    try:
        shape = S.parse_mesh(spec)
    except ValueError as e:
        raise ValueError(f"{'--mesh' if args.mesh is not None else f'{args.config}: mesh'}: {e}") from None
    return None if shape is None else S.make_mesh(shape)


def _run(loaded, args, session=None):
    """run_sweep with the command-line options; Ctrl-C exits 130 after saying where the completed rows are."""
    try:
        with S.mesh_context(_mesh(loaded, args)):
            return runner.run_sweep(loaded, args.out, metrics=_metrics(args.metrics), progress=not args.no_progress,
                                    command=_command(), session=session)
    except KeyboardInterrupt:
        where = f"{args.out}/results.jsonl" if args.out else "memory (no --out)"
        print(f"\nkvq: interrupted; completed rows are kept in {where}. Run the same command again to resume.",
              file=sys.stderr)
        raise SystemExit(130) from None


def cmd_eval(args) -> None:
    loaded = load_config(args.config, args.overrides, args.sizes)
    loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, sweep=None))
    t0 = time.perf_counter()
    summary = _run(loaded, args)
    for r in summary.rows:
        print(json.dumps(_summary(r)))
    print(f"[kvq] eval done in {time.perf_counter() - t0:.1f} s"
          + (f"; report: {args.out}/report.md" if args.out else ""), file=sys.stderr)


def cmd_sweep(args) -> None:
    if len(args.config) > 1:
        loaded = [load_config(c, args.overrides, args.sizes) for c in args.config]
        outs = [str(Path(args.out) / runner.sweep_name(ld)) for ld in loaded]
        if len(set(outs)) < len(outs):
            raise ValueError(f"kvq sweep: two configs share a sweep name, so their folders would collide: {outs}")
        session = Session()
        for ld, out in zip(loaded, outs):
            _sweep_one(ld, argparse.Namespace(**{**vars(args), "config": ld.path, "out": out}), session)
        return
    _sweep_one(load_config(args.config[0], args.overrides, args.sizes),
               argparse.Namespace(**{**vars(args), "config": args.config[0]}), None)


def _sweep_one(loaded, args, session) -> None:
    if args.list:
        for p in loaded.points():
            print(f"{p.index:3d}  {p.label}")
        return
    if args.prune:
        n = runner.prune(Path(args.out), loaded.points(), runner.sweep_baseline(loaded))
        print(f"[kvq] pruned {n} rows no current point uses from {args.out}/results.jsonl", file=sys.stderr)
    if loaded.config.sweep is None:
        print(f"[kvq] {args.config} has no sweep block: running its single point", file=sys.stderr)
    if args.report_only:
        import yaml

        manifest = Path(args.out) / "sweep.yaml"
        meta = (yaml.safe_load(manifest.read_text()) or {}) if manifest.exists() else {}
        # the recorded run's --metrics, unless this command names its own
        metrics = _metrics(args.metrics) if args.metrics else meta.get("metrics")
        print(write_report(Path(args.out), points=loaded.points(), sweep_name=runner.sweep_name(loaded),
                           baseline=runner.sweep_baseline(loaded), command=meta.get("command"), metrics=metrics,
                           owed=meta.get("owed")))
        return
    t0 = time.perf_counter()
    summary = _run(loaded, args, session)
    print(f"[kvq] sweep done in {time.perf_counter() - t0:.1f} s: {summary.computed} rows computed, "
          f"{summary.skipped} resumed from {args.out}/results.jsonl", file=sys.stderr)
    print(f"report: {Path(args.out) / 'report.md'}")
