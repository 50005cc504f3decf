"""Bad input to the ``prime_rl`` ops: a clear error naming the argument, never a crash or garbage.

Every case runs through each way a caller reaches an op: the Python front (where there is one),
the fake (what a traced or compiled graph runs) and the raw ``torch.ops.prime_rl`` call into the
CPU kernel. Metadata cases must be refused by all three with the same message (one contract,
csrc/checks.h and ``prime_ops.native._check_*``); value cases (expert ids, row_map entries) only
the kernel can see. Edge inputs that are valid must work and match plain PyTorch. FP8: the
PyTorch chain and the native kernel give the same bits on every input, non-finite ones included.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import prime_ops.attn.mla  # noqa: F401  (registers prime_rl::sparse_mla)
import prime_ops.moe  # noqa: F401
from prime_ops import fp8, native
from prime_ops.native import build as native_build

OPS = torch.ops.prime_rl


@pytest.fixture(scope="module", autouse=True)
def native_library():
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("the native ops need a C++ compiler (c++) and ninja to build")
    if not native_build.torch_supported():
        pytest.skip(f"the native ops need torch >= 2.10 (stable ABI), not {torch.__version__}")
    native_build.build()


def _map(*rows):
    return torch.tensor(rows, dtype=torch.int64)


def _merge(t=4, h=2, d=8, dtype=torch.float32, lse_dtype=torch.float32):
    return (
        torch.randn(t, h, d, dtype=dtype),
        torch.randn(h, t, dtype=lse_dtype),
        torch.randn(t, h, d, dtype=dtype),
        torch.randn(h, t, dtype=lse_dtype),
    )


def _with(args, i, value):
    return (*args[:i], value, *args[i + 1 :])


ROW_MAP = _map([0, 1], [2, 3])
Y = torch.randn(4, 3)
W = torch.ones(2, 2)
MERGE = _merge()
FRONTS = {
    "moe_permute": native.moe_permute,
    "moe_unpermute": native.moe_unpermute,
    "merge_attn_states": native.merge_attn_states,
    "quantize_fp8_blockwise": native.quantize_fp8_blockwise,
}

# (op, args, message): refused by the front, the fake and the kernel, with this message.
METADATA = [
    # moe_unpermute: weights of the wrong shape read out of bounds (issue 24), other dtypes
    (
        "moe_unpermute",
        (Y, ROW_MAP, torch.ones(1, 1)),
        r"topk_weights must have shape \[T, K\] "
        r"\(row_map's\) = \[2, 2\], got \[1, 1\]",
    ),
    ("moe_unpermute", (Y, ROW_MAP, torch.ones(3, 3)), r"= \[2, 2\], got \[3, 3\]"),
    ("moe_unpermute", (Y, ROW_MAP, W.double()), "topk_weights must be float32 or torch.float32"),
    ("moe_unpermute", (Y, ROW_MAP.int(), W), "row_map must be torch.int64, got torch.int32"),
    ("moe_unpermute", (Y.long(), ROW_MAP, W), "y_sorted must be float32, float64, bfloat16 or"),
    ("moe_unpermute", (Y[None], ROW_MAP, W), "y_sorted must have 2 dimensions"),
    ("moe_unpermute", (Y, ROW_MAP.flatten(), W), "row_map must have 2 dimensions"),
    (
        "moe_unpermute",
        (Y, torch.zeros(1, 4097, dtype=torch.long), torch.ones(1, 4097)),
        "row_map has 4097 slots per token, more than the 4096",
    ),
    # moe_unpermute_backward: too few gradient rows (issue 24), a gradient of another dtype
    (
        "moe_unpermute_backward",
        (torch.randn(1, 3), Y, ROW_MAP, W),
        r"grad_out must have shape \[T, D\] = \[2, 3\], got \[1, 3\]",
    ),
    ("moe_unpermute_backward", (torch.randn(2, 4), Y, ROW_MAP, W), r"got \[2, 4\]"),
    (
        "moe_unpermute_backward",
        (torch.randn(2, 3).double(), Y, ROW_MAP, W),
        "grad_out must be torch.float32, got torch.float64",
    ),
    (
        "moe_unpermute_backward",
        (torch.randn(2, 3), Y, ROW_MAP, torch.ones(2, 1)),
        r"topk_weights must have shape",
    ),
    ("moe_permute_backward", (Y, ROW_MAP.flatten()), "row_map must have 2 dimensions"),
    ("moe_permute_backward", (Y.int(), ROW_MAP), "grad_x_sorted must be float32, float64"),
    # merge_attn_states: lse as [T, H] and out_b of another head dim were accepted (issue 24)
    (
        "merge_attn_states",
        _with(MERGE, 1, torch.randn(4, 2)),
        r"lse_a must have shape \[H, T\] .*= \[2, 4\], got \[4, 2\]",
    ),
    (
        "merge_attn_states",
        _with(MERGE, 2, torch.randn(4, 2, 4)),
        r"out_b must have shape \[T, H, D\] \(out_a's\) = \[4, 2, 8\], got \[4, 2, 4\]",
    ),
    ("merge_attn_states", _with(MERGE, 2, torch.randn(3, 2, 8)), r"out_b must have shape"),
    ("merge_attn_states", _with(MERGE, 3, torch.randn(2, 3)), r"lse_b must have shape"),
    ("merge_attn_states", _with(MERGE, 2, MERGE[2].double()), "out_b must be torch.float32"),
    ("merge_attn_states", _with(MERGE, 1, MERGE[1].double()), "lse_a must be torch.float32"),
    ("merge_attn_states", (torch.randn(4, 16), *MERGE[1:]), "out_a must have 3 dimensions"),
    ("merge_attn_states", (MERGE[0].long(), *MERGE[1:]), "out_a must be float32, float64"),
    (
        "merge_attn_states_backward",
        (torch.randn(4, 2, 4), None, *MERGE),
        r"grad_out must have shape \[T, H, D\]",
    ),
    (
        "merge_attn_states_backward",
        (torch.randn(4, 2, 8), torch.randn(4, 2), *MERGE),
        r"grad_lse must have shape \[H, T\] = \[2, 4\], got \[4, 2\]",
    ),
    (
        "merge_attn_states_backward",
        (torch.randn(4, 2, 8).half(), None, *MERGE),
        "grad_out must be torch.float32, got torch.float16",
    ),
    # moe_permute: sizes that overflowed or hit internal allocation errors (issue 24)
    (
        "moe_permute",
        (torch.randn(2, 3), _map([0], [1]), 2, 2**62),
        r"alignment must be in \[1, "
        r"65536\] \(1 for no padding, 128 for DeepGEMM\), got 4611686018427387904",
    ),
    ("moe_permute", (torch.randn(2, 3), _map([0], [1]), 2, 2**61), r"alignment must be in \[1"),
    ("moe_permute", (torch.randn(2, 3), _map([0], [1]), 2, 0), r"alignment must be in \[1"),
    (
        "moe_permute",
        (torch.randn(2, 3), _map([0], [1]), 2**40, 1),
        r"num_experts must be in \[1, 4096\], got 1099511627776",
    ),
    ("moe_permute", (torch.randn(2, 3), _map([0], [1]), 0, 1), r"num_experts must be in \[1"),
    ("moe_permute", (torch.randn(3, 3), _map([0], [1]), 2, 1), "with the same T, got 3 and 2"),
    (
        "moe_permute",
        (torch.randn(2, 3), _map([0], [1]).float(), 2, 1),
        "topk_idx must be int64 or int32 expert ids, got torch.float32",
    ),
    ("moe_permute", (torch.randn(2, 3), _map(0, 1), 2, 1), "topk_idx must have 2 dimensions"),
    (
        "moe_permute",
        (torch.randn(1, 3), torch.zeros(1, 4097, dtype=torch.long), 2, 1),
        "topk_idx has 4097 slots per token",
    ),
    # quantize_fp8_blockwise
    ("quantize_fp8_blockwise", (torch.randn(2, 3, 4), 1, "fp32"), "x must have 2 dimensions"),
    ("quantize_fp8_blockwise", (torch.randn(4, 4), 64, "fp32"), "block_rows must be 1"),
    ("quantize_fp8_blockwise", (torch.randn(4, 4), 1, "e8m0"), "scale_format must be 'fp32' or"),
    (
        "quantize_fp8_blockwise",
        (torch.ones(4, 4, dtype=torch.int32), 1, "fp32"),
        "x must be float32, float64, bfloat16 or float16, got torch.int32",
    ),
]

# Strided inputs: the fronts make them contiguous; the fake and the kernel refuse them.
STRIDED = [
    ("moe_unpermute", (torch.randn(3, 4).T, ROW_MAP, W), "y_sorted must be contiguous"),
    ("moe_unpermute", (Y, ROW_MAP, torch.ones(2, 2).T), "topk_weights must be contiguous"),
    ("merge_attn_states", _with(MERGE, 1, torch.randn(4, 2).T), "lse_a must be contiguous"),
    ("moe_permute", (torch.randn(3, 2).T, _map([0], [1]), 2, 1), "x must be contiguous"),
    ("quantize_fp8_blockwise", (torch.randn(4, 4).T, 1, "fp32"), "x must be contiguous"),
]

# Values only the kernel sees (the front passes them through): refused by the raw call and front.
VALUES = [
    # -2 was moe_permute's "no bad id" sentinel: dropped like -1 instead of refused (issue 24)
    (
        "moe_permute",
        (torch.randn(2, 3), _map([0], [-2]), 2, 1),
        r"topk_idx\[1, 0\] = -2 is outside \[-1, num_experts=2\); -1 drops a slot",
    ),
    ("moe_permute", (torch.randn(2, 3), _map([0], [-2]).int(), 2, 1), r"topk_idx\[1, 0\] = -2"),
    ("moe_permute", (torch.randn(2, 3), _map([-3], [0]), 2, 1), r"topk_idx\[0, 0\] = -3"),
    ("moe_permute", (torch.randn(2, 3), _map([0, 1], [2, 5]), 2, 1), r"topk_idx\[1, 0\] = 2"),
    ("moe_unpermute", (Y, _map([0, 1], [2, 4]), W), r"row_map\[1, 1\] = 4 is outside \[-1, 4\)"),
    ("moe_unpermute", (Y, _map([0, -2], [2, 3]), W), r"row_map\[0, 1\] = -2 is outside"),
    ("moe_unpermute", (Y, _map([0, 1], [1, 3]), W), r"row_map names row 1 twice"),
]
RAW_VALUES = [  # backward ops have no front
    ("moe_permute_backward", (Y, _map([0, 9], [2, 3])), r"row_map\[0, 1\] = 9 is outside"),
    (
        "moe_unpermute_backward",
        (torch.randn(2, 3), Y, _map([0, 1], [-5, 3]), W),
        r"row_map\[1, 0\] = -5 is outside",
    ),
    (
        "moe_unpermute_backward",
        (torch.randn(2, 3), Y, _map([3, 1], [2, 3]), W),
        "row_map names row 3 twice",
    ),
]


def _fake(args):
    mode = FakeTensorMode()
    return mode, tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize(("op", "args", "message"), METADATA, ids=[c[0] for c in METADATA])
def test_metadata_refused_alike_by_front_fake_and_kernel(op, args, message):
    with pytest.raises(RuntimeError, match=message):  # the kernel (std::runtime_error)
        getattr(OPS, op)(*args)
    mode, fakes = _fake(args)
    with mode, pytest.raises((ValueError, TypeError), match=message):
        getattr(OPS, op)(*fakes)
    if op in FRONTS:
        with pytest.raises((ValueError, TypeError), match=message):
            FRONTS[op](*args)


@pytest.mark.parametrize(("op", "args", "message"), STRIDED, ids=[c[0] for c in STRIDED])
def test_strided_inputs_refused_by_fake_and_kernel_made_contiguous_by_front(op, args, message):
    with pytest.raises(RuntimeError, match=message):
        getattr(OPS, op)(*args)
    mode, fakes = _fake(args)
    with mode, pytest.raises(ValueError, match=message):
        getattr(OPS, op)(*fakes)
    want = getattr(OPS, op)(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))
    for got, expected in zip(FRONTS[op](*args), want, strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(("op", "args", "message"), VALUES + RAW_VALUES)
def test_values_refused_by_kernel(op, args, message):
    with pytest.raises(RuntimeError, match=message):
        getattr(OPS, op)(*args)
    if op in FRONTS:
        with pytest.raises(RuntimeError, match=message):
            FRONTS[op](*args)


def test_devices_must_match():
    x, idx = torch.randn(2, 3), _map([0], [1])
    with pytest.raises(ValueError, match="topk_idx is on meta but x on cpu"):
        native.moe_permute(x, idx.to("meta"), 2, 1)
    mode, (fx,) = _fake((x,))
    with mode, pytest.raises(ValueError, match="topk_idx is on meta but x on cpu"):
        OPS.moe_permute(fx, torch.empty(2, 1, dtype=torch.long, device="meta"), 2, 1)


def test_fronts_name_arguments_that_are_not_tensors():
    with pytest.raises(TypeError, match="row_map must be a torch.Tensor, got NoneType"):
        native.moe_unpermute(Y, None, W)
    with pytest.raises(TypeError, match="topk_idx must be a torch.Tensor, got list"):
        native.moe_permute(Y, [[0]], 2, 1)
    with pytest.raises(TypeError, match="lse_b must be a torch.Tensor, got float"):
        native.merge_attn_states(*MERGE[:3], 0.0)


def test_an_allocation_that_fails_names_the_tensor():
    """Padding 4096 experts to 65536 rows each of a 4096-wide x: 4 TiB that no allocator gives.
    Before, such failures read ``torch_call_dispatcher("aten::new_empty", ...) API call failed``.
    """
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("with vm.overcommit_memory=1 the allocation succeeds and zeroing it OOMs")
    x, idx = torch.zeros(4096, 4096), torch.arange(4096).view(-1, 1)
    with pytest.raises(RuntimeError, match=r"could not allocate x_sorted \[268435456, 4096\] of "
                       r"torch.float32 on cpu \(out of memory"):  # fmt: skip
        OPS.moe_permute(x, idx, 4096, 65536)


# --- valid edge inputs work, against plain PyTorch ---------------------------------------------


def test_edge_inputs_work():
    x = torch.randn(3, 5)
    # the limits themselves, dropped slots only, no tokens, no columns
    for idx, experts, alignment in [
        (_map([4095], [0], [4095]), 4096, 1),
        (_map([1], [0], [1]), 2, 65536),
        (_map([-1], [-1], [-1]), 3, 128),
    ]:
        x_sorted, row_map, counts = native.moe_permute(x, idx, experts, alignment)
        assert counts.tolist() == torch.bincount(idx[idx >= 0], minlength=experts).tolist()
        kept = row_map >= 0
        assert torch.equal(x_sorted[row_map[kept]], x[kept.nonzero()[:, 0]])
        assert x_sorted.shape[0] == sum(-(-int(c) // alignment) * alignment for c in counts)
        padding = torch.ones(x_sorted.shape[0], dtype=torch.bool)
        padding[row_map[kept]] = False
        assert x_sorted[padding].eq(0).all()
        w = torch.rand(3, 1)
        want = torch.where(kept, w, 0) * x
        torch.testing.assert_close(native.moe_unpermute(x_sorted, row_map, w), want)
    empty = native.moe_permute(torch.randn(0, 4), _map().view(0, 2), 4, 128)
    assert [tuple(t.shape) for t in empty] == [(0, 4), (0, 2), (4,)]
    no_slots = native.moe_permute(x, torch.zeros(3, 0, dtype=torch.long), 2, 1)
    assert no_slots[0].shape == (0, 5)
    assert native.moe_unpermute(no_slots[0], no_slots[1], torch.ones(3, 0)).eq(0).all()
    out, lse = native.merge_attn_states(*_merge(t=0))
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    q, scale = native.quantize_fp8_blockwise(torch.randn(3, 0), 1)
    assert q.shape == (3, 0) and scale.shape == (3, 0)


# --- FP8: the chain and the kernel agree bit for bit, non-finite and overflowing input too ------


def _chain(x, block_rows, ue8m0, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(native, "has_kernel", lambda name, device: False)
        return fp8.quantize_blockwise(x, block_rows, ue8m0=ue8m0)


def _same_bits(a, b):
    (qa, sa), (qb, sb) = a, b
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
    assert torch.equal(sa.view(torch.int32), sb.view(torch.int32))


NAN, POS_INF = 0x7FC00000, 0x7F800000


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_non_finite_blocks(ue8m0, monkeypatch):
    """A block with NaN: scale NaN (0x7fc00000); with +-inf: scale inf; every code NaN (0x7f).
    Before: with ue8m0 the chain gave an inf block finite codes (inf -> 448) and a NaN block the
    scale 1.0, where the kernel gave non-finite scales (issue 24)."""
    x = torch.randn(2, 384)
    x[0, 5] = float("inf")
    x[0, 200] = -float("inf")
    x[1, 130] = float("nan")
    x[1, 300] = -torch.nan  # a negative NaN: the same canonical scale
    fmt = "ue8m0" if ue8m0 else "fp32"
    got = native.quantize_fp8_blockwise(x, 1, fmt)
    _same_bits(got, _chain(x, 1, ue8m0, monkeypatch))
    q, scale = got
    bits = scale.view(torch.int32)
    assert bits[0, 0] == POS_INF and bits[0, 1] == POS_INF and bits[1, 1] == NAN
    assert bits[1, 2] == NAN and torch.isfinite(scale[0, 2]) and torch.isfinite(scale[1, 0])
    assert (
        q.view(torch.uint8)[0, :256].eq(0x7F).all() and q.view(torch.uint8)[1, 128:].eq(0x7F).all()
    )
    assert fp8.dequantize_blockwise(q, scale)[0, :256].isnan().all()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_float64_beyond_float32_is_inf_on_both_paths(ue8m0, monkeypatch):
    """1e39 is finite in float64 and inf in float32: before, the chain clamped it with ue8m0 and
    gave a NaN block without (issue 24); now it is an inf block either way."""
    x = torch.randn(1, 256, dtype=torch.float64)
    x[0, 3] = 1e39
    x[0, 200] = 3.0e38  # finite in float32 too
    got = OPS.quantize_fp8_blockwise(x, 1, "ue8m0" if ue8m0 else "fp32")
    _same_bits(got, _chain(x, 1, ue8m0, monkeypatch))
    assert got[1].view(torch.int32)[0, 0] == POS_INF and torch.isfinite(got[1][0, 1])


_SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1e-12, 3.4028235e38, -3.4028235e38,
             448.0, 448.00003, float("inf"), -float("inf"), float("nan")]  # fmt: skip
_values = st.one_of(
    st.sampled_from(_SPECIALS),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.floats(-1e3, 1e3, width=32),
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 300),
    data=st.data(),
    block_rows=st.sampled_from([1, 128]),
    ue8m0=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_fp8_chain_and_kernel_identical_property(rows, cols, data, block_rows, ue8m0, dtype):
    """Random blocks mixing inf, NaN, subnormals, the float32 extremes and ordinary values: the
    native kernel and the PyTorch chain (fp8.quantize_blockwise) give the same bits."""
    values = data.draw(st.lists(_values, min_size=rows * cols, max_size=rows * cols))
    x = torch.tensor(values, dtype=torch.float32).view(rows, cols).to(dtype)
    native_bits = OPS.quantize_fp8_blockwise(x, block_rows, "ue8m0" if ue8m0 else "fp32")
    with pytest.MonkeyPatch.context() as m:
        _same_bits(native_bits, _chain(x, block_rows, ue8m0, m))


# --- the FP8 GEMM ops and the routing telemetry, raw -----------------------------------------
#
# Each case: (name, op, args, message). The schemas are prime-rl's (tests/compat): block_size
# and the needs_grad flags are passed as prime-rl passes them.

_X, _W = torch.randn(2, 128), torch.randn(128, 128)
_Q8, _SF = torch.zeros(2, 128, dtype=fp8.FP8_DTYPE), torch.ones(1, 4)
_W3, _OFFS = torch.randn(2, 128, 128), torch.tensor([3, 4], dtype=torch.int32)
FP8_CASES = [
    ("K not a multiple of 128", "fp8_blockwise_mm",
     (torch.randn(2, 100), torch.randn(128, 100), 128), "not a multiple of 128"),
    ("x float64", "fp8_blockwise_mm",
     (_X.double(), _W, 128), "x must be bfloat16, float16 or float32"),
    ("x and weight disagree on K", "fp8_blockwise_mm",
     (_X, torch.randn(128, 256), 128), "with the same K"),
    ("block_size 64", "fp8_blockwise_mm", (_X, _W, 64), "block_size must be 128 .*got 64"),
    ("x_fp8 without x_sf", "fp8_blockwise_mm",
     (_X, _W, 128, 0, _Q8), "x_fp8 and x_sf come together .*got only x_fp8"),
    ("x_fp8 of another shape", "fp8_blockwise_mm",
     (_X, _W, 128, 0, _Q8[:1], _SF), r"x_fp8 has shape \(1, 128\) but x is \(2, 128\)"),
    ("x_sf too short", "fp8_blockwise_mm",
     (_X, _W, 128, 0, _Q8, _SF[:, :1]), r"x_sf has shape \(1, 1\) .*\[1, >= 2\]"),
    ("x_sf float64", "fp8_blockwise_mm",
     (_X, _W, 128, 0, _Q8, _SF.double()), "x_sf must be float32"),
    ("out_dtype int32", "fp8_blockwise_mm",
     (_X, _W, 128, 0, None, None, None, torch.int32), "out_dtype must be torch.bfloat16.*int32"),
    ("backward: grad_output of another shape", "fp8_blockwise_mm_backward",
     (torch.randn(3, 128), _X, _W, 128, True, True),
     r"grad_output must have the forward output's shape \[2, 128\], got \[3, 128\]"),
    ("backward: block_size 256", "fp8_blockwise_mm_backward",
     (torch.randn(2, 128), _X, _W, 256, True, True), "block_size must be 128"),
    ("offs past the rows", "grouped_fp8_gemm",
     (torch.randn(4, 128), _W3, torch.tensor([1, 5], dtype=torch.int32)),
     "offs must be .*finish at the row count of x"),
    ("offs decreasing", "grouped_fp8_gemm",
     (torch.randn(4, 128), _W3, torch.tensor([3, 1], dtype=torch.int32)), "non-decreasing"),
    ("offs int64", "grouped_fp8_gemm",
     (torch.randn(4, 128), _W3, torch.tensor([3, 4])), "offs must be a 1-D int32 tensor of 2"),
    ("weight [G, N, K] (not torch._grouped_mm's [G, K, N])", "grouped_fp8_gemm",
     (torch.randn(4, 128), torch.randn(2, 256, 128), _OFFS), r"weight \[G, K, N\]"),
    ("backward: offs past the rows", "grouped_fp8_gemm_backward",
     (torch.randn(4, 128), torch.randn(4, 128), _W3, torch.tensor([3, 9], dtype=torch.int32),
      True, True), "finish at the row count of x"),
    ("backward: grad_output of another shape", "grouped_fp8_gemm_backward",
     (torch.randn(4, 256), torch.randn(4, 128), _W3, _OFFS, True, True),
     r"grad_output must have the forward output's shape \[4, 128\], got \[4, 256\]"),
    ("gate and up weights of other shapes", "fp8_gate_up_mm",
     (torch.randn(4, 128), _W, torch.randn(256, 128), 128), "of one shape"),
    ("gate_up of an odd width", "fp8_clamped_swiglu",
     (torch.randn(4, 200), 1.0), r"gate_up must be \[T, 2I\]"),
    ("backward: gate_up not the GEMM's output", "fp8_gate_up_clamped_swiglu_backward",
     (torch.randn(2, 128), _X, _W, _W, torch.randn(2, 512), 1.0, 128, True, True),
     "gate_up must be fp8_gate_up_mm's output"),
]  # fmt: skip


_Q, _KV = torch.randn(4, 8, 96), torch.randn(16, 1, 96)
_IDX = torch.randint(-1, 16, (4, 1, 6), dtype=torch.int32)
_MLA_BACKWARD = (_Q, _KV, _IDX, torch.randn(4, 8, 64), torch.randn(4, 8), 0.1, 64, "reference")
OTHER_CASES = [
    ("int64 indices", "sparse_mla",
     (_Q, _KV, _IDX.long(), 0.1, 64, "reference"), "indices must be int32"),
    ("d_v above d_qk", "sparse_mla",
     (_Q, _KV, _IDX, 0.1, 200, "reference"), r"d_v must be in \[1, d_qk=96\]"),
    ("softmax_scale inf", "sparse_mla",
     (_Q, _KV, _IDX, float("inf"), 64, "reference"), "softmax_scale must be finite"),
    ("indices of other tokens", "sparse_mla",
     (_Q, _KV, _IDX[:2], 0.1, 64, "reference"), r"indices must be \[tokens"),
    ("backward: dout of another d_v", "sparse_mla_backward",
     (torch.randn(4, 8, 32), *_MLA_BACKWARD),
     r"dout must be torch.float32 \[4, 8, 64\] .*got torch.float32 \[4, 8, 32\]"),
    ("backward: lse transposed", "sparse_mla_backward",
     (torch.randn(4, 8, 64), *_MLA_BACKWARD[:3], torch.randn(4, 8, 64), torch.randn(8, 4),
      *_MLA_BACKWARD[5:]),
     r"lse must be torch.float32 \[4, 8\]"),
    ("token_counts of other experts", "record_moe_routing_statistics",
     (torch.zeros(4), torch.zeros(()), torch.ones(3), torch.ones(())),
     r"token_counts has shape \(3,\) but tokens_per_expert has \(4,\)"),
    ("float counts into an int64 counter", "record_moe_routing_statistics",
     (torch.zeros(4, dtype=torch.long), torch.zeros(()), torch.ones(4), torch.ones(())),
     "token_counts is torch.float32, which tokens_per_expert"),
    # issue 31: torch said "more than one element of the written-to tensor refers to a single
    # memory location"
    ("expanded tokens_per_expert", "record_moe_routing_statistics",
     (torch.zeros(1).expand(4), torch.zeros(()), torch.ones(4), torch.ones(())),
     r"tokens_per_expert is an expanded view .*pass a tensor that owns its elements "
     r"\(torch.zeros\(4\) or tokens_per_expert.clone\(\)\)"),
    ("confidence not reduced", "record_moe_routing_statistics",
     (torch.zeros(4), torch.zeros(()), torch.ones(4), torch.ones(5)),
     r"confidence has shape \(5,\) but routing_confidence_sum has \(\)"),
]  # fmt: skip
OP_CASES = FP8_CASES + OTHER_CASES


@pytest.mark.parametrize(("op", "args", "message"), [c[1:] for c in OP_CASES],
                         ids=[f"{c[1]}: {c[0]}" for c in OP_CASES])  # fmt: skip
def test_python_ops_refuse_bad_input(op, args, message):
    with pytest.raises((ValueError, TypeError), match=message):
        getattr(OPS, op)(*args)


def test_every_prime_rl_op_has_bad_input_cases():
    """A new op in the namespace needs its cases here."""
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("prime_rl::")}  # fmt: skip
    covered = {c[0] for c in METADATA + VALUES + RAW_VALUES} | {c[1] for c in OP_CASES}
    assert names - covered == set()


# --- FP8 Python entry points (issue 31: silent results) ----------------------------------------

_A, _SA = fp8.quantize_blockwise(torch.ones(4, 256), 1)
_B, _SB = fp8.quantize_blockwise(torch.ones(128, 256), 128)
FP8_FUNCTION_CASES = [
    ("dequantize: a scale of no layout of q", fp8.dequantize_blockwise,
     (_A, torch.ones(3, 5)), r"scale has shape \(3, 5\) but q \(4, 256\) needs \(4, 2\) "
     r"\(1x128 blocks\) or \(1, 2\) \(128x128 blocks\)"),
    ("dequantize: float64 scale", fp8.dequantize_blockwise,
     (_A, _SA.double()), "scale must be float32"),
    ("dequantize: q not FP8", fp8.dequantize_blockwise,
     (_A.float(), _SA), "q must be torch.float8_e4m3fn"),
    ("fp8_gemm_nt: out_dtype int32", fp8.fp8_gemm_nt,
     (_A, _SA, _B, _SB, torch.int32), r"out_dtype must be torch.bfloat16, torch.float16 or "
     r"torch.float32 \(the fp32 product, rounded once\), got torch.int32"),
    ("fp8_gemm_nt: out_dtype float64", fp8.fp8_gemm_nt,
     (_A, _SA, _B, _SB, torch.float64), "out_dtype must be .*got torch.float64"),
    ("fp8_gemm_nt: a_scale of another layout", fp8.fp8_gemm_nt,
     (_A, _SA[:1], _B, _SB), r"a_scale has shape \(1, 2\) .*needs \(4, 2\)"),
    ("fp8_gemm_nt: b_scale of another layout", fp8.fp8_gemm_nt,
     (_A, _SA, _B, _SA), r"b_scale has shape \(4, 2\) .*needs \(1, 2\)"),
    ("grouped_fp8_gemm_nt: out_dtype int32", fp8.grouped_fp8_gemm_nt,
     (_A, _SA, _B[None], _SB[None], torch.tensor([4], dtype=torch.int32), torch.int32),
     "out_dtype must be .*got torch.int32"),
    ("grouped_fp8_gemm_nt: b_scale of another layout", fp8.grouped_fp8_gemm_nt,
     (_A, _SA, _B[None], _SA[None], torch.tensor([4], dtype=torch.int32)),
     r"b_scale has shape \(1, 4, 2\) .*needs \(1, 1, 2\)"),
    ("accumulate_wgrad_fp32: key 0", fp8.accumulate_wgrad_fp32,
     (0, lambda: None), "key must be a nonzero int .*got 0"),
    ("accumulate_wgrad_fp32: not callable", fp8.accumulate_wgrad_fp32,
     (3, torch.zeros(2)), "accumulator must be a callable"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "args", "message"), [c[1:] for c in FP8_FUNCTION_CASES],
                         ids=[c[0] for c in FP8_FUNCTION_CASES])  # fmt: skip
def test_fp8_functions_refuse_bad_input(fn, args, message):
    with pytest.raises((ValueError, TypeError), match=message):
        fn(*args)


def test_wgrad_accumulator_of_another_shape_is_named():
    x, w = torch.randn(2, 128, requires_grad=True), torch.randn(128, 128, requires_grad=True)
    fp8.accumulate_wgrad_fp32(11, lambda: torch.zeros(3))
    try:
        out = OPS.fp8_blockwise_mm(x, w, 128, 11)
        with pytest.raises(ValueError, match=r"accumulator of wgrad_key=11 returned .*\(3,\)"):
            out.sum().backward()
    finally:
        fp8.accumulate_wgrad_fp32(11, None)


# --- prime-rl's deepep ops: refused before any communication ----------------------------------


class _OneOfTwoRanks:
    """A group stand-in: every case below is refused before the buffer communicates."""

    def size(self):
        return 2

    def rank(self):
        return 0


@pytest.fixture
def reference_buffer(monkeypatch):
    from prime_ops import deepep_prime_rl

    monkeypatch.setattr(deepep_prime_rl, "_current", None)
    deepep_prime_rl.create_buffer(_OneOfTwoRanks(), 16, backend="reference")


_TOKENS = torch.zeros(3, 8, dtype=torch.bfloat16)
_TOPK = torch.tensor([[0, 1], [2, 3], [1, 2]])
_WEIGHTS = torch.full((3, 2), 0.5)
DEEPEP_CASES = [
    ("x float32", "dispatch", (_TOKENS.float(), _TOPK, _WEIGHTS, 4),
     r"x must be a \[tokens, hidden\] bfloat16 tensor"),
    ("hidden 4", "dispatch", (_TOKENS[:, :4].contiguous(), _TOPK, _WEIGHTS, 4),
     "hidden must be a multiple of 8"),
    ("topk_idx int32", "dispatch", (_TOKENS, _TOPK.int(), _WEIGHTS, 4),
     "topk_idx must be int64 .*got dtype torch.int32"),
    ("topk_weights bf16", "dispatch", (_TOKENS, _TOPK, _WEIGHTS.bfloat16(), 4),
     r"topk_weights must be float32 .*top_scores.float\(\)"),
    ("num_experts not a multiple of the ranks", "dispatch", (_TOKENS, _TOPK, _WEIGHTS, 3),
     "num_experts=3 must be a positive multiple of the group size 2"),
    ("an expert past num_experts", "dispatch", (_TOKENS, _TOPK + 2, _WEIGHTS, 4),
     r"topk_idx values must lie in \[-1, num_experts=4\) .*got \[4, 5, 4\]"),
    ("handle_id float", "combine", (_TOKENS, torch.ones(1), 3),
     r"handle_id must be the CPU int64 tensor of shape \(1,\)"),
    ("handle_id of no dispatch", "combine", (_TOKENS, torch.tensor([10**9]), 3),
     "handle_id 1000000000 names no live dispatch"),
    ("backward: handle_id of shape (2,)", "dispatch_backward",
     (_TOKENS, _WEIGHTS, torch.zeros(2, dtype=torch.int64), 3), r"shape \(1,\)"),
    ("backward: grad_topk_weights of other rows", "dispatch_backward",
     (_TOKENS, _WEIGHTS[:2], torch.zeros(1, dtype=torch.int64), 3),
     r"grad_topk_weights must have shape \[3, \*\]"),
    ("backward: grad float32", "combine_backward",
     (_TOKENS.float(), torch.zeros(1, dtype=torch.int64), 3), "grad must be a .*bfloat16"),
]  # fmt: skip


@pytest.mark.parametrize(("op", "args", "message"), [c[1:] for c in DEEPEP_CASES],
                         ids=[f"{c[1]}: {c[0]}" for c in DEEPEP_CASES])  # fmt: skip
def test_deepep_ops_refuse_bad_input_before_communicating(reference_buffer, op, args, message):
    with pytest.raises((ValueError, TypeError), match=message):
        getattr(torch.ops.deepep, op)(*args)


def test_deepep_buffer_bad_input(monkeypatch):
    from prime_ops import deepep_prime_rl

    monkeypatch.setattr(deepep_prime_rl, "_current", None)
    with pytest.raises(RuntimeError, match=r"no DeepEP buffer: call .*create_buffer"):
        torch.ops.deepep.dispatch(_TOKENS, _TOPK, _WEIGHTS, 4)
    with pytest.raises(ValueError, match="backend must be one of .*got 'nccl'"):
        deepep_prime_rl.create_buffer(_OneOfTwoRanks(), 16, backend="nccl")
    with pytest.raises(ValueError, match="hidden_bytes=10 must be a positive multiple of 16"):
        deepep_prime_rl.create_buffer(_OneOfTwoRanks(), 10, backend="reference")
