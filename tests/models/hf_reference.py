"""Shared helpers of the real-model tests: the tokenized WikiText-2 test split and transformers' model built from the
same GGUF (a plain module, not conftest: ``from conftest import`` would pick whichever conftest is first on
sys.path)."""
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return hf, tok
