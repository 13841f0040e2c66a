"""experiments/device_carry.py: the model files split into call-sized parts and reassembled bit for bit on the
other side; a missing or corrupt part is named, a file whose bytes differ is refused."""
import json
import os

import numpy as np
import pytest

from experiment_scripts import load_experiment


@pytest.fixture(scope="module")
def dc():
    return load_experiment("device_carry")


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    out = []
    for name, n in (("a.gguf", 2500), ("b.gguf", 1001)):          # the part boundary falls inside both files
        p = tmp_path / "src" / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        out.append((name.split(".")[0], p))
    return out


def _carry(dc, files, tmp_path, part_bytes=1000):
    m = dc.pack(files, tmp_path / "carry", part_bytes)
    stash = tmp_path / "stash"
    for p in m["parts"]:
        dc.stash(tmp_path / "carry" / p["dir"], stash)
    return m, stash


def test_pack_stash_unpack_round_trip(dc, files, tmp_path):
    m, stash = _carry(dc, files, tmp_path)
    assert [p["size"] for p in m["parts"]] == [1000, 1000, 1000, 501]
    assert json.loads((tmp_path / "carry" / "manifest.json").read_text()) == m
    placed = dc.unpack(m, tmp_path / "cache", stash)
    assert [p.name for p in placed] == ["a.gguf", "b.gguf"]
    for (_, src), dst in zip(files, placed):
        assert dst.read_bytes() == src.read_bytes()
    assert not list((tmp_path / "cache").glob("*.part"))


def test_missing_and_corrupt_parts_are_named(dc, files, tmp_path):
    m, stash = _carry(dc, files, tmp_path)
    os.remove(stash / "p02")
    with pytest.raises(FileNotFoundError, match="part p02 .*repeat its stash call"):
        dc.unpack(m, tmp_path / "cache", stash)
    dc.stash(tmp_path / "carry" / "p02", stash)
    b = bytearray((stash / "p01").read_bytes())
    b[7] ^= 1
    (stash / "p01").write_bytes(bytes(b))
    with pytest.raises(ValueError, match="part p01 .* corrupt"):
        dc.unpack(m, tmp_path / "cache", stash)


def test_a_file_that_does_not_reassemble_is_refused(dc, files, tmp_path):
    m, stash = _carry(dc, files, tmp_path)
    m["files"][1]["sha256"] = "0" * 64                 # the manifest's file digest disagrees with the bytes
    with pytest.raises(ValueError, match="b.gguf: sha256"):
        dc.unpack(m, tmp_path / "cache", stash)
    assert (tmp_path / "cache" / "a.gguf").exists() and not (tmp_path / "cache" / "b.gguf").exists()


def test_stash_without_the_carried_part_says_so(dc, tmp_path):
    with pytest.raises(FileNotFoundError, match="carry"):
        dc.stash(tmp_path / "p00", tmp_path / "stash")
