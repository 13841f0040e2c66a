"""Inspect a compiled step for avoidable HBM passes over the cache (issue I's copy-free decode step).

``cache_buffer_copies(hlo_text, cache)`` lists the HLO ``copy`` instructions whose result has the shape of one of
the cache's buffers (a per-step copy of a donated cache buffer: what the serving layout must not contain), and
``aliased_parameters(hlo_text)`` counts the module's input -> output buffer aliases (each donated cache buffer that
is updated in place is one). ``hlo_text`` is ``jax.jit(f).lower(...).compile().as_text()``.
"""
from __future__ import annotations

import re

import jax

__all__ = ["hlo_shape", "cache_buffer_copies", "aliased_parameters"]

_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8", "int8": "s8", "int32": "s32",
              "uint32": "u32", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "bool": "pred"}


def hlo_shape(a) -> str:
    """HLO spelling of an array's type, e.g. ``u8[1,8,8,32768,64]``."""
    return f"{_HLO_DTYPE[str(a.dtype)]}[{','.join(str(d) for d in a.shape)}]"


def cache_buffer_copies(hlo_text: str, cache) -> list[tuple[str, str]]:
    """``(field, hlo type)`` of every HLO copy whose result has a cache buffer's type (``field`` is the pytree path
    of the first buffer of that type)."""
    shapes = {}
    for path, a in jax.tree_util.tree_leaves_with_path(cache.groups):
        shapes.setdefault(hlo_shape(a), jax.tree_util.keystr(path))
    found = re.findall(r"= (\w+\[[\d,]*\])\S* copy\(", hlo_text)
    return [(shapes[s], s) for s in found if s in shapes]


def aliased_parameters(hlo_text: str) -> int:
    """Number of input -> output aliases the compiled module declares (0 when it declares none)."""
    start = hlo_text.find("input_output_alias={")
    if start < 0:
        return 0
    header = hlo_text[start:hlo_text.find("\n", start)]
    return len(re.findall(r"\(\d+, \{[\d,]*\}, (?:may|must)-alias\)", header))
