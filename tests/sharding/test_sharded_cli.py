"""``--mesh`` on the command line and the config's ``mesh`` key: bad values are refused before a model loads,
and ``kvq eval`` on a mesh gives the unsharded rows (same keys, values within float rounding)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest

from kvquant_jax import cli
from kvquant_jax.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from eval_helpers import tiny_yaml  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--prompt", "hi", "--mesh", "data=1,modle=2"], "unknown axis 'modle'"),
    (["generate", "--prompt", "hi", "--mesh", "data=4,model=4"], "needs 16 devices, 8 available"),
    (["generate", "--prompt", "hi", "--coordinator", "nohost"], "'nohost' is not HOST:PORT"),
    (["generate", "--prompt", "hi", "--coordinator", "h:1", "--num-processes", "2"], "process_id is not (flag"),
    (["ppl", "--mesh", "data=2", "--max-segments", "3"], "--max-segments 3 must be a multiple of the mesh's data=2"),
    (["eval", "missing.yaml", "--mesh", "data=x"], "missing.yaml"),
])
def test_bad_mesh_flags_are_refused_before_the_model_loads(argv, msg, capsys, monkeypatch):
    monkeypatch.setattr("kvquant_jax.models.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_config_mesh_key_is_checked(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(tiny_yaml(mesh="data=1,model=x"))
    assert cli.main(["eval", str(p)]) == 2
    assert f"{p}: mesh: mesh 'data=1,model=x': model must be a positive integer" in capsys.readouterr().err


def test_eval_on_a_mesh_gives_the_unsharded_rows(tmp_path):
    """ppl through an int4 cache and the serving path, model=2 (the random model has 4 query / 2 KV heads): the
    same row keys as the unsharded run (the mesh is not part of a key) and values within 1e-5 relative."""
    blocks = {"cache": {"scheme": "int4"},
              "tasks": {"kv_error": {"enabled": False}, "agreement": {"enabled": False}, "bytes": {"enabled": False}}}
    p = tmp_path / "c.yaml"
    p.write_text(tiny_yaml(**blocks))
    q = tmp_path / "m.yaml"
    q.write_text(tiny_yaml(mesh="model=2", **blocks))
    assert load_config(q).config.mesh == "model=2"
    assert cli.main(["eval", str(p), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    assert cli.main(["eval", str(q), "--out", str(tmp_path / "b"), "--no-progress"]) == 0

    def rows(d):
        return {r["key"]: r for r in map(json.loads, (tmp_path / d / "results.jsonl").read_text().splitlines())}

    a, b = rows("a"), rows("b")
    assert a.keys() == b.keys() and {r["metric"] for r in a.values()} >= {"ppl", "serving_ppl"}
    for k in a:
        assert b[k]["values"]["nll"] == pytest.approx(a[k]["values"]["nll"], rel=1e-5), a[k]["metric"]
