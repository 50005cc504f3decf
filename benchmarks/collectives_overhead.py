"""Eager overhead of the prime_rl_collectives ops over calling torch.distributed directly.

Runs 2 gloo ranks on this machine, torch on one thread in each. For each op and tensor size it
times, each row naming its sides, the custom-op front (``prime_ops.collectives.<op>``, one
``prime_rl_collectives::<op>`` call) against the torch.distributed call a trainer would write by
hand (allocate the output, call ``dist.<collective>``), and the front on a checked group
(``set_checked``: a fingerprint exchange before the collective, see ``prime_ops.groups``).

Time is wall time (``time.perf_counter``) per call over a block of calls that starts at a
barrier: a collective's cost is mostly waiting for the peer and gloo's own threads moving bytes,
which the calling thread's CPU time would not see. Each round times a block of each side, back
to back, in rotating order; a ratio printed (custom / direct, checked / direct; 1.00 means no
overhead) is the median over rounds of the paired ratios, which keeps most load from other
processes on a shared machine out of it; "best" is the ratio of each side's fastest round, since
noise only adds time. Inputs do not require grad, so every side does the same work; the ratios
are the cost of the op boundary and of the check. The report names the machine (CPU model,
usable cores), the date and the load average before and after.

    python benchmarks/collectives_overhead.py            # table
    python benchmarks/collectives_overhead.py --json     # one JSON document on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
SIZES = {"4 KiB": 4 << 10, "4 MiB": 4 << 20}  # bytes of fp32 input per rank


def _cases(numel: int, world: int):
    """(op name, custom-op call, direct torch.distributed call, what the direct side calls) on a
    tensor of ``numel`` floats."""
    from prime_ops import collectives as C

    x = torch.randn(numel)
    rows = [numel // world] * world

    def a2a_direct():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, rows, rows)
        return out

    def a2a_equal_direct():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    def gather_direct():
        out = x.new_empty(world * numel)
        dist.all_gather_single(out, x)
        return out

    def scatter_direct():
        out = x.new_empty(numel // world)
        dist.reduce_scatter_single(out, x)
        return out

    return [
        (
            "all_to_all_single",
            lambda group=None: C.all_to_all_single(x, rows, rows, group),
            a2a_direct,
            "dist.all_to_all_single(out, x, splits, splits)",
        ),
        (
            "all_to_all_single_equal",
            lambda group=None: C.all_to_all_single_equal(x, group),
            a2a_equal_direct,
            "dist.all_to_all_single(out, x)",
        ),
        (
            "all_gather",
            lambda group=None: C.all_gather(x, group=group),
            gather_direct,
            "dist.all_gather_single(out, x)",
        ),
        (
            "reduce_scatter_sum",
            lambda group=None: C.reduce_scatter_sum(x, group=group),
            scatter_direct,
            "dist.reduce_scatter_single(out, x)",
        ),
    ]


def _per_call(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _rank_main(rank: int, init_file: str, rounds: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from prime_ops.groups import set_checked

    checked_group = dist.new_group()  # the mode is a group's setting: one group checks
    set_checked(True, checked_group)
    try:
        rows = []
        for label, nbytes in SIZES.items():
            iters = 20 if nbytes < (1 << 20) else 4
            for name, front, direct, direct_side in _cases(nbytes // 4, WORLD):
                sides = {
                    "direct": direct,
                    "custom": front,
                    "checked": lambda f=front: f(checked_group),
                }
                for fn in sides.values():  # warm-up: first-call registration and allocator
                    _per_call(fn, 3)
                times = {side: [] for side in sides}
                order = list(sides)
                for i in range(rounds):
                    for side in order[i % 3 :] + order[: i % 3]:
                        times[side].append(_per_call(sides[side], iters))

                def ratio(side, times=times):
                    pairs = zip(times[side], times["direct"], strict=True)
                    return statistics.median(c / d for c, d in pairs)

                rows.append(
                    {
                        "op": name,
                        "size": label,
                        "direct_side": direct_side,
                        "custom_side": f"prime_ops.collectives.{name} (prime_rl_collectives::{name})",
                        "direct_us": statistics.median(times["direct"]) * 1e6,
                        "custom_us": statistics.median(times["custom"]) * 1e6,
                        "checked_us": statistics.median(times["checked"]) * 1e6,
                        "overhead_us": statistics.median(
                            (c - d) * 1e6
                            for c, d in zip(times["custom"], times["direct"], strict=True)
                        ),
                        "check_us": statistics.median(
                            (c - d) * 1e6
                            for c, d in zip(times["checked"], times["custom"], strict=True)
                        ),
                        "ratio": ratio("custom"),
                        "checked_ratio": ratio("checked"),
                        # noise only adds time: the fastest rounds bound each side's own cost
                        "best_ratio": min(times["custom"]) / min(times["direct"]),
                        "best_checked_ratio": min(times["checked"]) / min(times["direct"]),
                    }
                )
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--rounds", type=int, default=41, help="paired timing rounds")
    args = parser.parse_args()
    from report import header, load_average, machine  # benchmarks/ (the script's own folder)

    torch.set_num_threads(1)  # the ranks set theirs; the report names this count
    before = machine()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, init_file, args.rounds, results))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    rows = results.get()
    after = load_average()
    if args.json:
        report = {"machine": before, "load_average_after": after, "world_size": WORLD}
        report |= {"backend": "gloo", "clock": "wall time", "results": rows}
        print(json.dumps(report, indent=2))
        return
    how = f"{WORLD} gloo ranks, wall time, medians of {args.rounds} rotating rounds"
    print(header(before, after, how))
    print(
        "ratio: custom (prime_ops.collectives.<op>, one prime_rl_collectives::<op> call) / direct "
        "(the dist.* call below); checked: the front on a set_checked(True) group / direct"
    )
    print(
        f"{'op':<26}{'size':>8}{'direct us':>11}{'custom us':>11}{'checked us':>12}"
        f"{'ratio':>7}{'best':>7}{'checked':>9}{'best':>7}   direct side"
    )
    for r in rows:
        print(
            f"{r['op']:<26}{r['size']:>8}{r['direct_us']:>11.1f}{r['custom_us']:>11.1f}"
            f"{r['checked_us']:>12.1f}{r['ratio']:>6.2f}x{r['best_ratio']:>6.2f}x"
            f"{r['checked_ratio']:>8.2f}x{r['best_checked_ratio']:>6.2f}x   {r['direct_side']}"
        )


if __name__ == "__main__":
    main()
