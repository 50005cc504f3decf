"""Compiled prime_ac plans against torch's memory-budget partitioner, both through inductor.

For each budget fraction, two copies of the built-in dense model (same weights, same batch):

- ``prime_ac``: ``checkpoint_blocks(mode="selective", targets="auto", budget=fraction)`` (the
  fraction of the no-AC activation memory), then each block ``.compile(backend="inductor")``:
  the compiled graphs keep and replay the plan's calls (prime_ac.compiled);
- ``torch``: each block ``.compile(backend="inductor")`` under
  ``torch._functorch.config.activation_memory_budget = fraction`` (torch's min-cut partitioner
  chooses what to recompute; 1.0 is its default, no recompute).

The two fractions are not the same quantity, so the table gives each one's bytes held for
backward (what the compiled graphs save, counted through saved-tensor hooks, parameters left
out; on the CPU the allocator reports no peak) and its step time: compare times at similar
bytes, and whether each one's bytes grow with its budget. Steps are interleaved (one of each per
round after warm-up, the model's gradients dropped between them); time is the main thread's
CPU time with torch on one thread; the ratio is the median of per-round ratios. dynamo is reset
between budgets (the partitioner's budget is read when a graph compiles).

    python benchmarks/compiled_plans.py                  # budgets 0.25 0.5 0.75 1.0
    python benchmarks/compiled_plans.py --budgets 0.5 --rounds 5 --dim 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import report  # noqa: E402

import prime_ac  # noqa: E402
from prime_ac.models import build_model  # noqa: E402


def _model(args):
    return build_model(
        "dense", seed=0, dim=args.dim, n_layers=args.layers, hidden_dim=4 * args.dim
    )


def _held(model, loss):
    """Bytes of the storages saved for backward in one step, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = loss(model)
    out.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def _timed(model, loss):
    t0 = time.thread_time()
    loss(model).backward()
    elapsed = time.thread_time() - t0
    model.zero_grad(set_to_none=True)
    return elapsed


def run(args) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=generator)

    def loss(m):
        return m.loss(tokens)

    rows = []
    for budget in args.budgets:
        torch._dynamo.reset()
        ours = _model(args)
        prime_ac.checkpoint_blocks(
            ours, mode="selective", targets="auto", budget=budget, profile=loss
        )
        theirs = _model(args)
        for model in (ours, theirs):
            for block in model.layers:
                block.compile(backend="inductor")
        _timed(ours, loss)  # compiles
        with torch._functorch.config.patch(activation_memory_budget=budget):
            _timed(theirs, loss)  # compiles under the budget
        held = {"prime_ac": _held(ours, loss), "torch": _held(theirs, loss)}
        times = {"prime_ac": [], "torch": []}
        for _ in range(args.rounds):
            times["prime_ac"].append(_timed(ours, loss))
            times["torch"].append(_timed(theirs, loss))
        ratio = statistics.median(a / b for a, b in zip(times["prime_ac"], times["torch"]))
        rows.append(
            {
                "budget": budget,
                "prime_ac_held": held["prime_ac"],
                "torch_held": held["torch"],
                "prime_ac_ms": statistics.median(times["prime_ac"]) * 1e3,
                "torch_ms": statistics.median(times["torch"]) * 1e3,
                "ratio": ratio,
            }
        )
        print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict) -> str:
    mib = 2**20
    return (
        f"| {r['budget']:.2f} | {r['prime_ac_held'] / mib:.2f} | {r['prime_ac_ms']:.1f} | "
        f"{r['torch_held'] / mib:.2f} | {r['torch_ms']:.1f} | {r['ratio']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="prime_ac")
    before = report.machine()
    print(
        f"dense, {args.layers} layers, dim {args.dim}, batch {args.batch} x {args.seq} tokens; "
        f"inductor; {args.rounds} interleaved rounds"
    )
    print(
        "| budget | prime_ac held MiB | prime_ac ms | torch held MiB | torch ms "
        "| prime_ac / torch time |"
    )
    print("|---|---|---|---|---|---|")
    rows = run(args)
    for name in ("prime_ac", "torch"):
        held = [r[f"{name}_held"] for r in rows]
        print(f"{name}: held bytes {'' if held == sorted(held) else 'not '}monotone in the budget")
    print(report.header(before, report.load_average(), "CPU time of the main thread, medians"))


if __name__ == "__main__":
    main()
