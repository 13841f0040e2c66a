"""Greedy-decode agreement with full precision over a long generation (generation quality and stability).

For each corpus prompt: the full-precision cache generates ``N`` greedy tokens ``G`` (the reference).  The
quantized cache then

* generates freely (greedy, its own tokens fed back): ``match`` = fraction of the ``N`` positions where its token
  equals ``G``'s, ``first_divergence`` = first differing position (``N`` when none);
* is teacher-forced on ``G`` (fed the reference tokens): ``top1`` = fraction of steps whose argmax is ``G``'s
  next token, and ``nll`` = mean NLL of ``G`` -- per-step agreement that a single early divergence cannot hide.

The first generated token comes from the prefill's last logits, computed with exact attention for every scheme,
so it always agrees and is not counted.
"""
from __future__ import annotations

import numpy as np

from kvquant_jax.eval.quantized_ppl import decode


def reference_generation(params, cfg, prompts, baseline, n: int) -> np.ndarray:
    """int32 [B, n + 1]: the baseline's greedy continuation (first token from the prefill)."""
    out = decode(params, cfg, baseline, prompts, n, free_running=True)
    return np.concatenate([out["first"][:, None], out["argmax"]], axis=1)


def greedy_agreement(params, cfg, prompts, policy, reference: np.ndarray) -> dict:
    """Agreement of ``policy`` with ``reference`` (from :func:`reference_generation`) on ``prompts`` [B, P]."""
    n = reference.shape[1] - 1
    free = decode(params, cfg, policy, prompts, n, free_running=True)
    gen = free["argmax"]                                            # [B, n]
    same = gen == reference[:, 1:]
    first_div = [int(np.argmin(r)) if not r.all() else n for r in same]
    forced = decode(params, cfg, policy, prompts, n, targets=reference)
    top1 = forced["argmax"] == reference[:, 1:]
    return {"match": float(same.mean()), "first_divergence": first_div,
            "mean_first_divergence": float(np.mean(first_div)), "top1": float(top1.mean()),
            "nll_of_reference": float(forced["nll"].mean()), "new_tokens": n}
