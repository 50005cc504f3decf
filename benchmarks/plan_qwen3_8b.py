"""Simulated: what the peak planner chooses for Qwen3-8B's decoder layers at 8k tokens on an H200.

No GPU needed: the profile is built from Qwen3-8B's shapes (36 layers, hidden 4096, MLP 12288,
32 query / 8 key-value heads of 128, bf16, one 8192-token sequence) and the step is simulated
by prime_ac.planner. Figures (NVIDIA's H200 SXM product page / datasheet): 989 TFLOP/s dense
BF16 (the 1,979 quoted is with sparsity), 4.8 TB/s HBM3e, PCIe Gen5 x16 at 128 GB/s both
directions together. Assumed: matrix products and attention run at 60% of the dense peak,
elementwise calls read and write three times their output at the HBM bandwidth, and host copies
reach 50 GB/s (of PCIe Gen5's 64 GB/s per direction). Only the blocks' activations are
modelled (not the logits, the optimizer or the weights).

    python benchmarks/plan_qwen3_8b.py
"""

from __future__ import annotations

from prime_ac.planner import KEEP, OFFLOAD, REPLAY, BlockProfile, Call, format_bytes, plan, simulate

LAYERS, TOKENS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 36, 8192, 4096, 12288, 32, 8, 128
BF16 = 2
PEAK_FLOPS, ACHIEVED = 989e12, 0.6
HBM = 4.8e12
HOST_LINK = 50e9
# prime_ac's selective default keeps attention and matrix products (prime_ac.DEFAULT_TARGETS)
SELECTIVE = {"aten::mm", "attention"}


def _matmul(op: str, index: int, n_out: int, n_in: int) -> Call:
    flops = 2 * TOKENS * n_in * n_out
    return Call(op, index, TOKENS * n_out * BF16, flops / (PEAK_FLOPS * ACHIEVED))


def _elementwise(op: str, index: int, width: int) -> Call:
    size = TOKENS * width * BF16
    return Call(op, index, size, 3 * size / HBM)


def layer(name: str) -> BlockProfile:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    attention_flops = 4 * TOKENS * TOKENS * HEADS * HEAD_DIM / 2  # causal forward
    calls = (
        _elementwise("rms_norm", 0, HIDDEN),
        _matmul("aten::mm", 0, q, HIDDEN),
        _matmul("aten::mm", 1, kv, HIDDEN),
        _matmul("aten::mm", 2, kv, HIDDEN),
        _elementwise("rms_norm", 1, q),
        _elementwise("rms_norm", 2, kv),
        _elementwise("rope", 0, q),
        _elementwise("rope", 1, kv),
        Call(
            "attention",
            0,
            TOKENS * q * BF16 + TOKENS * HEADS * 4,
            attention_flops / (PEAK_FLOPS * ACHIEVED),
        ),
        _matmul("aten::mm", 3, HIDDEN, q),
        _elementwise("add", 0, HIDDEN),
        _elementwise("rms_norm", 3, HIDDEN),
        _matmul("aten::mm", 4, MLP, HIDDEN),
        _matmul("aten::mm", 5, MLP, HIDDEN),
        _elementwise("silu", 0, MLP),
        _elementwise("mul", 0, MLP),
        _matmul("aten::mm", 6, HIDDEN, MLP),
        _elementwise("add", 1, HIDDEN),
    )
    return BlockProfile(name, calls, TOKENS * HIDDEN * BF16)


def main() -> None:
    blocks = [layer(f"layers.{i}") for i in range(LAYERS)]
    forward = sum(b.forward_seconds for b in blocks)
    no_ac_step = 3 * forward  # forward plus a backward of about twice its work
    fixed = {
        "no AC": [[KEEP] * len(b.calls) for b in blocks],
        "full AC": [[REPLAY] * len(b.calls) for b in blocks],
        "selective (mm, attention)": [
            [KEEP if c.op in SELECTIVE else REPLAY for c in b.calls] for b in blocks
        ],
    }
    rows = [(name, d, simulate(blocks, d, HOST_LINK)) for name, d in fixed.items()]
    for budget in ("8GiB", "16GiB", "24GiB", "32GiB"):
        size = int(budget[:-3]) * 2**30
        p = plan(blocks, size, bandwidth=HOST_LINK)
        rows.append(
            (f"planner, peak {budget}" + ("" if p.fits else " (unmet)"), p.decisions, p.simulation)
        )
    print(
        f"Qwen3-8B, {LAYERS} layers, {TOKENS} tokens, simulated H200 (host link {HOST_LINK / 1e9:.0f} GB/s)"
    )
    print(f"step without AC: {no_ac_step * 1e3:.1f} ms (modelled)\n")
    print(
        f"| {'plan':<28} | {'peak':>10} | {'host':>10} | keep/offload/replay | {'replay ms':>9} | {'exposed ms':>10} | {'step vs no AC':>13} |"
    )
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 12}|{'-' * 21}|{'-' * 11}|{'-' * 12}|{'-' * 15}|")
    for name, decisions, sim in rows:
        flat = [d for row in decisions for d in row]
        mix = f"{flat.count(KEEP)}/{flat.count(OFFLOAD)}/{flat.count(REPLAY)}"
        step = (no_ac_step + sim.cost) / no_ac_step
        print(
            f"| {name:<28} | {format_bytes(sim.peak):>10} | {format_bytes(sim.host_bytes):>10} | "
            f"{mix:>19} | {sim.replay_seconds * 1e3:>9.1f} | {sim.exposed_copy_seconds * 1e3:>10.1f} | "
            f"{step:>12.3f}x |"
        )


if __name__ == "__main__":
    main()
