"""Shared helpers of the real-model tests: the tokenized WikiText-2 test split and transformers' model built from the
same GGUF (a plain module, not conftest: ``from conftest import`` would pick whichever conftest is first on
sys.path)."""
import contextlib

import pytest


def wiki_test_ids(model, wikitext_test_path) -> list[int]:
    """The whole WikiText-2 test split tokenized by ``model``'s tokenizer (no special tokens)."""
    from kvquant_jax.data import load_corpus

    return model.tokenizer.encode(load_corpus(str(wikitext_test_path)).text)


def transformers_from_gguf(model):
    """transformers' fp32 model and tokenizer built from the same GGUF as ``model`` (a ``LoadedModel``); skips
    without the ``ref`` extra."""
    from pathlib import Path

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    p = Path(model.path)
    with _one_gguf_parse():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return hf, tok


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers reads the GGUF three times (model config, model tensors, tokenizer config + vocabulary), each
    time building a fresh ``gguf.GGUFReader`` (~30 s for Gemma-3's 262144-token vocabulary, all of it per-field
    numpy views). The reader is a read-only memmap view of the file, so within this block one reader per path is
    built and handed to all three: transformers still parses and converts the file itself, once."""
    import gguf

    orig, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = orig(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = orig
