"""Perplexity with transformers' convention (the documented default of ``kvq ppl``).

The whole corpus is tokenized once with no BOS, cut into contiguous ``seq_len`` segments, and each segment is
scored independently: mean NLL over its ``seq_len - 1`` next-token predictions; ppl = exp(mean over segments).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.fixed_order import is_fixed_order
from kvquant_jax.models.llama import forward_nocache, token_nll  # noqa: F401  (token_nll: public here too)


def segments(ids: list[int], seq_len: int, max_segments: int | None, *, bos_id: int | None = None) -> np.ndarray:
    """int32 [N, seq_len] contiguous segments (the last partial one dropped). With ``bos_id``, each segment is
    ``[bos] + seq_len - 1 tokens`` (the BOS position is not scored)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    step = seq_len if bos_id is None else seq_len - 1
    n = len(ids) // step
    if max_segments is not None:
        if isinstance(max_segments, bool) or not isinstance(max_segments, int) or max_segments < 1:
            raise ValueError(f"max_segments must be an integer >= 1 (or None for all), got {max_segments!r}")
        n = min(n, max_segments)
    if n == 0:
        raise ValueError(f"corpus has {len(ids)} tokens, fewer than one segment of {seq_len}")
    a = np.asarray(ids[: n * step], np.int32).reshape(n, step)
    if bos_id is not None:
        a = np.concatenate([np.full((n, 1), bos_id, np.int32), a], axis=1)
    return a


@functools.partial(jax.jit, static_argnames=("cfg",))
def _segment_nll(params, cfg: LlamaConfig, tokens):
    return token_nll(forward_nocache(params, cfg, tokens), tokens, fixed=is_fixed_order(cfg.activation))


@dataclasses.dataclass
class PplResult:
    ppl: float
    nll: float
    tokens: int           # scored predictions
    segments: int
    seq_len: int
    bos: bool
    seconds: float
    segment_nll: list

    def as_dict(self):
        return dataclasses.asdict(self)


def perplexity(params, cfg: LlamaConfig, ids: list[int], *, seq_len: int = 1024, max_segments: int | None = 8,
               batch_size: int = 1, bos_id: int | None = None, nll_fn=None, progress: bool = False) -> PplResult:
    """Perplexity over contiguous segments. ``nll_fn(params, cfg, tokens[B, T]) -> nll[B, T-1]`` may replace the
    full-precision forward (quantized-cache evaluation paths plug in here)."""
    segs = segments(ids, seq_len, max_segments, bos_id=bos_id)
    fn = nll_fn or _segment_nll
    t0 = time.perf_counter()
    per_seg = []
    it = range(0, len(segs), batch_size)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="ppl", unit="batch")
    for i in it:
        nll = np.asarray(fn(params, cfg, jnp.asarray(segs[i:i + batch_size])), np.float64)
        per_seg.extend(nll.mean(axis=1).tolist())
    mean = float(np.mean(per_seg))
    scored = len(per_seg) * (seq_len - 1)
    return PplResult(ppl=math.exp(mean), nll=mean, tokens=scored, segments=len(per_seg), seq_len=seq_len,
                     bos=bos_id is not None, seconds=time.perf_counter() - t0, segment_nll=per_seg)
