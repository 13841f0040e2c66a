"""Input checks shared by the command line and the small config files (ledger, calibration).

Every check raises ``ValueError`` whose message names where the value came from (a file or a command-line flag)
and the key: ``<where>: <key>: <problem>``.  Numbers are never coerced: ``2.9`` is not an integer, ``true`` is not
a number, ``nan`` / ``inf`` are not finite.  The CLI runs these checks before it loads a model or reads a corpus,
so a bad argument fails in milliseconds instead of after the expensive part.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from kvquant_jax.cache.registry import make_policy, make_scheme


def _fail(where: str, key: str, msg: str) -> ValueError:
    return ValueError(f"{where}: {key}: {msg}" if where else f"{key}: {msg}")


def check_int(v: Any, key: str, where: str = "", *, low: int | None = None, high: int | None = None) -> int:
    """``v`` itself if it is an int (not a bool) in ``[low, high]``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(where, key, f"expected an integer, got {v!r}")
    if low is not None and v < low:
        raise _fail(where, key, f"must be >= {low}, got {v}")
    if high is not None and v > high:
        raise _fail(where, key, f"must be <= {high}, got {v}")
    return v


def check_float(v: Any, key: str, where: str = "", *, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> float:
    """``float(v)`` if ``v`` is a finite int/float (not a bool) in ``[low, high]`` (``(low, high]`` with
    ``low_open``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(where, key, f"expected a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise _fail(where, key, f"must be finite, got {v!r}")
    if low is not None and (f <= low if low_open else f < low):
        raise _fail(where, key, f"must be {'>' if low_open else '>='} {low}, got {v}")
    if high is not None and f > high:
        raise _fail(where, key, f"must be <= {high}, got {v}")
    return f


def read_mapping(path, what: str) -> dict:
    """The top-level mapping of a YAML (or ``.json``) file; ``ValueError`` naming the file for a missing, empty,
    unreadable or invalid file or a non-mapping top level."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {p}: file not found" if not p.exists() else f"{what} {p}: not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {p}: cannot read ({e})") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{what} {p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    if data is None:
        raise ValueError(f"{what} {p}: the file is empty")
    if not isinstance(data, dict):
        raise ValueError(f"{what} {p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def check_fields(cls, d: dict, where: str) -> None:
    """Check each value of ``d`` against the annotation of the dataclass field of the same name (int, float, str,
    bool, ``X | None``); unknown keys are left to the caller."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in d:
            _check_type(hints[f.name], d[f.name], f.name, where)


def _check_type(tp, v, key, where) -> None:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if v is None and len(args) < len(typing.get_args(tp)):
            return
        if len(args) == 1:
            return _check_type(args[0], v, key, where)
        return
    if tp is int:
        check_int(v, key, where)
    elif tp is float:
        check_float(v, key, where)
    elif tp is bool and not isinstance(v, bool):
        raise _fail(where, key, f"expected true/false, got {v!r}")
    elif tp is str and not isinstance(v, str):
        raise _fail(where, key, f"expected a string, got {v!r}")


# ------------------------------------------------------------------------------------------------ ledger config

LEDGER_SHAPE = {"num_layers": 1, "batch": 1, "num_kv_heads": 1, "head_dim": 1, "length": 0, "capacity": 1}
LEDGER_POLICY_INTS = ("full_precision_first", "full_precision_last")


def ledger_config(path) -> dict:
    """The checked mapping of a ``kvq ledger`` YAML/JSON file (see ``cache.registry.ledger_from_config``): shape
    fields are integers >= 1 (``length`` >= 0), ``rope_theta`` a positive number, the policy counts integers >= 0."""
    where = str(path)
    d = read_mapping(path, "ledger config")
    for k, low in LEDGER_SHAPE.items():
        if k in d:
            check_int(d[k], k, where, low=low)
    if "rope_theta" in d:
        check_float(d["rope_theta"], "rope_theta", where, low=0.0, low_open=True)
    if "rope_pairing" in d and d["rope_pairing"] not in ("half_split", "interleaved"):
        raise _fail(where, "rope_pairing", f"must be 'half_split' or 'interleaved', got {d['rope_pairing']!r}")
    spec = d.get("cache", d.get("scheme"))
    if isinstance(spec, dict):
        for k in LEDGER_POLICY_INTS:
            if k in spec:
                check_int(spec[k], f"cache.{k}", where, low=0)
        if "full_precision_layers" in spec:
            lay = spec["full_precision_layers"]
            if not isinstance(lay, list):
                raise _fail(where, "cache.full_precision_layers", f"expected a list of layer indices, got {lay!r}")
            for i, x in enumerate(lay):
                check_int(x, f"cache.full_precision_layers[{i}]", where, low=0)
    elif spec is not None and not isinstance(spec, str):
        raise _fail(where, "cache", f"expected a scheme name or mapping, got {spec!r}")
    if spec is not None:
        try:
            make_policy(spec, d.get("num_layers", 32), rope_theta=float(d.get("rope_theta", 10000.0)),
                        rope_pairing=d.get("rope_pairing", "half_split"))
        except (ValueError, TypeError) as e:
            raise _fail(where, "cache", str(e)) from None
    return d


# ------------------------------------------------------------------------------------------------ command line

def scheme_arg(spec, flag: str = "--cache") -> None:
    """Build the scheme once with default RoPE settings so a bad ``--cache`` fails before the model loads."""
    if spec is None:
        return
    try:
        make_scheme(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag}: {e}") from None


def new_dir(path, flag: str = "--out") -> None:
    """``path`` must not exist yet (artifacts are immutable) and its parent must be a directory (or creatable)."""
    p = Path(path)
    if p.exists():
        raise ValueError(f"{flag}: {p} exists (artifacts are immutable; pick a new path)")
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}: {p}: {parent} is not a directory")


def empty_or_missing_dir(path, flag: str) -> None:
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise ValueError(f"{flag}: {p} must be an empty directory or not exist yet")


def existing_dir(path, flag: str) -> None:
    if not Path(path).is_dir():
        raise ValueError(f"{flag}: {path} is not a directory")


def model_args(args) -> None:
    if getattr(args, "reduction", "fast") == "fixed_order" and getattr(args, "w8a8", False):
        raise ValueError("--reduction fixed_order replaces the projection hook; it does not combine with --w8a8")
    if getattr(args, "smooth_alpha", None) is not None:
        check_float(args.smooth_alpha, "--smooth-alpha", low=0.0, high=1.0)


def generate_args(args) -> None:
    """``kvq generate``: everything that can be checked before loading the model."""
    model_args(args)
    check_int(args.max_new_tokens, "--max-new-tokens", low=1)
    check_float(args.temperature, "--temperature", low=0.0)
    check_int(args.top_k, "--top-k", low=0)
    check_float(args.top_p, "--top-p", low=0.0, high=1.0, low_open=True)
    check_int(args.seed, "--seed", low=0)
    if args.capacity is not None:
        check_int(args.capacity, "--capacity", low=1)
    scheme_arg(args.cache)


def ppl_args(args) -> None:
    """``kvq ppl``: everything that can be checked before loading the model."""
    model_args(args)
    check_int(args.seq_len, "--seq-len", low=2)
    check_int(args.max_segments, "--max-segments", low=1)
    check_int(args.chunk, "--chunk", low=1)
    if args.corpus not in (None, "wikitext2", "builtin") and not Path(args.corpus).expanduser().is_file():
        raise ValueError(f"--corpus: {args.corpus}: no such file (or use 'wikitext2' / 'builtin')")
    scheme_arg(args.cache)


def context_fits(n: int, cfg, flag: str) -> None:
    """``n`` positions must fit the model's trained context length (``cfg.max_position``)."""
    if n > cfg.max_position:
        raise ValueError(f"{flag}: {n} positions exceed the context length {cfg.max_position} of model "
                         f"{cfg.name!r}; use at most {cfg.max_position}")
