"""What the prime_rl_attn op boundary costs.

CPU (always): eager forward time of ``varlen_attention(backend="sdpa")`` against calling
``torch.nn.functional.scaled_dot_product_attention`` on the same packed batch (one call per
sequence, as a hand-written loop would), and against the op's own kernel function called without
the op (the pure dispatch/validation overhead). Ratios are from one run of each loop
(medians).

GPU (when CUDA is present): forward+backward time of each installed backend through the op
against that backend's own function on the same inputs.

    python benchmarks/attention.py [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from itertools import pairwise

import torch
import torch.nn.functional as F

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops.attn import varlen_attention
from prime_ops.attn.varlen import BACKENDS, VarlenArgs


def _time(fn, iters: int, sync=lambda: None) -> float:
    """Median seconds per call after warm-up (the first op call pays one-time set-up; the median
    keeps other processes' load spikes out of the ratio)."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _packed(lengths, heads, head_dim, dtype, device, requires_grad=False):
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, heads, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
        for _ in range(3)
    )
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return q, k, v, cu, offsets


def cpu_overhead(iters: int) -> dict:
    lengths, heads, head_dim = [64, 32, 96, 64], 4, 32
    q, k, v, cu, offsets = _packed(lengths, heads, head_dim, torch.float32, "cpu")
    n = max(lengths)
    scale = head_dim**-0.5

    def op():
        varlen_attention(q, k, v, cu, cu, n, n, causal=True)

    def op_unchecked():
        varlen_attention(q, k, v, cu, cu, n, n, causal=True, check_cu_seqlens=False)

    def kernel():
        BACKENDS["sdpa"].forward(q, k, v, VarlenArgs(cu, cu, n, n, True, scale, -1, -1, 0.0))

    def sdpa_loop():
        for start, end in pairwise(offsets):
            F.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1) for t in (q, k, v)), is_causal=True
            )

    with torch.no_grad():
        t_op, t_kernel, t_sdpa = _time(op, iters), _time(kernel, iters), _time(sdpa_loop, iters)
        t_unchecked = _time(op_unchecked, iters)
    return {
        "shape": {"lengths": lengths, "heads": heads, "head_dim": head_dim, "dtype": "float32"},
        "op_us": t_op * 1e6,
        "op_unchecked_us": t_unchecked * 1e6,
        "kernel_us": t_kernel * 1e6,
        "direct_sdpa_us": t_sdpa * 1e6,
        "op_over_direct_sdpa": t_op / t_sdpa,
        "op_over_own_kernel": t_op / t_kernel,
        "op_unchecked_over_own_kernel": t_unchecked / t_kernel,
    }


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _direct_calls(q, k, v, cu, n, scale):
    """Each installed backend's own varlen entry point (fwd+bwd through its autograd)."""
    calls = {}
    if _installed("flash_attn.flash_attn_interface") and _installed("flash_attn_2_cuda"):
        from flash_attn import flash_attn_varlen_func

        calls["fa2"] = lambda: flash_attn_varlen_func(
            q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True
        )
    if _installed("flash_attn_3"):
        from flash_attn_3.flash_attn_interface import flash_attn_varlen_func as fa3_varlen

        calls["fa3"] = lambda: fa3_varlen(q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True)
    if _installed("flash_attn.cute"):
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

        calls["fa4"] = lambda: fa4_varlen(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=n,
            max_seqlen_k=n,
            softmax_scale=scale,
            causal=True,
        )
    return calls


def gpu_backends(iters: int) -> dict:
    lengths, heads, head_dim = [2048, 1024, 3072, 2048], 16, 128
    q, k, v, cu, _ = _packed(lengths, heads, head_dim, torch.bfloat16, "cuda", requires_grad=True)
    n, scale = max(lengths), head_dim**-0.5
    dout = torch.randn_like(q)
    results = {}
    for name, direct in _direct_calls(q, k, v, cu, n, scale).items():

        def through_op(name=name):
            out, _ = varlen_attention(q, k, v, cu, cu, n, n, causal=True, backend=name)
            out.backward(dout)

        def own_function(direct=direct):
            out = direct()
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dout)

        t_op = _time(through_op, iters, torch.cuda.synchronize)
        t_own = _time(own_function, iters, torch.cuda.synchronize)
        results[name] = {
            "op": f"prime_rl_attn::{BACKENDS[name].op}_varlen",
            "op_ms": t_op * 1e3,
            "own_ms": t_own * 1e3,
            "op_over_own": t_op / t_own,
        }
    return {
        "shape": {"lengths": lengths, "heads": heads, "head_dim": head_dim, "dtype": "bfloat16"},
        "fwd_bwd": results,
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    report = {"cpu": cpu_overhead(args.iters)}
    if torch.cuda.is_available():
        report["gpu"] = gpu_backends(args.iters)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    cpu = report["cpu"]
    print(
        f"cpu eager forward: op {cpu['op_us']:.0f} us, its kernel alone {cpu['kernel_us']:.0f} "
        f"us, direct SDPA loop {cpu['direct_sdpa_us']:.0f} us"
    )
    print(f"  op / own kernel = {cpu['op_over_own_kernel']:.3f}   (dispatch + validation)")
    print(
        f"  op(check_cu_seqlens=False) / own kernel = "
        f"{cpu['op_unchecked_over_own_kernel']:.3f}   (dispatch only)"
    )
    print(f"  op / direct SDPA = {cpu['op_over_direct_sdpa']:.3f}   (reference math + lse)")
    for name, row in report.get("gpu", {}).get("fwd_bwd", {}).items():
        print(
            f"gpu {name} ({row['op']}) fwd+bwd: op {row['op_ms']:.3f} ms, own "
            f"{row['own_ms']:.3f} ms, "
            f"ratio {row['op_over_own']:.3f}"
        )


if __name__ == "__main__":
    main()
