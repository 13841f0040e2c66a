"""Mixed per-layer cache policies (design notes 0x0AC): a tuple of schemes, one per layer.

``init_cache`` accepts such a tuple and stacks each run of consecutive equal schemes into one group (so the model
still scans over layers inside a run).  Helpers build the common policies: quantize every layer except the first /
last ``n`` (or a named set), which stay full precision -- e.g. FP8 with skipped sensitive layers.  The byte ledger
sums the real per-layer representations of a policy (no fictional uniform ``H_kv``/bytes product).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import CacheScheme, SchemeBase

_IDENTITY = ("rope_theta", "rope_pairing", "key_stage", "model_id", "tokenizer_hash", "kernel_family")


def uniform(scheme: CacheScheme, num_layers: int) -> tuple[CacheScheme, ...]:
    """The same scheme for every layer."""
    return (scheme,) * _check_layers(num_layers)


def full_precision_like(scheme: CacheScheme, dtype: str = "fp32") -> FullPrecisionScheme:
    """A full-precision scheme carrying ``scheme``'s identity fields (RoPE convention, key stage, model, tokenizer),
    so a mixed policy stays one consistent ABI apart from each layer's storage."""
    ident = {f: getattr(scheme, f) for f in _IDENTITY} if isinstance(scheme, SchemeBase) else {}
    return FullPrecisionScheme(dtype=dtype, **ident)


def with_full_precision(scheme: CacheScheme, num_layers: int, *, first: int = 0, last: int = 0,
                        layers: Iterable[int] = (), dtype: str = "fp32") -> tuple[CacheScheme, ...]:
    """``scheme`` everywhere except the first ``first`` layers, the last ``last`` layers and ``layers``, which keep
    full-precision K/V in ``dtype``."""
    n = _check_layers(num_layers)
    keep = set(range(min(first, n))) | set(range(max(0, n - last), n)) | set(layers)
    bad = [i for i in keep if not 0 <= i < n]
    if first < 0 or last < 0 or bad:
        raise ValueError(f"with_full_precision: layers {sorted(bad)} / first={first} / last={last} invalid for "
                         f"{n} layers")
    full = full_precision_like(scheme, dtype)
    return tuple(full if i in keep else scheme for i in range(n))


def skip_layers(scheme: CacheScheme, num_layers: int, layers: Iterable[int], dtype: str = "fp32"):
    """vLLM-style selective skipping: the listed layers are not quantized (kept full precision)."""
    return with_full_precision(scheme, num_layers, layers=layers, dtype=dtype)


def describe(policy: Sequence[CacheScheme]) -> str:
    """Compact run-length description, e.g. ``"0-1: full(fp32) | 2-29: kivi | 30-31: full(fp32)"``."""
    out, start = [], 0
    policy = tuple(policy)
    for i in range(1, len(policy) + 1):
        if i == len(policy) or policy[i] != policy[start]:
            s = policy[start]
            name = f"full({s.dtype})" if isinstance(s, FullPrecisionScheme) else s.schema.scheme
            out.append(f"{start}-{i - 1}: {name}" if i - 1 > start else f"{start}: {name}")
            start = i
    return " | ".join(out)


def _check_layers(num_layers: int) -> int:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    return num_layers
