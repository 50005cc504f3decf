"""DeepGEMM's host asserts that a prime_ops FP8 call can reach, as data, and a stand-in
``deep_gemm`` module that enforces them per architecture.

DeepGEMM has nothing installable (no wheel; PyPI's 1.0.0 is an early sdist that does not build),
so its host code cannot run here. Each record names the DeepGEMM commit and file it was read
from (repository deepseek-ai/DeepGEMM, the newest versions in the search index) and the
condition as DeepGEMM writes it; :class:`StandInDeepGEMM` checks the same conditions, in the same
order as DeepGEMM's dispatch, before computing the product in float64 from the scales as that
architecture reads them (SM100 keeps only the exponent of an fp32 scale).

The Python signatures are DeepGEMM's bindings: ``fp8_gemm_nt(a, b, d, c=None, recipe=None,
compiled_dims="nk", disable_ue8m0_cast=False)`` and ``m_grouped_fp8_gemm_nt_contiguous(a, b, d,
grouped_layout, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
...)``, with ``a`` and ``b`` ``(values, scales)`` pairs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

REPO = "deepseek-ai/DeepGEMM"
GEMM_API = ("csrc/apis/gemm.hpp", "0274ad7b911b99b4eb6f8d796403811cf1e18f3d")
LAYOUT = ("csrc/utils/layout.hpp", "057ca5964aae0879ff2e0eb71ee05a3cb0ba3df7")
SM90_1D2D = (
    "csrc/jit_kernels/impls/sm90_fp8_gemm_1d2d.hpp",
    "0fcd03c0040448c853585ed90e70731ba1672ecd",
)
SM90_1D1D = (
    "csrc/jit_kernels/impls/sm90_fp8_gemm_1d1d.hpp",
    "1fab197d601af1a98602f61c58434832a9b42f8b",
)
SM100_1D1D = (
    "csrc/jit_kernels/impls/sm100_fp8_fp4_gemm_1d1d.hpp",
    "057ca5964aae0879ff2e0eb71ee05a3cb0ba3df7",
)


class HostAssert(NamedTuple):
    key: str
    source: tuple[str, str]  # (file, commit)
    function: str
    condition: str  # as DeepGEMM writes it


ASSERTS = {
    a.key: a
    for a in (
        HostAssert("cd_n_major", LAYOUT, "check_major_type_cd", "t.stride(-1) == 1"),
        HostAssert(
            "ab_k_major", SM90_1D2D, "sm90_fp8_gemm_1d2d",
            "major_a == cute::UMMA::Major::K and major_b == cute::UMMA::Major::K",
        ),
        HostAssert("nt_shapes", GEMM_API, "fp8_fp4_gemm_nt", "m == m_ and n == n_ and k == k_"),
        HostAssert(
            "nt_d_dtype", GEMM_API, "fp8_fp4_gemm_nt",
            "d.scalar_type() == torch::kBFloat16 or d.scalar_type() == torch::kFloat",
        ),
        HostAssert(
            "cd_same_layout", GEMM_API, "early_return",
            "c->sizes() == d.sizes() and c->strides() == d.strides()",
        ),
        HostAssert(
            "c_dtype", GEMM_API, "early_return", "d.scalar_type() == c.value().scalar_type()"
        ),
        HostAssert(
            "sm90_fp32_scales", LAYOUT, "get_default_recipe",
            "sfa_dtype == torch::kFloat and sfb_dtype == torch::kFloat",
        ),
        HostAssert(
            "sf_mn", LAYOUT, "check_sf_layout", "sf.size(-2) == ceil_div(mn, gran_mn)"
        ),
        HostAssert(
            "sf_k", LAYOUT, "check_sf_layout",
            "sf.size(-1) == ceil_div(k, gran_k * (sf_dtype == torch::kFloat ? 1 : 4))",
        ),
        HostAssert(
            "sm90_1d2d_bf16", SM90_1D2D, "sm90_fp8_gemm_1d2d",
            "not c.has_value() and d.scalar_type() == torch::kBFloat16",
        ),
        HostAssert(
            "sm90_1d1d_accumulates", SM90_1D1D, "sm90_fp8_gemm_1d1d",
            "c.has_value() and d.scalar_type() == torch::kFloat",
        ),
        HostAssert(
            "grouped_sizes", GEMM_API, "m_grouped_fp8_fp4_gemm_nt_contiguous",
            "n > 0 and k > 0 and num_groups > 0",
        ),
        HostAssert(
            "grouped_shapes", GEMM_API, "m_grouped_fp8_fp4_gemm_nt_contiguous",
            "m == m_ and n == n_ and k == k_",
        ),
        HostAssert(
            "grouped_d_bf16", GEMM_API, "m_grouped_fp8_fp4_gemm_nt_contiguous",
            "d.scalar_type() == torch::kBFloat16",
        ),
        HostAssert(
            "grouped_layout_int", GEMM_API, "m_grouped_fp8_fp4_gemm_nt_contiguous",
            "grouped_layout.scalar_type() == torch::kInt",
        ),
        HostAssert(
            "grouped_layout_rows", GEMM_API, "m_grouped_fp8_fp4_gemm_nt_contiguous",
            "m == m__ (grouped_layout has one entry per row without the psum layout)",
        ),
        HostAssert(
            "grouped_layout_contiguous", GEMM_API, "m_grouped_fp8_fp4_gemm_nt_contiguous",
            "grouped_layout.is_contiguous()",
        ),
    )
}  # fmt: skip
"""Every assert the stand-in enforces. SM100's ``sm100_fp8_fp4_gemm_1d1d`` (SM100_1D1D) asserts
nothing on ``d`` or ``c``: the dispatch's bf16-or-fp32 check is all SM100 asks of them."""


class DeepGEMMHostAssert(RuntimeError):
    """What DeepGEMM's ``DG_HOST_ASSERT`` raises, with the record it came from."""

    def __init__(self, key: str):
        self.key = key
        a = ASSERTS[key]
        file, commit = a.source
        super().__init__(
            f"DeepGEMM host assert [{key}] {a.function} ({REPO} {file} @ {commit[:12]}): "
            f"{a.condition}"
        )


def _require(ok: bool, key: str) -> None:
    if not ok:
        raise DeepGEMMHostAssert(key)


def _read_scales(sf: torch.Tensor, arch: int, disable_ue8m0_cast: bool) -> torch.Tensor:
    """fp32 scales as the kernel reads them: exactly on SM90, only the exponent on SM100."""
    sf = sf.double()
    if arch >= 10 and not disable_ue8m0_cast:
        sf = torch.ldexp(torch.ones_like(sf), torch.frexp(sf).exponent - 1)
    return sf


def _dequantize(q, sf, gran_mn, arch, disable_ue8m0_cast):
    full = _read_scales(sf, arch, disable_ue8m0_cast)
    full = full.repeat_interleave(gran_mn, -2).repeat_interleave(128, -1)
    return q.double() * full[..., : q.shape[-2], : q.shape[-1]]


class Call(NamedTuple):
    api: str
    kernel: str
    d_dtype: torch.dtype
    accumulates: bool
    recipe: tuple[int, int, int]


class StandInDeepGEMM:
    """A ``deep_gemm`` module for one architecture (9: SM90, 10: SM100) that records each call."""

    __name__ = "deep_gemm"

    def __init__(self, arch: int):
        self.arch = arch
        self.calls: list[Call] = []

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return 128

    def _recipe(self, sfa, sfb, recipe):
        if recipe is not None:
            return tuple(recipe)
        if self.arch == 9:
            _require(sfa.dtype == sfb.dtype == torch.float32, "sm90_fp32_scales")
        return (1, 128, 128)

    def _check_sf(self, sf, mn, k, gran_mn, gran_k):
        _require(sf.shape[-2] == math.ceil(mn / gran_mn), "sf_mn")
        _require(sf.shape[-1] == math.ceil(k / gran_k), "sf_k")

    def fp8_gemm_nt(
        self, a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False
    ):
        (qa, sfa), (qb, sfb) = a, b
        _require(qa.stride(-1) == 1 and qb.stride(-1) == 1, "ab_k_major")
        _require(d.stride(-1) == 1, "cd_n_major")
        (m, k), (n, k_), (m_, n_) = qa.shape, qb.shape, d.shape
        _require(m == m_ and n == n_ and k == k_, "nt_shapes")
        _require(d.dtype in (torch.bfloat16, torch.float32), "nt_d_dtype")
        if c is not None:
            if c.data_ptr() == d.data_ptr():
                _require(c.shape == d.shape and c.stride() == d.stride(), "cd_same_layout")
            _require(c.dtype == d.dtype, "c_dtype")
        gran_a, gran_b, gran_k = self._recipe(sfa, sfb, recipe)
        self._check_sf(sfa, m, k, gran_a, gran_k)
        self._check_sf(sfb, n, k, gran_b, gran_k)
        if self.arch == 9:
            if gran_b == 1:
                kernel = "sm90_fp8_gemm_1d1d"
                _require(c is not None and d.dtype == torch.float32, "sm90_1d1d_accumulates")
            else:
                kernel = "sm90_fp8_gemm_1d2d"
                _require(c is None and d.dtype == torch.bfloat16, "sm90_1d2d_bf16")
        else:
            kernel = "sm100_fp8_fp4_gemm_1d1d"
        self.calls.append(
            Call("fp8_gemm_nt", kernel, d.dtype, c is not None, (gran_a, gran_b, gran_k))
        )
        if m == 0 or n == 0:
            return
        lhs = _dequantize(qa, sfa, gran_a, self.arch, disable_ue8m0_cast)
        product = lhs @ _dequantize(qb, sfb, gran_b, self.arch, disable_ue8m0_cast).T
        base = c.double() if c is not None else 0.0
        d.copy_(base + product)

    def m_grouped_fp8_gemm_nt_contiguous(
        self, a, b, d, grouped_layout, recipe=None, compiled_dims="nk",
        disable_ue8m0_cast=False, use_psum_layout=False,
    ):  # fmt: skip
        (qa, sfa), (qb, sfb) = a, b
        _require(grouped_layout.is_contiguous(), "grouped_layout_contiguous")
        (m, k), (groups, n, k_), (m_, n_) = qa.shape, qb.shape, d.shape
        _require(m == m_ and n == n_ and k == k_, "grouped_shapes")
        _require(n > 0 and k > 0 and groups > 0, "grouped_sizes")
        _require(d.dtype == torch.bfloat16, "grouped_d_bf16")
        _require(grouped_layout.dtype == torch.int32, "grouped_layout_int")
        _require(grouped_layout.shape == (m,), "grouped_layout_rows")
        _require(d.stride(-1) == 1, "cd_n_major")
        gran_a, gran_b, gran_k = self._recipe(sfa, sfb, recipe)
        self._check_sf(sfa, m, k, gran_a, gran_k)
        self._check_sf(sfb, n, k, gran_b, gran_k)
        kernel = (
            "sm90_m_grouped_fp8_gemm_contiguous_1d2d"
            if self.arch == 9
            else ("sm100_m_grouped_fp8_fp4_gemm_contiguous_1d1d")
        )
        self.calls.append(
            Call(
                "m_grouped_fp8_gemm_nt_contiguous", kernel, d.dtype, False, (gran_a, gran_b, gran_k)
            )
        )
        for start in range(0, m, 128):
            group = int(grouped_layout[start])
            if group >= 0:
                rows = slice(start, start + 128)
                lhs = _dequantize(qa[rows], sfa[rows], gran_a, self.arch, disable_ue8m0_cast)
                rhs = _dequantize(qb[group], sfb[group], gran_b, self.arch, disable_ue8m0_cast)
                d[rows] = (lhs @ rhs.T).to(d.dtype)
