"""The native CPU ops of ``csrc/`` against the plain-PyTorch chains they replace.

Chains: the reference EP layer's token sort and weighted sum-back (``prime_ops.expert_parallel``),
the same sort padded to 128-row expert segments (DeepGEMM's layout, written with index ops),
ring attention's lse merge (``prime_ops.attn.ring``) and the FP8 GEMM ops' block quantisation
(``prime_ops.fp8.quantize_blockwise``). Sizes: T = 4096 tokens, D = 2048, top-k 8 of 64 experts;
the merge uses 16 heads of 128. Each round times both sides back to back in alternating order;
the printed ratio (chain time / native time, > 1 means native is faster) is the median over
rounds of the paired ratios, which keeps load from other processes mostly out of it.

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
from functools import partial

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from prime_ops import native
from prime_ops.fp8 import quantize_blockwise

NATIVE_TARGETS = ("prime_rl::moe_permute", "prime_rl::moe_unpermute", "prime_rl::merge_attn_states")


# --- the chains each native op replaces -----------------------------------------------------------


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


# --- timing ---------------------------------------------------------------------------------------


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ratio(chain, native_fn, rounds: int) -> dict:
    chain(), native_fn()  # warm-up
    ratios, best_chain, best_native = [], float("inf"), float("inf")
    for r in range(rounds):
        if r % 2:
            n, c = _time(native_fn), _time(chain)
        else:
            c, n = _time(chain), _time(native_fn)
        ratios.append(c / n)
        best_chain, best_native = min(best_chain, c), min(best_native, n)
    return {
        "ratio": statistics.median(ratios),
        "chain_ms": best_chain * 1e3,
        "native_ms": best_native * 1e3,
    }


def _backward(fn):
    def run():
        outs = fn()
        out = outs[0] if isinstance(outs, tuple) else outs
        out.backward(torch.ones_like(out))

    return run


def speed(tokens: int, dim: int, top_k: int, experts: int, heads: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=gen).bfloat16()
    idx = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    w = torch.rand(tokens, top_k, generator=gen)
    rows = torch.randn(tokens * top_k, dim, generator=gen).bfloat16()
    _, row_map, _ = native.moe_permute(x, idx, experts, 1)
    order = torch.argsort(idx.flatten(), stable=True)
    head_dim = dim // heads
    out = torch.randn(tokens, heads, head_dim, generator=gen)
    part = torch.randn(tokens, heads, head_dim, generator=gen)
    lse, part_lse = torch.randn(heads, tokens, generator=gen), torch.randn(heads, tokens)
    weight = torch.randn(dim, dim, generator=gen).bfloat16()

    xg, rows_g, wg = (t.detach().requires_grad_() for t in (x, rows, w))
    merge_in = [t.detach().requires_grad_() for t in (out, lse, part, part_lse)]
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
            lambda: chain_merge(out, lse, part, part_lse),
            lambda: native.merge_attn_states(out, lse, part, part_lse),
        ),
        "quantize_fp8_blockwise (1x128)": (
            lambda: quantize_blockwise(x, 1),
            lambda: native.quantize_fp8_blockwise(x, 1),
        ),
        "quantize_fp8_blockwise (128x128)": (
            lambda: quantize_blockwise(weight, 128),
            lambda: native.quantize_fp8_blockwise(weight, 128),
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
            _backward(lambda: chain_merge(*merge_in)),
            _backward(lambda: native.merge_attn_states(*merge_in)),
        ),
    }
    return {name: _ratio(c, n, rounds) for name, (c, n) in cases.items()}


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
    for name, (chain, fused, inputs) in {
        "MoE layer": (moe_chain, moe_native, (x, w)),
        "ring step": (chain_merge, native.merge_attn_states, step),
    }.items():
        row = {}
        for side, fn in (("chain", chain), ("native", fused)):
            kept, replayed = policy_stats(fn, inputs)
            row[side] = {"saved_no_ac": saved_bytes(fn, inputs), "kept": kept, "replayed": replayed}
        result[name] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--small", action="store_true", help="T = 256 smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not native.is_available():
        raise SystemExit("build the native ops first: python -m prime_ops.native")
    sizes = {"tokens": 256 if args.small else 4096, "dim": 2048, "top_k": 8, "experts": 64}
    sizes["heads"] = 16
    report = {
        "sizes": sizes,
        "threads": torch.get_num_threads(),
        "speed": speed(**sizes, rounds=args.rounds),
        "memory": memory(**sizes),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"sizes {sizes}, {report['threads']} threads, median of {args.rounds} paired rounds")
    print(f"{'op':36} {'chain/native':>12} {'chain ms':>10} {'native ms':>10}")
    for name, r in report["speed"].items():
        print(f"{name:36} {r['ratio']:12.2f} {r['chain_ms']:10.1f} {r['native_ms']:10.1f}")
    print(f"\n{'region':12} {'side':7} {'saved, no AC':>14} {'kept, SAC':>12} {'replayed ops':>13}")
    for name, row in report["memory"].items():
        for side, m in row.items():
            print(
                f"{name:12} {side:7} {m['saved_no_ac'] / 2**20:11.1f} MiB "
                f"{m['kept'] / 2**20:8.1f} MiB {m['replayed']:13d}"
            )


if __name__ == "__main__":
    main()
