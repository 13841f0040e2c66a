"""W8A8 live activations in the model: a per-linear precision policy, weights quantized once, a ``linear`` hook.

Scheme (design notes 0x02A-0x02B), for every linear the policy names (q, k, v, o, gate, up, down; ``lm_head``
optional, embeddings never)::

    weights   W [K, N] (the model's x @ W layout)  ->  codes int8 [N, K] (kernel ABI, K contiguous), scale f32 [N]
              per OUTPUT channel, symmetric narrow range [-127, 127] (``quant.symmetric.quantize_symmetric``)
    prefill   (T > 1) "w8a8":  x [B, T, K] -> per-TOKEN symmetric INT8 rows (codes int8 [M, K], scale f32 [M],
              M = B*T), int8 x int8 -> int32 accumulate, float32 epilogue  y = acc * s_x[m] * s_w[n]
    decode    (T == 1) "w8a16" (weight-only, default): y = (x @ codes^T) * s_w  in x's dtype (dequantized weights,
              float activations) -- or "w8a8" / "float", as configured.

One model, one policy, both phases: the hook sees ``x [B, T, K]`` and picks the phase from the static ``T``.
Quantized weights are built ONCE by :func:`quantize_params` (a params pytree whose selected linears are
:class:`QuantLinear` leaves, stacked ``[L, N, K]`` like every layer parameter); :func:`save` / :func:`restore`
checkpoint them with Orbax (bit-exact).

Bad activations: the eager :func:`w8a8_dense` raises ``ValueError`` naming the problem (non-finite input, an
FTZ-unsafe subnormal / underflowing scale). Inside ``jit`` (the model forward) a rejected row cannot raise: its
output row is poisoned with NaN, so the model's finiteness check on K/V (``ok``) rejects the step instead of
silently using zero codes.

``impl``: "xla" (default; ``lax.dot_general`` int8 x int8 -> int32, any platform) or "pallas"
(``pallas_kernels.w8a8_matmul.w8a8_matmul``; on CPU it runs in the Pallas interpreter, ``interpret=None`` picks
the platform default).

Fused RMSNorm producer (``fuse_norm=True``, the default): in the W8A8 mode the projections that read the same
RMSNorm output -- q/k/v after ``attn_norm``, gate/up after ``ffn_norm`` (and the head after ``final_norm`` when it
is quantized) -- get their INT8 activation rows from ONE call of the fused RMSNorm -> per-token INT8 producer
(``pallas_kernels.rmsnorm_quantize``: the Pallas kernel for ``impl="pallas"``, its XLA reference for "xla"),
shared by the group's GEMMs: the normalized activations never exist in float, and each token row is quantized
once instead of once per projection. (Numerically the producer's amax is r * max|x * w| in float32, the unfused
path's max|rmsnorm(x)|: equal up to float32 rounding, so a code can differ by one step at a rounding tie.)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.artifact import array_specs, read_artifact, write_artifact
from kvquant_jax.models.llama import dense, rms_norm
from kvquant_jax.quant import _common as C
from kvquant_jax.quant.symmetric import quantize_symmetric, quantize_symmetric_rows_with_status
from pallas_kernels import rmsnorm_quantize as RQ
from pallas_kernels.w8a8_matmul import w8a8_matmul

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
PARAM_NAME = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
MODES = ("w8a8", "w8a16", "float")
FORMAT = "kvquant_jax.w8a8.v1"


class QuantLinear(NamedTuple):
    """A per-output-channel INT8 weight. ``codes: int8 [..., N, K]``; ``scale: float32 [..., N]``;
    ``W ~= codes^T * scale`` (``[K, N]``). Leading axes: the stacked layer axis ``L`` (absent inside the scan).

    With a per-layer policy (``W8A8Policy.float_layers``) two more leaves ride along: ``w_float [..., K, N]`` (the
    original float weight) and ``active: bool [...]`` (False on the layers that stay float); else both are None."""

    codes: jax.Array
    scale: jax.Array
    w_float: jax.Array | None = None
    active: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class W8A8Policy:
    """Which linears run W8A8 and how (hashable: a static jit argument; also the ``linear`` hook itself).

    Attributes:
      linears: names quantized, subset of ``LINEARS + ("lm_head",)``. Default: the 7 block linears; embeddings
        and the output head stay float (``lm_head`` must be asked for explicitly).
      prefill: mode for T > 1 forwards: "w8a8" (default), "w8a16" or "float" (the float mode dequantizes the
        weights, i.e. it is W8A16 with no activation quantization -- the original float weights are not kept).
      decode: mode for T == 1 forwards: "w8a16" (default, weight-only), "w8a8" or "float" (= "w8a16").
      impl: "xla" or "pallas" (the INT8 GEMM of the w8a8 mode).
      interpret: Pallas interpreter flag (None = platform default).
      act_qparam_dtype: per-token activation scale dtype, "fp32" (default) or "fp16".
      float_layers: decoder layers whose linears keep their float weights and float activations (e.g. the first
        and last layers); the others follow the modes above.  Chosen per layer at run time inside the layer scan
        (``lax.cond`` on a stacked per-layer flag), so one compiled forward serves the mixed model.
      fuse_norm: in the w8a8 mode, quantize each RMSNorm output once with the fused RMSNorm -> INT8 producer and
        share the codes across the projections reading it (module docstring); False = RMSNorm in float, then one
        activation quantization per projection.
    """

    linears: tuple[str, ...] = LINEARS
    prefill: str = "w8a8"
    decode: str = "w8a16"
    impl: str = "xla"
    interpret: bool | None = None
    act_qparam_dtype: str = "fp32"
    float_layers: tuple[int, ...] = ()
    fuse_norm: bool = True

    def __post_init__(self):
        object.__setattr__(self, "linears", tuple(self.linears))
        object.__setattr__(self, "float_layers", tuple(sorted({int(i) for i in self.float_layers})))
        if any(i < 0 for i in self.float_layers):
            raise ValueError(f"W8A8Policy: float_layers must be layer indices >= 0, got {list(self.float_layers)}")
        bad = [n for n in self.linears if n not in LINEARS + ("lm_head",)]
        if bad:
            raise ValueError(f"W8A8Policy: unknown linear(s) {bad}; allowed {list(LINEARS + ('lm_head',))} "
                             "(embeddings are never quantized)")
        for f in ("prefill", "decode"):
            if getattr(self, f) not in MODES:
                raise ValueError(f"W8A8Policy: {f} must be one of {MODES}, got {getattr(self, f)!r}")
        if self.impl not in ("xla", "pallas"):
            raise ValueError(f"W8A8Policy: impl must be 'xla' or 'pallas', got {self.impl!r}")
        if self.act_qparam_dtype not in ("fp32", "fp16"):
            raise ValueError(f"W8A8Policy: act_qparam_dtype must be 'fp32' or 'fp16', got {self.act_qparam_dtype!r}")

    def mode(self, tokens_per_row: int) -> str:
        """The path of a forward with ``T = tokens_per_row`` tokens: prefill (T > 1) or decode (T == 1)."""
        return self.decode if tokens_per_row == 1 else self.prefill

    def __call__(self, x: jax.Array, w, name: str) -> jax.Array:
        """The ``linear(x, w, name)`` hook of ``llama.forward``: ``x [B, T, K]`` (or ``[B, K]``-like ``[..., K]``;
        the phase is read from ``x.shape[-2]``), ``w`` a float ``[K, N]`` array (not quantized: float matmul) or a
        :class:`QuantLinear`. Returns ``[..., N]`` in x's dtype."""
        if not isinstance(w, QuantLinear):
            if name in self.linears:
                raise ValueError(f"W8A8Policy: linear {name!r} is in the policy but its weight is float; pass the "
                                 "params from quantize_params(params, policy)")
            return dense(x, w, name)
        t = x.shape[-2] if x.ndim >= 2 else 1
        mode = self.mode(t)

        def quantized(x):
            if mode == "w8a8":
                return w8a8_dense(x, w, impl=self.impl, interpret=self.interpret,
                                  act_qparam_dtype=self.act_qparam_dtype)
            return w8a16_dense(x, w)

        if w.active is None:
            return quantized(x)
        return jax.lax.cond(w.active, quantized, lambda x: dense(x, w.w_float, name), x)

    def norm_linears(self, x: jax.Array, norm_w: jax.Array, eps: float, projections) -> list:
        """The ``norm_linears`` hook of ``llama``: ``RMSNorm(x; norm_w, eps)`` followed by every ``(w, name)`` of
        ``projections`` (weights reading the same normalized activations). ``x [B, T, K]``; returns one
        ``[B, T, N_i]`` array per projection, in x's dtype. The W8A8 mode with ``fuse_norm`` and every weight a
        :class:`QuantLinear` runs :func:`norm_w8a8_dense` (one fused producer call, shared codes); any other case
        is RMSNorm in float, then this policy per projection."""
        ws = [w for w, _ in projections]
        t = x.shape[-2] if x.ndim >= 2 else 1
        if not (self.fuse_norm and self.mode(t) == "w8a8" and all(isinstance(w, QuantLinear) for w in ws)):
            h = rms_norm(x, norm_w, eps)
            return [self(h, w, name) for w, name in projections]

        def fused(x):
            return norm_w8a8_dense(x, norm_w, eps, ws, impl=self.impl, interpret=self.interpret,
                                   act_qparam_dtype=self.act_qparam_dtype)

        if all(w.active is None for w in ws):
            return fused(x)
        if any(w.active is None for w in ws):
            raise ValueError("W8A8Policy.norm_linears: a projection group mixes per-layer and plain QuantLinears; "
                             "quantize the params with one quantize_params(params, policy) call")

        def float_path(x):                    # a float layer: exactly the float model's norm + projections
            h = rms_norm(x, norm_w, eps)
            return [dense(h, w.w_float, name) for w, name in projections]

        return jax.lax.cond(ws[0].active, fused, float_path, x)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["linears"] = list(self.linears)
        d["float_layers"] = list(self.float_layers)
        return d


def quantize_weight(w) -> QuantLinear:
    """Float ``w [..., K, N]`` -> :class:`QuantLinear` (codes int8 ``[..., N, K]``, scale float32 ``[..., N]``),
    per output channel, symmetric INT8. Raises ``ValueError`` for non-finite weights or FTZ-unsafe scales."""
    w = C.check_float_input(w, "quantize_weight", min_ndim=2)
    wt = jnp.swapaxes(w.astype(jnp.float32), -1, -2)
    q = quantize_symmetric(wt, bits=8, axis=-1, group_size=0, qparam_dtype=jnp.float32)
    return QuantLinear(q.codes, q.scale[..., 0])


def dequantize_weight(w: QuantLinear, dtype=jnp.float32) -> jax.Array:
    """``[..., K, N]`` float weights ``codes^T * scale`` (the W8A16 view)."""
    return (jnp.swapaxes(w.codes, -1, -2).astype(jnp.float32) * w.scale[..., None, :]).astype(dtype)


def w8a16_dense(x: jax.Array, w: QuantLinear) -> jax.Array:
    """Weight-only path: ``y[..., n] = (sum_k x[..., k] codes[n, k]) * scale[n]`` in float32, cast to x's dtype."""
    xf = x.astype(jnp.float32)
    acc = jnp.einsum("...k,nk->...n", xf, w.codes.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (acc * w.scale.astype(jnp.float32)).astype(x.dtype)


def _int8_gemm(xq, xs, w: QuantLinear, impl: str, interpret) -> jax.Array:
    if impl == "pallas":
        return w8a8_matmul(xq, xs, w.codes, w.scale, out_dtype=jnp.float32, interpret=interpret)
    acc = jax.lax.dot_general(xq, w.codes, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs.astype(jnp.float32)[:, None] * w.scale.astype(jnp.float32)[None, :]


def _poisoned_gemm(codes, scale, status, w: QuantLinear, impl: str, interpret, lead, dtype) -> jax.Array:
    """INT8 GEMM of activation rows ``codes [M, K]`` / ``scale [M]`` with ``w``; rows whose ``status`` is not 0 are
    NaN (never silently zero). Returns ``[*lead, N]`` in ``dtype``."""
    y = jnp.where((status == 0)[:, None], _int8_gemm(codes, scale, w, impl, interpret), jnp.float32(jnp.nan))
    return y.reshape(*lead, -1).astype(dtype)


def w8a8_dense_with_status(x: jax.Array, w: QuantLinear, *, impl: str = "xla", interpret=None,
                           act_qparam_dtype: str = "fp32") -> tuple[jax.Array, jax.Array]:
    """Jit-safe W8A8 linear. ``x [..., K]`` float, ``w`` a :class:`QuantLinear` with ``codes [N, K]``.

    Returns ``(y [..., N] in x's dtype, status int32 [...])`` (per-token ``QuantStatus`` flags, 0 = OK). Rows with
    a non-zero status have ``y = NaN`` (poisoned, never silently zero)."""
    if w.codes.ndim != 2 or x.shape[-1] != w.codes.shape[1]:
        raise ValueError(f"w8a8_dense: expected x [..., K] and codes [N, K], got {x.shape} and {w.codes.shape}")
    lead, k = x.shape[:-1], x.shape[-1]
    q, status = quantize_symmetric_rows_with_status(x.reshape(-1, k), bits=8, qparam_dtype=act_qparam_dtype)
    return _poisoned_gemm(q.codes, q.scale, status, w, impl, interpret, lead, x.dtype), status.reshape(lead)


def w8a8_dense(x: jax.Array, w: QuantLinear, *, impl: str = "xla", interpret=None,
               act_qparam_dtype: str = "fp32") -> jax.Array:
    """W8A8 linear ``x [..., K] -> [..., N]`` (see :func:`w8a8_dense_with_status`). On concrete inputs raises
    ``ValueError`` naming the problem (non-finite activations, FTZ-unsafe / underflowing per-token scale)."""
    y, status = w8a8_dense_with_status(x, w, impl=impl, interpret=interpret, act_qparam_dtype=act_qparam_dtype)
    if C.is_concrete(status):
        C.raise_for_status(status, "w8a8_dense (per-token activation quantization)")
    return y


def _producer_status(status: jax.Array) -> jax.Array:
    """``pallas_kernels.rmsnorm_quantize`` row status -> :class:`~kvquant_jax.quant._common.QuantStatus` flags."""
    return jnp.where(status == RQ.STATUS_NONFINITE, int(C.QuantStatus.NONFINITE_INPUT),
                     jnp.where(status == RQ.STATUS_FTZ_UNSAFE, int(C.QuantStatus.SCALE_SUBNORMAL), 0)
                     ).astype(jnp.int32)


def norm_w8a8_dense_with_status(x: jax.Array, norm_w: jax.Array, eps: float, ws, *, impl: str = "xla",
                                interpret=None, act_qparam_dtype: str = "fp32") -> tuple[list, jax.Array]:
    """Jit-safe fused RMSNorm -> W8A8 projections sharing one activation quantization.

    ``x [..., K]`` float32/bfloat16/float16, ``norm_w [K]`` the RMSNorm weight, ``eps`` a static float, ``ws`` a
    sequence of :class:`QuantLinear` (``codes [N_i, K]``). The fused producer (``pallas_kernels.rmsnorm_quantize``
    for ``impl="pallas"``, ``rmsnorm_quantize_reference`` -- the same semantics in XLA -- for "xla") turns each token
    row into INT8 codes + one scale (``act_qparam_dtype``) once; every weight's GEMM reads them. Returns
    ``([y_i [..., N_i] in x's dtype], status int32 [...])`` with :class:`~kvquant_jax.quant._common.QuantStatus`
    flags (0 = OK); rejected rows are NaN in every output."""
    if not ws or any(w.codes.ndim != 2 or w.codes.shape[1] != x.shape[-1] for w in ws):
        raise ValueError(f"norm_w8a8_dense: expected x [..., K] and weights codes [N, K], got {x.shape} and "
                         f"{[tuple(w.codes.shape) for w in ws]}")
    lead, k = x.shape[:-1], x.shape[-1]
    qdtype = C.canonical_qparam_dtype(act_qparam_dtype)
    if impl == "pallas":
        codes, scale, status = RQ.rmsnorm_quantize(x.reshape(-1, k), norm_w, eps=eps, qparam_dtype=qdtype,
                                                   interpret=interpret, check=False)
    else:
        codes, scale, status = RQ.rmsnorm_quantize_reference(x.reshape(-1, k), norm_w, eps=eps, qparam_dtype=qdtype,
                                                             check=False)
    ys = [_poisoned_gemm(codes, scale, status, w, impl, interpret, lead, x.dtype) for w in ws]
    return ys, _producer_status(status).reshape(lead)


def norm_w8a8_dense(x: jax.Array, norm_w: jax.Array, eps: float, ws, *, impl: str = "xla", interpret=None,
                    act_qparam_dtype: str = "fp32") -> list:
    """:func:`norm_w8a8_dense_with_status` without the status; on concrete inputs raises ``ValueError`` naming the
    problem (non-finite activations, FTZ-unsafe per-token scale)."""
    ys, status = norm_w8a8_dense_with_status(x, norm_w, eps, ws, impl=impl, interpret=interpret,
                                             act_qparam_dtype=act_qparam_dtype)
    if C.is_concrete(status):
        C.raise_for_status(status, "norm_w8a8_dense (fused RMSNorm -> per-token activation quantization)")
    return ys


def quantize_params(params: dict, policy: W8A8Policy = W8A8Policy()) -> dict:
    """Params pytree -> the same pytree with every policy linear replaced by a stacked :class:`QuantLinear`.

    ``params["layers"][PARAM_NAME[n]]: [L, K, N]`` -> ``QuantLinear(codes [L, N, K], scale [L, N])``; norms, the
    embedding (and the float head unless ``"lm_head"`` is named, then ``params["lm_head_q"]`` is added and the
    float embedding kept for the lookup) are untouched. Call once at load; pass the result with ``linear=policy``.
    """
    out = dict(params)
    layers = dict(params["layers"])
    num_layers = int(layers["wq"].shape[0])
    bad = [i for i in policy.float_layers if i >= num_layers]
    if bad:
        raise ValueError(f"quantize_params: float_layers {bad} out of range for a {num_layers}-layer model")
    active = None
    if policy.float_layers:
        active = jnp.asarray([i not in policy.float_layers for i in range(num_layers)])
    for n in policy.linears:
        if n == "lm_head":
            head = params["lm_head"] if "lm_head" in params else jnp.swapaxes(params["embed"], 0, 1)
            out["lm_head_q"] = quantize_weight(head)
        else:
            w = layers[PARAM_NAME[n]]
            if isinstance(w, QuantLinear):
                raise ValueError(f"quantize_params: {n} is already quantized")
            q = quantize_weight(w)
            layers[PARAM_NAME[n]] = q if active is None else q._replace(w_float=w, active=active)
    out["layers"] = layers
    return out


def apply_policy(params: dict, cfg, policy: W8A8Policy) -> tuple[dict, object]:
    """``(quantize_params(params, policy), cfg with activation=policy)``: after this every forward of the model
    (``llama.forward`` / ``forward_nocache``, serving, evaluation) runs the policy without further arguments."""
    return quantize_params(params, policy), dataclasses.replace(cfg, activation=policy)


# ------------------------------------------------------------------------------------------------ checkpointing
def _flatten(qparams: dict) -> dict[str, np.ndarray]:
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(qparams)[0]:
        key = ".".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)
        flat[key] = np.asarray(leaf)
    return flat


def save(qparams: dict, policy: W8A8Policy, path, *, model_sha256: str = "") -> Path:
    """Write ``path/arrays`` (Orbax) + ``path/manifest.json`` (format, policy, model sha256, array shapes/dtypes).
    ``path`` must not exist."""
    flat = _flatten(qparams)
    quant = sorted(k.rsplit(".", 1)[0] for k in flat if k.endswith(".codes"))
    man = {"format": FORMAT, "policy": policy.to_dict(), "model_sha256": model_sha256, "quantized": quant,
           "arrays": array_specs(flat)}
    return write_artifact(path, flat, man, "w8a8 weights")


def restore(path) -> tuple[dict, W8A8Policy]:
    """Inverse of :func:`save`: ``(qparams, policy)`` with the same pytree structure (QuantLinear leaves)."""
    man, flat = read_artifact(path, FORMAT, "w8a8 weights")
    flat = {k: jnp.asarray(v) for k, v in flat.items()}
    quant = set(man["quantized"])
    out: dict = {}
    for q in quant:
        node = out
        *parents, leaf = q.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = QuantLinear(flat.pop(q + ".codes"), flat.pop(q + ".scale"), flat.pop(q + ".w_float", None),
                                 flat.pop(q + ".active", None))
    for k, v in flat.items():
        node = out
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    policy = man["policy"]
    policy["float_layers"] = tuple(policy.get("float_layers", ()))
    return out, W8A8Policy(**policy)
