"""The native CPU ops of ``csrc/`` against plain-PyTorch implementations of the same work.

Each row names both sides: the PyTorch side is a chain of eager aten ops written out in this
file (the reference EP layer's token sort and weighted sum-back, the same sort padded to
128-row expert segments as DeepGEMM's layout needs, ring attention's lse merge, and the FP8
recipe's block quantisation), and it never reaches a ``prime_rl`` kernel
(tests/test_native.py checks that); the native side is one ``prime_rl`` op. Sizes: T = 4096
tokens, D = 2048, top-k 8 of 64 experts; the merge uses 16 heads of 128.

Time is the CPU time of the calling thread (``time.thread_time``) with torch on one thread
(``--threads`` says otherwise, and the report names the count), so other processes on a shared
machine barely move it. Each round times both sides back to back, in alternating order; the
ratio (PyTorch time / native time, > 1: native faster) is the median over the rounds of the
paired ratios, from one run. The report names the machine (CPU model, cores this process may
use), the date and the load average before and after.

Memory, per MoE layer (permute -> SiLU "experts" -> unpermute) and per ring step (one merge):
bytes autograd saves for backward without checkpointing (region inputs excluded), and under a
``prime_ac`` selective policy whose targets add the native op names, the bytes the policy keeps
and the number of operators the recompute replays.

    python benchmarks/native_ops.py              # table
    python benchmarks/native_ops.py --json       # one JSON document on stdout
    python benchmarks/native_ops.py --small      # a quick smoke run at T = 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from prime_ops import native

NATIVE_TARGETS = ("prime_rl::moe_permute", "prime_rl::moe_unpermute", "prime_rl::merge_attn_states")
FP8_MAX, FP8_BLOCK = 448.0, 128


# --- the PyTorch side of each row: eager aten chains, never a prime_rl op ------------------------


def chain_permute(x, idx, num_experts, alignment):
    top_k = idx.shape[1]
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    if alignment == 1:
        return x[order // top_k], order
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + alignment - 1) // alignment * alignment
    seg_start = torch.cumsum(padded, 0) - padded
    sorted_start = torch.cumsum(counts, 0) - counts
    experts = flat[order]
    dest = seg_start[experts] + torch.arange(flat.numel()) - sorted_start[experts]
    out = x.new_zeros(int(padded.sum()), x.shape[1])
    out[dest] = x[order // top_k]
    return out, order


def chain_unpermute(rows, order, weights, tokens, top_k):
    slots = torch.empty_like(rows).index_copy(0, order, rows).view(tokens, top_k, -1)
    return (slots * weights.unsqueeze(-1).to(slots.dtype)).sum(1)


def chain_merge(out, lse, part_out, part_lse):
    merged = torch.logaddexp(lse, part_lse)
    finite = merged.masked_fill(merged == float("-inf"), 0.0)
    old_w = torch.exp(lse - finite).transpose(0, 1).unsqueeze(-1)
    new_w = torch.exp(part_lse - finite).transpose(0, 1).unsqueeze(-1)
    return out * old_w + part_out * new_w, merged


def chain_quantize(x, block_rows, ue8m0=False):
    """The FP8 recipe as eager ops: float32, pad to whole blocks, per-block amax, ``scale =
    max(amax, 1e-12) / 448`` (a power of two at or above it with ``ue8m0``), clamp, cast; a
    non-finite block gets a non-finite scale and NaN codes. ``prime_ops.fp8.quantize_blockwise``
    is not used: it runs the native kernel whenever the library is built."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, (-cols) % FP8_BLOCK, 0, (-rows) % block_rows))
    blocks = padded.unflatten(1, (-1, FP8_BLOCK)).unflatten(0, (-1, block_rows))
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = amax.clamp(min=1e-12) / FP8_MAX
    if ue8m0:  # scale = m * 2**e with m in [0.5, 1): exactly 2**(e-1) when m is 0.5, else 2**e
        mantissa, exponent = torch.frexp(scale)
        scale = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
    finite = amax.isfinite()
    scale = torch.where(finite, scale, amax)
    q = torch.where(finite, (blocks / scale).clamp(-FP8_MAX, FP8_MAX), torch.nan)
    q = q.to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)[:rows, :cols].contiguous()
    return q, scale.flatten(1).flatten(0, 1).view(blocks.shape[0], blocks.shape[2])


# --- the rows -------------------------------------------------------------------------------------


class Row(NamedTuple):
    """One comparison: what each side runs, and a call of each."""

    pytorch_side: str
    pytorch: Callable[[], object]
    native_side: str
    native: Callable[[], object]


def inputs(tokens, dim, top_k, experts, heads, device="cpu") -> dict:
    """The rows' inputs (seeded; bf16 activations and weights, fp32 attention partials)."""
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


def _backward(fn):
    def run():
        outs = fn()
        out = outs[0] if isinstance(outs, tuple) else outs
        out.backward(torch.ones_like(out))

    return run


def rows(t: dict, experts: int) -> dict[str, Row]:
    """Every row over the tensors of :func:`inputs`."""
    x, idx, w, rows_, weight = t["x"], t["idx"], t["w"], t["rows"], t["weight"]
    tokens, top_k = idx.shape
    _, row_map, _ = native.moe_permute(x, idx, experts, 1)
    order = torch.argsort(idx.flatten(), stable=True)
    merge = (t["out"], t["lse"], t["part"], t["part_lse"])
    xg, rows_g, wg = (v.detach().requires_grad_() for v in (x, rows_, w))
    merge_g = [v.detach().requires_grad_() for v in merge]
    sort, sort_pad = "argsort + gather", "argsort + bincount + cumsum + index_put"
    sum_back, merge_chain = "index_copy + mul + sum", "logaddexp + masked_fill + exp + mul + add"
    quant = "pad + abs + amax + div + clamp + cast"
    return {
        "moe_permute (alignment 1)": Row(
            sort,
            lambda: chain_permute(x, idx, experts, 1),
            "prime_rl::moe_permute",
            lambda: native.moe_permute(x, idx, experts, 1),
        ),
        "moe_permute (alignment 128)": Row(
            sort_pad,
            lambda: chain_permute(x, idx, experts, 128),
            "prime_rl::moe_permute",
            lambda: native.moe_permute(x, idx, experts, 128),
        ),
        "moe_unpermute": Row(
            sum_back,
            lambda: chain_unpermute(rows_, order, w, tokens, top_k),
            "prime_rl::moe_unpermute",
            lambda: native.moe_unpermute(rows_, row_map, w),
        ),
        "merge_attn_states": Row(
            merge_chain,
            lambda: chain_merge(*merge),
            "prime_rl::merge_attn_states",
            lambda: native.merge_attn_states(*merge),
        ),
        "quantize_fp8_blockwise (1x128)": Row(
            quant,
            lambda: chain_quantize(x, 1),
            "prime_rl::quantize_fp8_blockwise",
            lambda: native.quantize_fp8_blockwise(x, 1),
        ),
        "quantize_fp8_blockwise (128x128)": Row(
            quant,
            lambda: chain_quantize(weight, 128),
            "prime_rl::quantize_fp8_blockwise",
            lambda: native.quantize_fp8_blockwise(weight, 128),
        ),
        "moe_permute fwd+bwd": Row(
            f"{sort}, autograd",
            _backward(lambda: chain_permute(xg, idx, experts, 1)),
            "prime_rl::moe_permute + _backward",
            _backward(lambda: native.moe_permute(xg, idx, experts, 1)),
        ),
        "moe_unpermute fwd+bwd": Row(
            f"{sum_back}, autograd",
            _backward(lambda: chain_unpermute(rows_g, order, wg, tokens, top_k)),
            "prime_rl::moe_unpermute + _backward",
            _backward(lambda: native.moe_unpermute(rows_g, row_map, wg)),
        ),
        "merge_attn_states fwd+bwd": Row(
            f"{merge_chain}, autograd",
            _backward(lambda: chain_merge(*merge_g)),
            "prime_rl::merge_attn_states + _backward",
            _backward(lambda: native.merge_attn_states(*merge_g)),
        ),
    }


# --- timing ---------------------------------------------------------------------------------------


def _cpu_seconds(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def paired(row: Row, rounds: int, clock=_cpu_seconds) -> dict:
    """Both sides once per round, alternating which goes first; ratios of the same round."""
    row.pytorch(), row.native()  # warm-up
    ratios, pytorch_s, native_s = [], [], []
    for r in range(rounds):
        if r % 2:
            n, p = clock(row.native), clock(row.pytorch)
        else:
            p, n = clock(row.pytorch), clock(row.native)
        ratios.append(p / n)
        pytorch_s.append(p)
        native_s.append(n)
    return {
        "pytorch_side": row.pytorch_side,
        "native_side": row.native_side,
        "ratio": statistics.median(ratios),
        "pytorch_ms": statistics.median(pytorch_s) * 1e3,
        "native_ms": statistics.median(native_s) * 1e3,
    }


def speed(tokens: int, dim: int, top_k: int, experts: int, heads: int, rounds: int) -> dict:
    t = inputs(tokens, dim, top_k, experts, heads)
    return {name: paired(row, rounds) for name, row in rows(t, experts).items()}


# --- memory ---------------------------------------------------------------------------------------


def _storage_bytes(tensors, exclude) -> int:
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def saved_bytes(fn, inputs) -> int:
    """Bytes autograd saves for backward when ``fn`` runs without checkpointing."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    return _storage_bytes(saved, inputs)


def policy_stats(fn, inputs) -> tuple[int, int]:
    """(bytes kept, operators replayed) under prime_ac's selective policy + the native names."""
    import prime_ac

    policy = prime_ac.make_policy(
        "selective", targets=list(prime_ac.DEFAULT_TARGETS) + list(NATIVE_TARGETS)
    )
    kept, replayed = [], [0]

    def counting(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            out = ctx.op_output
            kept.extend(
                t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t)
            )
        else:
            replayed[0] += 1
        return decision

    checkpoint(
        fn,
        *inputs,
        use_reentrant=False,
        context_fn=partial(create_selective_checkpoint_contexts, counting),
    )
    return _storage_bytes(kept, inputs), replayed[0]


def memory(tokens: int, dim: int, top_k: int, experts: int, heads: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=gen).bfloat16().requires_grad_()
    idx = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    w = torch.rand(tokens, top_k, generator=gen).requires_grad_()

    def moe_chain(x, w):
        rows, order = chain_permute(x, idx, experts, 1)
        return chain_unpermute(torch.nn.functional.silu(rows), order, w, tokens, top_k)

    def moe_native(x, w):
        rows, row_map, _ = native.moe_permute(x, idx, experts, 1)
        return native.moe_unpermute(torch.nn.functional.silu(rows), row_map, w)

    head_dim = dim // heads
    out = torch.randn(tokens, heads, head_dim, generator=gen).requires_grad_()
    part = torch.randn(tokens, heads, head_dim, generator=gen).requires_grad_()
    lse = torch.randn(heads, tokens, generator=gen).requires_grad_()
    part_lse = torch.randn(heads, tokens, generator=gen).requires_grad_()
    step = (out, lse, part, part_lse)
    result = {}
    for name, (chain, fused, args) in {
        "MoE layer": (moe_chain, moe_native, (x, w)),
        "ring step": (chain_merge, native.merge_attn_states, step),
    }.items():
        row = {}
        for side, fn in (("pytorch", chain), ("native", fused)):
            kept, replayed = policy_stats(fn, args)
            row[side] = {"saved_no_ac": saved_bytes(fn, args), "kept": kept, "replayed": replayed}
        result[name] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--small", action="store_true", help="T = 256 smoke run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    if not native.is_available():
        raise SystemExit("build the native ops first: python -m prime_ops.native")
    torch.set_num_threads(args.threads)
    sizes = {"tokens": 256 if args.small else 4096, "dim": 2048, "top_k": 8, "experts": 64}
    sizes["heads"] = 16
    from report import header, load_average, machine  # benchmarks/ (the script's own folder)

    report = {"machine": machine(), "sizes": sizes, "rounds": args.rounds}
    report["speed"] = speed(**sizes, rounds=args.rounds)
    report["memory"] = memory(**sizes)
    report["load_average_after"] = load_average()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    how = f"sizes {sizes}; thread CPU time, medians of {args.rounds} interleaved rounds"
    print(header(report["machine"], report["load_average_after"], how))
    print(f"{'op':34} {'PyTorch side':52} {'ratio':>6} {'PyTorch ms':>10} {'native ms':>10}")
    for name, r in report["speed"].items():
        print(
            f"{name:34} {r['pytorch_side']:52} {r['ratio']:6.2f} {r['pytorch_ms']:10.1f} "
            f"{r['native_ms']:10.1f}"
        )
    print(f"\n{'region':12} {'side':8} {'saved, no AC':>14} {'kept, SAC':>12} {'replayed ops':>13}")
    for name, row in report["memory"].items():
        for side, m in row.items():
            print(
                f"{name:12} {side:8} {m['saved_no_ac'] / 2**20:11.1f} MiB "
                f"{m['kept'] / 2**20:8.1f} MiB {m['replayed']:13d}"
            )


if __name__ == "__main__":
    main()
