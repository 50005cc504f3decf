"""``varlen_attention(backend="sdpa")`` on CUDA against SDPA called once per sequence.

``benchmarks/attention.py`` times the flash backends on the GPU, where they are installed; the
sdpa backend is there on every CUDA machine. Same packed batch as attention.py's GPU case
(sequences of 2048, 1024, 3072 and 2048 tokens, 16 heads of 128, bf16, causal), forward +
backward, median CUDA-event time after warm-up: through the op (``op_ms``) and as a hand-written
loop of ``scaled_dot_product_attention`` calls (``own_ms``).

    python benchmarks/cuda_attention.py [--json] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
from itertools import pairwise

import torch
import torch.nn.functional as F

from prime_ops.attn import varlen_attention

LENGTHS, HEADS, HEAD_DIM = [2048, 1024, 3072, 2048], 16, 128


def _median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def sdpa_rows(iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (
        torch.randn(
            total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen
        ).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    offsets = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    n = max(LENGTHS)

    def through_op():
        out, _ = varlen_attention(q, k, v, cu, cu, n, n, causal=True, backend="sdpa")
        out.backward(dout)

    def loop():
        outs = [
            F.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True
            )
            .squeeze(0)
            .transpose(0, 1)
            for a, b in pairwise(offsets)
        ]
        torch.cat(outs).backward(dout)

    op_ms, own_ms = _median_ms(through_op, iters), _median_ms(loop, iters)
    row = {"op": "prime_rl_attn::sdpa_varlen", "op_ms": op_ms, "own_ms": own_ms}
    return {"sdpa": {**row, "op_over_own": op_ms / own_ms}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    report = {
        "device": torch.cuda.get_device_name(),
        "shape": {"lengths": LENGTHS, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "rows": sdpa_rows(args.iters),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, row in report["rows"].items():
        print(
            f"{report['device']} {name} ({row['op']}) fwd+bwd: op {row['op_ms']:.3f} ms, "
            f"per-sequence SDPA {row['own_ms']:.3f} ms, ratio {row['op_over_own']:.3f}"
        )


if __name__ == "__main__":
    main()
