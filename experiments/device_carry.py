"""Move the cached model files to the lent GPU machine, whose calls carry at most 64 MiB each.

    # here: split the cached GGUFs (fetched with `kvq fetch-model NAME` first) into parts, one folder per call
    python experiments/device_carry.py pack --models smollm2-135m gemma3-270m --out .carry
    # device, one call per part, back to back (the machine keeps /tmp while it stays warm):
    #   run(command="python3 experiments/device_carry.py stash .carry/p00", carry=[".carry/p00"])
    #   ... p01, p02, ...
    # device, the last call (carry .carry/manifest.json): reassemble, check every part's and file's sha256,
    # place the files in $KVQ_CACHE_DIR
    python3 experiments/device_carry.py unpack --manifest .carry/manifest.json --cache /tmp/kvqcache

The files are concatenated in order and cut into parts of ``--part-bytes`` (default 50,000,000: a part plus the
working tree stays under a call's 64 MiB).  ``manifest.json`` records each file's name, size and sha256 and each
part's size and sha256; ``unpack`` refuses a missing or corrupt part (naming it and the call to repeat) and a file
whose sha256 differs, and writes each file under the name ``kvquant_jax.models.fetch`` looks for, so ``kvq
fetch-model NAME`` (and every ``--model NAME``) then finds it without a download.  The part folders are meant for
an ignored path (``.carry/`` in ``.git/info/exclude``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STASH = Path(os.environ.get("KVQ_CARRY_STASH", "/tmp/kvq_carry_parts"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def pack(files: list[tuple[str, Path]], out: Path, part_bytes: int = 50_000_000) -> dict:
    """Split ``files`` (``(model name, path)``, concatenated in order) into ``out/pNN/part`` + ``out/manifest.json``."""
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    out.mkdir(parents=True, exist_ok=True)
    entries = [{"model": m, "name": p.name, "size": p.stat().st_size, "sha256": _sha256(p)} for m, p in files]
    parts, buf, idx = [], bytearray(), 0

    def flush():
        nonlocal buf, idx
        d = out / f"p{idx:02d}"
        d.mkdir(exist_ok=True)
        (d / "part").write_bytes(bytes(buf))
        parts.append({"dir": d.name, "size": len(buf), "sha256": hashlib.sha256(buf).hexdigest()})
        buf, idx = bytearray(), idx + 1

    for _, p in files:
        with open(p, "rb") as f:
            while chunk := f.read(part_bytes - len(buf)):
                buf += chunk
                if len(buf) == part_bytes:
                    flush()
    if buf:
        flush()
    manifest = {"files": entries, "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def stash(part_dir: Path, stash_dir: Path = STASH) -> Path:
    """Copy one carried part folder's ``part`` to ``stash_dir/<folder name>`` (device side, one call per part)."""
    src = part_dir / "part"
    if not src.exists():
        raise FileNotFoundError(f"{src} is missing: carry {part_dir} in this call")
    stash_dir.mkdir(parents=True, exist_ok=True)
    dest = stash_dir / part_dir.name
    shutil.copyfile(src, dest)
    return dest


def unpack(manifest: dict, cache: Path, stash_dir: Path = STASH) -> list[Path]:
    """Check every stashed part, reassemble the files, check each file's sha256, write them into ``cache``."""
    for p in manifest["parts"]:
        f = stash_dir / p["dir"]
        if not f.exists():
            raise FileNotFoundError(f"part {p['dir']} is not in {stash_dir}: repeat its stash call (carry .carry/{p['dir']})")
        if f.stat().st_size != p["size"] or _sha256(f) != p["sha256"]:
            raise ValueError(f"part {p['dir']} in {stash_dir} is corrupt (size/sha256 differ from the manifest): "
                             f"repeat its stash call")
    cache.mkdir(parents=True, exist_ok=True)
    streams = (open(stash_dir / p["dir"], "rb") for p in manifest["parts"])
    cur, written = next(streams, None), []
    for e in manifest["files"]:
        tmp = cache / (e["name"] + ".part")
        left = e["size"]
        with open(tmp, "wb") as out:
            while left:
                if cur is None:
                    raise ValueError(f"the parts end before {e['name']} is complete")
                b = cur.read(min(left, 1 << 20))
                if not b:
                    cur.close()
                    cur = next(streams, None)
                    continue
                out.write(b)
                left -= len(b)
        got = _sha256(tmp)
        if got != e["sha256"]:
            tmp.unlink()
            raise ValueError(f"{e['name']}: sha256 {got} != {e['sha256']} after reassembly")
        dest = cache / e["name"]
        os.replace(tmp, dest)
        written.append(dest)
    if cur is not None:
        cur.close()
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--models", nargs="+", default=["smollm2-135m"])
    p.add_argument("--out", default=".carry")
    p.add_argument("--part-bytes", type=int, default=50_000_000)
    p = sub.add_parser("stash")
    p.add_argument("part_dir")
    p = sub.add_parser("unpack")
    p.add_argument("--manifest", default=".carry/manifest.json")
    p.add_argument("--cache", default=os.environ.get("KVQ_CACHE_DIR", "/tmp/kvqcache"))
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        from kvquant_jax.models.fetch import fetch_model

        m = pack([(n, Path(fetch_model(n))) for n in a.models], Path(a.out), a.part_bytes)
        print(f"{len(m['parts'])} parts in {a.out}: " + " ".join(p["dir"] for p in m["parts"]))
    elif a.cmd == "stash":
        print(f"stashed {stash(Path(a.part_dir))}")
    else:
        for f in unpack(json.loads(Path(a.manifest).read_text()), Path(a.cache)):
            print(f"placed {f}")


if __name__ == "__main__":
    main()
