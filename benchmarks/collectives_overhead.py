"""Eager overhead of the prime_rl_collectives ops over calling torch.distributed directly.

Runs 2 gloo ranks on this machine. For each op and tensor size it times the custom-op front
(``prime_ops.collectives``) against the torch.distributed call a trainer would write by hand
(allocate the output, call the collective). Each round times a block of calls of each side,
back to back and in alternating order; the ratio printed (custom / direct; 1.00 means no
overhead) is the median over rounds of the paired ratios, which keeps load from other processes
on a shared machine out of it; "best" is the ratio of each side's fastest round, since noise only
adds time. Inputs do not require grad, so both sides do the same work; the
ratio is the cost of the op boundary itself.

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
    """(op name, custom-op call, direct torch.distributed call) on a tensor of ``numel`` floats."""
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
        ("all_to_all_single", lambda: C.all_to_all_single(x, rows, rows), a2a_direct),
        ("all_to_all_single_equal", lambda: C.all_to_all_single_equal(x), a2a_equal_direct),
        ("all_gather", lambda: C.all_gather(x), gather_direct),
        ("reduce_scatter_sum", lambda: C.reduce_scatter_sum(x), scatter_direct),
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
    try:
        rows = []
        for label, nbytes in SIZES.items():
            iters = 20 if nbytes < (1 << 20) else 4
            for name, custom, direct in _cases(nbytes // 4, WORLD):
                for fn in (custom, direct):  # warm-up: first-call registration and allocator
                    _per_call(fn, 3)
                direct_s, custom_s = [], []
                for i in range(rounds):
                    if i % 2:
                        custom_s.append(_per_call(custom, iters))
                        direct_s.append(_per_call(direct, iters))
                    else:
                        direct_s.append(_per_call(direct, iters))
                        custom_s.append(_per_call(custom, iters))
                ratios = [c / d for c, d in zip(custom_s, direct_s, strict=True)]
                rows.append(
                    {
                        "op": name,
                        "size": label,
                        "direct_us": statistics.median(direct_s) * 1e6,
                        "custom_us": statistics.median(custom_s) * 1e6,
                        "overhead_us": statistics.median(
                            (c - d) * 1e6 for c, d in zip(custom_s, direct_s, strict=True)
                        ),
                        "ratio": statistics.median(ratios),
                        # noise only adds time: the fastest rounds bound each side's own cost
                        "best_ratio": min(custom_s) / min(direct_s),
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

    if args.json:
        print(json.dumps({"world_size": WORLD, "backend": "gloo", "results": rows}, indent=2))
        return
    print(
        f"prime_rl_collectives eager overhead, {WORLD} gloo ranks (custom op / torch.distributed)"
    )
    print(
        f"{'op':<26}{'size':>8}{'direct us':>12}{'custom us':>12}{'extra us':>10}{'ratio':>8}"
        f"{'best':>8}"
    )
    for r in rows:
        print(
            f"{r['op']:<26}{r['size']:>8}{r['direct_us']:>12.1f}{r['custom_us']:>12.1f}"
            f"{r['overhead_us']:>10.1f}{r['ratio']:>7.2f}x{r['best_ratio']:>7.2f}x"
        )


if __name__ == "__main__":
    main()
