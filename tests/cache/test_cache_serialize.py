"""Serialization: Orbax checkpoint and byte blob round-trip bit-exactly and refuse mismatched / corrupted input."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from kvquant_jax.cache import ops, serialize
from kvquant_jax.cache.schema import IncompatibleSchemaError

from cache_helpers import CASES, new_cache, rows


def _filled(case):
    rng = np.random.default_rng(11)
    cache = ops.append(new_cache(CASES[case]), rows(rng, 5, "mixed"), np.array([5, 3, 4]))
    for _ in range(6):
        cache = ops.append(cache, rows(rng, 1, "mixed"), np.array([1, 1, 0]))
    return cache


def _bit_equal(a, b):
    assert a.schemes == b.schemes and a.capacity == b.capacity
    assert (a.num_kv_heads, a.head_dim) == (b.num_kv_heads, b.head_dim)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("case", sorted(CASES))
def test_blob_round_trip_is_bit_exact(case):
    cache = _filled(case)
    back = serialize.from_bytes(serialize.to_bytes(cache), expect=cache)
    _bit_equal(cache, back)
    ops.validate(back)


@pytest.mark.parametrize("case", ["kivi2_official_r0", "fp8_e4m3_calibrated_skip0", "int4_g4"])
def test_orbax_round_trip_is_bit_exact(case, tmp_path):
    cache = _filled(case)
    serialize.save(tmp_path / "ckpt", cache)
    back = serialize.restore(tmp_path / "ckpt", expect=CASES[case])
    _bit_equal(cache, back)
    # the restored cache keeps working: same next append as the original
    more = rows(np.random.default_rng(12), 1)
    _bit_equal(ops.append(cache, more, 1), ops.append(back, more, 1))


def test_blob_rejections():
    cache = _filled("kivi2_official")
    blob = serialize.to_bytes(cache)
    with pytest.raises(serialize.CacheIntegrityError, match="sha256"):
        serialize.from_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))                 # one flipped payload bit
    with pytest.raises(serialize.CacheIntegrityError, match="truncated|trailing"):
        serialize.from_bytes(blob[:-3])
    with pytest.raises(serialize.CacheIntegrityError, match="magic"):
        serialize.from_bytes(b"NOTACACHE" + blob)
    # a request expecting another schema is refused, naming the differing field
    other = tuple(dataclasses.replace(s, residual=4) for s in CASES["kivi2_official"])
    with pytest.raises(IncompatibleSchemaError, match="residual"):
        serialize.from_bytes(blob, expect=other)
    with pytest.raises(IncompatibleSchemaError, match="calibration_id"):
        serialize.from_bytes(serialize.to_bytes(_filled("fp8_e4m3_calibrated_skip0")),
                             expect=tuple(dataclasses.replace(s, calibration_id="other") if hasattr(
                                 s, "calibration_id") else s for s in CASES["fp8_e4m3_calibrated_skip0"]))
    # an edited manifest (schema changed, checksum kept) is refused: first by the manifest's own hash (issue Q.8),
    # and with that hash recomputed by the schema-vs-scheme check
    n = int.from_bytes(blob[8:16], "little")
    man = json.loads(blob[16:16 + n])
    man["runs"][0]["schema"]["rope_theta"] = 500000.0
    head = json.dumps(man, sort_keys=True).encode()
    with pytest.raises(serialize.CacheIntegrityError, match="corrupt artifact.*manifest_sha256"):
        serialize.from_bytes(blob[:8] + len(head).to_bytes(8, "little") + head + blob[16 + n:])
    resigned = serialize._sign({k: v for k, v in man.items() if k != "manifest_sha256"})
    head = json.dumps(resigned, sort_keys=True).encode()
    with pytest.raises(IncompatibleSchemaError, match="rope_theta"):
        serialize.from_bytes(blob[:8] + len(head).to_bytes(8, "little") + head + blob[16 + n:])
    man["runs"][0]["schema"]["rope_theta"] = 10000.0
    man["runs"][0]["config"]["residual"] = 4
    man["runs"][0]["schema"]["residual"] = 4
    head = json.dumps(man, sort_keys=True).encode()
    with pytest.raises(serialize.CacheIntegrityError):
        serialize.from_bytes(blob[:8] + len(head).to_bytes(8, "little") + head + blob[16 + n:])


def test_orbax_rejections(tmp_path):
    cache = _filled("int8")
    path = tmp_path / "ckpt"
    serialize.save(path, cache)
    with pytest.raises(IncompatibleSchemaError, match="key.payload: .int8. != .int4."):
        serialize.restore(path, expect=CASES["int4_g4"])
    # tamper with the stored manifest: the checksum (or the schema check) refuses it
    files = [os.path.join(d, f) for d, _, fs in os.walk(path / "manifest") for f in fs]
    target = next(f for f in files if open(f, "rb").read(1) == b"{")
    man = json.load(open(target))
    man["capacity"] = man["capacity"]
    man["sha256"] = "0" * 64
    json.dump(man, open(target, "w"))
    with pytest.raises(serialize.CacheIntegrityError, match="sha256"):
        serialize.restore(path)
