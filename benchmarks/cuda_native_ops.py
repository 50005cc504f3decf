"""The native CUDA ops of ``csrc/cuda`` against the PyTorch chains they replace, and against the
native CPU kernels' results.

The rows are ``benchmarks/native_ops.py``'s, run on the GPU (the same sizes: T = 4096 tokens,
D = 2048, top-k 8 of 64 experts, 16 heads of 128 for the merge): each names its PyTorch side, a
chain of eager aten ops that never reaches a ``prime_rl`` kernel, and its native side. Each op
is timed with CUDA events, one call per sample, the two sides alternating; the ratio (PyTorch /
native, > 1: native faster) is the median of the paired ratios of one run. Agreement: each op's
CUDA output against the CPU kernel's on the same inputs, bitwise where both compute exactly
(layouts, FP8 casts), else the largest absolute difference.

    python -m prime_ops.native --cuda && python benchmarks/cuda_native_ops.py [--json]
"""

from __future__ import annotations

import argparse
import json

import torch
from native_ops import inputs, paired, rows  # this script's directory
from report import machine

from prime_ops import native


def _event_seconds(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def speed(tokens, dim, top_k, experts, heads, rounds) -> dict:
    table = rows(inputs(tokens, dim, top_k, experts, heads, "cuda"), experts)
    with torch.device("cuda"):  # the chains' own index tensors (torch.arange) on the GPU too
        for row in table.values():  # more warm-up: allocator, cuBLAS, first-launch costs
            row.pytorch(), row.native()
        return {name: paired(row, rounds, _event_seconds) for name, row in table.items()}


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
    c = inputs(tokens, dim, top_k, experts, heads, "cpu")
    g = inputs(tokens, dim, top_k, experts, heads, "cuda")
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
        "host": machine(),
        "sizes": sizes,
        "speed": speed(**sizes, rounds=args.rounds),
        "vs_cpu": against_cpu(**sizes),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    host = report["host"]
    print(
        f"{report['device']} on {host['cpu']}, {host['date']}, torch {host['torch']}; sizes "
        f"{sizes}; medians of {args.rounds} paired CUDA-event rounds"
    )
    print(f"{'op':34} {'PyTorch side':52} {'ratio':>6} {'PyTorch ms':>10} {'native ms':>10}")
    for name, r in report["speed"].items():
        print(
            f"{name:34} {r['pytorch_side']:52} {r['ratio']:6.2f} {r['pytorch_ms']:10.3f} "
            f"{r['native_ms']:10.3f}"
        )
    print(f"\n{'op (CUDA against CPU kernel)':42} {'bitwise':>8} {'max abs err':>12}")
    for name, r in report["vs_cpu"].items():
        print(f"{name:42} {str(r['bitwise']):>8} {r['max_abs_err']:12.3g}")


if __name__ == "__main__":
    main()
