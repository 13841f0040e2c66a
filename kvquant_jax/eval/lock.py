"""An exclusive, process-held lock on a sweep output directory (``DIR/.kvq.lock``).

Two ``kvq sweep`` / ``kvq eval --out`` processes on the same directory would both compute every row and append
duplicate keys; the second one is refused with a message naming the process that holds the lock.  The lock is an
``fcntl.flock`` on the lock file, so it is released by the kernel when the holder exits or is killed (a stale lock
file left behind by a killed run is not a lock).  Re-entrant within one process.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

LOCK_NAME = ".kvq.lock"
_held: dict[str, int] = {}          # resolved dir -> depth (this process)


class OutputLockedError(RuntimeError):
    """Another process is writing the same output directory."""


@contextlib.contextmanager
def output_lock(out_dir, what: str = "kvq"):
    """Hold the lock of ``out_dir`` (created if missing) for the ``with`` body; raise :class:`OutputLockedError`
    naming the holder's pid when another process holds it."""
    import fcntl

    out = Path(out_dir).resolve()
    key = str(out)
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            raise OutputLockedError(f"{what}: {out} is in use by another process ({holder}); wait for it to finish "
                                    f"or pick another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
