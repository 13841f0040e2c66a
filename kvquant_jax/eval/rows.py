"""Result rows of a sweep: their keys and the reader of ``results.jsonl`` (used by the runner and the report).

``row_key`` hashes a row's role, metric and the resolved config blocks the metric depends on; ``parse_rows`` /
``read_rows`` read every valid row of a (possibly damaged) file, reporting the lines that are not rows.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from kvquant_jax.config import ExperimentConfig, SchemeSpec
from kvquant_jax.eval.metrics import DELTA_FIELDS

# config blocks each metric depends on (besides model / cache / calibration / activation)
USES_DATA = {"ppl", "serving_ppl", "kv_error", "agreement", "passkey"}


# Keys added to a config block after results were first keyed: left out of a row's key while they hold their
# default value, so adding an option never invalidates finished rows (setting it does change the key).
KEY_STABLE_ADDITIONS = {"activation": ("linears", "prefill", "decode", "float_layers", "impl", "act_qparam_dtype",
                                       "fuse_norm", "smooth_sites", "smooth_attention_alpha", "smooth_windows",
                                       "smooth_len"),
                        "model": ("reduction",)}


def _stable_block(cfg: ExperimentConfig, name: str, block: dict) -> dict:
    default = type(getattr(cfg, name))()
    added = KEY_STABLE_ADDITIONS.get(name, ())
    return {k: v for k, v in block.items() if k not in added or getattr(getattr(cfg, name), k) != getattr(default, k)}


def row_key(cfg: ExperimentConfig, metric: str, role: str, baseline: SchemeSpec) -> str:
    d = cfg.to_dict()
    blocks = {"model": _stable_block(cfg, "model", d["model"]), "cache": d["cache"], "calibration": d["calibration"],
              "activation": _stable_block(cfg, "activation", d["activation"]), "task": d["tasks"][metric]}
    if metric in USES_DATA:
        blocks["data"] = d["data"]
    if metric == "agreement" or metric in DELTA_FIELDS:
        blocks["reference"] = baseline.to_spec()
    payload = json.dumps({"role": role, "metric": metric, **blocks}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def parse_rows(data: bytes, path="results.jsonl") -> tuple[dict[str, dict], list[tuple[int, str]], int]:
    """``(rows by key, bad lines, duplicates)`` of the bytes of a ``results.jsonl``.  Every line that parses as a
    JSON object with a string ``key`` is a row (the first row of a key wins; later ones count as duplicates);
    any other non-blank line is bad: ``(line number, reason)``."""
    rows: dict[str, dict] = {}
    bad: list[tuple[int, str]] = []
    dups = 0
    for n, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            bad.append((n, f"not JSON ({e.msg if hasattr(e, 'msg') else e})"))
            continue
        if not isinstance(row, dict) or not isinstance(row.get("key"), str):
            bad.append((n, "a JSON value without a string 'key'"))
            continue
        if row["key"] in rows:
            dups += 1
        else:
            rows[row["key"]] = row
    return rows, bad, dups


def read_rows(path: Path, log: Callable[[str], None] | None = None) -> dict[str, dict]:
    """The rows of ``path`` (see :func:`parse_rows`); bad lines and duplicates are reported through ``log``."""
    path = Path(path)
    if not path.exists():
        return {}
    rows, bad, dups = parse_rows(path.read_bytes(), path)
    if log is not None:
        for n, why in bad:
            log(f"{path}:{n}: skipping a line that is not a results row: {why}")
        if dups:
            log(f"{path}: {dups} duplicate row(s) ignored (the first row of each key is used)")
    return rows
