"""Shared by the sharded-model tests (test_sharded_model.py: tiny random model; test_sharded_smollm2.py): the decode
length, the small-group KIVI-2 spec and one prefill + decode run on a mesh or on one device."""
from __future__ import annotations

import numpy as np

from kvquant_jax import sharding as S
from kvquant_jax.eval.quantized_ppl import decode

N = 64
KIVI2 = "kivi2:group_size=8,v_group_size=8,residual=16"      # small groups: 64 steps close many K/V groups


def run_decode(cfg, params, policy, mesh, prompt, targets, *, logprobs=False):
    """(greedy tokens [B, N], serving-path NLL [B, N], teacher-forced log-probabilities [B, N, V] or None) through
    one compiled prefill + decode scan (greedy and teacher-forced runs share it)."""
    with S.mesh_context(mesh):
        p = params if mesh is None else S.place_params(params, cfg, mesh)
        greedy = decode(p, cfg, policy, prompt, N, free_running=True, return_logprobs=logprobs)["argmax"]
        tf = decode(p, cfg, policy, prompt, N, targets=targets, return_logprobs=logprobs)
    return greedy, tf["nll"], (np.asarray(tf["logprobs"]) if logprobs else None)
