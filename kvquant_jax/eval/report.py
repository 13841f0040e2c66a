"""``DIR/report.md`` and PNG plots from ``DIR/results.jsonl`` (only the rows of the current points are used)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from kvquant_jax.config import METRICS, ActivationConfig, Point, SchemeSpec
from kvquant_jax.eval.metrics import DELTA_FIELDS, baseline_config
from kvquant_jax.eval.rows import read_rows, row_key
from kvquant_jax.eval.stats import ppl_delta_ci, wilson_interval


def _load(path: Path) -> dict[str, dict]:
    """Rows by key: lines that are not rows are skipped, duplicate keys keep their first row (reported on stderr)."""
    return read_rows(path, log=lambda msg: print(f"[kvq] report: {msg}", file=sys.stderr))


def _fmt(x, digits=3, signed=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:+.2e}" if signed else f"{x:.2e}"
        return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return str(x)


def collect(rows: dict, points: list[Point], baseline: SchemeSpec, metrics=None) -> list[dict]:
    """Per point: ``{"point": Point, <metric>: row or None, "baseline_<metric>": row}`` for the metrics the point
    enables that the sweep ran (``metrics``: the sweep's ``--metrics`` subset as recorded in ``sweep.yaml``; None =
    all enabled metrics)."""
    out = []
    for p in points:
        e = {"point": p}
        for m in METRICS:
            if not getattr(p.config.tasks, m).enabled or (metrics is not None and m not in metrics):
                continue
            e[m] = rows.get(row_key(p.config, m, "point", baseline))
            if m in DELTA_FIELDS:
                e["baseline_" + m] = rows.get(row_key(baseline_config(p.config, baseline), m, "baseline", baseline))
        out.append(e)
    return out


def _v(e, metric, *path):
    row = e.get(metric)
    if row is None:
        return None
    node = row
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return node


def write_report(out_dir: str | Path, *, points: list[Point], sweep_name: str, baseline: SchemeSpec,
                 command: str | None = None, metrics=None, owed: dict | None = None) -> Path:
    """``metrics``: the sweep's ``--metrics`` subset (``sweep.yaml``'s ``metrics``); None = every enabled metric.
    The task line, the planned row count and the tables cover only those metrics. ``owed``: ``sweep.yaml``'s
    ``owed`` record of a committed partial run (``{"points": [label, ...], "reason": str}``, checked by
    :func:`owed_labels`); the report names those points and the reason instead of the generic "rerun" hint."""
    out = Path(out_dir)
    rows = _load(out / "results.jsonl")
    metrics = tuple(metrics) if metrics else None
    entries = collect(rows, points, baseline, metrics)
    done = sum(1 for e in entries for m in METRICS if e.get(m) is not None)
    planned = sum(1 for e in entries for m in METRICS if m in e)
    used = [r for e in entries for m in METRICS if (r := e.get(m)) is not None]
    any_row = used[0] if used else None
    lines = [f"# Sweep `{sweep_name}`", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    if any_row is not None:
        pv = any_row["provenance"]
        cfg = points[0].config.to_dict()
        lines += [f"- model: `{pv.get('model')}` sha256 `{pv.get('model_sha256', '')[:16]}…` ({pv.get('model_path')})"]
        c = next((r["provenance"] for e in entries for m in METRICS if (r := e.get(m)) and "corpus" in r["provenance"]),
                 None)
        if c:
            lines += [f"- corpus: `{c['corpus']}` sha256 `{c['corpus_sha256'][:16]}…` ({c['corpus_source']})"]
        commits = sorted({r["provenance"].get("git_commit", "")[:12] + ("+dirty" if r["provenance"].get("git_dirty")
                                                                          else "") for r in used})
        dates = sorted(r["provenance"].get("date", "") for r in used)
        secs = sum(r.get("seconds", 0) for r in used)
        lines += [f"- git {', '.join(f'`{c}`' for c in commits)}; JAX {pv.get('jax_version')}, backend "
                  f"{pv.get('backend')} ({pv.get('device')}, {pv.get('cpu_count')} CPUs, {pv.get('platform')})",
                  f"- rows computed {dates[0]} … {dates[-1]}; {secs / 60:.1f} min of row wall time (baseline rows "
                  f"not included)",
                  f"- rows: {done} of {planned} planned point rows in `results.jsonl`"
                  + (_incomplete_note(points, owed) if done < planned else ""),
                  f"- baseline (Δ reference): `{baseline}` cache on the same tokens",
                  f"- tasks: {_task_line(cfg, metrics)}", ""]
    lines += _main_table(entries, baseline)
    lines += _model_transform_table(entries, baseline)
    lines += _passkey_tables(entries)
    lines += _error_tables(entries)
    plots = _plots(out, entries)
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += _notes()
    path = out / "report.md"
    tmp = out / "report.md.tmp"
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def owed_labels(points: list[Point], owed: dict | None) -> list[str]:
    """The point labels a committed partial run declares not yet computed (``sweep.yaml``'s ``owed.points``).
    Raises ValueError when the record has no reason or names a label that is not a point of the config."""
    if not owed:
        return []
    labels, reason = list(owed.get("points") or []), owed.get("reason")
    if not labels or not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"sweep.yaml 'owed' needs a non-empty 'points' list and a 'reason': {owed!r}")
    unknown = sorted(set(labels) - {p.label for p in points})
    if unknown:
        raise ValueError(f"sweep.yaml 'owed' names labels that are not points of the config: {unknown}")
    return labels


def _incomplete_note(points: list[Point], owed: dict | None) -> str:
    labels = owed_labels(points, owed)
    if not labels:
        return " (incomplete: rerun the command to resume)"
    return f" (incomplete: {', '.join(f'`{lb}`' for lb in labels)} not yet run: {owed['reason'].strip()})"


def _task_line(cfg: dict, metrics=None) -> str:
    """The tasks the sweep ran: enabled in the config and, when the sweep was run with ``--metrics``, in that
    subset (a task the sweep dropped is not listed)."""
    t = {m: v if metrics is None or m in metrics else {**v, "enabled": False} for m, v in cfg["tasks"].items()}
    parts = []
    if t["ppl"]["enabled"]:
        p = t["ppl"]
        parts.append(f"fast ppl {p['max_segments']}×{p['seq_len']} tokens, chunk {p['chunk']}")
    if t["serving_ppl"]["enabled"]:
        s = t["serving_ppl"]
        parts.append(f"serving ppl {s['segments']}× (prefill {s['prefill']} + decode {s['decode']})")
    if t["kv_error"]["enabled"]:
        k = t["kv_error"]
        parts.append(f"K/V error on {k['seq_len']} tokens (prefill {k['prefill']}, {k['probes']} probes)")
    if t["agreement"]["enabled"]:
        a = t["agreement"]
        parts.append(f"greedy agreement {a['segments']}× ({a['prompt_tokens']} prompt + {a['new_tokens']} new)")
    if t["passkey"]["enabled"]:
        pk = t["passkey"]
        parts.append(f"passkey lengths {pk['lengths']} depths {pk['depths']} × {pk['trials']} trials")
    if t["bytes"]["enabled"]:
        parts.append(f"bytes at {t['bytes']['length']} tokens")
    return "; ".join(parts)


def delta_ci(e, metric):
    """Paired-bootstrap CI of the point's Δppl against the baseline row of the same segments (None when either row
    or its per-segment NLL is missing)."""
    x = _v(e, metric, "values", "segment_nll")
    b = (e.get("baseline_" + metric) or {}).get("values", {}).get("segment_nll")
    if x is None or b is None or len(x) != len(b) or len(x) < 2:
        return None
    return ppl_delta_ci(x, b)


def _transformed(e) -> bool:
    """The point runs a transformed model (a non-default ``activation`` block: W8A8, SmoothQuant, SmoothAttention
    folds), so its baseline rows are the baseline cache on that transformed model."""
    point = e.get("point")
    return point is not None and point.config.activation != ActivationConfig()


def _ci_suffix(ci, x, b) -> str:
    """What follows a Δ: `` [lo, hi]`` (+ `` n.s.`` when it contains 0), or `` (1 segment: no CI)`` when both rows
    scored a single segment (nothing to resample), or nothing when the per-segment NLLs are missing/unpaired."""
    if ci is not None:
        return f" [{_fmt(ci.lo, 3, True)}, {_fmt(ci.hi, 3, True)}]" + ("" if ci.excludes_zero else " n.s.")
    if x is not None and b is not None and len(x) == len(b) == 1:
        return " (1 segment: no CI)"
    return ""


def _passkey_trials(row: dict | None, default: int | None = None) -> int | None:
    """Trials per (length, depth) cell of a passkey row (its recorded config), else ``default``."""
    t = (((row or {}).get("config") or {}).get("tasks") or {}).get("passkey", {}).get("trials")
    return int(t) if t else default


def _passkey_mean_cell(row: dict | None, trials: int | None = None) -> str:
    """A passkey row's mean accuracy with the Wilson 95% interval over all its trials (every cell × ``trials``)."""
    v = (row or {}).get("values")
    if not v:
        return "–"
    trials = _passkey_trials(row, trials)
    cells = [a for accs in v.get("accuracy", []) for a in accs]
    if not trials or not cells:
        return _fmt(v["mean"], 2)
    k, n = sum(round(a * trials) for a in cells), trials * len(cells)
    lo, hi = wilson_interval(k, n)
    return f"{_fmt(v['mean'], 2)} [{lo:.2f}, {hi:.2f}]"


def _delta_cell(e, metric) -> str:
    d = _v(e, metric, "delta", "delta_ppl")
    ci = delta_ci(e, metric)
    mark = " †" if d is not None and _transformed(e) else ""
    if d is None or ci is None:
        one = len(_v(e, metric, "values", "segment_nll") or ()) == 1
        return _fmt(d, 3, True) + (" (1 segment: no CI)" if d is not None and one else "") + mark
    return (f"{_fmt(d, 3, True)} [{_fmt(ci.lo, 3, True)}, {_fmt(ci.hi, 3, True)}]"
            + ("" if ci.excludes_zero else " n.s.") + mark)


def _model_transform_table(entries, baseline) -> list[str]:
    """The transformed models' own effect: each distinct transformed model's baseline-cache row against the
    untransformed model's (same segments; paired bootstrap CI), for ppl and serving ppl."""
    plain = {m: next((e["baseline_" + m] for e in entries if e.get("baseline_" + m) and not _transformed(e)), None)
             for m in ("ppl", "serving_ppl")}
    seen, rows = set(), []
    for e in entries:
        if not _transformed(e):
            continue
        keys = tuple((e.get("baseline_" + m) or {}).get("key") for m in ("ppl", "serving_ppl"))
        if keys in seen or not any(keys):
            continue
        seen.add(keys)
        cells = [e["point"].label]
        for m in ("ppl", "serving_ppl"):
            own, ref = e.get("baseline_" + m), plain[m]
            if own is None or ref is None:
                cells += [_fmt(_v(own or {}, "values", "ppl")), "–"]
                continue
            d = own["values"]["ppl"] - ref["values"]["ppl"]
            x, b = own["values"].get("segment_nll"), ref["values"].get("segment_nll")
            ci = ppl_delta_ci(x, b) if x and b and len(x) == len(b) and len(x) >= 2 else None
            cells += [_fmt(own["values"]["ppl"]), _fmt(d, 3, True) + _ci_suffix(ci, x, b)]
        rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return []
    return (["## Model transforms (their own effect, with the baseline cache)", "",
             f"† in the summary: a point with an `activation` block is compared with the `{baseline}` cache on the "
             "same transformed model, so its Δ is the cache's effect alone. The transform's own effect is below: "
             f"that model with the `{baseline}` cache against the untransformed model with the `{baseline}` cache "
             "(same segments, paired bootstrap 95% CI).", "",
             "| model of point | ppl | Δppl vs untransformed | serving ppl | Δ serving vs untransformed |",
             "|---|---|---|---|---|"] + rows + [""])


def _scored(entries, metric) -> str:
    toks = {int(t) for e in entries if (t := _v(e, metric, "values", "tokens")) is not None}
    return "/".join(str(t) for t in sorted(toks)) if toks else "–"


def _main_table(entries, baseline) -> list[str]:
    head = ["point", "cache policy", "bits/elem", "bytes/token", "ppl", "Δppl", "serving ppl", "Δ serving",
            "KL serving", "top-1 serving", "greedy match", "top-1", "K nmse", "V nmse", "attn out err", "passkey"]
    lines = ["## Summary", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    bl = {m: next((e["baseline_" + m] for e in entries if e.get("baseline_" + m)), None)
          for m in ("ppl", "serving_ppl", "passkey")}
    if any(bl.values()):
        cells = [f"**baseline** `{baseline}`", "", "", "",
                 _fmt(bl["ppl"]["values"]["ppl"]) if bl["ppl"] else "–", "",
                 _fmt(bl["serving_ppl"]["values"]["ppl"]) if bl["serving_ppl"] else "–", "", "", "", "", "", "", "",
                 "", _passkey_mean_cell(bl["passkey"])]
        lines.append("| " + " | ".join(cells) + " |")
    for e in entries:
        p = e["point"]
        pol = next((r["cache_policy"] for m in METRICS if (r := e.get(m))), "")
        sim = _v(e, "bytes", "values", "simulated")
        cells = [p.label, "–" if not pol else f"`{pol}`" if len(pol) < 60 else f"`{pol[:57]}…`",
                 _fmt(_v(e, "bytes", "values", "bits_per_element"), 2) + (" (sim)" if sim else ""),
                 _fmt(_v(e, "bytes", "values", "bytes_per_token"), 0),
                 _fmt(_v(e, "ppl", "values", "ppl")), _delta_cell(e, "ppl"),
                 _fmt(_v(e, "serving_ppl", "values", "ppl")), _delta_cell(e, "serving_ppl"),
                 _fmt(_v(e, "serving_ppl", "values", "kl")), _fmt(_v(e, "serving_ppl", "values", "top1"), 3),
                 _fmt(_v(e, "agreement", "values", "match"), 3), _fmt(_v(e, "agreement", "values", "top1"), 3),
                 _fmt(_v(e, "kv_error", "values", "k_nmse")), _fmt(_v(e, "kv_error", "values", "v_nmse")),
                 _fmt(_v(e, "kv_error", "values", "out_rel")),
                 _passkey_mean_cell(e.get("passkey"), e["point"].config.tasks.passkey.trials)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Δ [95% CI]: paired bootstrap of Δppl over the scored segments against the baseline on the same "
                  f"segments (BCa, 10,000 resamples, `kvquant_jax.eval.stats`); **n.s.** marks an interval that "
                  f"contains 0 (no distinguishable difference). KL serving: mean KL(baseline ‖ point) of the next-token "
                  f"distributions at every scored serving step (same tokens, teacher-forced); top-1 serving: the "
                  f"fraction of those steps whose argmax equals the baseline's. Scored tokens per point: ppl {_scored(entries, 'ppl')}, "
                  f"serving ppl {_scored(entries, 'serving_ppl')}.", "",
              "bits/elem: logical bytes at the bytes-task length (codes + qparams + residual rows + the "
                  "`lengths` metadata) × 8 / (2·L·Hkv·D·T); `(sim)`: simulated ablation scheme, bits of the "
                  "equivalent packed layout. nmse: mean over layers of mean((x̂−x)²)/mean(x²). attn out err: "
                  "relative L2 error of the attention output at the probes. greedy match: fraction of free-running "
                  "greedy tokens equal to full precision's; top-1: teacher-forced argmax agreement."
              + (" passkey: mean accuracy over the length × depth cells [Wilson 95% interval over all the point's "
                 "trials]." if any(e.get("passkey") for e in entries) else ""), ""]
    return lines


def _passkey_tables(entries) -> list[str]:
    lines = []
    for e in entries:
        v = _v(e, "passkey", "values")
        if v is None:
            continue
        if not lines:
            lines = ["## Passkey retrieval (accuracy per context length × needle depth)", ""]
        b = _v(e, "baseline_passkey", "values")
        trials = e["point"].config.tasks.passkey.trials
        lines += [f"**{e['point'].label}**" + (f" (baseline mean {_passkey_mean_cell(e['baseline_passkey'])})"
                                                if b else "")
                  + f"; {trials} trials per cell, [95% Wilson interval]", "",
                  "| length \\ depth | " + " | ".join(f"{d:g}" for d in v["depths"]) + " |",
                  "|---|" + "---|" * len(v["depths"])]
        for n, accs in zip(v["lengths"], v["accuracy"]):
            cells = []
            for a in accs:
                lo, hi = wilson_interval(round(a * trials), trials)
                cells.append(f"{_fmt(a, 2)} [{lo:.2f}, {hi:.2f}]")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _error_tables(entries) -> list[str]:
    have = [e for e in entries if _v(e, "kv_error", "values")]
    if not have:
        return []
    lines = ["## K/V and attention error (exact K/V stored by each layer's scheme)", "",
             "| point | K nmse first / last pos bin | V nmse first / last pos bin | worst K layer | worst V layer "
             "| logit rel err | attn TV | attn out err |", "|---|---|---|---|---|---|---|---|"]
    for e in have:
        v = e["kv_error"]["values"]
        kl, vl = v["k_nmse_by_layer"], v["v_nmse_by_layer"]
        ki, vi = max(range(len(kl)), key=kl.__getitem__), max(range(len(vl)), key=vl.__getitem__)
        lines.append(f"| {e['point'].label} | {_fmt(v['k_nmse_by_pos'][0])} / {_fmt(v['k_nmse_by_pos'][-1])} | "
                     f"{_fmt(v['v_nmse_by_pos'][0])} / {_fmt(v['v_nmse_by_pos'][-1])} | {ki} ({_fmt(kl[ki])}) | "
                     f"{vi} ({_fmt(vl[vi])}) | {_fmt(v['logit_rel_rms'])} | {_fmt(v['attn_tv'])} | "
                     f"{_fmt(v['out_rel'])} |")
    sat = [(e["point"].label, v["k_saturated"], v["v_saturated"]) for e in have
           if (v := e["kv_error"]["values"]).get("k_saturated", 0) + v.get("v_saturated", 0) > 0]
    if sat:
        lines += ["", "**Saturated values** (finite K/V beyond the FP8 range, stored as ±max × scale; counts over "
                      "the kv_error rows of every layer): "
                  + "; ".join(f"{label}: K {k}, V {v}" for label, k, v in sat)]
    return lines + [""]


def _plots(out: Path, entries) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    pts = [(e["point"].label, _v(e, "bytes", "values", "bits_per_element"), _v(e, "ppl", "delta", "delta_ppl"),
            _v(e, "serving_ppl", "delta", "delta_ppl")) for e in entries]
    pts = [p for p in pts if p[1] is not None and (p[2] is not None or p[3] is not None)]
    if pts:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, bits, d_fast, d_serv in pts:
            if d_fast is not None:
                ax.scatter(bits, d_fast, marker="o", color="tab:blue")
                ax.annotate(label, (bits, d_fast), fontsize=6, xytext=(3, 3), textcoords="offset points")
            if d_serv is not None:
                ax.scatter(bits, d_serv, marker="x", color="tab:red")
        ax.scatter([], [], marker="o", color="tab:blue", label="Δppl fast (chunked)")
        ax.scatter([], [], marker="x", color="tab:red", label="Δppl serving (decode)")
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xlabel("bits per cached K/V element (incl. qparams, residual, metadata)")
        ax.set_ylabel("Δ perplexity vs full precision")
        ax.legend(fontsize=7)
        fig.tight_layout()
        made.append(_save(fig, out / "delta_ppl_vs_bits.png"))
    pk = [(e["point"].label, _v(e, "passkey", "values")) for e in entries if _v(e, "passkey", "values")]
    if pk:
        n = len(pk)
        cols = min(n, 4)
        rows_ = -(-n // cols)
        fig, axes = plt.subplots(rows_, cols, figsize=(3.2 * cols, 2.6 * rows_), squeeze=False)
        for ax, (label, v) in zip(axes.flat, pk):
            im = ax.imshow(v["accuracy"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(v["depths"])), [f"{d:g}" for d in v["depths"]], fontsize=6)
            ax.set_yticks(range(len(v["lengths"])), [str(x) for x in v["lengths"]], fontsize=6)
            ax.set_title(label, fontsize=7)
            ax.set_xlabel("depth", fontsize=6)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
        made.append(_save(fig, out / "passkey_heatmaps.png"))
    ev = [(e["point"].label, _v(e, "kv_error", "values")) for e in entries if _v(e, "kv_error", "values")]
    if ev:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for label, v in ev:
            for ax, name in zip(axes, ("k_nmse_by_pos", "v_nmse_by_pos")):
                y = [max(x, 1e-12) for x in v[name]]
                xs = [(i + 0.5) * v["seq_len"] / len(y) for i in range(len(y))]
                ax.plot(xs, y, label=label, lw=1)
        for ax, t in zip(axes, ("K", "V")):
            ax.set_yscale("log")
            ax.set_xlabel("token position")
            ax.set_title(f"{t} reconstruction nmse by position (mean over layers)", fontsize=8)
        axes[0].set_ylabel("nmse")
        axes[1].legend(fontsize=6)
        fig.tight_layout()
        made.append(_save(fig, out / "error_vs_position.png"))
    return made


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _notes() -> list[str]:
    return ["## How to read this", "",
            "- **fast ppl**: contiguous segments fed in `chunk`-token forwards through the cache; a query sees the "
            "exact K/V of its own chunk and the stored (quantized) K/V of earlier chunks "
            "(`kvquant_jax/eval/quantized_ppl.py`). Optimistic for lossy caches: up to `chunk − 1` recent tokens "
            "are exact.",
            "- **serving ppl**: prefill, then teacher-forced decode one token per forward (T = 1); every decode "
            "query reads all history from the stored representation — what a deployed decode step sees. Only the "
            "decode predictions are scored. For a full-precision cache both equal plain perplexity "
            "(`tests/eval/test_ppl_paths.py`).",
            "- **Δ** columns: point minus the baseline cache on the same tokens with the same settings.",
            "- **K/V nmse, attention error**: each layer's exact K/V (from a full-precision forward) stored by that "
            "layer's scheme as serving would (prefill, then decode appends) and read back; no error feedback "
            "through later layers (`kvquant_jax/eval/errors.py`).", ""]
