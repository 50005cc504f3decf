"""prime_ops' FA2, FA3 and FlashMLA calls against those libraries' host asserts, per architecture.

None of the three installs on a machine without CUDA (FA2's wheel builds against CUDA, FA3 and
FlashMLA's sparse kernels build from source), so their host checks are recorded here as data,
each with the library's commit, file and function and the condition in the library's words, and
enforced by stand-in modules that record each call. Every case runs prime_ops' real op kernel
(``check_arguments`` then the adapter) on CUDA fake tensors with torch.cuda reporting one device
of the architecture under test, and must end one of two ways:

- prime_ops calls the library, and every recorded assert passes; or
- prime_ops refuses first (ValueError, naming the backend), and the same call made through the
  adapter without prime_ops' checks fails one of the library's asserts: a refusal the library
  would not make is listed in :data:`STRICTER` with its reason.

FA2 is flash-attn 2.8.3 (the ``fa2`` extra's pin); FA3 and FlashMLA are the newest commits in the
search index, since neither has releases.
"""

from __future__ import annotations

import sys
import types
from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from prime_ops.attn import mla, varlen

# --- the libraries' host asserts, as data ---------------------------------------------------------


class Source(NamedTuple):
    repo: str
    commit: str
    file: str


FA2 = Source(
    "Dao-AILab/flash-attention",
    "060c9188beec3a8b62b33a3bfa6d5d2d44975fab",
    "csrc/flash_attn/flash_api.cpp",
)  # tag v2.8.3; the Python wrapper: flash_attn/flash_attn_interface.py (maybe_contiguous)
FA3 = Source(
    "Dao-AILab/flash-attention", "bc0e4ac01484ffb61ddc694724826bec4d9cf1c2", "hopper/flash_api.cpp"
)
FLASHMLA = Source(
    "deepseek-ai/FlashMLA", "082094b793fcc7452977d0a71a00e266a2e3061e", "csrc/api/sparse_fwd.h"
)
FLASHMLA_KERNELS = {  # the kernels' launch-time KU_ASSERTs on params (host side)
    "sm90": "csrc/sm90/prefill/sparse/phase1.cuh (B_H = B_TOPK = 64, config.h)",
    "sm100_h64": "csrc/sm100/prefill/sparse/fwd/head64/phase1.cuh (B_TOPK = 64)",
    "sm100_h128": "csrc/sm100/prefill/sparse/fwd/head128/phase1.cuh (B_TOPK = 128)",
    "sm100_small": "csrc/sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.cuh (B_TOPK = 64)",
}

ASSERTS = {
    # FA2 mha_varlen_fwd / mha_varlen_bwd (the Python custom ops make q, k, v, out, dout
    # contiguous in the last dim first)
    "fa2.arch": "cc_major >= 8: FlashAttention only supports Ampere GPUs or newer.",
    "fa2.dtype": "q_dtype == kFloat16 || q_dtype == kBFloat16",
    "fa2.same_dtype": "k, v (and out, dout, dq, dk, dv in the backward) have q's dtype",
    "fa2.cu_int32": "cu_seqlens_q/k.dtype() == kInt32",
    "fa2.device": "CHECK_DEVICE: every tensor on CUDA",
    "fa2.last_dim": "stride(-1) == 1: Input tensor must have contiguous last dimension",
    "fa2.cu_contiguous": "CHECK_CONTIGUOUS(cu_seqlens_q/k)",
    "fa2.batch": "batch_size > 0: batch size must be positive",
    "fa2.head_max": "head_size <= 256: ... only supports head dimension at most 256",
    "fa2.head_mult": "head_size % 8 == 0",
    "fa2.gqa": "num_heads % num_heads_k == 0",
    "fa2.shapes": "CHECK_SHAPE(q, total_q, H, D); k, v (total_k, Hk, D): v's head dim is q's",
    "fa2.cu_shape": "CHECK_SHAPE(cu_seqlens_q/k, batch_size + 1)",
    "fa2.softcap": "softcap > 0 needs p_dropout == 0",
    # FA3 mha_fwd / mha_bwd (no Python wrapper: the tensors arrive as passed)
    "fa3.arch": "dprops->major >= 8: FlashAttention only supports Ampere GPUs or newer.",
    "fa3.dtype": "fp16, bf16 or fp8_e4m3 (fwd; before SM90 and in bwd fp16/bf16 only)",
    "fa3.same_dtype": "k, v (out, dout, dq, dk, dv in the backward) have q's dtype",
    "fa3.last_dim": "stride(-1) == 1 for q, k, v (out, dout, dq, dk, dv)",
    "fa3.cu_int32": "cu_seqlens_q/k.dtype() == kInt32, max_seqlen given with them",
    "fa3.batch": "batch_size == batch_size_k",
    "fa3.head_max": "fwd: head_size <= 256; bwd: max(head_size, head_size_v) <= 256",
    "fa3.gqa": "num_heads % num_heads_k == 0",
    "fa3.dv": "head_size_v != head_size only for Q/K in (128, 192] with V in (96, 128], or Q/K <= 64 "
    "with V <= 512",
    "fa3.dv_arch": "dprops->major == 9: Only Hopper supports different V headdim",
    "fa3.head_mult": "head_size % 8 == 0 and head_size_v % 8 == 0 (16 for fp8)",
    "fa3.deterministic": "!deterministic || head_size_rounded < 256",
    "fa3.kernel": "ARCH_SWITCH (hopper/static_switch.h) runs the SM90 kernels for arch >= 90, "
    "built for sm_90a only (hopper/setup.py: cc_flag): no kernel image from SM100 on (at launch)",
    # FlashMLA sparse_attn_prefill_interface and the kernels it launches
    "mla.arch": "is_sm90a (9.0) || is_sm100f (10.x): Sparse Attention Forward Kernel is only "
    "supported on SM90a and SM100f architectures.",
    "mla.ndim": "KU_CHECK_NDIM(q, 3), (kv, 3), (indices, 3)",
    "mla.d_qk": "d_qk == 576 || d_qk == 512",
    "mla.d_v": "d_v == 512",
    "mla.device": "KU_CHECK_DEVICE(q, kv, indices)",
    "mla.dtype": "q, kv bfloat16; indices int32",
    "mla.shapes": "q (s_q, h_q, d_qk), kv (s_kv, h_kv, d_qk), indices (s_q, h_kv, topk)",
    "mla.last_dim": "KU_CHECK_LAST_DIM_CONTIGUOUS(q, kv, indices)",
    "mla.h_q": "h_q == 64 or h_q == 128: Unsupported h_q",
    "mla.h_kv": "params.h_kv == 1 (every kernel)",
    "mla.topk": "SM90: topk > 0 and topk % 128 == 0; SM100 head64: topk % 64; head128: topk % 128, "
    "or % 64 in the small-topk kernel (topk <= 1280)",
}

STRICTER = {
    "fa3_bwd_dv": "FA3's mha_bwd checks no V head-dim rule; prime_ops refuses the backward wherever "
    "it (and FA3's mha_fwd) refuses the forward: there is no forward output to differentiate",
    "flashmla_topk_64": "FlashMLA's SM100 kernels take topk multiples of 64 (head 64, or head 128 "
    "with topk <= 1280); prime_ops asks for multiples of 128 on every architecture, what SM90 needs",
}


class HostAssert(RuntimeError):
    """A recorded host assert failed: what the library would raise (its TORCH_CHECK; for
    ``fa3.kernel``, the launch's CUDA error)."""

    def __init__(self, key: str):
        super().__init__(f"{key}: {ASSERTS[key]}")
        self.key = key


def _require(ok: bool, key: str) -> None:
    if not ok:
        raise HostAssert(key)


# --- stand-in modules ---------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)


class Device:
    """The simulated GPU: what the libraries read through cudaDeviceProp."""

    major = 9
    minor = 0


def _varlen_shapes(prefix, q, k, v, cu_q, cu_k, *, same_dv: bool):
    total_q, heads, d = q.shape
    total_k, heads_k, _ = k.shape
    _require(cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, f"{prefix}.cu_int32")
    batch = cu_q.shape[0] - 1
    if prefix == "fa2":
        _require(batch > 0, "fa2.batch")
        _require(tuple(cu_k.shape) == (batch + 1,), "fa2.cu_shape")
        _require(cu_q.is_contiguous() and cu_k.is_contiguous(), "fa2.cu_contiguous")
    else:
        _require(cu_k.shape[0] - 1 == batch, "fa3.batch")
    _require(heads % heads_k == 0, f"{prefix}.gqa")
    if same_dv:
        _require(tuple(v.shape) == (total_k, heads_k, d), "fa2.shapes")
    return d, v.shape[-1]


class StandInFA2(types.ModuleType):
    """``flash_attn.flash_attn_interface`` 2.8.3: its two varlen ops, by their parameter names."""

    def __init__(self):
        super().__init__("flash_attn.flash_attn_interface")
        self.calls = []

    def _common(self, tensors, cu_q, cu_k, softcap, dropout_p):
        _require(Device.major >= 8, "fa2.arch")
        q = tensors["q"]
        _require(q.dtype in _HALF, "fa2.dtype")
        _require(all(t.dtype == q.dtype for t in tensors.values()), "fa2.same_dtype")
        _require(all(t.is_cuda for t in (*tensors.values(), cu_q, cu_k)), "fa2.device")
        _require(all(t.stride(-1) == 1 for t in tensors.values()), "fa2.last_dim")
        if softcap > 0:
            _require(dropout_p == 0, "fa2.softcap")

    def _flash_attn_varlen_forward(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
        alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
        zero_tensors=False,
    ):  # fmt: skip
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        self._common({"q": q, "k": k, "v": v}, cu_seqlens_q, cu_seqlens_k, softcap, dropout_p)
        d, _ = _varlen_shapes("fa2", q, k, v, cu_seqlens_q, cu_seqlens_k, same_dv=True)
        _require(d <= 256, "fa2.head_max")
        _require(d % 8 == 0, "fa2.head_mult")
        self.calls.append(("fwd", dict(q=q, k=k, v=v, causal=causal, softcap=softcap,
                                       window=(window_size_left, window_size_right))))  # fmt: skip
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        return torch.empty_like(q), lse, None, torch.empty(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(
        self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False,
    ):  # fmt: skip
        dout, q, k, v, out = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (dout, q, k, v, out)
        )
        tensors = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv}
        self._common(tensors, cu_seqlens_q, cu_seqlens_k, softcap, dropout_p)
        d, _ = _varlen_shapes("fa2", q, k, v, cu_seqlens_q, cu_seqlens_k, same_dv=True)
        _require(d % 8 == 0, "fa2.head_mult")
        _require(d <= 256, "fa2.head_max")
        for grad, like in ((dq, q), (dk, k), (dv, v), (out, q), (dout, q)):
            _require(grad.shape == like.shape, "fa2.shapes")
        self.calls.append(("bwd", dict(q=q, causal=causal, softcap=softcap)))
        return torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)


class StandInFA3:
    """``torch.ops.flash_attn_3``: ``fwd`` and ``bwd`` as prime_ops calls them (by keyword)."""

    def __init__(self):
        self.calls = []

    def _common(self, q, k, v, cu_q, cu_k, others=()):
        _require(Device.major >= 8, "fa3.arch")
        _require(Device.major < 10, "fa3.kernel")
        _require(all(t.dtype == q.dtype for t in (k, v, *others)), "fa3.same_dtype")
        _require(all(t.stride(-1) == 1 for t in (q, k, v, *others)), "fa3.last_dim")
        return _varlen_shapes("fa3", q, k, v, cu_q, cu_k, same_dv=False)

    def fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, is_causal, window_size_left, window_size_right, softcap, **rest):  # fmt: skip
        allowed = (*_HALF, torch.float8_e4m3fn) if Device.major >= 9 else _HALF
        _require(q.dtype in allowed, "fa3.dtype")
        d, dv = self._common(q, k, v, cu_seqlens_q, cu_seqlens_k)
        _require(d <= 256, "fa3.head_max")
        if dv != d:
            _require((128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512), "fa3.dv")
            _require(Device.major == 9, "fa3.dv_arch")
        _require(d % 8 == 0 and dv % 8 == 0, "fa3.head_mult")
        self.calls.append(("fwd", dict(q=q, causal=is_causal, softcap=softcap,
                                       window=(window_size_left, window_size_right))))  # fmt: skip
        out = q.new_empty(q.shape[0], q.shape[1], dv)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        return out, lse, None, None

    def bwd(self, *, dout, q, k, v, out, softmax_lse, dq, dk, dv, deterministic, **rest):
        _require(q.dtype in _HALF, "fa3.dtype")
        others = (out, dout, dq, dk, dv)
        d, d_v = self._common(q, k, v, rest["cu_seqlens_q"], rest["cu_seqlens_k"], others)
        _require(d % 8 == 0 and d_v % 8 == 0, "fa3.head_mult")
        _require(max(d, d_v) <= 256, "fa3.head_max")
        _require(not deterministic or -(-d // 32) * 32 < 256, "fa3.deterministic")
        self.calls.append(("bwd", dict(q=q)))
        return (None,) * 5


class StandInFlashMLA(types.ModuleType):
    """``flash_mla`` with ``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512,
    attn_sink=None, topk_length=None)`` (the signature since Jan. 2026: natural-log lse)."""

    def __init__(self):
        super().__init__("flash_mla")
        self.calls = []

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None,
                             topk_length=None):  # fmt: skip
        sm90 = (Device.major, Device.minor) == (9, 0)
        _require(sm90 or Device.major == 10, "mla.arch")
        _require(q.dim() == kv.dim() == indices.dim() == 3, "mla.ndim")
        s_q, h_q, d_qk = q.shape
        _, h_kv, _ = kv.shape
        topk = indices.shape[2]
        _require(d_qk in (512, 576), "mla.d_qk")
        _require(d_v == 512, "mla.d_v")
        _require(q.is_cuda and kv.is_cuda and indices.is_cuda, "mla.device")
        ok = q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
        _require(ok, "mla.dtype")
        ok = kv.shape[2] == d_qk and tuple(indices.shape[:2]) == (s_q, h_kv)
        _require(ok, "mla.shapes")
        _require(all(t.stride(-1) == 1 for t in (q, kv, indices)), "mla.last_dim")
        _require(h_q in (64, 128), "mla.h_q")
        _require(h_kv == 1, "mla.h_kv")
        if sm90:
            _require(topk > 0 and topk % 128 == 0, "mla.topk")
        else:
            block = 64 if h_q == 64 or topk <= 1280 else 128
            _require(topk > 0 and topk % block == 0, "mla.topk")
        self.calls.append(dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v))
        lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
        return q.new_empty(s_q, h_q, d_v), torch.empty_like(lse), lse


# --- the simulated device and the stand-ins in place ---------------------------------------------

ARCHES = {"sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}


class Libraries(NamedTuple):
    fa2: StandInFA2
    fa3: StandInFA3
    mla: StandInFlashMLA


@pytest.fixture(params=sorted(ARCHES))
def libs(request, monkeypatch):
    major, minor = ARCHES[request.param]
    monkeypatch.setattr(Device, "major", major)
    monkeypatch.setattr(Device, "minor", minor)
    monkeypatch.delenv("FLASH_ATTENTION_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    fa2, fa3, flash_mla = StandInFA2(), StandInFA3(), StandInFlashMLA()
    package = types.ModuleType("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn_3", types.ModuleType("flash_attn_3"))
    monkeypatch.setitem(sys.modules, "flash_attn_3._C", types.ModuleType("flash_attn_3._C"))
    monkeypatch.setattr(torch.ops, "flash_attn_3", fa3, raising=False)
    monkeypatch.setitem(sys.modules, "flash_mla", flash_mla)
    return Libraries(fa2, fa3, flash_mla)


# --- cases: every option a prime_ops attention call passes on ------------------------------------


class Case(NamedTuple):
    d: int
    dv: int
    heads: int = 8
    heads_k: int = 2
    dtype: torch.dtype = torch.bfloat16
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    lengths: tuple[int, ...] = (5, 3)
    layout: str = "contiguous"  # or "head_strided": unit stride in the head dim only


# Slicing or copying a fake CUDA tensor needs torch's CUDA build, so a head dim FA2 pads (its
# output is sliced back) and a layout prime_ops copies are not among these cases.
CASES = [
    Case(64, 64),
    Case(128, 128, causal=False),
    Case(128, 128, window=(16, 0)),
    Case(128, 128, softcap=30.0),
    Case(96, 96, heads=4, heads_k=4),
    Case(256, 256),
    Case(264, 264),
    Case(40, 40),
    Case(192, 128),
    Case(64, 512),
    Case(128, 64),
    Case(128, 128, dtype=torch.float16),
    Case(128, 128, dtype=torch.float32),
    Case(64, 64, heads=6, heads_k=4),
    Case(64, 64, lengths=(1, 1, 1)),  # one query per sequence: FA2's GQA reshape path
    Case(64, 64, lengths=(0, 1, 2)),
    Case(64, 64, layout="head_strided"),
]
FA3_ONLY = [Case(36, 36)]  # FA2 would pad it; FA3 refuses it


def _qkv(case: Case):
    total = sum(case.lengths)
    # Host checks read only metadata: the offsets' values are never looked at.
    cu = torch.empty(len(case.lengths) + 1, dtype=torch.int32, device="cuda")

    def make(heads, dim):
        shape = (total, heads, dim)
        if case.layout == "head_strided":  # a slice of rows twice as wide
            stride = (heads * dim * 2, dim * 2, 1)
            return torch.empty_strided(shape, stride, dtype=case.dtype, device="cuda")
        return torch.empty(shape, dtype=case.dtype, device="cuda")

    q, k, v = make(case.heads, case.d), make(case.heads_k, case.d), make(case.heads_k, case.dv)
    return q, k, v, cu, max(case.lengths)


def _flash_args(case: Case, cu, max_len):
    scale = case.d**-0.5
    return (cu, cu, max_len, max_len, scale, case.causal, *case.window, case.softcap)


def _adapter_call(backend, q, k, v, a, backward):
    """The adapter's library call without prime_ops' checks: what the library would be asked."""
    spec = varlen.BACKENDS[backend]
    q, k, v = map(varlen.head_dim_strided, (q, k, v))
    if backward:
        out, dout = q.new_empty(*q.shape[:2], v.shape[2]), q.new_empty(*q.shape[:2], v.shape[2])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        spec.backward(dout, q, k, v, out, lse, a)
    else:
        spec.forward(q, k, v, a)


def _run(backend: str, case: Case, calls: list, backward: bool):
    """prime_ops' op kernel on fake CUDA tensors; returns what happened, checked both ways."""
    forward_op, backward_op = varlen.OPS[backend]
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, cu, max_len = _qkv(case)
        args = _flash_args(case, cu, max_len)
        try:
            if backward:
                dout = q.new_empty(*q.shape[:2], v.shape[2])
                out = torch.empty_like(dout)
                lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device="cuda")
                backward_op._init_fn(dout, q, k, v, out, lse, *args)
            else:
                forward_op._init_fn(q, k, v, *args)
        except HostAssert as exc:
            pytest.fail(f"prime_ops passed {backend} a call its host code refuses: {exc} ({case})")
        except (ValueError, TypeError) as refusal:
            assert not calls, calls
            a = varlen.FLASH_SCHEMA.bind(q, k, cu, cu, args[2:], {})
            try:  # the library refuses it too ...
                _adapter_call(backend, q, k, v, a, backward)
            except HostAssert:
                return "refused"
            # ... or it is a backward whose forward the library refuses (STRICTER["fa3_bwd_dv"])
            assert backward, f"prime_ops refuses what {backend} takes: {refusal} ({case})"
            with pytest.raises(HostAssert):
                _adapter_call(backend, q, k, v, a, False)
            return "refused"
    (call,) = calls
    return call


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:2])) + str(c[2:]))
def test_fa2_calls_pass_flash_attn_2_8_3_host_asserts(libs, case, backward):
    result = _run("fa2", case, libs.fa2.calls, backward)
    if result != "refused" and not backward:
        _, seen = result
        assert seen["q"].shape[-1] % 8 == 0 and seen["causal"] == case.causal
        assert seen["window"] == case.window and seen["softcap"] == case.softcap


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize(
    "case", CASES + FA3_ONLY, ids=lambda c: "-".join(map(str, c[:2])) + str(c[2:])
)
def test_fa3_calls_pass_fa3_host_asserts(libs, case, backward):
    result = _run("fa3", case, libs.fa3.calls, backward)
    if result != "refused" and not backward:
        _, seen = result
        assert seen["causal"] == case.causal and seen["window"] == case.window


def test_the_architectures_decide_what_runs(libs):
    """Per architecture, which of the head-dim pairs above reach each library (a summary that
    fails when a limit moves)."""
    reached = {}
    for backend, calls in (("fa2", libs.fa2.calls), ("fa3", libs.fa3.calls)):
        for case in CASES[:11] + (FA3_ONLY if backend == "fa3" else []):
            calls.clear()
            reached[backend, case.d, case.dv] = _run(backend, case, calls, False) != "refused"
    assert reached["fa2", 256, 256] and not reached["fa2", 264, 264]
    assert reached["fa2", 40, 40] and not reached["fa2", 192, 128]
    assert not reached["fa3", 36, 36] and not reached["fa3", 264, 264]
    hopper = Device.major == 9
    assert reached["fa3", 192, 128] == reached["fa3", 64, 512] == hopper
    assert not reached["fa3", 128, 64]
    assert reached["fa3", 64, 64] == reached["fa3", 256, 256] == (Device.major < 10)


# --- FlashMLA: prime_rl::sparse_mla with backend="flashmla" ---------------------------------------


class MLACase(NamedTuple):
    heads: int = 128
    d_qk: int = 576
    d_v: int = 512
    topk: int = 256
    kv_heads: int = 1
    dtype: torch.dtype = torch.bfloat16
    stricter: str | None = None  # a STRICTER key where prime_ops refuses what the library takes


MLA_CASES = [
    MLACase(),
    MLACase(heads=64),
    MLACase(d_qk=512),
    MLACase(topk=2048),
    MLACase(topk=64, stricter="flashmla_topk_64"),
    MLACase(heads=64, topk=192, stricter="flashmla_topk_64"),
    MLACase(topk=100),
    MLACase(heads=32),
    MLACase(d_qk=192, d_v=128),
    MLACase(d_v=256),
    MLACase(kv_heads=2, heads=128),
    MLACase(dtype=torch.float16),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: str(tuple(c)[:6]))
def test_flashmla_calls_pass_flashmla_host_asserts(libs, case):
    calls = libs.mla.calls
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(6, case.heads, case.d_qk, dtype=case.dtype, device="cuda")
        kv = torch.empty(40, case.kv_heads, case.d_qk, dtype=case.dtype, device="cuda")
        indices = torch.empty(6, case.kv_heads, case.topk, dtype=torch.int32, device="cuda")
        try:
            out, lse = mla._sparse_mla._init_fn(q, kv, indices, 0.1, case.d_v, "flashmla")
        except HostAssert as exc:
            pytest.fail(f"prime_ops passed FlashMLA a call it refuses: {exc} ({case})")
        except ValueError as refusal:
            assert not calls and "'flashmla'" in str(refusal), refusal
            if case.stricter is not None and Device.major == 10:
                assert case.stricter in STRICTER
                mla.flashmla_forward(q, kv, indices, 0.1, case.d_v)  # the library takes it
            else:
                with pytest.raises(HostAssert):
                    mla.flashmla_forward(q, kv, indices, 0.1, case.d_v)
            return
    assert case.stricter is None or Device.major != 10, "prime_ops takes what STRICTER refuses"
    (call,) = calls
    assert call["sm_scale"] == 0.1 and call["d_v"] == case.d_v
    assert out.shape == (6, case.heads, case.d_v) and lse.shape == (6, case.heads)
