"""What every metric needs: the model (real or small random), its tokenizer and the tokenized corpora."""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from kvquant_jax.data import load_corpus
from kvquant_jax.models import load_model
from kvquant_jax.models.fixed_order import apply_numerics
from kvquant_jax.models.testing import random_params, tiny_config


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenizer of the random test models: id = byte + 3 (0..2 are pad/bos/eos)."""

    bos_id: int = 1
    eos_id: int = 2
    offset: int = 3
    hash: str = "bytes-v1"

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset).decode("utf-8", "replace")


@dataclasses.dataclass
class EvalModel:
    params: Any
    cfg: Any                       # LlamaConfig
    tokenizer: Any                 # .encode(text) / .decode(ids)
    sha256: str
    path: str


def load_eval_model(mc) -> EvalModel:
    """The model of a config ``model`` block (``reduction``: its projection numerics on ``cfg.activation``)."""
    if mc.name == "random":

        r = mc.random
        cfg = tiny_config(vocab_size=r.vocab_size, hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
                          num_layers=r.num_layers, num_heads=r.num_heads, num_kv_heads=r.num_kv_heads,
                          head_dim=r.head_dim, rope_theta=r.rope_theta, rope_pairing=mc.rope_pairing,
                          max_position=r.max_position, name=f"random-{r.seed}")
        params = random_params(cfg, seed=r.seed, dtype=mc.dtype)
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(params):
            h.update(np.asarray(leaf, np.float32).tobytes())
        return EvalModel(params=params, cfg=apply_numerics(cfg, mc.reduction), tokenizer=ByteTokenizer(),
                         sha256=h.hexdigest(), path=f"random:{dataclasses.asdict(r)}")
    m = load_model(mc.name, dtype=mc.dtype, rope_pairing=mc.rope_pairing)
    return EvalModel(params=m.params, cfg=apply_numerics(m.cfg, mc.reduction), tokenizer=m.tokenizer,
                     sha256=m.cfg.sha256, path=m.path)


@dataclasses.dataclass
class TokenizedCorpus:
    ids: np.ndarray                # int32 [N] (after the config's offset)
    name: str
    source: str
    sha256: str

    def take(self, n: int, count: int, what: str) -> np.ndarray:
        """int32 ``[count, n]``: ``count`` consecutive segments of ``n`` tokens from the start."""
        need = n * count
        if len(self.ids) < need:
            raise ValueError(f"{what}: needs {count} segment(s) of {n} tokens ({need}) but corpus {self.name} "
                             f"({self.source}) has {len(self.ids)} tokens")
        return self.ids[:need].reshape(count, n)


def tokenize_corpus(tokenizer, spec: str | None, split: str, fallback: bool, offset: int = 0) -> TokenizedCorpus:
    """Load and tokenize a corpus (``kvquant_jax.data.load_corpus``; a missing one names every path tried)."""
    c = load_corpus(spec, split=split, fallback=fallback)
    ids = np.asarray(tokenizer.encode(c.text), np.int32)[offset:]
    return TokenizedCorpus(ids=ids, name=c.name, source=c.source, sha256=c.sha256)
