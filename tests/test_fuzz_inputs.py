"""Fuzz (hypothesis, bounded for CI): the config loader, the inline scheme-spec parser and the CLI argument
validation turn any input into either a valid result or a ``ValueError`` that names where the problem is -- never
another exception type (KeyError, TypeError, AttributeError, OverflowError, a traceback)."""
import dataclasses
import json
import math
import string
import tempfile
import typing
from pathlib import Path
from unittest import mock

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvquant_jax import config as C

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _field_names(cls, out):
    for f in dataclasses.fields(cls):
        out.add(f.name)
        for tp in (f.type, *typing.get_args(typing.get_type_hints(cls)[f.name])):
            if dataclasses.is_dataclass(tp):
                _field_names(tp, out)
    return out


KEYS = sorted(_field_names(C.ExperimentConfig, {"base", "grid", "zip", "points", "label", "name", "scheme", "bits",
                                                 "residual", "group_size", "layers"}))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["kivi2", "int4", "fp8_e4m3", "random", "builtin", "observe", "2-5", "fp32",
                                     "kivi2:residual=16", "int4:group_size=x", "wikitext2", "test", "validation"]))
KEY = st.one_of(st.sampled_from(KEYS), st.text(string.ascii_letters + "._-", min_size=1, max_size=8))
TREE = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                     st.dictionaries(KEY, kids, max_size=5)), max_leaves=25)
BLOCKS = st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(C.ExperimentConfig)]),
                         st.one_of(TREE, st.dictionaries(KEY, TREE, max_size=6)), max_size=6)


def _ok_or_value_error(fn, where: str):
    try:
        out = fn()
        event("valid")
        return out
    except ValueError as e:
        event("ValueError")
        msg = str(e)
        assert msg.strip(), "an empty error message"
        assert where in msg or "--set" in msg, f"the error does not say where: {msg!r}"
        return e


@FUZZ
@given(tree=BLOCKS)
def test_config_loader_random_trees(tree):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(yaml.safe_dump(tree, allow_unicode=True))
        got = _ok_or_value_error(lambda: C.load_config(p), str(p))
        if isinstance(got, C.LoadedConfig):          # a valid config round-trips
            assert C.from_dict(got.config.to_dict()) == got.config or got.config.sweep is not None
            try:
                got.points()
            except ValueError as e:
                assert str(p) in str(e) or "sweep" in str(e)


@FUZZ
@given(text=st.one_of(st.text(max_size=60), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                      st.sampled_from(["a: [1", "{", "- 1\n- 2", "base: nosuch.yaml", "base: [1, 2]", "!!python/x 1",
                                       "cache: {scheme: {}}", "&a [*a]", "tasks: {ppl: {seq_len: 1e400}}"])))
def test_config_loader_random_text(text):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(text, encoding="utf-8", errors="surrogatepass") if False else p.write_bytes(
            text.encode("utf-8", "replace"))
        _ok_or_value_error(lambda: C.load_config(p), str(p))


@FUZZ
@given(sets=st.lists(st.one_of(
    st.tuples(st.sampled_from(["cache.scheme", "cache.scheme.residual", "tasks.ppl.seq_len", "model.random.seed",
                               "tasks.passkey.lengths", "sweep.grid", "data.offset", "activation.smooth_alpha",
                               "a..b", "cache.scheme.bits.x", "tasks"]),
              st.one_of(st.text(max_size=10), st.sampled_from(["[1,", "2.9", "true", "null", "{a: 1}", "-3", "nan"])))
    .map(lambda kv: f"{kv[0]}={kv[1]}"), st.text(max_size=15)), max_size=4))
def test_config_overrides(sets):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text("model: {name: random}\ndata: {corpus: builtin}\n")
        _ok_or_value_error(lambda: C.load_config(p, sets), str(p))


SPEC_TEXT = st.one_of(
    st.text(max_size=40),
    st.builds(lambda name, items: name + ":" + ",".join(items),
              st.sampled_from(["kivi2", "kivi4", "int4", "int8", "fp8_e4m3", "fp8_e5m2", "qserve4", "fp32", "x"]),
              st.lists(st.builds(lambda k, v: f"{k}={v}",
                                 st.sampled_from(["residual", "group_size", "v_group_size", "residual_rule", "bits",
                                                  "scales", "scale_axis", "k_scales", "qparam_dtype", "fmt", "rule",
                                                  "k_bits", "dtype", "calibration_id", "zz"]),
                                 st.one_of(st.sampled_from(["1e999", "-1", "0", "16", "2.5", "true", "null", "[1,2]",
                                                            "{}", "\"s\"", "synchronized", "calibrated", "head",
                                                            "NaN", "[[1]]", "1e-50"]),
                                           st.text(max_size=6))), max_size=4)))
SPEC_DICT = st.builds(lambda name, opts: {"name": name, **opts},
                      st.sampled_from(["kivi2", "int4", "fp8_e4m3", "qserve4", "bf16"]),
                      st.dictionaries(st.sampled_from(["residual", "group_size", "bits", "scales", "k_scales",
                                                       "scale_axis", "full_precision_first", "full_precision_layers",
                                                       "residual_rule", "qparam_dtype"]), SCALARS | st.lists(SCALARS,
                                                                                                             max_size=3),
                                      max_size=3))


@FUZZ
@given(spec=st.one_of(SPEC_TEXT, SPEC_DICT))
def test_scheme_spec_parser(spec):
    from kvquant_jax.cache.interface import CacheScheme
    from kvquant_jax.validation import scheme_arg

    try:
        scheme_arg(spec)
    except ValueError as e:
        event("ValueError")
        assert str(e).startswith("--cache: ")
        return
    event("valid")
    from kvquant_jax.cache.registry import make_scheme

    try:
        s = make_scheme(spec)
    except ValueError:          # make_policy-only keys in a dict spec
        assert isinstance(spec, dict)
        return
    assert isinstance(s, CacheScheme)
    json.dumps(s.schema.to_dict())                   # a built scheme describes itself


ARG = st.one_of(st.sampled_from(["0", "-1", "1", "2", "64", "nan", "inf", "-inf", "1e9", "0.5", "x", "", "kivi2",
                                 "int4", "builtin", "/nonexistent"]), st.text(max_size=6))


@FUZZ
@given(cmd=st.sampled_from(["ppl", "generate"]),
       pairs=st.lists(st.tuples(st.sampled_from(["--seq-len", "--max-segments", "--chunk", "--cache", "--corpus",
                                                 "--smooth-alpha", "--max-new-tokens", "--temperature", "--top-k",
                                                 "--top-p", "--capacity", "--seed", "--dtype"]), ARG), max_size=4))
def test_cli_argument_validation(cmd, pairs):
    import contextlib
    import io

    from kvquant_jax import cli

    class Loaded(Exception):
        pass

    def no_load(args):
        raise Loaded

    argv = [cmd] + (["--prompt", "hi"] if cmd == "generate" else [])
    for flag, val in pairs:
        if cmd == "ppl" and flag in ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--capacity",
                                     "--seed"):
            continue
        if cmd == "generate" and flag in ("--seq-len", "--max-segments", "--chunk", "--corpus"):
            continue
        argv += [flag, val]
    err = io.StringIO()
    with mock.patch.object(cli, "_load", no_load), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:          # argparse: a value of the wrong type
            event("argparse")
            assert e.code == 2
            return
        except Loaded:                   # every argument passed the checks
            event("valid")
            return
    event("ValueError")
    assert rc == 2 and "kvq: error: " in err.getvalue() and "Traceback" not in err.getvalue()
    msg = err.getvalue()
    assert any(flag in msg for flag, _ in pairs), msg


@FUZZ
@given(tree=st.dictionaries(st.sampled_from(["cache", "num_layers", "batch", "num_kv_heads", "head_dim", "length",
                                             "capacity", "rope_theta", "rope_pairing", "extra"]),
                            SCALARS | st.dictionaries(st.sampled_from(["name", "full_precision_first", "bits",
                                                                       "full_precision_layers", "residual"]),
                                                      SCALARS, max_size=3), max_size=6))
def test_ledger_config(tree):
    import contextlib
    import io

    from kvquant_jax import cli

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "l.yaml"
        p.write_text(yaml.safe_dump(tree))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["ledger", str(p)])
        assert rc in (0, 2)
        event(f"rc={rc}")
        if rc == 0:
            assert "KV cache byte ledger" in out.getvalue()
        else:
            assert "kvq: error: " in err.getvalue()




# ------------------------------------------------------------------------------------------------ one-field mutations
# A valid config with ONE value replaced by a random one: the loader accepts it or names that very key.

BASE = {"name": "t", "model": {"name": "random", "random": {"num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                                            "num_kv_heads": 2, "head_dim": 16, "vocab_size": 320}},
        "data": {"corpus": "builtin", "offset": 0},
        "cache": {"scheme": {"name": "kivi2", "residual": 32}, "full_precision_first": 1, "layers": [
            {"layers": "0-1", "scheme": "int4"}]},
        "activation": {"enabled": True, "smooth_alpha": 0.5, "float_layers": [0]},
        "calibration": {"observe_tokens": 256},
        "tasks": {"ppl": {"seq_len": 48, "max_segments": 2, "chunk": 16}, "passkey": {"lengths": [320],
                                                                                     "depths": [0.0, 1.0]},
                  "kv_error": {"seq_len": 40, "prefill": 16, "probes": 3}, "bytes": {"length": 64}},
        "sweep": {"grid": {"cache.scheme.residual": [32, 64]}}}


def _leaves(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,)


LEAVES = sorted(_leaves(BASE))


@FUZZ
@given(key=st.sampled_from(LEAVES), value=TREE)
def test_config_one_field_mutation_names_the_key(key, value):
    import copy

    raw = copy.deepcopy(BASE)
    node = raw
    parts = key
    for p in parts[:-1]:
        node = node[p]
    node[parts[-1]] = value
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(yaml.safe_dump(raw, allow_unicode=True))
        got = _ok_or_value_error(lambda: C.load_config(p).points(), str(p))
        if isinstance(got, ValueError):
            msg = str(got)
            top = parts[0]
            assert top in msg or "sweep" in msg or "point" in msg, (key, msg)


CAL_FIELDS = [f.name for f in dataclasses.fields(__import__("kvquant_jax.calibration.kvquant",
                                                            fromlist=["CalibrationConfig"]).CalibrationConfig)]


@FUZZ
@given(key=st.sampled_from(CAL_FIELDS), value=SCALARS)
def test_calibration_config_one_field_mutation(key, value):
    from kvquant_jax.calibration.kvquant import CalibrationConfig

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(yaml.safe_dump({"calibration": {key: value}}))
        try:
            CalibrationConfig.from_file(p)
            event("valid")
        except ValueError as e:
            event("ValueError")
            assert str(p) in str(e) and key in str(e), str(e)


LEDGER_BASE = {"cache": "int4", "num_layers": 2, "batch": 1, "num_kv_heads": 2, "head_dim": 16, "length": 64,
               "capacity": 64}


@FUZZ
@given(key=st.sampled_from(sorted(LEDGER_BASE) + ["rope_theta", "rope_pairing"]), value=SCALARS)
def test_ledger_one_field_mutation(key, value):
    import contextlib
    import io

    from kvquant_jax import cli

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "l.yaml"
        p.write_text(yaml.safe_dump({**LEDGER_BASE, key: value}))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["ledger", str(p)])
        event(f"rc={rc}")
        assert rc in (0, 2)
        if rc == 2:
            msg = err.getvalue()
            assert "kvq: error: " in msg and (key in msg or "capacity" in msg), msg


def test_mutation_bases_are_valid(tmp_path):
    """The one-field mutations start from valid inputs (else they would only ever test one error)."""
    import contextlib
    import io

    from kvquant_jax import cli

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(BASE))
    assert len(C.load_config(p).points()) == 2
    q = tmp_path / "l.yaml"
    q.write_text(yaml.safe_dump(LEDGER_BASE))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["ledger", str(q)]) == 0
    assert FUZZ.max_examples <= 200 and not math.isnan(FUZZ.max_examples)
