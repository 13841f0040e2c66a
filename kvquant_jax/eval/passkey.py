"""Passkey retrieval: a random number hidden at a depth of a repetitive filler context; greedy decode must
return it (EOS is not special: exactly ``max_new_tokens`` greedy tokens are generated).

Prompt (token ids are concatenated piece by piece, so a context has exactly the requested length)::

    <intro> <filler> x n_before  <needle: "The pass key is 12345. Remember it. 12345 is the pass key.">
            <filler> x n_after  <question: "What is the pass key? The pass key is">

``depth`` 0 puts the needle right after the intro, 1 right before the question.  The answer is correct when the
first run of digits in the greedy continuation equals the key.  The whole prompt is prefilled in one forward
(exact attention among its tokens, as a serving prefill), so the cache representation matters from the first
decode step: every generated token reads the needle from the stored (quantized) history.
"""
from __future__ import annotations

import re

import numpy as np

from kvquant_jax.eval import quantized_ppl

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"


def make_prompt(tokenizer, length: int, depth: float, key: str) -> list[int]:
    """Token ids of a passkey prompt of exactly ``length`` tokens (filler cut to fit) with the needle at ``depth``."""
    intro = tokenizer.encode(INTRO)
    filler = tokenizer.encode(FILLER)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"passkey length {length} is shorter than the fixed text ({length - room} tokens)")
    reps = -(-room // len(filler))
    fill = (filler * reps)[:room]
    cut = min(room, len(filler) * int(round(depth * room / len(filler))))   # on a filler sentence boundary
    return intro + fill[:cut] + needle + fill[cut:] + question


def draw_trials(rng: np.random.Generator, num_depths: int, trials: int, digits: int) -> list[tuple[int, str]]:
    """One length's trials ``[(depth index, key), ...]``, depth-major then trial, each key a random
    ``digits``-digit number drawn from ``rng`` (the order :func:`passkey_accuracy` consumes the stream in)."""
    lo, hi = 10 ** (digits - 1), 10 ** digits
    return [(di, str(rng.integers(lo, hi))) for di in range(num_depths) for _ in range(trials)]


def first_number(text: str) -> str:
    m = re.search(r"\d+", text)
    return m.group(0) if m else ""


def passkey_accuracy(params, cfg, tokenizer, policy, *, lengths, depths, trials: int, digits: int,
                     max_new_tokens: int, batch_size: int, seed: int) -> dict:
    """Accuracy per (length, depth) cell over ``trials`` random keys.

    Returns dict(lengths, depths, accuracy [len][depth], mean, answers [len][depth][trial] (generated text))."""
    rng = np.random.default_rng(seed)
    acc = np.zeros((len(lengths), len(depths)))
    answers = [[[] for _ in depths] for _ in lengths]
    for li, n in enumerate(lengths):
        if n + max_new_tokens > cfg.max_position:
            raise ValueError(f"passkey length {n} + {max_new_tokens} new tokens exceeds the model's context "
                             f"{cfg.max_position}")
        cells = draw_trials(rng, len(depths), trials, digits)
        for s in range(0, len(cells), batch_size):
            batch = cells[s:s + batch_size]
            prompts = np.asarray([make_prompt(tokenizer, n, depths[di], key) for di, key in batch], np.int32)
            out = quantized_ppl.decode(params, cfg, policy, prompts, max_new_tokens - 1, free_running=True)
            gen = np.concatenate([out["first"][:, None], out["argmax"]], axis=1)
            for (di, key), ids in zip(batch, gen):
                text = tokenizer.decode([int(i) for i in ids])
                answers[li][di].append(text)
                acc[li, di] += float(first_number(text) == key) / trials
    return {"lengths": list(lengths), "depths": list(depths), "accuracy": acc.tolist(), "mean": float(acc.mean()),
            "answers": answers}
