"""Corpora: WikiText-2 from ``$KVQ_DATA_DIR`` or ``../shared/data``, any text file, or a built-in fallback.

The fallback needs no download: the English help text that ships with CPython (``pydoc_data.topics``).
Every corpus comes with its sha256 and a description of where it came from, for result provenance.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

SPLITS = {"test": "wikitext2/wiki.test.raw", "validation": "wikitext2/wiki.valid.tokens"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    text: str
    name: str
    source: str     # path or "builtin:pydoc_data.topics"
    sha256: str


class CorpusNotFound(FileNotFoundError):
    pass


def data_dirs() -> list[Path]:
    """Candidate data directories in priority order."""
    out = []
    if os.environ.get("KVQ_DATA_DIR"):
        out.append(Path(os.environ["KVQ_DATA_DIR"]))
    repo = Path(__file__).resolve().parents[1]
    out += [repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data"]
    seen, uniq = set(), []
    for p in out:
        r = p.resolve()
        if r not in seen:
            seen.add(r)
            uniq.append(p)
    return uniq


def _corpus_from_file(path: Path, name: str) -> Corpus:
    raw = path.read_bytes()
    # Universal newlines (as ``open(path).read()``): "\r\n" and lone "\r" become "\n". The sha256 is of the bytes.
    text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    return Corpus(text=text, name=name, source=str(path), sha256=hashlib.sha256(raw).hexdigest())


def builtin_corpus() -> Corpus:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return Corpus(text=text, name="builtin-pydoc-topics", source="builtin:pydoc_data.topics",
                  sha256=hashlib.sha256(text.encode()).hexdigest())


def load_corpus(spec: str | None = None, *, split: str = "test", fallback: bool = True) -> Corpus:
    """``spec``: a file path, "wikitext2", "builtin", or None (WikiText-2 ``split`` if found, else the fallback).

    Raises :class:`CorpusNotFound` naming every path tried when nothing is found and ``fallback`` is False.
    """
    if spec == "builtin":
        return builtin_corpus()
    if spec and spec != "wikitext2":
        p = Path(spec).expanduser()
        if not p.is_file():
            raise CorpusNotFound(f"corpus file not found: {p}")
        return _corpus_from_file(p, p.name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    tried = []
    for d in data_dirs():
        f = d / SPLITS[split]
        tried.append(str(f))
        if f.is_file():
            return _corpus_from_file(f, f"wikitext2-{split}")
    if spec == "wikitext2" or not fallback:
        raise CorpusNotFound(f"WikiText-2 {split} split not found; tried: {', '.join(tried)} "
                             f"(set KVQ_DATA_DIR)")
    return builtin_corpus()
