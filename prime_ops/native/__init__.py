"""Native kernels that prime_ops owns (``csrc/``), as ``prime_rl`` custom ops.

Each op replaces a chain of small eager ops that trainers run today; as one registered operator
it is one name that autograd, torch.compile and ``prime_ac`` policies see:

- ``prime_rl::moe_permute`` / ``moe_unpermute``: tokens into an expert-contiguous layout
  (segments padded to ``alignment`` rows, 128 for DeepGEMM's contiguous grouped GEMM) and the
  weighted sum back. Deterministic and stable; their backwards are each other's adjoints.
- ``prime_rl::merge_attn_states``: merge two partial attention results through their lse
  (``out [T, H, D]``, fp32 ``lse [H, T]``, as ``prime_rl_attn`` returns them).
- ``prime_rl::quantize_fp8_blockwise``: float8_e4m3fn with one scale per 1x128 or 128x128
  block, fp32 or power-of-two (UE8M0) scales, in DeepGEMM's operand layout.

Schemas, fakes and autograd are registered at import, so the ops trace and compile on any
machine; the kernels come from a cached build (:mod:`prime_ops.native.build`). A call before
``python -m prime_ops.native`` ran raises :class:`~prime_ops.BackendUnavailable`.

>>> x_sorted, row_map, counts = moe_permute(x, topk_idx, num_experts=64, alignment=128)
>>> out = moe_unpermute(expert_fn(x_sorted), row_map, topk_weights)
"""

from __future__ import annotations

import torch
from torch import Tensor

from prime_ops.backends import BackendUnavailable
from prime_ops.native import build as _build

__all__ = [
    "has_kernel",
    "is_available",
    "merge_attn_states",
    "moe_permute",
    "moe_unpermute",
    "quantize_fp8_blockwise",
]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_SCALE_FORMATS = ("fp32", "ue8m0")
_FP8_BLOCK = 128

_SCHEMAS = {
    "moe_permute": "(Tensor x, Tensor topk_idx, int num_experts, int alignment) "
    "-> (Tensor, Tensor, Tensor)",
    "moe_permute_backward": "(Tensor grad_x_sorted, Tensor row_map) -> Tensor",
    "moe_unpermute": "(Tensor y_sorted, Tensor row_map, Tensor topk_weights) -> Tensor",
    "moe_unpermute_backward": "(Tensor grad_out, Tensor y_sorted, Tensor row_map, "
    "Tensor topk_weights) -> (Tensor, Tensor)",
    "merge_attn_states": "(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) "
    "-> (Tensor, Tensor)",
    "merge_attn_states_backward": "(Tensor grad_out, Tensor? grad_lse, Tensor out_a, "
    "Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor, Tensor, Tensor)",
    "quantize_fp8_blockwise": "(Tensor x, int block_rows, str scale_format) -> (Tensor, Tensor)",
}

_lib = torch.library.Library("prime_rl", "FRAGMENT")  # kept referenced: it owns the schemas
for _name, _schema in _SCHEMAS.items():
    _lib.define(_name + _schema)


def is_available() -> bool:
    """True when the native library is loaded or a cached build can be loaded now (a build
    another process is running is waited for, saying so; ``build.why_not_loaded()`` says why
    not)."""
    return _build.load()


@torch.compiler.assume_constant_result  # torch.compile asks once while tracing
def has_kernel(name: str, device: torch.device) -> bool:
    """True when ``prime_rl::<name>`` can run on ``device`` now (library built, with kernels for
    that device type). Callers that keep an eager chain as their fallback ask this first.

    >>> if native.has_kernel("merge_attn_states", out.device): ...
    """
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    if key is None or not _build.load():
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"prime_rl::{name}", key)


def _unavailable(name: str):
    """The kernel behind every op until the library is loaded (backend kernels take precedence
    once it is): loads a cached build and re-dispatches, or says how to build."""

    def kernel(*args):
        device = next(a.device for a in args if isinstance(a, Tensor))
        if not _build.load():
            raise BackendUnavailable(f"prime_rl::{name} cannot run: {_build.why_not_loaded()}")
        if not has_kernel(name, device):
            raise BackendUnavailable(
                f"prime_rl::{name} has no {device.type} kernel in the loaded native library; "
                "CUDA kernels are built with a CUDA build of torch, nvcc and a visible GPU, or "
                "on request: "
                f"{_build.BUILD_COMMAND} --cuda"
            )
        return getattr(torch.ops.prime_rl, name)(*args)

    return kernel


for _name in _SCHEMAS:
    _lib.impl(_name, _unavailable(_name), "CompositeExplicitAutograd")


# --- argument checks: the contract of csrc/checks.h, run by the fronts and the fakes ------------
# The kernels run the same checks (and those that need values: expert ids, row_map entries), so
# a call is refused alike through a front, a traced graph or torch.ops.prime_rl directly.

MAX_EXPERTS = 4096  # csrc/checks.h: kMaxExperts, kMaxTopK, kMaxAlignment
MAX_TOP_K = 4096
MAX_ALIGNMENT = 65536


def _contiguous(**named: Tensor) -> tuple[Tensor, ...]:
    """The fronts' inputs, contiguous (as the kernels read them); anything but a tensor is named."""
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return tuple(t.contiguous() for t in named.values())


def _check_float(name: str, t: Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")


def _check_dim(name: str, t: Tensor, dim: int) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")


def _check_shape(name: str, t: Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(t.shape)}")


def _check_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _check_layout(first: tuple[str, Tensor], *others: tuple[str, Tensor | None]) -> None:
    """One device for every tensor, and contiguous ones (the kernels read raw pointers)."""
    ref_name, ref = first
    for name, t in (first, *others):
        if t is None:
            continue
        if t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} on {ref.device}; move it with "
                f".to({ref_name}.device)"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _check_top_k(name: str, row_map: Tensor) -> None:
    if row_map.shape[1] > MAX_TOP_K:
        raise ValueError(
            f"{name} has {row_map.shape[1]} slots per token, more than the {MAX_TOP_K} the "
            "kernels support"
        )


def _check_permute(x: Tensor, topk_idx: Tensor, num_experts: int, alignment: int) -> None:
    _check_dim("x", x, 2)
    _check_dim("topk_idx", topk_idx, 2)
    if x.shape[0] != topk_idx.shape[0]:
        raise ValueError(
            f"moe_permute needs x [T, D] and topk_idx [T, K] with the same T, got "
            f"{x.shape[0]} and {topk_idx.shape[0]} tokens; flatten the batch dimensions first"
        )
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_idx must be int64 or int32 expert ids, got {topk_idx.dtype}")
    _check_top_k("topk_idx", topk_idx)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not 1 <= alignment <= MAX_ALIGNMENT:
        raise ValueError(
            f"alignment must be in [1, {MAX_ALIGNMENT}] (1 for no padding, 128 for DeepGEMM), "
            f"got {alignment}"
        )
    _check_layout(("x", x), ("topk_idx", topk_idx))


def _check_rows_and_map(rows_name: str, rows: Tensor, row_map: Tensor) -> None:
    _check_float(rows_name, rows)
    _check_dim(rows_name, rows, 2)
    _check_dim("row_map", row_map, 2)
    _check_dtype("row_map", row_map, torch.int64)
    _check_top_k("row_map", row_map)
    _check_layout((rows_name, rows), ("row_map", row_map))


def _check_unpermute(y_sorted: Tensor, row_map: Tensor, topk_weights: Tensor) -> None:
    _check_rows_and_map("y_sorted", y_sorted, row_map)
    _check_shape("topk_weights", topk_weights, tuple(row_map.shape), "[T, K] (row_map's)")
    if topk_weights.dtype not in (torch.float32, y_sorted.dtype):
        raise TypeError(
            f"topk_weights must be float32 or {y_sorted.dtype} (the dtype of y_sorted), got "
            f"{topk_weights.dtype}"
        )
    _check_layout(("y_sorted", y_sorted), ("topk_weights", topk_weights))


def _check_unpermute_backward(grad_out, y_sorted, row_map, topk_weights) -> None:
    _check_unpermute(y_sorted, row_map, topk_weights)
    _check_shape("grad_out", grad_out, (row_map.shape[0], y_sorted.shape[1]), "[T, D]")
    _check_dtype("grad_out", grad_out, y_sorted.dtype)
    _check_layout(("y_sorted", y_sorted), ("grad_out", grad_out))


def _lse_dtype(out: Tensor) -> torch.dtype:
    return torch.float64 if out.dtype == torch.float64 else torch.float32


def _check_merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    _check_float("out_a", out_a)
    _check_dim("out_a", out_a, 3)
    tokens, heads, _ = out_a.shape
    _check_shape("out_b", out_b, tuple(out_a.shape), "[T, H, D] (out_a's)")
    _check_dtype("out_b", out_b, out_a.dtype)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _check_shape(name, lse, (heads, tokens), "[H, T] (heads first, as prime_rl_attn returns)")
        _check_dtype(name, lse, _lse_dtype(out_a))
    _check_layout(("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b))


def _check_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b) -> None:
    _check_merge(out_a, lse_a, out_b, lse_b)
    _check_shape("grad_out", grad_out, tuple(out_a.shape), "[T, H, D] (out_a's)")
    _check_dtype("grad_out", grad_out, out_a.dtype)
    if grad_lse is not None:
        _check_shape("grad_lse", grad_lse, tuple(lse_a.shape), "[H, T]")
        _check_dtype("grad_lse", grad_lse, _lse_dtype(out_a))
    _check_layout(("out_a", out_a), ("grad_out", grad_out), ("grad_lse", grad_lse))


def _check_quantize(x: Tensor, block_rows: int, scale_format: str) -> None:
    _check_float("x", x)
    _check_dim("x", x, 2)
    _check_layout(("x", x))
    if block_rows not in (1, _FP8_BLOCK):
        raise ValueError(
            f"block_rows must be 1 (activations, 1x128 blocks) or 128 (weights, 128x128 "
            f"blocks), got {block_rows}"
        )
    if scale_format not in _SCALE_FORMATS:
        raise ValueError(f"scale_format must be 'fp32' or 'ue8m0', got {scale_format!r}")


# --- fakes --------------------------------------------------------------------------------------


@torch.library.register_fake("prime_rl::moe_permute")
def _(x, topk_idx, num_experts, alignment):
    _check_permute(x, topk_idx, num_experts, alignment)
    rows = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty(rows, x.shape[1]),
        topk_idx.new_empty(topk_idx.shape, dtype=torch.int64),
        topk_idx.new_empty(num_experts, dtype=torch.int64),
    )


@torch.library.register_fake("prime_rl::moe_permute_backward")
def _(grad_x_sorted, row_map):
    _check_rows_and_map("grad_x_sorted", grad_x_sorted, row_map)
    return grad_x_sorted.new_empty(row_map.shape[0], grad_x_sorted.shape[1])


@torch.library.register_fake("prime_rl::moe_unpermute")
def _(y_sorted, row_map, topk_weights):
    _check_unpermute(y_sorted, row_map, topk_weights)
    return y_sorted.new_empty(row_map.shape[0], y_sorted.shape[1])


@torch.library.register_fake("prime_rl::moe_unpermute_backward")
def _(grad_out, y_sorted, row_map, topk_weights):
    _check_unpermute_backward(grad_out, y_sorted, row_map, topk_weights)
    return torch.empty_like(y_sorted), torch.empty_like(topk_weights)


@torch.library.register_fake("prime_rl::merge_attn_states")
def _(out_a, lse_a, out_b, lse_b):
    _check_merge(out_a, lse_a, out_b, lse_b)
    return torch.empty_like(out_a), torch.empty_like(lse_a)


@torch.library.register_fake("prime_rl::merge_attn_states_backward")
def _(grad_out, grad_lse, out_a, lse_a, out_b, lse_b):
    _check_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b)
    return (
        torch.empty_like(out_a),
        torch.empty_like(lse_a),
        torch.empty_like(out_b),
        torch.empty_like(lse_b),
    )


@torch.library.register_fake("prime_rl::quantize_fp8_blockwise")
def _(x, block_rows, scale_format):
    _check_quantize(x, block_rows, scale_format)
    rows, cols = x.shape
    q = x.new_empty(rows, cols, dtype=torch.float8_e4m3fn)
    blocks = (-(-rows // block_rows), -(-cols // _FP8_BLOCK))
    return q, x.new_empty(blocks, dtype=torch.float32)


# --- autograd -----------------------------------------------------------------------------------


def _permute_setup(ctx, inputs, output):
    _, row_map, _ = output
    ctx.save_for_backward(row_map)
    ctx.mark_non_differentiable(row_map, output[2])


def _permute_backward(ctx, grad_sorted, _grad_map, _grad_counts):
    (row_map,) = ctx.saved_tensors
    grad_x = torch.ops.prime_rl.moe_permute_backward(grad_sorted.contiguous(), row_map)
    return grad_x, None, None, None


torch.library.register_autograd(
    "prime_rl::moe_permute", _permute_backward, setup_context=_permute_setup
)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_backward(ctx, grad_out):
    y_sorted, row_map, topk_weights = ctx.saved_tensors
    grad_y, grad_w = torch.ops.prime_rl.moe_unpermute_backward(
        grad_out.contiguous(), y_sorted, row_map, topk_weights
    )
    return grad_y, None, grad_w


torch.library.register_autograd(
    "prime_rl::moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup
)


def _merge_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _merge_backward(ctx, grad_out, grad_lse):
    out_a, lse_a, out_b, lse_b = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out_a)
    grad_lse = None if grad_lse is None else grad_lse.contiguous()
    return tuple(
        torch.ops.prime_rl.merge_attn_states_backward(
            grad_out.contiguous(), grad_lse, out_a, lse_a, out_b, lse_b
        )
    )


torch.library.register_autograd(
    "prime_rl::merge_attn_states", _merge_backward, setup_context=_merge_setup
)


def _quantize_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


def _quantize_backward(ctx, _grad_q, _grad_scale):
    return None, None, None


torch.library.register_autograd(
    "prime_rl::quantize_fp8_blockwise", _quantize_backward, setup_context=_quantize_setup
)


# --- Python fronts ------------------------------------------------------------------------------


def moe_permute(
    x: Tensor, topk_idx: Tensor, num_experts: int, alignment: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    """Gather every routed (token, slot) of ``x [T, D]`` into an expert-contiguous buffer.

    ``topk_idx [T, K]`` holds expert ids; ``-1`` drops a slot (DeepEP marks experts on other ranks
    that way). Returns ``(x_sorted [M, D], row_map [T, K], tokens_per_expert [E])``: expert e's
    rows are its (token, slot) pairs in that order, followed by zero rows up to a multiple of
    ``alignment``; ``row_map[t, k]`` is the row of slot k of token t (-1 when dropped);
    ``tokens_per_expert`` counts real rows (int64). ``M`` depends on the routing (one host sync
    on CUDA). Differentiable in ``x``.

    >>> x_sorted, row_map, counts = moe_permute(x, topk_idx, num_experts=8, alignment=128)
    """
    x, topk_idx = _contiguous(x=x, topk_idx=topk_idx)
    _check_permute(x, topk_idx, num_experts, alignment)
    return torch.ops.prime_rl.moe_permute(x, topk_idx, num_experts, alignment)


def moe_unpermute(y_sorted: Tensor, row_map: Tensor, topk_weights: Tensor) -> Tensor:
    """``out[t] = sum_k topk_weights[t, k] * y_sorted[row_map[t, k]]`` over kept slots.

    The inverse layout change of :func:`moe_permute` fused with the weighted top-k sum, summed
    in slot order in fp32 (float64 for float64). ``topk_weights`` may be float32 or the dtype of
    ``y_sorted``. Differentiable in ``y_sorted`` and ``topk_weights``.

    >>> out = moe_unpermute(expert_out, row_map, topk_weights)  # [T, D]
    """
    y_sorted, row_map, topk_weights = _contiguous(
        y_sorted=y_sorted, row_map=row_map, topk_weights=topk_weights
    )
    _check_unpermute(y_sorted, row_map, topk_weights)
    return torch.ops.prime_rl.moe_unpermute(y_sorted, row_map, topk_weights)


def merge_attn_states(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge attention over two disjoint key sets into attention over their union.

    ``out_x [T, H, D]`` and ``lse_x [H, T]`` (fp32; float64 for float64 outputs) are the partial
    results; returns ``(out, lse)`` with ``lse = logaddexp(lse_a, lse_b)`` and ``out`` the
    lse-weighted sum, computed in fp32. Rows where both lse are ``-inf`` (no key seen) give
    ``out = 0`` and ``lse = -inf``. Differentiable in all four inputs.

    >>> out, lse = merge_attn_states(out, lse, step_out, step_lse)
    """
    out_a, lse_a, out_b, lse_b = _contiguous(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    _check_merge(out_a, lse_a, out_b, lse_b)
    return torch.ops.prime_rl.merge_attn_states(out_a, lse_a, out_b, lse_b)


def quantize_fp8_blockwise(
    x: Tensor, block_rows: int = 1, scale_format: str = "fp32"
) -> tuple[Tensor, Tensor]:
    """Quantize ``x [M, K]`` to float8_e4m3fn with one scale per ``block_rows x 128`` block.

    Returns ``(q [M, K], scale [ceil(M / block_rows), ceil(K / 128)])`` with ``x ~ q * scale``
    per block: ``block_rows=1`` for activations, 128 for weights (DeepGEMM's operand layout).
    ``scale = amax / 448``; ``scale_format="ue8m0"`` rounds it up to a power of two (fp32
    values DeepGEMM's SM100 kernels read as UE8M0 exactly), so ``|x / scale| <= 448`` holds
    either way. Not differentiable.

    >>> q, scale = quantize_fp8_blockwise(weight, block_rows=128, scale_format="ue8m0")
    """
    (x,) = _contiguous(x=x)
    _check_quantize(x, block_rows, scale_format)
    return torch.ops.prime_rl.quantize_fp8_blockwise(x, block_rows, scale_format)
