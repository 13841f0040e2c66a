"""Issue Q.3 / Q.5 / Q.6: every command-line argument and small config file is checked (type and range, message
naming the flag or the file and key) before any model is loaded or any expensive work starts."""
import json
import types

import pytest

from kvquant_jax import cli


def _no_load(*a, **k):
    raise AssertionError("the model was loaded before the arguments were checked")


@pytest.fixture
def tiny_model():
    from kvquant_jax.eval.context import ByteTokenizer
    from kvquant_jax.models.testing import random_params, tiny_config

    cfg = tiny_config(vocab_size=320, num_layers=1, max_position=64, name="tiny-ctx64")
    return types.SimpleNamespace(params=random_params(cfg, seed=3), cfg=cfg, tokenizer=ByteTokenizer(),
                                 path="tiny", load_seconds=0.0)


# ------------------------------------------------------------------------------------------------ Q.3 kvq ppl

def test_ppl_refuses_a_sequence_longer_than_the_context(monkeypatch, tiny_model, capsys):
    monkeypatch.setattr(cli, "_load", lambda args: tiny_model)
    assert cli.main(["ppl", "--corpus", "builtin", "--seq-len", "65", "--max-segments", "1"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len" in err and "context length 64" in err
    # at the context length it runs (the oracle: the same segment through the library directly)
    assert cli.main(["ppl", "--corpus", "builtin", "--seq-len", "64", "--max-segments", "1"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from kvquant_jax.data import load_corpus
    from kvquant_jax.eval.ppl import perplexity

    ids = tiny_model.tokenizer.encode(load_corpus("builtin").text)
    want = perplexity(tiny_model.params, tiny_model.cfg, ids, seq_len=64, max_segments=1)
    assert got["ppl"] == pytest.approx(want.ppl, rel=1e-6) and got["seq_len"] == 64


@pytest.mark.parametrize("argv, flag", [
    (["--max-segments", "0"], "--max-segments"), (["--max-segments", "-3"], "--max-segments"),
    (["--seq-len", "1"], "--seq-len"), (["--chunk", "0"], "--chunk"), (["--smooth-alpha", "nan"], "--smooth-alpha"),
    (["--smooth-alpha", "1.5"], "--smooth-alpha"), (["--cache", "nosuch"], "--cache"),
    (["--cache", "kivi2:bogus=1"], "--cache"), (["--corpus", "/nonexistent/x.txt"], "--corpus")])
def test_ppl_arguments_checked_before_loading(monkeypatch, capsys, argv, flag):
    monkeypatch.setattr(cli, "_load", _no_load)
    assert cli.main(["ppl", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_ppl_library_max_segments_zero_message():
    from kvquant_jax.eval.ppl import segments

    with pytest.raises(ValueError, match="max_segments must be an integer >= 1"):
        segments(list(range(100)), 10, 0)
    assert segments(list(range(100)), 10, 3).shape == (3, 10)


@pytest.mark.parametrize("argv, flag", [
    (["--top-p", "0"], "--top-p"), (["--top-p", "1.01"], "--top-p"), (["--temperature", "-1"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--top-k", "-1"], "--top-k"), (["--capacity", "0"], "--capacity"), (["--cache", "int9"], "--cache")])
def test_generate_arguments_checked_before_loading(monkeypatch, capsys, argv, flag):
    monkeypatch.setattr(cli, "_load", _no_load)
    assert cli.main(["generate", "--prompt", "hi", *argv]) == 2
    assert flag in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ Q.5 numbers

LEDGER = "cache: int4\nnum_layers: 2\nbatch: 1\nnum_kv_heads: 2\nhead_dim: 16\nlength: 64\ncapacity: 64\n"


@pytest.mark.parametrize("edit, key", [
    (("num_layers: 2", "num_layers: 2.9"), "num_layers"), (("length: 64", "length: true"), "length"),
    (("batch: 1", "batch: '1'"), "batch"), (("head_dim: 16", "head_dim: 0"), "head_dim"),
    (("cache: int4", "cache: {name: int4, full_precision_first: 1.5}"), "cache.full_precision_first"),
    (("cache: int4", "cache: int4\nrope_theta: .nan"), "rope_theta")])
def test_ledger_numbers_are_not_coerced(tmp_path, capsys, edit, key):
    p = tmp_path / "l.yaml"
    p.write_text(LEDGER.replace(*edit))
    assert cli.main(["ledger", str(p)]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and f"{key}:" in err


@pytest.mark.parametrize("text, what", [("", "empty"), ("cache: [int4\n", "not valid YAML"),
                                        ("- 1\n- 2\n", "must be a mapping")])
def test_ledger_empty_or_invalid_yaml(tmp_path, capsys, text, what):
    p = tmp_path / "l.yaml"
    p.write_text(text)
    assert cli.main(["ledger", str(p)]) == 2
    err = capsys.readouterr().err
    assert what in err and str(p) in err


def test_ledger_valid_file_matches_library(tmp_path, capsys):
    from kvquant_jax.cache.registry import make_policy
    from kvquant_jax.quant.ledger import LedgerShape, ledger_table

    p = tmp_path / "l.yaml"
    p.write_text(LEDGER)
    assert cli.main(["ledger", str(p)]) == 0
    want = ledger_table(make_policy("int4", 2), LedgerShape(2, 1, 2, 16, 64, 64))
    assert capsys.readouterr().out.strip() == want.strip()


def test_ledger_shape_rejects_bool():
    from kvquant_jax.quant.ledger import LedgerShape

    with pytest.raises(ValueError, match="batch"):
        LedgerShape(num_layers=2, batch=True, num_kv_heads=2, head_dim=16, length=4, capacity=4)


@pytest.mark.parametrize("line, key", [("num_samples: 2.5", "num_samples"), ("k_bits: 2.9", "k_bits"),
                                       ("outlier_fraction: true", "outlier_fraction"), ("sink: -1", "sink"),
                                       ("seed: 1.5", "seed"), ("k_bits: 5", "k_bits"), ("dtype: 3", "dtype")])
def test_calibration_config_numbers(tmp_path, line, key):
    from kvquant_jax.calibration.kvquant import CalibrationConfig

    p = tmp_path / "c.yaml"
    p.write_text(f"calibration:\n  {line}\n")
    with pytest.raises(ValueError, match=key) as e:
        CalibrationConfig.from_file(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("text", ["", "a: [1\n", "7\n"])
def test_calibration_config_bad_yaml(tmp_path, text):
    from kvquant_jax.calibration.kvquant import CalibrationConfig

    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=str(p)):
        CalibrationConfig.from_file(p)


# ------------------------------------------------------------------------------------------------ Q.6 outputs first

def test_calibrate_existing_out_fails_before_calibrating(monkeypatch, tmp_path, capsys):
    from kvquant_jax.calibration import kvquant as KC

    monkeypatch.setattr(KC, "calibrate", _no_load)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("calibration:\n  num_samples: 2\n  seq_len: 16\n")
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    assert cli.main(["calibrate", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "exists" in err
    assert (out / "keep.txt").read_text() == "old"


def test_calibrate_bad_config_fails_before_calibrating(monkeypatch, tmp_path, capsys):
    from kvquant_jax.calibration import kvquant as KC

    monkeypatch.setattr(KC, "calibrate", _no_load)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("calibration:\n  k_bits: 7\n")
    assert cli.main(["calibrate", str(cfg), "--out", str(tmp_path / "new")]) == 2
    assert "k_bits" in capsys.readouterr().err


def test_calibrate_missing_corpus_fails_before_loading_the_model(monkeypatch, tmp_path, capsys):
    import kvquant_jax.models

    monkeypatch.setattr(kvquant_jax.models, "load_model", _no_load)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"calibration:\n  corpus: {tmp_path / 'nope.txt'}\n")
    assert cli.main(["calibrate", str(cfg), "--out", str(tmp_path / "new")]) == 2
    assert "nope.txt" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv, flag", [
    (["intactkv", "extract", "--out", "{exists}"], "--out"),
    (["prefixquant", "discover", "--out", "{exists}"], "--out"),
    (["prefixquant", "discover", "--out", "{new}", "--eta", "0"], "--eta"),
    (["intactkv", "calibrate", "--artifact", "{exists}", "--cache", "int4", "--out", "{exists}",
      "--checkpoint-dir", "{new}"], "--out"),
    (["intactkv", "calibrate", "--artifact", "{exists}", "--cache", "int4", "--out", "{new}",
      "--checkpoint-dir", "{full}"], "--checkpoint-dir"),
    (["intactkv", "calibrate", "--artifact", "{new}", "--cache", "int4", "--out", "{new}",
      "--checkpoint-dir", "{new}"], "--artifact"),
    (["intactkv", "calibrate", "--artifact", "{exists}", "--cache", "bogus", "--out", "{new}",
      "--checkpoint-dir", "{new}"], "--cache"),
    (["intactkv", "calibrate", "--artifact", "{exists}", "--cache", "int4", "--out", "{new}",
      "--checkpoint-dir", "{new}", "--lr", "-1"], "--lr")])
def test_prefix_commands_check_before_loading(monkeypatch, tmp_path, capsys, argv, flag):
    from kvquant_jax.calibration import commands

    monkeypatch.setattr(commands, "_load", _no_load)
    (tmp_path / "exists").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("1")
    subs = {"{exists}": str(tmp_path / "exists"), "{new}": str(tmp_path / "new"), "{full}": str(tmp_path / "full")}
    assert cli.main([subs.get(a, a) for a in argv]) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
