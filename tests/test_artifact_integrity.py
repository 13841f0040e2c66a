"""Issue Q.8: every artifact kind signs its whole manifest (sha256 over the canonical JSON of every field but the
hash); a metadata edit or a flipped byte in any file of an Orbax directory gives a clear "corrupt artifact" error
(a ValueError), never a UnicodeDecodeError / KeyError, and never loads different values."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from kvquant_jax.integrity import CorruptArtifactError, canonical_json, manifest_digest, sign, verify

REPO = Path(__file__).resolve().parents[1]


def _files(root):
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def _flip(path, pos_frac, bit=0x80):
    data = bytearray(path.read_bytes())
    if not data:
        return False
    i = min(int(len(data) * pos_frac), len(data) - 1)
    data[i] ^= bit
    path.write_bytes(bytes(data))
    return True


def _each_flip(src, tmp_path, load, equal):
    """Flip one byte (two positions, two bit patterns) in every file of the artifact directory ``src`` in turn:
    loading either refuses with a ValueError saying "corrupt" / naming the problem, or returns values equal to the
    original (a flip in a file that holds no data, e.g. Orbax's commit marker)."""
    import shutil

    refused, n = 0, 0
    for rel in [p.relative_to(src) for p in _files(src)]:
        for frac, bit in ((0.5, 0x80), (0.1, 0x01)):
            n += 1
            dst = tmp_path / f"flip{n}"
            shutil.copytree(src, dst)
            if not _flip(dst / rel, frac, bit):
                continue
            try:
                got = load(dst)
            except ValueError as e:
                assert type(e).__name__ != "UnicodeDecodeError"
                refused += 1
                continue
            assert equal(got), f"a flipped byte in {rel} loaded different values"
    assert refused > 0


def test_canonical_json_excludes_only_the_hash():
    man = sign({"b": [1, 2.5, "x"], "a": {"z": None, "y": True}})
    assert json.loads(canonical_json(man)) == {"a": {"y": True, "z": None}, "b": [1, 2.5, "x"]}
    verify(man, "t", "here")
    for edit in ({"b": [1, 2.5, "y"]}, {"a": {"z": 0, "y": True}}, {"c": 1}):
        with pytest.raises(CorruptArtifactError, match="corrupt artifact"):
            verify({**man, **edit}, "t", "here")
    with pytest.raises(CorruptArtifactError, match="no manifest_sha256"):
        verify({"a": 1}, "t", "here")
    assert manifest_digest(man) == man["manifest_sha256"]


# ------------------------------------------------------------------------------------------------ W8A8 / generic

@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    from kvquant_jax.models import w8a8 as W
    from kvquant_jax.models.testing import random_params, tiny_config

    cfg = tiny_config(num_layers=1)
    pol = W.W8A8Policy(linears=("q", "k"))
    qp = W.quantize_params(random_params(cfg, seed=4), pol)
    path = tmp_path_factory.mktemp("w8") / "ck"
    W.save(qp, pol, path, model_sha256="abc")
    return path, qp, pol


def _w8_equal(qp):
    def eq(got):
        a, b = jax.tree.leaves(qp), jax.tree.leaves(got[0])
        return len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    return eq


def test_w8a8_manifest_edit_is_refused(w8a8, tmp_path):
    import shutil

    from kvquant_jax.models import w8a8 as W

    path, qp, pol = w8a8
    got, pol2 = W.restore(path)
    assert pol2 == pol and _w8_equal(qp)((got, pol2))
    dst = tmp_path / "edited"
    shutil.copytree(path, dst)
    man = json.loads((dst / "manifest.json").read_text())
    man["policy"]["decode"] = "w8a8"                      # a metadata-only edit (the arrays are untouched)
    (dst / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptArtifactError, match="corrupt artifact.*metadata field was edited"):
        W.restore(dst)


def test_w8a8_byte_flips_in_the_orbax_directory(w8a8, tmp_path):
    from kvquant_jax.models import w8a8 as W

    path, qp, _ = w8a8
    _each_flip(path, tmp_path, W.restore, _w8_equal(qp))


# ------------------------------------------------------------------------------------------------ prefix artifacts

@pytest.fixture(scope="module")
def prefix_art(tmp_path_factory):
    from kvquant_jax.cache.prefix import PrefixArtifact, PrefixIdentity, save_artifact

    rng = np.random.default_rng(2)
    idn = PrefixIdentity(model_sha256="m" * 8, tokenizer_hash="t", prefix_token_ids=(1, 2, 3), compute_dtype="fp32",
                         num_layers=2, num_kv_heads=2, head_dim=4, rope_theta=10000.0, rope_pairing="half_split")
    k = rng.standard_normal((2, 2, 3, 4)).astype(np.float32)
    art = PrefixArtifact(k=k, v=-k + 0.5, identity=idn, kind="prefixquant", visibility="hidden",
                         provenance={"eta": 64.0})
    return save_artifact(art, tmp_path_factory.mktemp("pre") / "art"), art


@pytest.mark.parametrize("edit", [("visibility", "visible"), ("provenance", {"eta": 1.0})])
def test_prefix_manifest_edit_is_refused(prefix_art, tmp_path, edit):
    """visibility and provenance are not part of the artifact id: before the manifest hash, editing them loaded."""
    import shutil

    from kvquant_jax.cache.prefix import load_artifact

    path, art = prefix_art
    assert load_artifact(path).same_tensors(art)
    dst = tmp_path / "edited"
    shutil.copytree(path, dst)
    man = json.loads((dst / "manifest.json").read_text())
    man[edit[0]] = edit[1]
    (dst / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptArtifactError, match="corrupt artifact"):
        load_artifact(dst)


def test_prefix_byte_flips(prefix_art, tmp_path):
    from kvquant_jax.cache.prefix import load_artifact

    path, art = prefix_art
    _each_flip(path, tmp_path, load_artifact,
               lambda got: got.same_tensors(art) and got.visibility == art.visibility and got.kind == art.kind)


# ------------------------------------------------------------------------------------------------ FP8 scales

def _fp8_cal(seed=0):
    import hashlib

    from kvquant_jax.eval.calib import Fp8Calibration

    rng = np.random.default_rng(seed)
    k, v = rng.uniform(0.5, 9, (2, 2)).astype(np.float32), rng.uniform(0.5, 9, (2, 2)).astype(np.float32)
    digest = hashlib.sha256(k.tobytes() + v.tobytes()).hexdigest()[:12]
    return Fp8Calibration(calibration_id=f"observed:abcdefabcdef:64:{digest}", source="test", k_amax=k, v_amax=v)


def test_fp8_scales_signed_and_checked(tmp_path):
    from kvquant_jax.eval.calib import load_fp8_artifact, save_fp8_artifact

    cal = _fp8_cal()
    p = tmp_path / "s.npz"
    save_fp8_artifact(cal, p)
    back = load_fp8_artifact(p, 2)
    assert back.calibration_id == cal.calibration_id and np.array_equal(back.k_amax, cal.k_amax)
    with np.load(p) as z:
        d = {k: z[k] for k in z.files}
    # a changed array (with the manifest kept) and a changed id are both refused
    np.savez(tmp_path / "a.npz", **{**d, "k_amax": d["k_amax"] * 2})
    with pytest.raises(CorruptArtifactError, match="k_amax"):
        load_fp8_artifact(tmp_path / "a.npz", 2)
    np.savez(tmp_path / "b.npz", **{**d, "calibration_id": np.asarray("observed:x:1:y")})
    with pytest.raises(CorruptArtifactError, match="calibration_id"):
        load_fp8_artifact(tmp_path / "b.npz", 2)
    man = json.loads(str(d["manifest"]))
    man["source"] = "elsewhere"
    np.savez(tmp_path / "c.npz", **{**d, "manifest": np.asarray(json.dumps(man))})
    with pytest.raises(CorruptArtifactError, match="metadata field was edited"):
        load_fp8_artifact(tmp_path / "c.npz", 2)
    # an unsigned observed file must hash to its id; a hand-made unsigned file is named by its bytes
    np.savez(tmp_path / "d.npz", calibration_id=np.asarray(cal.calibration_id), k_amax=cal.k_amax * 3,
             v_amax=cal.v_amax)
    with pytest.raises(CorruptArtifactError, match="hash to"):
        load_fp8_artifact(tmp_path / "d.npz", 2)
    np.savez(tmp_path / "e.npz", calibration_id=np.asarray("my-scales"), k_scale=np.ones(2), v_scale=np.ones(2))
    import hashlib

    want = "my-scales@sha256:" + hashlib.sha256((tmp_path / "e.npz").read_bytes()).hexdigest()[:16]
    assert load_fp8_artifact(tmp_path / "e.npz", 2).calibration_id == want
    (tmp_path / "f.npz").write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(CorruptArtifactError, match="corrupt artifact"):
        load_fp8_artifact(tmp_path / "f.npz", 2)


def test_committed_fp8_scales_still_load():
    from kvquant_jax.eval.calib import load_fp8_artifact

    p = REPO / "docs/results/fp8/fp8_scales_585887e7c1c9.npz"
    with np.load(p) as z:
        n = z["k_amax"].shape[0]
    cal = load_fp8_artifact(p, n)
    assert cal.calibration_id.endswith(":585887e7c1c9")


# ------------------------------------------------------------------------------------------------ cache checkpoints

@pytest.fixture(scope="module")
def cache_ck(tmp_path_factory):
    from kvquant_jax.cache import ops, serialize
    from kvquant_jax.cache.interface import init_cache
    from kvquant_jax.cache.registry import make_scheme

    rng = np.random.default_rng(8)
    cache = init_cache(make_scheme("int4"), num_layers=2, batch=2, capacity=8, num_kv_heads=2, head_dim=8)
    pairs = [(rng.standard_normal((2, 3, 2, 8)).astype(np.float32),
              rng.standard_normal((2, 3, 2, 8)).astype(np.float32)) for _ in range(2)]
    cache = ops.append(cache, pairs, np.array([3, 2]))
    path = tmp_path_factory.mktemp("cc") / "ck"
    serialize.save(path, cache)
    return path, cache


def _cache_equal(cache):
    def eq(got):
        return all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                   for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(got)))
    return eq


def test_cache_checkpoint_byte_flips(cache_ck, tmp_path):
    from kvquant_jax.cache import serialize

    path, cache = cache_ck
    assert _cache_equal(cache)(serialize.restore(path))
    _each_flip(path, tmp_path, serialize.restore, _cache_equal(cache))


def test_cache_blob_manifest_is_signed(cache_ck):
    from kvquant_jax.cache import serialize

    _, cache = cache_ck
    blob = serialize.to_bytes(cache)
    assert _cache_equal(cache)(serialize.from_bytes(blob))
    n = int.from_bytes(blob[8:16], "little")
    man = json.loads(blob[16:16 + n])
    assert man["manifest_sha256"] == manifest_digest({k: v for k, v in man.items() if k != "sha256"})
    for i in range(0, len(blob), max(1, len(blob) // 97)):
        bad = bytearray(blob)
        bad[i] ^= 0x80
        try:
            got = serialize.from_bytes(bytes(bad))
        except ValueError as e:
            assert type(e).__name__ != "UnicodeDecodeError"
            continue
        assert _cache_equal(cache)(got), f"byte {i}"
