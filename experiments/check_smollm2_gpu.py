"""SmolLM2 greedy tokens: the GPU serving path (defaults: kernel decode, serving layout) vs the CPU reference path.

    python experiments/check_smollm2_gpu.py --record tokens.json            # CPU: the reference tokens
    python experiments/check_smollm2_gpu.py --model M.gguf --expect tokens.json   # GPU: compare

Two prompts (the chat-templated France question and 200 tokens of the built-in corpus), 64 greedy tokens each
(EOS ignored), caches bf16 / int4 / kivi2, float32 weights. The reference run uses ``attention_impl="reference"``,
stacked params and stacked cache groups (the CPU path); the checked run uses ``generate``'s defaults on the
device it runs on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.data import load_corpus  # noqa: E402
from kvquant_jax.models import load_model  # noqa: E402
from kvquant_jax.models.llama import unstack_layers  # noqa: E402
from kvquant_jax.serving.generate import generate  # noqa: E402

SCHEMES = ("bf16", "int4", "kivi2")


def prompts(tok):
    return [tok.encode_chat("What is the capital of France?"), tok.encode(load_corpus(None).text)[:200]]


def run(m, reference: bool) -> dict:
    out = {}
    ps = prompts(m.tokenizer)
    params = m.params if reference else unstack_layers(m.params)
    for spec in SCHEMES:
        scheme = make_scheme(spec, rope_theta=m.cfg.rope_theta, rope_pairing=m.cfg.rope_pairing)
        kw = dict(attention_impl="reference", layer_groups="runs") if reference else {}
        res = generate(params, m.cfg, ps, max_new_tokens=64, scheme=scheme, eos_id=-1, **kw)
        out[spec] = res.tokens
        print(f"{spec}: {[m.tokenizer.decode(t[:12]) for t in res.tokens]}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--record", default=None, help="write the reference-path tokens here")
    ap.add_argument("--expect", default=None, help="compare this device's default path with these tokens")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    m = load_model(args.model)
    print(f"{jax.devices()[0]} JAX {jax.__version__}, model {m.cfg.name}", flush=True)
    if args.record:
        with open(args.record, "w") as f:
            json.dump(run(m, reference=True), f)
        return
    got = run(m, reference=False)
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    if args.expect:
        want = json.load(open(args.expect))
        for spec in SCHEMES:
            same = [a == b for a, b in zip(got[spec], want[spec])]
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                     for a, b in zip(got[spec], want[spec])]
            report[spec] = dict(equal=all(same), first_difference=first)
            print(f"{spec}: GPU default path == CPU reference path for 64 tokens: {same} (first diff {first})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "smollm2_greedy.json"), "w") as f:
            json.dump(dict(report=report, tokens=got), f)


if __name__ == "__main__":
    main()
