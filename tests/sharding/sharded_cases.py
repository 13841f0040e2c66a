"""Shared by the sharded-model tests (test_sharded_model.py: tiny random model; test_sharded_smollm2.py): the decode
length, the small-group KIVI-2 spec and one prefill + decode run on a mesh or on one device."""
from __future__ import annotations

import numpy as np

from kvquant_jax import sharding as S
from kvquant_jax.eval.quantized_ppl import decode

# 32 decode steps (64 until 2026-12-02; the fixed-order runs are run-time bound: SmolLM2's 30 layers x 64 steps
# took ~35 s per single-device run on CI's CPU, compile ~40 s).  With KIVI-2 at group 8 / residual 8 (the "kivi"
# closure rule: K closes each full 8-row residual chunk, V every row past the residual) a 32-step decode closes K
# 4 times during decode (prompt 12: length 44, 40 K rows / 5 groups closed; SmolLM2's prompt 5: 37, 32 K rows)
# and V on every step after the first few, so the sharded quantize-on-close path runs many times.
N = 32
KIVI2 = "kivi2:group_size=8,v_group_size=8,residual=8"       # small groups: 32 steps close many K/V groups


def run_decode(cfg, params, policy, mesh, prompt, targets, *, logprobs=False):
    """(greedy tokens [B, N], serving-path NLL [B, N], teacher-forced log-probabilities [B, N, V] or None) through
    one compiled prefill + decode scan (greedy and teacher-forced runs share it)."""
    with S.mesh_context(mesh):
        p = params if mesh is None else S.place_params(params, cfg, mesh)
        greedy = decode(p, cfg, policy, prompt, N, free_running=True, return_logprobs=logprobs)["argmax"]
        tf = decode(p, cfg, policy, prompt, N, targets=targets, return_logprobs=logprobs)
    return greedy, tf["nll"], (np.asarray(tf["logprobs"]) if logprobs else None)
