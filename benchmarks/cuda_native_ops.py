"""The native CUDA ops of ``csrc/cuda`` against the PyTorch chains they replace, and against the
native CPU kernels' results.

The chains are ``benchmarks/native_ops.py``'s, run on the GPU (the same sizes: T = 4096 tokens,
D = 2048, top-k 8 of 64 experts, 16 heads of 128 for the merge). Each op is timed with CUDA
events, one call per sample, chain and native alternating; the ratio (chain / native, > 1: native
faster) is the median of the paired ratios. Agreement: each op's CUDA output against the CPU
kernel's on the same inputs, bitwise where both compute exactly (layouts, FP8 casts), else the
largest absolute difference.

    python -m prime_ops.native --cuda && python benchmarks/cuda_native_ops.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from native_ops import chain_merge, chain_permute, chain_unpermute  # this script's directory

from prime_ops import native
from prime_ops.fp8 import quantize_blockwise


def _event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _paired(chain, native_fn, rounds: int) -> dict:
    for _ in range(3):  # warm-up: allocator, cuBLAS, first-launch costs
        chain(), native_fn()
    ratios, chain_ms, native_ms = [], [], []
    for r in range(rounds):
        if r % 2:
            n, c = _event_ms(native_fn), _event_ms(chain)
        else:
            c, n = _event_ms(chain), _event_ms(native_fn)
        ratios.append(c / n)
        chain_ms.append(c)
        native_ms.append(n)
    return {
        "ratio": statistics.median(ratios),
        "chain_ms": statistics.median(chain_ms),
        "native_ms": statistics.median(native_ms),
    }


def _backward(fn):
    def run():
        outs = fn()
        out = outs[0] if isinstance(outs, tuple) else outs
        out.backward(torch.ones_like(out))

    return run


def _inputs(tokens, dim, top_k, experts, heads, device):
    gen = torch.Generator().manual_seed(0)
    head_dim = dim // heads
    cpu = {
        "x": torch.randn(tokens, dim, generator=gen).bfloat16(),
        "idx": torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices,
        "w": torch.rand(tokens, top_k, generator=gen),
        "rows": torch.randn(tokens * top_k, dim, generator=gen).bfloat16(),
        "out": torch.randn(tokens, heads, head_dim, generator=gen),
        "part": torch.randn(tokens, heads, head_dim, generator=gen),
        "lse": torch.randn(heads, tokens, generator=gen),
        "part_lse": torch.randn(heads, tokens, generator=gen),
        "weight": torch.randn(dim, dim, generator=gen).bfloat16(),
    }
    return {name: t.to(device) for name, t in cpu.items()}


def speed(tokens, dim, top_k, experts, heads, rounds) -> dict:
    t = _inputs(tokens, dim, top_k, experts, heads, "cuda")
    x, idx, w, rows = t["x"], t["idx"], t["w"], t["rows"]
    _, row_map, _ = native.moe_permute(x, idx, experts, 1)
    order = torch.argsort(idx.flatten(), stable=True)
    merge = (t["out"], t["lse"], t["part"], t["part_lse"])
    xg, rows_g, wg = (v.detach().requires_grad_() for v in (x, rows, w))
    merge_g = [v.detach().requires_grad_() for v in merge]
    cases = {
        "moe_permute (alignment 1)": (
            lambda: chain_permute(x, idx, experts, 1),
            lambda: native.moe_permute(x, idx, experts, 1),
        ),
        "moe_permute (alignment 128)": (
            lambda: chain_permute(x, idx, experts, 128),
            lambda: native.moe_permute(x, idx, experts, 128),
        ),
        "moe_unpermute": (
            lambda: chain_unpermute(rows, order, w, tokens, top_k),
            lambda: native.moe_unpermute(rows, row_map, w),
        ),
        "merge_attn_states": (
            lambda: chain_merge(*merge),
            lambda: native.merge_attn_states(*merge),
        ),
        "quantize_fp8_blockwise (1x128)": (
            lambda: quantize_blockwise(x, 1),
            lambda: native.quantize_fp8_blockwise(x, 1),
        ),
        "quantize_fp8_blockwise (128x128)": (
            lambda: quantize_blockwise(t["weight"], 128),
            lambda: native.quantize_fp8_blockwise(t["weight"], 128),
        ),
        "moe_permute fwd+bwd": (
            _backward(lambda: chain_permute(xg, idx, experts, 1)),
            _backward(lambda: native.moe_permute(xg, idx, experts, 1)),
        ),
        "moe_unpermute fwd+bwd": (
            _backward(lambda: chain_unpermute(rows_g, order, wg, tokens, top_k)),
            _backward(lambda: native.moe_unpermute(rows_g, row_map, wg)),
        ),
        "merge_attn_states fwd+bwd": (
            _backward(lambda: chain_merge(*merge_g)),
            _backward(lambda: native.merge_attn_states(*merge_g)),
        ),
    }
    with torch.device("cuda"):  # the chains' own index tensors (torch.arange) on the GPU too
        return {name: _paired(chain, fused, rounds) for name, (chain, fused) in cases.items()}


def _compare(cpu_out, cuda_out) -> dict:
    cpu_out = cpu_out if isinstance(cpu_out, tuple) else (cpu_out,)
    cuda_out = cuda_out if isinstance(cuda_out, tuple) else (cuda_out,)
    bitwise, err = True, 0.0
    for a, b in zip(cpu_out, cuda_out, strict=True):
        b = b.cpu()
        if a.dtype == torch.float8_e4m3fn:  # compare codes: NaN codes compare equal as bytes
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        bitwise &= a.shape == b.shape and torch.equal(a, b)
        if a.shape == b.shape and a.is_floating_point():
            finite = a.isfinite() & b.isfinite()
            diff = (a[finite].double() - b[finite].double()).abs()
            err = max(err, diff.max().item() if diff.numel() else 0.0)
    return {"bitwise": bool(bitwise), "max_abs_err": err}


def against_cpu(tokens, dim, top_k, experts, heads) -> dict:
    """Each native op on the CPU and on CUDA, same inputs: are the results the same?"""
    c = _inputs(tokens, dim, top_k, experts, heads, "cpu")
    g = _inputs(tokens, dim, top_k, experts, heads, "cuda")
    perm1 = native.moe_permute(c["x"], c["idx"], experts, 1)
    perm1_g = native.moe_permute(g["x"], g["idx"], experts, 1)
    calls = {
        "moe_permute (alignment 1)": lambda t: native.moe_permute(t["x"], t["idx"], experts, 1),
        "moe_permute (alignment 128)": lambda t: native.moe_permute(t["x"], t["idx"], experts, 128),
        "merge_attn_states": lambda t: native.merge_attn_states(
            t["out"], t["lse"], t["part"], t["part_lse"]
        ),
        "quantize_fp8_blockwise (1x128)": lambda t: native.quantize_fp8_blockwise(t["x"], 1),
        "quantize_fp8_blockwise (128x128, ue8m0)": lambda t: native.quantize_fp8_blockwise(
            t["weight"], 128, "ue8m0"
        ),
    }
    result = {name: _compare(call(c), call(g)) for name, call in calls.items()}
    result["moe_unpermute"] = _compare(
        native.moe_unpermute(c["rows"], perm1[1], c["w"]),
        native.moe_unpermute(g["rows"], perm1_g[1], g["w"]),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--small", action="store_true", help="T = 256 smoke run")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if not native.has_kernel("moe_permute", torch.device("cuda")):
        raise SystemExit("build the CUDA kernels first: python -m prime_ops.native --cuda")
    sizes = {"tokens": 256 if args.small else 4096, "dim": 2048, "top_k": 8, "experts": 64}
    sizes["heads"] = 16
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sizes": sizes,
        "speed": speed(**sizes, rounds=args.rounds),
        "vs_cpu": against_cpu(**sizes),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['device']}, sizes {sizes}, median of {args.rounds} paired CUDA-event rounds")
    print(f"{'op':36} {'chain/native':>12} {'chain ms':>10} {'native ms':>10}")
    for name, r in report["speed"].items():
        print(f"{name:36} {r['ratio']:12.2f} {r['chain_ms']:10.3f} {r['native_ms']:10.3f}")
    print(f"\n{'op (CUDA against CPU kernel)':42} {'bitwise':>8} {'max abs err':>12}")
    for name, r in report["vs_cpu"].items():
        print(f"{name:42} {str(r['bitwise']):>8} {r['max_abs_err']:12.3g}")


if __name__ == "__main__":
    main()
