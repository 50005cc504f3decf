"""What the prime_rl_attn op boundary costs, each row naming both sides.

CPU (always), eager forward under ``no_grad`` on a packed batch of 4 sequences (64, 32, 96, 64
tokens, 4 heads of 32, float32, causal), the op ``prime_rl_attn::sdpa_varlen`` (called through
``varlen_attention``) against:

- ``F.scaled_dot_product_attention`` called once per sequence, as a hand-written loop would (plain
  aten ops, no lse): what the packed op costs over that loop;
- the op's own kernel function, ``prime_ops.attn.sdpa.forward``, called without the op: the op's
  dispatch and validation overhead (and, with ``check_cu_seqlens=False``, dispatch alone).

The baseline side never dispatches a ``prime_rl`` or ``prime_rl_attn`` op (tests/test_native.py
checks that). Time is the CPU time of the calling thread (``time.thread_time``) with torch on one
thread (``--threads`` says otherwise), ``--number`` calls per sample; each round times both sides
back to back in alternating order, and the ratio (op time / baseline time, > 1: the op is slower)
is the median over the rounds of the paired ratios, from one run. The report names the machine
(CPU model, usable cores), the date and the load average before and after.

GPU (when CUDA is present): forward+backward of each installed flash backend through the op
against that backend's own Python function on the same inputs (bf16, 4 sequences of 1-3k tokens,
16 heads of 128). These rows are wall clock around a ``torch.cuda.synchronize`` (the kernels run
on the GPU, which thread CPU time does not see), in the same interleaved rounds.

    python benchmarks/attention.py [--json] [--rounds N] [--number N] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from itertools import pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops.attn import sdpa, varlen_attention
from prime_ops.attn.args import VarlenArgs
from prime_ops.attn.varlen import BACKENDS

CPU_SHAPE = {"lengths": [64, 32, 96, 64], "heads": 4, "head_dim": 32, "dtype": "float32"}
GPU_SHAPE = {"lengths": [2048, 1024, 3072, 2048], "heads": 16, "head_dim": 128, "dtype": "bfloat16"}


class Row(NamedTuple):
    """One comparison: what each side runs, and a call of each."""

    baseline_side: str
    baseline: Callable[[], object]
    op_side: str
    op: Callable[[], object]


def _packed(lengths, heads, head_dim, dtype, device, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, heads, head_dim, generator=gen, dtype=dtype)
        .to(device)
        .requires_grad_(requires_grad)
        for _ in range(3)
    )
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return q, k, v, cu, offsets


def cpu_rows(lengths, heads, head_dim) -> dict[str, Row]:
    """The CPU rows over a seeded packed float32 batch (forward only; run them under no_grad)."""
    q, k, v, cu, offsets = _packed(lengths, heads, head_dim, torch.float32, "cpu")
    n, scale = max(lengths), head_dim**-0.5
    op = "prime_rl_attn::sdpa_varlen"

    def through_op():
        return varlen_attention(q, k, v, cu, cu, n, n, causal=True)

    def through_op_unchecked():
        return varlen_attention(q, k, v, cu, cu, n, n, causal=True, check_cu_seqlens=False)

    def own_kernel():
        return sdpa.forward(q, k, v, VarlenArgs(cu, cu, n, n, True, scale, -1, -1, 0.0))

    def sdpa_loop():
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t[start:end].transpose(0, 1) for t in (q, k, v)), is_causal=True
                ).transpose(0, 1)
                for start, end in pairwise(offsets)
            ]
        )

    kernel = "prime_ops.attn.sdpa.forward (the op's kernel, no op)"
    return {
        "op vs SDPA loop": Row(
            "F.scaled_dot_product_attention per sequence + cat (no lse)", sdpa_loop, op, through_op
        ),
        "op vs own kernel": Row(kernel, own_kernel, op, through_op),
        "op unchecked vs own kernel": Row(
            kernel, own_kernel, f"{op}, check_cu_seqlens=False", through_op_unchecked
        ),
    }


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _direct_calls(q, k, v, cu, n, scale) -> dict[str, tuple[str, Callable]]:
    """Each installed backend's own varlen entry point: (its name, a call through its autograd)."""
    calls = {}
    if _installed("flash_attn.flash_attn_interface") and _installed("flash_attn_2_cuda"):
        from flash_attn import flash_attn_varlen_func

        calls["fa2"] = (
            "flash_attn.flash_attn_varlen_func",
            lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True),
        )
    if _installed("flash_attn_3"):
        from flash_attn_3.flash_attn_interface import flash_attn_varlen_func as fa3_varlen

        calls["fa3"] = (
            "flash_attn_3.flash_attn_interface.flash_attn_varlen_func",
            lambda: fa3_varlen(q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True),
        )
    if _installed("flash_attn.cute"):
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

        calls["fa4"] = (
            "flash_attn.cute.flash_attn_varlen_func",
            lambda: fa4_varlen(
                q,
                k,
                v,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=n,
                max_seqlen_k=n,
                softmax_scale=scale,
                causal=True,
            ),
        )
    return calls


def gpu_rows(lengths, heads, head_dim) -> dict[str, Row]:
    """Forward+backward of each installed flash backend, its own function against the op."""
    q, k, v, cu, _ = _packed(lengths, heads, head_dim, torch.bfloat16, "cuda", requires_grad=True)
    n, scale = max(lengths), head_dim**-0.5
    dout = torch.randn_like(q)
    rows = {}
    for name, (own_name, direct) in _direct_calls(q, k, v, cu, n, scale).items():

        def through_op(name=name):
            out, _ = varlen_attention(q, k, v, cu, cu, n, n, causal=True, backend=name)
            out.backward(dout)

        def own_function(direct=direct):
            out = direct()
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dout)

        op = f"prime_rl_attn::{BACKENDS[name].op}_varlen"
        baseline = f"{own_name} + backward"
        rows[f"{name} fwd+bwd"] = Row(baseline, own_function, f"{op} + _backward", through_op)
    return rows


# --- timing ---------------------------------------------------------------------------------------


def cpu_clock(number: int) -> Callable[[Callable], float]:
    """Thread CPU seconds per call, over ``number`` calls."""

    def clock(fn):
        start = time.thread_time()
        for _ in range(number):
            fn()
        return (time.thread_time() - start) / number

    return clock


def gpu_clock(number: int) -> Callable[[Callable], float]:
    """Wall seconds per call over ``number`` calls, synchronized before and after."""

    def clock(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / number

    return clock


def paired(row: Row, rounds: int, clock) -> dict:
    """Both sides once per round, alternating which goes first; ratios of the same round."""
    for _ in range(3):  # warm-up: the first op call pays one-time set-up
        row.baseline(), row.op()
    ratios, baseline_s, op_s = [], [], []
    for r in range(rounds):
        if r % 2:
            o, b = clock(row.op), clock(row.baseline)
        else:
            b, o = clock(row.baseline), clock(row.op)
        ratios.append(o / b)
        baseline_s.append(b)
        op_s.append(o)
    return {
        "baseline_side": row.baseline_side,
        "op_side": row.op_side,
        "op_over_baseline": statistics.median(ratios),
        "baseline_us": statistics.median(baseline_s) * 1e6,
        "op_us": statistics.median(op_s) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20, help="calls per timed sample")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    from report import header, load_average, machine  # benchmarks/ (the script's own folder)

    torch.set_num_threads(args.threads)
    cpu = {k: v for k, v in CPU_SHAPE.items() if k != "dtype"}
    report = {"machine": machine(), "rounds": args.rounds, "number": args.number}
    with torch.no_grad():
        rows, clock = cpu_rows(**cpu), cpu_clock(args.number)
        timed = {name: paired(row, args.rounds, clock) for name, row in rows.items()}
    report["cpu"] = {"shape": CPU_SHAPE, "clock": "thread CPU time", "rows": timed}
    if torch.cuda.is_available():
        gpu = {k: v for k, v in GPU_SHAPE.items() if k != "dtype"}
        rows, clock = gpu_rows(**gpu), gpu_clock(args.number)
        report["gpu"] = {
            "shape": GPU_SHAPE,
            "device": torch.cuda.get_device_name(),
            "clock": "wall time, CUDA synchronized",
            "rows": {name: paired(row, args.rounds, clock) for name, row in rows.items()},
        }
    report["load_average_after"] = load_average()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    how = f"medians of {args.rounds} interleaved rounds of {args.number} calls; ratio op / baseline"
    print(header(report["machine"], report["load_average_after"], how))
    for part in ("cpu", "gpu"):
        if part not in report:
            continue
        device = report[part].get("device", "CPU")
        print(f"\n{device}, {report[part]['clock']}, shape {report[part]['shape']}")
        print(f"{'row':28} {'baseline side':58} {'ratio':>6} {'baseline us':>11} {'op us':>8}")
        for name, r in report[part]["rows"].items():
            print(
                f"{name:28} {r['baseline_side']:58} {r['op_over_baseline']:6.3f} "
                f"{r['baseline_us']:11.1f} {r['op_us']:8.1f}"
            )
            print(f"{'':28} op side: {r['op_side']}")


if __name__ == "__main__":
    main()
