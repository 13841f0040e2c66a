"""Generation from a prefix cache (IntactKV / PrefixQuant), with hidden-prefix accounting (design notes 0x08C).

* A **visible** prefix (IntactKV: ``[BOS]`` or ``[BOS] + system block``) is part of the user's prompt: the prompt
  must start with the prefix ids (else the request is refused), only the rest is run, and reported prompt tokens
  include the prefix.
* A **hidden** prefix (PrefixQuant) is inserted method state: the whole prompt follows it, reported prompt tokens
  exclude it and ``hidden_prefix_tokens`` reports it separately.
Either way the prefix rows are real cache rows: positions of user tokens start at ``P``, the capacity and the
model's context length (``max_position``) must hold ``P + prompt + new`` rows, and a request that does not fit is
refused before anything runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from kvquant_jax.cache.interface import CacheScheme
from kvquant_jax.cache.prefix import PrefixArtifact, start_request
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.serving.generate import GenerationResult, bucket, check_fits, run_batch
from kvquant_jax.serving.sampling import SamplingParams


@dataclasses.dataclass
class PrefixAccounting:
    """Token and row accounting of one prefixed batch."""

    prefix_tokens: int            # P, rows at positions 0..P-1
    visibility: str               # "visible" | "hidden"
    prompt_tokens: list           # reported prompt tokens per request (visible prefix included, hidden excluded)
    hidden_prefix_tokens: int     # P for a hidden prefix, else 0
    run_tokens: list              # tokens actually run through the model per request (prompt minus visible prefix)
    cache_rows: list              # committed rows per request after generation (prefix rows included)
    capacity: int                 # total rows per sequence (prefix included)
    max_user_tokens: int          # prompt + new tokens a request may have at this capacity / context length

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def max_user_tokens(cfg: LlamaConfig, prefix_len: int, visibility: str, capacity: int) -> int:
    """Prompt + generated tokens one request may have: the hidden prefix takes rows from both the capacity and the
    context length; a visible prefix counts as prompt tokens."""
    room = min(capacity, cfg.max_position)
    return room - prefix_len if visibility == "hidden" else room


def generate_with_prefix(params, cfg: LlamaConfig, prompts: list[list[int]], artifact: PrefixArtifact,
                         body: CacheScheme | tuple, *, expect: Mapping[str, Any], max_new_tokens: int = 32,
                         capacity: int | None = None, sampling: SamplingParams = SamplingParams(), seed: int = 0,
                         eos_id: int | None = None) -> tuple[GenerationResult, PrefixAccounting]:
    """Generate for token-id prompts after the artifact's prefix rows (body rows stored under ``body``).

    Raises ``IncompatibleSchemaError`` for an artifact of another model / tokenizer / layout (``expect`` is the
    serving identity, :func:`kvquant_jax.cache.prefix.model_identity`), ``ValueError`` for a visible-prefix prompt
    that does not start with the prefix ids, an empty remainder, or a request over the capacity / context length
    (both count the prefix rows).
    """
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    p = artifact.prefix_len
    pre = list(artifact.token_ids)
    runs = []
    for i, ids in enumerate(prompts):
        ids = [int(t) for t in ids]
        if artifact.visibility == "visible":
            if ids[:p] != pre:
                raise ValueError(f"prompt {i} does not start with the visible prefix {pre} (starts {ids[:p]}); this "
                                 "prefix cannot serve it")
            ids = ids[p:]
        if not ids:
            raise ValueError(f"prompt {i} has no tokens after the prefix")
        runs.append(ids)
    lens = [len(r) for r in runs]
    need = p + max(lens) + max_new_tokens
    capacity = capacity or bucket(need, 64)
    check_fits(cfg, need, capacity, f"prefix of {p} rows + prompt of {max(lens)} tokens + {max_new_tokens} new "
               "tokens (the capacity and context length count the prefix rows)")
    cache = start_request(artifact, body, len(runs), capacity, expect=expect)
    res = run_batch(params, cfg, runs, cache, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                    eos_id=eos_id)
    cache = res.cache
    hidden = artifact.visibility == "hidden"
    acct = PrefixAccounting(
        prefix_tokens=p, visibility=artifact.visibility,
        prompt_tokens=[len(r) + (0 if hidden else p) for r in runs], hidden_prefix_tokens=p if hidden else 0,
        run_tokens=lens, cache_rows=np.asarray(cache.lengths).tolist(), capacity=capacity,
        max_user_tokens=max_user_tokens(cfg, p, artifact.visibility, capacity))
    return res, acct
