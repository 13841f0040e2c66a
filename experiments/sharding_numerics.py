"""Where sharded and single-device results differ, and by how much: teacher-forced logits of a prefill + decode run
through a cache, for each mesh and projection numerics (``fast`` / ``fixed_order``), against the unsharded run of
the same numerics.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/sharding_numerics.py --model tiny
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/sharding_numerics.py --model smollm2 \
        --meshes data=1,model=3 data=2,model=3 data=2,model=1 --cache fp32 int4

Per row: ``rel`` = max over steps of max |logit - logit_ref| / max |logit_ref| (the step's logits over batch and
vocabulary), ``exact`` = fraction of steps whose logits are bit-identical, ``tok`` = teacher-forced argmax equal at
every step.  Prints one JSON line per row (and a markdown table at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvquant_jax import sharding as S  # noqa: E402
from kvquant_jax.cache.registry import make_policy  # noqa: E402
from kvquant_jax.eval.policy import as_policy  # noqa: E402
from kvquant_jax.models.fixed_order import NUMERICS, apply_numerics  # noqa: E402
from kvquant_jax.models.llama import forward_jit  # noqa: E402

TINY = dict(vocab_size=128, num_heads=8, num_kv_heads=8, hidden_size=64, intermediate_size=128, num_layers=2,
            head_dim=32)


def step_logits(params, cfg, policy, prompt, forced, mesh) -> np.ndarray:
    """float32 [n + 1, B, V]: the prefill's last logits, then one decode step per column of ``forced [B, n]``."""
    b, p = prompt.shape
    with S.mesh_context(mesh):
        pm = params if mesh is None else S.place_params(params, cfg, mesh)
        cache = policy.init(cfg, b, p + forced.shape[1] + 1)
        logits, cache, _ = forward_jit(pm, cfg, jnp.asarray(prompt), cache, jnp.full((b,), p, jnp.int32))
        out = [np.asarray(logits[:, -1])]
        for i in range(forced.shape[1]):
            logits, cache, _ = forward_jit(pm, cfg, jnp.asarray(forced[:, i:i + 1]), cache, jnp.ones((b,), jnp.int32))
            out.append(np.asarray(logits[:, 0]))
    return np.stack(out)


def compare(got: np.ndarray, ref: np.ndarray) -> dict:
    """rel (max over steps of max|Δ| / max|ref|), exact (fraction of bit-identical steps), tok (argmax equal)."""
    rel = np.abs(got - ref).max(axis=(1, 2)) / np.abs(ref).max(axis=(1, 2))
    return {"rel": float(rel.max()), "exact": float(np.mean([np.array_equal(g, r) for g, r in zip(got, ref)])),
            "tok": bool((got.argmax(-1) == ref.argmax(-1)).all())}


def load(model: str):
    if model == "tiny":
        from kvquant_jax.models.testing import random_params, tiny_config
        cfg = tiny_config(**TINY)
        return cfg, random_params(cfg, seed=1), None
    from kvquant_jax.models import load_model
    m = load_model()
    return m.cfg, m.params, m.tokenizer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--meshes", nargs="+", default=["data=1,model=1", "data=1,model=2", "data=1,model=4",
                                                    "data=1,model=8", "data=2,model=4", "data=8,model=1"])
    ap.add_argument("--cache", nargs="+", default=["fp32", "int4"])
    ap.add_argument("--numerics", nargs="+", default=list(NUMERICS), choices=NUMERICS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args(argv)
    cfg0, params, _ = load(a.model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg0.vocab_size, (a.batch, a.prompt)).astype(np.int32)
    forced = rng.integers(3, cfg0.vocab_size, (a.batch, a.steps)).astype(np.int32)
    rows = []
    for numerics in a.numerics:
        cfg = apply_numerics(cfg0, numerics)
        for spec in a.cache:
            policy = as_policy(make_policy(spec, cfg.num_layers, rope_theta=cfg.rope_theta,
                                           rope_pairing=cfg.rope_pairing))
            ref = step_logits(params, cfg, policy, prompt, forced, None)
            for mesh in a.meshes:
                got = step_logits(params, cfg, policy, prompt, forced, S.make_mesh(mesh))
                row = {"model": a.model, "numerics": numerics, "cache": spec, "mesh": mesh, **compare(got, ref)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| numerics | cache | mesh | rel | exact steps | argmax equal |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['numerics']} | {r['cache']} | {r['mesh']} | {r['rel']:.2e} | {r['exact']:.2f} | {r['tok']} |")


if __name__ == "__main__":
    main()
