"""Config loading: inheritance, overrides, typed validation with errors that name the file and the key, sweeps."""
from pathlib import Path

import pytest

from kvquant_jax.config import (ConfigError, ExperimentConfig, SchemeSpec, from_dict, load_config, parse_overrides,
                                sweep_points)

REPO = Path(__file__).resolve().parents[1]
OWN_CONFIGS = sorted([REPO / "configs" / "base.yaml", REPO / "configs" / "sweep_sizes.yaml"]
                     + list((REPO / "configs" / "models").glob("*.yaml"))
                     + list((REPO / "configs" / "schemes").glob("*.yaml"))
                     + list((REPO / "configs" / "sweeps").glob("*.yaml")))


def write(tmp_path, name, text):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", OWN_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads_and_resolves(path):
    loaded = load_config(path)
    points = loaded.points()
    assert points and all(isinstance(p.config, ExperimentConfig) for p in points)
    assert len({p.label for p in points}) == len(points)
    for p in points:                       # round trip through plain dicts
        assert from_dict(p.config.to_dict()) == p.config


def test_defaults_and_typed_blocks():
    cfg = from_dict({})
    assert cfg.model.name == "smollm2-135m" and cfg.cache.scheme == SchemeSpec("fp32")
    assert cfg.tasks.ppl.chunk == 128 and cfg.sweep is None
    cfg = from_dict({"cache": {"scheme": "kivi2:residual=64", "layers": [{"layers": "0-2", "scheme": "fp8_e4m3"}]},
                     "tasks": {"passkey": {"depths": [0, 1]}}})
    assert cfg.cache.scheme.name == "kivi2" and cfg.cache.scheme.get("residual") == 64
    assert cfg.cache.layers[0].layers == (0, 1, 2)
    assert cfg.tasks.passkey.depths == (0.0, 1.0)           # ints accepted for floats, frozen to tuples
    with pytest.raises(Exception):
        cfg.tasks.ppl.chunk = 3                            # frozen


def test_base_inheritance_and_overrides(tmp_path):
    write(tmp_path, "base.yaml", "name: b\ncache: {scheme: {name: kivi2, residual: 64}}\ntasks: {ppl: {chunk: 64}}\n")
    child = write(tmp_path, "sub/child.yaml", "base: ../base.yaml\nname: c\ntasks: {ppl: {seq_len: 256}}\n")
    cfg = load_config(child).config
    assert (cfg.name, cfg.tasks.ppl.chunk, cfg.tasks.ppl.seq_len) == ("c", 64, 256)
    assert cfg.cache.scheme.get("residual") == 64
    cfg = load_config(child, ["cache.scheme.residual=32", "tasks.ppl.chunk=16", "data.corpus=builtin"]).config
    assert cfg.cache.scheme.get("residual") == 32 and cfg.tasks.ppl.chunk == 16 and cfg.data.corpus == "builtin"
    # a dotted override into a scheme given as a string turns it into a mapping
    cfg = load_config(child, ["cache.scheme=int4", "cache.scheme.group_size=32"]).config
    assert cfg.cache.scheme == SchemeSpec("int4", (("group_size", 32),))
    assert parse_overrides(["a.b=[1, 2]", "c=null"]) == [("a.b", [1, 2]), ("c", None)]


@pytest.mark.parametrize("text, key, words", [
    ("tasks: {ppl: {chunks: 3}}\n", "tasks.ppl.chunks", "unknown key"),
    ("tasks: {ppl: {chunk: '3'}}\n", "tasks.ppl.chunk", "expected an integer"),
    ("tasks: {ppl: {chunk: 0}}\n", "tasks.ppl.chunk", ">= 1"),
    ("tasks: {passkey: {enabled: 1}}\n", "tasks.passkey.enabled", "true/false"),
    ("tasks: {passkey: {depths: [0.5, 1.5]}}\n", "tasks.passkey.depths[1]", "[0, 1]"),
    ("tasks: {kv_error: {seq_len: 64, prefill: 100}}\n", "tasks.kv_error.prefill", "exceeds"),
    ("model: {dtype: fp64}\n", "model.dtype", "one of"),
    ("cache: {scheme: {name: kivi2, group_size: 32, residual: 48}}\n", "cache.scheme", "multiple of group_size"),
    ("cache: {scheme: {name: kivi_axes, group_size: 32, residual: 40}}\n", "cache.scheme", "multiple of group_size"),
    ("cache: {scheme: {name: kivi2, residul: 32}}\n", "cache.scheme", "unknown key 'residul'"),
    ("cache: {scheme: nope4}\n", "cache.scheme", "unknown cache scheme"),
    ("cache: {scheme: {residual: 32}}\n", "cache.scheme", "needs a 'name'"),
    ("cache: {scheme: {name: fp8_e4m3, scales: calibrated}}\n", "cache.scheme", "calibration.fp8_scales"),
    ("cache: {layers: [{layers: '3-1', scheme: int8}]}\n", "cache.layers[0].layers", "empty layer range"),
    ("cache: {layers: [{scheme: int8}]}\n", "cache.layers[0].layers", "missing"),
    ("activation: {act_symmetric: false}\n", "activation.act_symmetric", "only symmetric"),
    ("activation: {linears: [q, embed]}\n", "activation.linears[1]", "embeddings are never quantized"),
    ("activation: {prefill: w4a4}\n", "activation.prefill", "w8a8"),
    ("activation: {smooth_alpha: 2}\n", "activation.smooth_alpha", "[0, 1]"),
    ("model: {random: {num_layers: 2}}\n", "model.random", "only applies"),
    ("data: {split: validation}\n", "data.calibration_split", "must differ"),
    ("sweep: {grid: {cache.scheme: []}}\n", "sweep.grid.cache.scheme", "non-empty list"),
    ("sweep: {zip: {a.b: [1, 2], c.d: [1]}}\n", "sweep.zip", "same length"),
    ("sweep: {name: x}\n", "sweep", "at least one of"),
    ("- just\n- a list\n", "", "top level must be a mapping"),
])
def test_errors_name_the_file_and_the_key(tmp_path, text, key, words):
    p = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(p).points()
    msg = str(e.value)
    assert msg.startswith(str(p)), msg
    assert f": {key}:" in msg or not key, msg
    assert words in msg, msg


def test_error_in_a_base_file_names_that_file(tmp_path):
    base = write(tmp_path, "base.yaml", "tasks: {ppl: {batch_size: -1}}\n")
    child = write(tmp_path, "child.yaml", "base: base.yaml\nname: c\n")
    with pytest.raises(ConfigError, match=rf"^{base}: tasks.ppl.batch_size: must be >= 1"):
        load_config(child)


def test_override_and_file_errors(tmp_path):
    p = write(tmp_path, "ok.yaml", "name: ok\n")
    with pytest.raises(ConfigError, match=r"^--set: tasks.ppl.chunk: expected an integer"):
        load_config(p, ["tasks.ppl.chunk=abc"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(p, ["tasks.ppl.chunk"])
    with pytest.raises(ConfigError, match=r"config file not found"):
        load_config(tmp_path / "missing.yaml")
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match=r"base: file 'nope.yaml' not found"):
        load_config(write(tmp_path, "c.yaml", "base: nope.yaml\n"))


def test_sweep_grid_zip_points(tmp_path):
    p = write(tmp_path, "s.yaml", """
cache: {scheme: kivi2}
sweep:
  name: s
  grid:
    cache.scheme.residual: [0, 32]
    tasks.ppl.chunk: [16, 64, 128]
  zip:
    label: [two, four]
    cache.scheme.bits: [2, 4]
  points:
    - {tasks.ppl.seq_len: 256}
""")
    pts = load_config(p).points()
    assert len(pts) == 2 * 3 * 2 * 1
    first = pts[0]
    assert first.label == "two, residual=0, chunk=16"
    assert first.config.cache.scheme.get("bits") == 2 and first.config.tasks.ppl.seq_len == 256
    assert [p.config.tasks.ppl.chunk for p in pts[:6]] == [16, 16, 64, 64, 128, 128]
    assert pts[-1].label == "four, residual=32, chunk=128" and pts[-1].config.cache.scheme.get("residual") == 32
    # --set applies after the point's own overrides; the sweep block itself can be overridden
    pts = load_config(p, ["tasks.ppl.chunk=8", "sweep.grid={cache.scheme.residual: [0]}"]).points()
    assert len(pts) == 2 and {p.config.tasks.ppl.chunk for p in pts} == {8}


def test_sweep_whole_scheme_then_refinement(tmp_path):
    """A broader key applies first whatever axis sets it: a zip scheme mapping refined by a grid bits axis."""
    p = write(tmp_path, "s.yaml", """
sweep:
  grid: {cache.scheme.bits: [2, 4]}
  zip: {cache.scheme: [{name: kivi2, residual: 32}, {name: kivi_axes, k_axis: token, residual: 32}]}
""")
    pts = load_config(p).points()
    specs = [p.config.cache.scheme.to_spec() for p in pts]
    assert specs[0] == {"name": "kivi2", "residual": 32, "bits": 2}
    assert specs[3] == {"name": "kivi_axes", "k_axis": "token", "residual": 32, "bits": 4}


def test_sweep_point_error_names_the_point(tmp_path):
    p = write(tmp_path, "s.yaml", "sweep: {grid: {cache.scheme: [int8, {name: kivi2, residual: 33}]}}\n")
    with pytest.raises(ConfigError, match=r"sweep point 1 .*: cache.scheme: kivi: residual \(33\)"):
        load_config(p).points()


def test_policy_errors_need_the_model(tiny_model_cfg):
    from kvquant_jax.eval.policy import build_policy

    cfg = from_dict({"cache": {"scheme": "int4", "full_precision_first": 2, "full_precision_last": 1}})
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        build_policy(cfg.cache, tiny_model_cfg)
    cfg = from_dict({"cache": {"scheme": "int4", "layers": [{"layers": [5], "scheme": "int8"}]}})
    with pytest.raises(ValueError, match=r"cache.layers\[0\].layers: \[5\] out of range"):
        build_policy(cfg.cache, tiny_model_cfg)
    cfg = from_dict({"cache": {"scheme": "int4:group_size=24"}})
    with pytest.raises(ValueError, match="cache: .*head_dim 16"):
        build_policy(cfg.cache, tiny_model_cfg)
    cfg = from_dict({"cache": {"scheme": "int4", "full_precision_last": 1,
                               "layers": [{"layers": [0], "scheme": "int8"}]}})
    pol = build_policy(cfg.cache, tiny_model_cfg)
    assert [s.family for s in pol.schemes] == ["per_token", "full"] and pol.schemes[0].bits == 8


@pytest.fixture
def tiny_model_cfg():
    from kvquant_jax.models.testing import tiny_config

    return tiny_config(num_layers=2, head_dim=16, num_heads=4, num_kv_heads=2, hidden_size=64)


def test_missing_corpus_names_the_paths_tried(tmp_path, monkeypatch):
    from kvquant_jax import data
    from kvquant_jax.eval.metrics import Session

    dirs = [tmp_path / "d1", tmp_path / "d2"]
    monkeypatch.setattr(data, "data_dirs", lambda: dirs)
    cfg = from_dict({"model": {"name": "random"}, "data": {"corpus": "wikitext2"}})
    with pytest.raises(FileNotFoundError) as e:
        Session().corpus(cfg)
    msg = str(e.value)
    assert msg.startswith("data.corpus:")
    for d in dirs:
        assert str(d / "wikitext2" / "wiki.test.raw") in msg
    cfg = from_dict({"model": {"name": "random"}, "data": {"corpus": str(tmp_path / "none.txt")}})
    with pytest.raises(FileNotFoundError, match="none.txt"):
        Session().corpus(cfg)
    # without WikiText-2 and with the fallback allowed, the built-in text is used
    assert Session().corpus(from_dict({"model": {"name": "random"}})).name == "builtin-pydoc-topics"


# ----------------------------------------------------------------------------------------- size presets

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_gpu_size_preset_sets_sizes_and_keeps_the_configs_metric_choice():
    cpu = load_config(REPO_CONFIGS / "sweeps" / "passkey.yaml")
    gpu = load_config(REPO_CONFIGS / "sweeps" / "passkey.yaml", sizes="gpu")
    t = gpu.config.tasks
    # sizes come from the preset ...
    assert t.serving_ppl.segments * t.serving_ppl.decode >= 65536
    assert t.passkey.trials >= 20 and t.passkey.lengths[-1] == 8000 and t.passkey.lengths != cpu.config.tasks.passkey.lengths
    # ... which metrics run stays the config's (passkey.yaml turns everything but passkey off)
    for name in ("ppl", "serving_ppl", "kv_error", "agreement", "passkey"):
        assert getattr(t, name).enabled == getattr(cpu.config.tasks, name).enabled
    assert gpu.sizes == "gpu" and cpu.sizes is None
    # the points' configs carry the preset's sizes (so their row keys differ from the CPU rows')
    assert all(p.config.tasks.passkey.trials == 20 for p in gpu.points())
    assert {p.config.digest() for p in gpu.points()}.isdisjoint({p.config.digest() for p in cpu.points()})


def test_size_preset_applies_before_set_and_from_the_config_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {REPO_CONFIGS / 'base.yaml'}\nsizes: gpu\n")
    with pytest.raises(ConfigError, match="sweep_sizes_gpu.yaml not found"):
        load_config(cfg)                                   # a name is looked up beside the config and above it
    (tmp_path / "sweep_sizes_gpu.yaml").write_text((REPO_CONFIGS / "sweep_sizes_gpu.yaml").read_text())
    loaded = load_config(cfg, ["tasks.serving_ppl.segments=3"])
    assert loaded.config.tasks.serving_ppl.segments == 3 and loaded.config.tasks.serving_ppl.decode == 1024
    by_file = load_config(cfg, sizes=str(tmp_path / "sweep_sizes_gpu.yaml"))   # a file path works too
    assert by_file.config.tasks == load_config(cfg).config.tasks


def test_size_preset_bad_input_names_the_problem(tmp_path):
    cfg = REPO_CONFIGS / "sweeps" / "int.yaml"
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config(cfg, sizes="huge")
    bad = tmp_path / "p.yaml"
    bad.write_text("tasks: {ppl: {seq_len: 64}}\ncache: {scheme: int4}\n")
    with pytest.raises(ConfigError, match="only a tasks block"):
        load_config(cfg, sizes=str(bad))
    bad.write_text("tasks: {ppl: 64}\n")
    with pytest.raises(ConfigError, match="mappings of sizes"):
        load_config(cfg, sizes=str(bad))
