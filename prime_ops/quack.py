"""Functional, autograd-enabled QuACK GEMMs that checkpoint policies can see (namespace ``quack``).

Since quack-kernels 0.6.2 an eager call to QuACK's own ops skips the op boundary, so a dispatch
mode (a checkpoint policy included) sees only what runs inside them. The ops here wrap QuACK's
GEMMs in ops of our own, under ``prime_*`` names QuACK does not use:

- ``quack::prime_linear(x, weight, bias)``: ``x @ weight.T + bias``.
- ``quack::prime_grouped_linear(x, weight, offsets)``: per-expert ``x_g @ weight[g].T`` over the
  contiguous grouped layout (``offsets`` int32 ``[E]`` cumulative row ends, as in
  ``prime_rl::grouped_fp8_gemm``).

The SwiGLU expert MLP (:func:`gated_mlp`) is built so that selective checkpointing keeps the
expensive part and replays the cheap part: the gate/up projection is one GEMM whose output
columns interleave gate and up (``[g0, u0, g1, u1, ...]``, QuACK's gated layout) and is kept as a
GEMM target; the activation ``silu(gate) * up`` is plain aten elementwise ops that replay.

CUDA runs QuACK (``quack.gemm_interface.gemm``, ``out = A @ B`` with ``B`` as ``(K, N)``); CPU runs
reference kernels with the same semantics (fp32 accumulation, output in the input dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prime_ops._compat import registered_op_names
from prime_ops.backends import import_backend
from prime_ops.devices import check_same_device
from prime_ops.grouped import check_offsets_meta, check_offsets_values

__all__ = [
    "OP_NAMES",
    "QUACK_OP_NAMES",
    "gated_mlp",
    "grouped_linear",
    "interleave_gate_up",
    "linear",
    "swiglu",
]

QUACK_OP_NAMES = frozenset(
    {
        # GEMMs: kept by prime_ac's policies (prime_ac.targets.QUACK_GEMMS)
        "gemm",
        "gemm_add",
        "gemm_add_inplace",
        "gemm_add_out",
        "gemm_out",
        "gemm_quant_out",
        "gemm_act_out",
        "gemm_dact_out",
        "gemm_gated_out",
        "gemm_dgated_out",
        "gemm_symmetric_out",
        "gemm_rms_out",
        "gemm_norm_act_out",
        "gemm_norm_gated_out",
        "gemm_epi",
        "gemm_epi_f",
        # the rest, replayed (docs/backends.md, "QuACK's other ops", says why for each)
        "split_k_reduce_out",
        "rms_final_reduce_out",
        "_rmsnorm_fwd",
        "_rmsnorm_bwd",
        "rmsnorm_bwd_f",
        "rmsnorm_bwd_f_dual",
        "_softmax_fwd",
        "_softmax_backward",
        "cross_entropy_fwd_out",
        "cross_entropy_bwd_out",
        "lce_scaled_exp_fwd",
        "_rotary_fwd_out",
        "_rotary_fwd_inplace",
        "_rotary_inplace_bwd",
        "_rotary_qkv_inplace",
        "_rotary_qkv_inplace_bwd",
        "_topk_fwd",
        "_topk_bwd",
        "_hadamard_transform_fwd",
    }
)
"""Every op quack-kernels 0.6.5 registers in namespace ``quack`` once its modules are imported
(tests/libraries/test_quack_host.py compares); ours must never take these names."""

OP_NAMES = (
    "prime_linear",
    "prime_linear_backward",
    "prime_grouped_linear",
    "prime_grouped_linear_backward",
)


def _check_names_free(names) -> None:
    """Refuse to register over an op QuACK (or anyone) already defines in namespace ``quack``."""
    registered = registered_op_names()
    taken = sorted(n for n in names if n in QUACK_OP_NAMES or f"quack::{n}" in registered)
    if taken:
        raise RuntimeError(
            f"prime_ops cannot register quack::{', quack::'.join(taken)}: the name is already "
            "defined in namespace 'quack' (by quack-kernels or another library). prime_ops never "
            "re-registers QuACK's ops; upgrade prime-ops or report the clash"
        )


_check_names_free(OP_NAMES)


def _gemm():
    return import_backend("quack.gemm_interface", extra="quack").gemm


def _cu_seqlens(offsets: torch.Tensor) -> torch.Tensor:
    return F.pad(offsets, (1, 0))


def _check_linear(x, weight, bias) -> None:
    check_same_device("quack::prime_linear", x=x, weight=weight, bias=bias)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"prime_linear needs x [M, K] and weight [N, K] with the same K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")


def _check_grouped(x, weight, offsets) -> None:
    check_same_device("quack::prime_grouped_linear", x=x, weight=weight, offsets=offsets)
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"prime_grouped_linear needs x [M, K] and weight [E, N, K] with the same K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    check_offsets_meta(offsets, weight.shape[0])


# --- reference kernels (CPU) --------------------------------------------------------------------


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Accumulate in fp32 (or the input's precision, if higher), as QuACK's GEMMs do."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _reference_linear(x, weight, bias):
    out = _acc(x) @ _acc(weight).T
    if bias is not None:
        out += _acc(bias)
    return out.to(x.dtype)


def _reference_grouped(x, weight, offsets, out_rows, transpose_weight=False):
    """Rows of group g times ``weight[g].T`` (or ``weight[g]`` when ``transpose_weight``)."""
    cols = weight.shape[2] if transpose_weight else weight.shape[1]
    out = x.new_empty(out_rows, cols)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        w = _acc(weight[g]) if transpose_weight else _acc(weight[g]).T
        out[start:end] = (_acc(x[start:end]) @ w).to(x.dtype)
        start = end
    return out


# --- prime_linear -------------------------------------------------------------------------------


@torch.library.custom_op("quack::prime_linear", mutates_args=(), device_types="cpu")
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check_linear(x, weight, bias)
    return _reference_linear(x, weight, bias)


@_linear.register_kernel("cuda")
def _(x, weight, bias):
    _check_linear(x, weight, bias)
    return _quack_linear(x, weight, bias)


def _quack_linear(x, weight, bias):
    return _gemm()(x, weight.mT, bias=bias)


@_linear.register_fake
def _(x, weight, bias):
    _check_linear(x, weight, bias)
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("quack::prime_linear_backward", mutates_args=(), device_types="cpu")
def _linear_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = (_acc(grad) @ _acc(weight)).to(x.dtype)
    grad_w = (_acc(grad).T @ _acc(x)).to(weight.dtype)
    return grad_x, grad_w


@_linear_backward.register_kernel("cuda")
def _(grad, x, weight):
    return _quack_linear_backward(grad, x, weight)


def _quack_linear_backward(grad, x, weight):
    gemm = _gemm()
    return gemm(grad, weight), gemm(grad.mT, x)


@_linear_backward.register_fake
def _(grad, x, weight):
    check_same_device("quack::prime_linear_backward", grad=grad, x=x, weight=weight)
    return torch.empty_like(x), torch.empty_like(weight)


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.quack.prime_linear_backward(grad.contiguous(), x, weight)
    return grad_x, grad_w, grad.sum(0) if ctx.has_bias else None


_linear.register_autograd(_linear_grad, setup_context=_linear_setup)


# --- prime_grouped_linear -----------------------------------------------------------------------


@torch.library.custom_op("quack::prime_grouped_linear", mutates_args=(), device_types="cpu")
def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check_grouped(x, weight, offsets)
    check_offsets_values(offsets, x.shape[0])
    return _reference_grouped(x, weight, offsets, x.shape[0])


@_grouped.register_kernel("cuda")
def _(x, weight, offsets):
    _check_grouped(x, weight, offsets)
    check_offsets_values(offsets, x.shape[0])
    return _quack_grouped(x, weight, offsets)


def _quack_grouped(x, weight, offsets):
    return _gemm()(x, weight.mT, cu_seqlens_m=_cu_seqlens(offsets))


@_grouped.register_fake
def _(x, weight, offsets):
    _check_grouped(x, weight, offsets)
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op(
    "quack::prime_grouped_linear_backward", mutates_args=(), device_types="cpu"
)
def _grouped_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = _reference_grouped(grad, weight, offsets, x.shape[0], transpose_weight=True)
    grad_w = torch.zeros_like(weight)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        grad_w[g] = (_acc(grad[start:end]).T @ _acc(x[start:end])).to(weight.dtype)
        start = end
    return grad_x, grad_w


@_grouped_backward.register_kernel("cuda")
def _(grad, x, weight, offsets):
    return _quack_grouped_backward(grad, x, weight, offsets)


def _quack_grouped_backward(grad, x, weight, offsets):
    gemm, cu_seqlens = _gemm(), _cu_seqlens(offsets)
    grad_x = gemm(grad, weight, cu_seqlens_m=cu_seqlens)
    grad_w = gemm(grad.mT, x, cu_seqlens_k=cu_seqlens)
    return grad_x, grad_w


@_grouped_backward.register_fake
def _(grad, x, weight, offsets):
    check_same_device(
        "quack::prime_grouped_linear_backward", grad=grad, x=x, weight=weight, offsets=offsets
    )
    return torch.empty_like(x), torch.empty_like(weight)


def _grouped_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_grad(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    grad_x, grad_w = torch.ops.quack.prime_grouped_linear_backward(
        grad.contiguous(), x, weight, offsets
    )
    return grad_x, grad_w, None


_grouped.register_autograd(_grouped_grad, setup_context=_grouped_setup)


# --- fronts -------------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., K]``, ``weight [N, K]`` (``quack::prime_linear``)."""
    out = torch.ops.quack.prime_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[g-1]:offsets[g]`` of ``x`` times ``weight[g].T`` (``weight [E, N, K]``)."""
    return torch.ops.quack.prime_grouped_linear(x, weight, offsets)


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Stack gate and up weights (``[..., I, K]`` each) into rows ``g0, u0, g1, u1, ...``.

    The result ``[..., 2I, K]`` is the gate/up weight :func:`gated_mlp` takes: its GEMM output has
    gate and up columns interleaved, QuACK's gated layout.
    """
    if w_gate.shape != w_up.shape:
        raise ValueError(
            f"w_gate and w_up must have the same shape, got {tuple(w_gate.shape)} and "
            f"{tuple(w_up.shape)}"
        )
    return torch.stack((w_gate, w_up), dim=-2).flatten(-3, -2)


def swiglu(preact: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for interleaved columns ``[g0, u0, g1, u1, ...]``; plain aten ops."""
    if preact.shape[-1] % 2:
        raise ValueError(
            f"preact must have an even number of columns (interleaved gate/up), got "
            f"{preact.shape[-1]}"
        )
    gate, up = preact.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def gated_mlp(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` on QuACK GEMMs, dense or per expert.

    ``w_gate_up`` is ``[2I, K]`` (``[E, 2I, K]`` with ``offsets``) with interleaved gate/up rows
    (:func:`interleave_gate_up`); ``w_down`` is ``[K_out, I]`` (``[E, K_out, I]``). Under
    selective checkpointing both GEMMs are kept and only the activation replays.
    """
    if offsets is None:
        return linear(swiglu(linear(x, w_gate_up)), w_down)
    return grouped_linear(swiglu(grouped_linear(x, w_gate_up, offsets)), w_down, offsets)
