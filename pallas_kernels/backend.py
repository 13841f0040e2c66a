"""Backend detection shared by the Pallas kernels (kept tiny and stable on purpose).

``platform()`` names the platform of JAX's default backend, normalised to ``"cpu"``, ``"gpu"`` or ``"tpu"``
(``"cuda"``/``"rocm"`` map to ``"gpu"``). ``default_interpret()`` is True unless that platform is a GPU or a TPU,
i.e. where no Pallas compiler exists and kernels must run in the Pallas interpreter.  ``resolve(backend,
interpret)`` is every kernel wrapper's argument resolution (the Pallas lowering to use and whether to interpret).
"""
from __future__ import annotations

import jax

__all__ = ["default_interpret", "platform", "resolve"]


def platform() -> str:
    name = jax.default_backend().lower()
    if name in ("gpu", "cuda", "rocm"):
        return "gpu"
    return name


def default_interpret() -> bool:
    return platform() not in ("gpu", "tpu")


def resolve(backend: str | None, interpret, what: str = "") -> tuple[str, bool]:
    """``(backend, interpret)`` of a kernel call: ``backend`` None -> ``"tpu"`` on a TPU, else ``"gpu"`` (Pallas
    Triton, also the generic interpreter); anything but "gpu" / "tpu" raises ``ValueError`` (prefixed by
    ``what``); ``interpret`` None -> :func:`default_interpret`."""
    if backend is None:
        backend = "tpu" if platform() == "tpu" else "gpu"
    if backend not in ("gpu", "tpu"):
        raise ValueError(f"{what}backend must be None, 'gpu' or 'tpu', got {backend!r}")
    if interpret is None:
        interpret = default_interpret()
    return backend, interpret
