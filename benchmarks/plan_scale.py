"""How the peak planner's time grows with the model: synthetic stacks, 8 to 128 blocks of 50 to
500 operator calls each, planned at a budget halfway between the least memory the rules allow
and keeping everything (one thread; the planner is pure Python).

Two kinds of stack: "distinct" blocks (every call's bytes drawn per block, so no two blocks are
alike and none share a plan: the planner's worst case) and "identical" blocks (one block drawn
and repeated, as a transformer's layers are: one plan for all but the last). For each it prints
the CPU seconds the planning took (the process's: on a loaded machine the waits for a core do
not count) and the simulator nodes evaluated (``Plan.evaluations``), and fits the growth
exponent of both against the number of calls (time ~ calls ** exponent; 1 is linear).

    python benchmarks/plan_scale.py            # the whole table (about a minute)
    python benchmarks/plan_scale.py --quick    # 8 and 32 blocks only
    python benchmarks/plan_scale.py --llama    # a whole checkpoint_blocks(..., budget=) call

``--llama`` times a whole ``checkpoint_blocks(..., budget=...)`` call (the audit's full-mode
step, measured phase by phase; the planning; the measured step) on a Llama-style model from
``prime_ac.models`` (hidden 1024, 8 layers, vocabulary 32,000, 128 tokens; budget 1.3x its
full-AC peak) against a training step of the planned model (forward, backward, SGD) in the
same run, as a ratio of the process's CPU seconds (one thread: a loaded machine's waits for a
core do not count): the first call in the process (it imports what the audit and the FLOP
counter need) and a second, on a fresh copy of the model.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

from prime_ac.planner import KEEP, OFFLOAD, REPLAY, BlockProfile, Call, plan, simulate

KINDS = ("plain", "plain", "plain", "plain", "mandatory", "view")


def stack(blocks: int, calls: int, identical: bool, seed: int = 0) -> list[BlockProfile]:
    """``blocks`` blocks of ``calls`` calls: bytes of 1-64 MiB, replay times of 10 us-5 ms."""
    rng = random.Random(seed)

    def draw(name: str) -> BlockProfile:
        items = []
        for j in range(calls):
            kind = rng.choice(KINDS)
            size = 0 if kind == "view" else rng.randrange(1, 64) * 2**20
            items.append(Call(f"op{j % 7}", j, size, rng.uniform(1e-5, 5e-3), kind))
        saved = sum(c.bytes for c in items) // 2
        return BlockProfile(name, tuple(items), 32 * 2**20, saved)

    if identical:
        one = draw("layers.0")
        return [
            BlockProfile(f"layers.{i}", one.calls, one.input_bytes, one.saved_bytes)
            for i in range(blocks)
        ]
    return [draw(f"layers.{i}") for i in range(blocks)]


def budget(blocks: list[BlockProfile]) -> int:
    least = [[OFFLOAD if c.kind == "mandatory" else REPLAY for c in b.calls] for b in blocks]
    every = [[KEEP] * len(b.calls) for b in blocks]
    return (simulate(blocks, least).peak + simulate(blocks, every).peak) // 2


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y on log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(quick: bool = False) -> None:
    sizes = [(b, c) for b in (8, 32, 128) for c in (50, 500)]
    if quick:
        sizes = [(b, c) for b, c in sizes if b <= 32]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"one thread, {os.cpu_count()} cores, load {load:.1f}")
    print(
        f"| {'stack':<9} | {'blocks':>6} | {'calls/block':>11} | {'calls':>6} | {'CPU s':>8} "
        f"| {'evaluations':>11} |"
    )
    print(f"|{'-' * 11}|{'-' * 8}|{'-' * 13}|{'-' * 8}|{'-' * 10}|{'-' * 13}|")
    for kind in ("distinct", "identical"):
        xs, times, counts = [], [], []
        for blocks, calls in sizes:
            profile = stack(blocks, calls, kind == "identical")
            limit = budget(profile)
            start = time.process_time()
            chosen = plan(profile, limit)
            seconds = time.process_time() - start
            assert chosen.fits and chosen.simulation.peak <= limit
            xs.append(blocks * calls)
            times.append(seconds)
            counts.append(chosen.evaluations)
            print(
                f"| {kind:<9} | {blocks:>6} | {calls:>11} | {blocks * calls:>6} | "
                f"{seconds:>8.2f} | {chosen.evaluations:>11,} |"
            )
        print(
            f"| {kind:<9} | growth exponent: seconds {slope(xs, times):.2f}, evaluations "
            f"{slope(xs, counts):.2f} |"
        )


def llama(tokens: int = 128) -> None:
    import copy

    import torch

    import prime_ac
    from prime_ac.measure import measure_peak
    from prime_ac.models import build_model

    torch.set_num_threads(1)
    model = build_model(
        "dense",
        dim=1024,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        hidden_dim=2816,
        vocab_size=32000,
        max_seq_len=tokens + 1,
    )
    batch = torch.randint(0, 32000, (1, tokens + 1))

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return m.loss(batch)

    full = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(full, mode="full")
    budget = int(1.3 * measure_peak(full, loss))
    del full
    planning = []
    for again in (copy.deepcopy(model), model):
        start = time.process_time()
        prime_ac.checkpoint_blocks(
            again, mode="selective", targets="auto", budget=budget, profile=loss
        )
        planning.append(time.process_time() - start)
        del again
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    steps = []
    for _ in range(3):
        start = time.process_time()
        optimizer.zero_grad()
        loss(model).backward()
        optimizer.step()
        steps.append(time.process_time() - start)
    step = sorted(steps)[1]
    peak = model.layers[0]._prime_ac.plan.peak
    first = peak.tightened_from or peak
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"checkpoint_blocks(budget={budget / 2**20:.1f} MiB): {planning[0]:.1f} CPU s first, "
        f"{planning[1]:.1f} CPU s again; training step (median of 3): {step:.1f} CPU s; ratio "
        f"{planning[0] / step:.2f} first, {planning[1] / step:.2f} again (load {load:.1f}). "
        "First plan: "
        f"predicted {first.simulation.peak / 2**20:.2f} MiB, measured "
        f"{first.measured / 2**20:.2f} MiB ({first.measured / budget:.3f} of the budget)"
        + ("; planned again" if peak.tightened_from is not None else "")
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 32 blocks only")
    parser.add_argument("--llama", action="store_true", help="time checkpoint_blocks on Llama")
    args = parser.parse_args()
    llama() if args.llama else main(args.quick)
