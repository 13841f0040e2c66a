"""Pareto table (and plot) of tuned vs uniform vs hand-written mixed-layer cache policies on the test split.

    python experiments/policy_pareto.py --rows docs/results/policy/sweep/results.jsonl \
        --rows docs/results/mixed_layers/results.jsonl --tuned docs/results/policy/tuned --out docs/results/policy
    python experiments/policy_pareto.py --rows docs/results/policy/gemma3/sweep/results.jsonl \
        --out docs/results/policy/gemma3 --title "Gemma-3-270M, WikiText-2 test, fast path 4 x ([BOS] + 511)"

Reads ``kvq sweep`` rows (fast-path ``ppl`` with per-segment NLL, ``bytes`` with bits/element); every Δ is against
the fp32 baseline row of the same file on the same segments (the files must share the baseline tokens: checked),
with a paired bootstrap 95% CI (``kvquant_jax.eval.stats.ppl_delta_ci``).  Writes ``pareto.md`` (the table) and
``pareto.png`` (matplotlib, when installed).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvquant_jax.eval.stats import ppl_delta_ci


def load_points(path: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    base = next(r for r in rows if r["metric"] == "ppl" and r["role"] == "baseline")
    bits = {r["point"]: r["values"]["bits_per_element"] for r in rows if r["metric"] == "bytes"}
    out = []
    for r in rows:
        if r["metric"] != "ppl" or r["role"] == "baseline":
            continue
        ci = ppl_delta_ci(r["values"]["segment_nll"], base["values"]["segment_nll"])
        p0 = base["values"]["ppl"]
        out.append({"point": r["point"], "policy": r["cache_policy"], "bits": bits.get(r["point"]),
                    "ppl": r["values"]["ppl"], "dppl": ci.delta, "pct": 100 * ci.delta / p0,
                    "lo": 100 * ci.lo / p0, "hi": 100 * ci.hi / p0, "ns": not ci.excludes_zero,
                    "tokens": r["values"]["tokens"], "source": path.parent.name,
                    "bits_length": next((b["values"]["length"] for b in rows if b["metric"] == "bytes"
                                         and b["point"] == r["point"]), None)})
    return base, out


def _policy(p: dict) -> str:
    """The run-length policy, or where a tuned policy's rules are (its per-layer K/V formats do not fit a cell)."""
    if p["point"].startswith("tuned"):
        kind, budget = p["point"].rsplit("-", 1)
        return f"{kind}/ppl_{budget.rstrip('%')}/policy.yaml"
    return f"`{p['policy']}`"


def pareto(points: list[dict]) -> set[str]:
    """Points no other point beats on both bits and Δppl%."""
    front = set()
    for p in points:
        if not any(q["bits"] <= p["bits"] and q["pct"] <= p["pct"] and (q["bits"], q["pct"]) != (p["bits"], p["pct"])
                   for q in points):
            front.add(p["point"])
    return front


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", action="append", required=True, help="a sweep results.jsonl (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="SmolLM2-135M, WikiText-2 test, fast path 4 x 512", help="plot title")
    args = ap.parse_args(argv)
    bases, points = [], []
    for f in args.rows:
        b, pts = load_points(Path(f))
        bases.append(b)
        points += pts
    segs = {tuple(np.round(b["values"]["segment_nll"], 5)) for b in bases}
    if len(segs) != 1:
        raise SystemExit(f"baselines differ between files: {segs} (not the same tokens)")
    points = [p for p in points if p["bits"] is not None]
    front = pareto(points)
    p0 = bases[0]["values"]["ppl"]
    lines = [f"fp32 baseline ppl {p0:.3f} ({bases[0]['values']['tokens']} scored tokens per point, "
             f"{bases[0]['values']['segments']} segments x {bases[0]['values']['seq_len']}"
             f"{' ([BOS] + text)' if bases[0]['values'].get('bos') else ''}, chunk "
             f"{bases[0]['values']['chunk']}); Δppl% = 100 Δppl / baseline ppl, [95% CI] paired bootstrap over the "
             "segments; n.s. = the interval contains 0; * = on the Pareto frontier (bits, Δppl%).", "",
             "| point | source | bits/elem | ppl | Δppl % [95% CI] | cache policy |", "|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: p["bits"]):
        mark = " n.s." if p["ns"] else ""
        lines.append(f"| {'*' if p['point'] in front else ''}{p['point']} | {p['source']} | {p['bits']:.2f} | "
                     f"{p['ppl']:.3f} | {p['pct']:+.2f} [{p['lo']:+.2f}, {p['hi']:+.2f}]{mark} | {_policy(p)} |")
    out = Path(args.out)
    (out / "pareto.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kinds = (("uniform", "tab:blue", "uniform", True), ("tuned-dnll", "tab:gray", "tuned, cost Δ NLL only", False),
             ("tuned-cal4", "tab:purple", "tuned, 4 × 512 calibration tokens", True),
             ("tuned", "tab:red", "tuned (cost max(Δ NLL, KL))", True),
             ("full_precision", "tab:green", "mixed layers (KIVI-2 R=32, fp32 ends)", False),
             ("local", "tab:green", "by layer type (local / global)", True))
    for kind, color, label, annotate in kinds:
        sel = [p for p in points if p["point"].startswith(kind)
               and not (kind == "tuned" and ("dnll" in p["point"] or "cal4" in p["point"]))]
        if not sel:
            continue
        x = np.array([p["bits"] for p in sel])
        y = np.array([p["pct"] for p in sel])
        err = np.array([[p["pct"] - p["lo"] for p in sel], [p["hi"] - p["pct"] for p in sel]])
        ax.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=3, label=label)
        for p in sel if annotate else ():
            ax.annotate(p["point"].split("-", 1)[-1], (p["bits"], p["pct"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.axhline(0, color="gray", lw=0.5)
    lengths = sorted({p["bits_length"] for p in points if p["bits_length"]})
    ax.set_xlabel(f"bits / element (at {', '.join(f'{n:,}' for n in lengths)} tokens)")
    ax.set_ylabel("Δppl vs fp32 (%), 95% CI")
    ax.set_yscale("symlog", linthresh=1)
    ax.legend(fontsize=8)
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)


if __name__ == "__main__":
    main()
