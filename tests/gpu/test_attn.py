"""Real FlashAttention 2/3/4 through prime_rl_attn against the sdpa reference (needs CUDA)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from libraries import cases as library_cases

import prime_ops
from prime_ops.attn import ring_attention, varlen_attention

pytestmark = pytest.mark.gpu

MODULES = {
    "fa2": "flash_attn.flash_attn_interface",
    "fa3": "flash_attn_3._C",
    "fa4": "flash_attn.cute.interface",
}


def _available(backend: str) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(MODULES[backend])
    except ImportError:
        return False
    return True


def _requires(backend: str):
    return pytest.mark.skipif(not _available(backend), reason=f"needs CUDA and {backend}")


BACKENDS = [pytest.param(name, marks=_requires(name)) for name in MODULES]

CASES = {
    "causal_gqa": dict(lengths=[300, 1, 129, 512], h=8, hkv=2, d=128, causal=True),
    "plain": dict(lengths=[256, 77], h=4, hkv=4, d=64),
    "window": dict(lengths=[400, 200], h=4, hkv=1, d=64, causal=True, window=(64, 0)),
    "softcap": dict(lengths=[333, 64], h=4, hkv=2, d=128, causal=True, softcap=30.0),
    "cross_no_key_rows": dict(lengths=[128, 64], lengths_k=[64, 64], h=4, hkv=2, d=64, causal=True),
    # FA2's single-query GQA path reshapes q by batch size; an empty sequence used to break it.
    "single_query_gqa_empty": dict(
        lengths=[1, 0, 1, 1], lengths_k=[64, 32, 16, 8], h=8, hkv=2, d=64, causal=True
    ),
}


def _inputs(lengths, h, hkv, d, lengths_k=None, dtype=torch.bfloat16, dv=None):
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths_k = lengths_k or lengths

    def rand(tokens, heads, dim=d):
        return torch.randn(tokens, heads, dim, device="cuda", dtype=dtype, generator=gen)

    q, k = rand(sum(lengths), h), rand(sum(lengths_k), hkv)
    v = rand(sum(lengths_k), hkv, dv or d)

    def cu(ls):
        return torch.tensor(
            [0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
        )

    return q, k, v, cu(lengths), cu(lengths_k), max(lengths), max(lengths_k)


def _run(backend, q, k, v, *rest, dout, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attention(*leaves, *rest, backend=backend, **kwargs)
    out.backward(dout)
    return out, lse, [t.grad for t in leaves]


def _close(got, ref, rel=2e-2):
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= rel * max(ref.float().abs().max().item(), 1.0), f"max error {err}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_matches_sdpa_reference(backend, case):
    spec = dict(CASES[case])
    kwargs = {key: spec.pop(key) for key in ("causal", "window", "softcap") if key in spec}
    if "window" in kwargs:
        kwargs["window_size"] = kwargs.pop("window")
    q, k, v, *rest = _inputs(**spec)
    dout = torch.randn_like(q[..., : v.shape[-1]])
    out, lse, grads = _run(backend, q, k, v, *rest, dout=dout, **kwargs)
    ref_out, ref_lse, ref_grads = _run("sdpa", q, k, v, *rest, dout=dout, **kwargs)
    _close(out, ref_out)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())  # -inf rows, FA2's +inf normalised
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)
    for got, ref in zip(grads, ref_grads, strict=True):
        _close(got, ref, rel=5e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_without_keys_gives_minus_inf_lse(backend):
    """FA3 skips its kernel when total_k == 0 and writes lse +inf; the contract says -inf."""
    q, k, v, cu_q, cu_k, max_q, _ = _inputs([5, 3], 4, 2, 64, lengths_k=[0, 0])
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max_q, 0, backend=backend)
    assert lse.isneginf().all() and (out == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_compiles_without_graph_break(backend):
    q, k, v, cu_q, cu_k, max_q, max_k = _inputs([200, 56], 4, 2, 64)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    @torch.compile(fullgraph=True)
    def step(q, k, v):
        out, _ = varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend=backend, check_cu_seqlens=False
        )
        return out.float().square().mean()

    step(*leaves).backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in leaves)


def _library_case(case):
    """A tests/libraries case as (inputs, varlen_attention keywords)."""
    inputs = _inputs(list(case.lengths), case.h, case.hkv, case.d, dv=case.dv)
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap)
    if case.softmax_scale is not None:
        kwargs["softmax_scale"] = case.softmax_scale
    return inputs, kwargs


@_requires("fa4")
@pytest.mark.parametrize("name", sorted(library_cases.FA4_CASES))
def test_fa4_library_case_matches_sdpa(name):
    """The calls tests/libraries compiles for SM90 / SM100 without a GPU, run by FA4's kernels."""
    case = library_cases.FA4_CASES[name]
    (q, k, v, *rest), kwargs = _library_case(case)
    dout = torch.randn_like(q[..., : case.dv])
    if not case.backward:
        out, lse = varlen_attention(q, k, v, *rest, backend="fa4", **kwargs)
        ref_out, ref_lse = varlen_attention(q, k, v, *rest, backend="sdpa", **kwargs)
        _close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
        return
    out, lse, grads = _run("fa4", q, k, v, *rest, dout=dout, **kwargs)
    ref_out, ref_lse, ref_grads = _run("sdpa", q, k, v, *rest, dout=dout, **kwargs)
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
    for got, ref in zip(grads, ref_grads, strict=True):
        _close(got, ref, rel=5e-2)


@_requires("fa4")
@pytest.mark.parametrize("name", sorted(library_cases.FA4_REFUSED))
def test_fa4_library_refusal_on_device(name):
    """The calls FA4 refuses on this architecture fail before any launch, as on CPU."""
    case = library_cases.FA4_REFUSED[name]
    major, minor = torch.cuda.get_device_capability()
    if f"sm_{major}{minor}" not in case.arches:
        pytest.skip(f"FA4 refuses {name} on {', '.join(case.arches)} only")
    (q, k, v, *rest), kwargs = _library_case(case)
    if not case.backward:
        with pytest.raises(ValueError, match="cannot run head dims"):
            varlen_attention(q, k, v, *rest, backend="fa4", **kwargs)
        return
    dout = torch.randn_like(q)
    fa4_release = importlib.metadata.version("flash-attn-4")
    if case.softcap and fa4_release not in library_cases.FA4_HD256_NO_SOFTCAP:
        # from 4.0.0b39 on FA4's (256, 256) backward takes softcap: the call runs
        _, _, grads = _run("fa4", q, k, v, *rest, dout=dout, **kwargs)
        _, _, ref_grads = _run("sdpa", q, k, v, *rest, dout=dout, **kwargs)
        for got, ref in zip(grads, ref_grads, strict=True):
            _close(got, ref, rel=5e-2)
        return
    with pytest.raises(ValueError, match="cannot run head dims.*softcap"):
        _run("fa4", q, k, v, *rest, dout=dout, **kwargs)


# prime-rl's calls (src/prime_rl/trainer/models/layers/attn.py, see tests/compat): the op by name,
# q/k/v as transposed views, None max_seqlen and windows for FA4.
PRIME_RL_CALLS = {
    "fa2": lambda q, k, v, cu, n: torch.ops.prime_rl_attn.flash_attn_2_varlen(
        q, k, v, cu, cu, n, n, q.shape[-1] ** -0.5, True, -1, -1
    ),
    "fa3": lambda q, k, v, cu, n: torch.ops.prime_rl_attn.flash_attn_3_varlen(
        q, k, v, cu, cu, n, n, q.shape[-1] ** -0.5, True, -1, -1
    ),
    "fa4": lambda q, k, v, cu, n: torch.ops.prime_rl_attn.flash_attn_4_varlen(
        q, k, v, cu, cu, None, None, True, None, None
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_prime_rl_call_on_transposed_views(backend):
    q, k, v, cu, _, n, _ = _inputs([300, 1, 129], 8, 2, 128)
    views = [t.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for t in (q, k, v)]
    assert not views[0].is_contiguous() and views[0].stride(-1) == 1
    out, lse = PRIME_RL_CALLS[backend](*views, cu, n)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref_lse, ref_grads = _run("sdpa", q, k, v, cu, cu, n, n, dout=dout, causal=True)
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
    for got, ref in zip(views, ref_grads, strict=True):
        _close(got.grad, ref, rel=5e-2)


def test_missing_backend_raises_backend_unavailable():
    missing = [name for name in MODULES if not _available(name)]
    if not torch.cuda.is_available() or not missing:
        pytest.skip("needs CUDA and at least one backend that is not installed")
    q, k, v, *rest = _inputs([64], 2, 2, 64)
    with pytest.raises(prime_ops.BackendUnavailable, match=rf"prime-ops\[{missing[0]}\]"):
        varlen_attention(q, k, v, *rest, backend=missing[0])


def _ring_on_gpus(rank, world, backend):
    torch.cuda.set_device(rank)
    q, k, v, cu, _, n, _ = _inputs([700, 300, 1048], 4, 2, 64)
    shard = slice(rank * q.shape[0] // world, (rank + 1) * q.shape[0] // world)
    dout = torch.randn_like(q)
    ref_out, ref_lse, ref_grads = _run(backend, q, k, v, cu, cu, n, n, dout=dout, causal=True)
    local = [t[shard].clone().requires_grad_() for t in (q, k, v)]
    out, lse = ring_attention(*local, cu, n, causal=True, backend=backend)
    out.backward(dout[shard])
    _close(out, ref_out[shard])
    torch.testing.assert_close(lse, ref_lse[:, shard], atol=2e-2, rtol=1e-3)
    for got, ref in zip(local, ref_grads, strict=True):
        _close(got.grad, ref[shard], rel=5e-2)


def _ring_entry(rank, world, store, backend):
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _ring_on_gpus(rank, world, backend)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["sdpa", *BACKENDS])
def test_ring_on_two_gpus_over_nccl(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ring_entry, args=(2, os.path.join(tmp, "store"), backend), nprocs=2)
