"""Backend detection shared by the Pallas kernels (kept tiny and stable on purpose).

``platform()`` names the platform of JAX's default backend, normalised to ``"cpu"``, ``"gpu"`` or ``"tpu"``
(``"cuda"``/``"rocm"`` map to ``"gpu"``). ``default_interpret()`` is True unless that platform is a GPU or a TPU,
i.e. where no Pallas compiler exists and kernels must run in the Pallas interpreter.
"""
from __future__ import annotations

import jax

__all__ = ["default_interpret", "platform"]


def platform() -> str:
    name = jax.default_backend().lower()
    if name in ("gpu", "cuda", "rocm"):
        return "gpu"
    return name


def default_interpret() -> bool:
    return platform() not in ("gpu", "tpu")
