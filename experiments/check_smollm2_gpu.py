"""SmolLM2 greedy tokens: the GPU serving path (defaults: kernel decode, serving layout) vs the CPU reference path.

    python experiments/check_smollm2_gpu.py --record tokens.json            # CPU: the reference tokens
    python experiments/check_smollm2_gpu.py --model M.gguf --expect tokens.json   # GPU: compare

Two prompts (the chat-templated France question and a fixed paragraph, :data:`TEXT`), 64 greedy tokens each
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
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvquant_jax.cache.registry import make_scheme  # noqa: E402
from kvquant_jax.models import load_model  # noqa: E402
from kvquant_jax.models.llama import unstack_layers  # noqa: E402
from kvquant_jax.quant.packing import unpack_bits  # noqa: E402
from kvquant_jax.serving.generate import generate  # noqa: E402

SCHEMES = ("bf16", "int4", "kivi2")


#: a fixed text (not a corpus file: WikiText may be absent on the device, and the built-in pydoc corpus differs
#: between Python 3.11 on the CPU and 3.12 on the device)
TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest structure "
        "in Paris. Its base is square, measuring 125 metres on each side. During its construction, the Eiffel "
        "Tower surpassed the Washington Monument to become the tallest man-made structure in the world, a title "
        "it held for 41 years until the Chrysler Building in New York City was finished in 1930. It was the "
        "first structure to reach a height of 300 metres. Due to the addition of a broadcasting aerial at the "
        "top of the tower in 1957, it is now taller than the Chrysler Building by 5.2 metres. Excluding "
        "transmitters, the Eiffel Tower is the second tallest free-standing structure in France after the "
        "Millau Viaduct.")


def prompts(tok):
    return [tok.encode_chat("What is the capital of France?"), tok.encode(TEXT)[:200]]


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


def dump_prefill(m, path: str) -> None:
    """The prompt caches of the chat prompt on ONE fixed path (reference attention, stacked layers), to compare
    devices: the float32 K/V (``fp32`` cache) and the int4 codes + scales, as ``.npz``."""
    ps = prompts(m.tokenizer)[:1]
    arrays = {}
    for spec in ("fp32", "int4"):
        scheme = make_scheme(spec, rope_theta=m.cfg.rope_theta, rope_pairing=m.cfg.rope_pairing)
        res = generate(m.params, m.cfg, ps, max_new_tokens=1, scheme=scheme, eos_id=-1, attention_impl="reference",
                       layer_groups="runs")
        (group,) = res.cache.groups
        n = int(res.cache.lengths[0]) - 1          # the prompt rows (the last row is the first generated token's)
        for name, leaf in vars(group).items():
            arrays[f"{spec}.{name}"] = np.asarray(leaf)[:, :, :, :n]
    np.savez(path, **arrays)


def compare_dumps(a_path: str, b_path: str) -> dict:
    """Device A vs device B prompt caches: float32 K/V relative difference, int4 codes that differ, and for each
    differing code how far the quantizer's input ``x / scale`` was from a rounding boundary (x.5)."""
    a, b = np.load(a_path), np.load(b_path)
    out = {}
    for t in "kv":
        xa, xb = a[f"fp32.{t}"].astype(np.float64), b[f"fp32.{t}"].astype(np.float64)
        rel = np.abs(xa - xb).max() / np.abs(xa).max()
        ca = np.asarray(unpack_bits(a[f"int4.{t}_codes"], 4, axis=-1, count=xa.shape[-1]))
        cb = np.asarray(unpack_bits(b[f"int4.{t}_codes"], 4, axis=-1, count=xa.shape[-1]))
        diff = ca != cb
        scale = a[f"int4.{t}_scale"].astype(np.float64)
        frac = np.abs(xa / scale) % 1.0
        dist = np.abs(frac[diff] - 0.5)
        out[t] = dict(fp32_max_rel_diff=float(rel), codes=int(ca.size), codes_differing=int(diff.sum()),
                      max_distance_to_boundary=float(dist.max()) if dist.size else None,
                      layers_with_difference=sorted({int(i) for i in np.nonzero(diff)[0]}))
        print(f"{t.upper()}: fp32 max rel diff {rel:.2e}; int4 codes differing {int(diff.sum())} / {ca.size}; "
              f"their |x/scale - (n + 0.5)| <= {out[t]['max_distance_to_boundary']}; layers "
              f"{out[t]['layers_with_difference'][:10]}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None, help="write the chat prompt's fp32 / int4 caches (one fixed path) here")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("A.npz", "B.npz"), help="compare two --dump files")
    ap.add_argument("--model", default=None)
    ap.add_argument("--record", default=None, help="write the reference-path tokens here")
    ap.add_argument("--expect", default=None, help="compare this device's default path with these tokens")
    ap.add_argument("--same-device", action="store_true",
                    help="also run the reference path HERE and compare the default path with it")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.compare:
        compare_dumps(*args.compare)
        return
    m = load_model(args.model)
    if args.dump:
        dump_prefill(m, args.dump)
        print(f"wrote {args.dump}")
        return
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
    if args.same_device:
        here = run(m, reference=True)
        for spec in SCHEMES:
            same = [a == b for a, b in zip(got[spec], here[spec])]
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                     for a, b in zip(got[spec], here[spec])]
            report[spec + "_same_device"] = dict(equal=all(same), first_difference=first)
            print(f"{spec}: default path == reference path on this device for 64 tokens: {same} (first diff {first})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "smollm2_greedy.json"), "w") as f:
            json.dump(dict(report=report, tokens=got), f)


if __name__ == "__main__":
    main()
