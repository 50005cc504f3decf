"""Memory against replay for each checkpoint policy, on the built-in dense and MoE models.

For no AC, full, selective (prime_ac's defaults), torchtitan's SelectiveAC rule (reimplemented
as the anchor: compute-intensive ops kept, every other matmul replayed) and the budget policy at
several budgets, one run prints:

- kept: bytes alive between forward and backward, relative to no AC (deterministic)
- replayed: forward FLOPs the backward re-executes, relative to one forward (deterministic)

Both columns are deterministic: no timing here (a wall-clock step column, taken one policy after
another on a shared machine, was noise; benchmarks/eager_overhead.py times steps interleaved on
one thread). Each model's table is printed as soon as it is measured. Then it checks the budget
policy against the torchtitan rule (Pareto dominance, from the two deterministic columns only)
and times the policy's per-operator decision (thread CPU time on one thread, with and without
scoped targets in alternating rounds). The report starts with the machine (CPU model, usable
cores), the date and the load average before and after (``benchmarks/report.py``). ``--json``
prints the results as JSON only.
tests/test_ac_audit.py runs ``measure`` on the smallest models that show the dominance.

    python benchmarks/ac_tradeoff.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time

import torch

import prime_ac
from prime_ac.budget import budget_context_fn
from prime_ac.models import build_model
from prime_ac.wrapping import checkpoint_state, wrap_block, wrapped_blocks

aten = torch.ops.aten

# torchtitan's save list; on CPU, SDPA dispatches to the flash_for_cpu op, which stands in for the
# CUDA attention kernels it names. aten::mm is kept at every second call of a region (below).
TORCHTITAN_SAVE = [
    "aten::_scaled_dot_product_efficient_attention.default",
    "aten::_scaled_dot_product_flash_attention.default",
    "aten::_scaled_dot_product_cudnn_attention.default",
    "aten::_scaled_dot_product_flash_attention_for_cpu.default",
    "aten::_scaled_mm.default",
    "aten::max.default",
    "aten::topk.default",
    "_c10d_functional::reduce_scatter_tensor.default",
    "_c10d_functional::all_to_all_single.default",
    "higher_order::flex_attention",
]


def apply_torchtitan_rule(model):
    """torchtitan's SelectiveAC rule: the save list, and every second matmul of a region.

    torchtitan counts matmuls in its policy and keeps the 1st, 3rd, ... of each region; the same
    decisions are a per-call plan here (call indices 0, 2, 4, ... of aten::mm in each block), so
    the audit measures them exactly as it measures prime_ac's own policies.
    """
    policy = prime_ac.make_policy("selective", targets=TORCHTITAN_SAVE)
    every_second_mm = frozenset((aten.mm.default, i) for i in range(0, 1024, 2))
    prime_ac.checkpoint_blocks(model, mode="full")
    for name, block in wrapped_blocks(model):
        state = dataclasses.replace(
            checkpoint_state(block),
            policy=policy,
            context_fn=budget_context_fn(policy, every_second_mm, f"block {name!r}"),
        )
        wrap_block(block, state)


def apply_policy(model, name, loss, budget=None):
    if name == "none":
        return
    if name == "torchtitan":
        apply_torchtitan_rule(model)
    elif name.startswith("budget"):
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=budget, profile=loss
        )
    else:
        prime_ac.checkpoint_blocks(model, mode=name)


def measure(kind, overrides, budgets, seq_len, batch=4):
    """One row per policy: kept bytes and replayed FLOPs, both from the audit."""
    base = build_model(kind, **overrides)
    tokens = torch.randint(
        0, base.cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0)
    )

    def loss(m):
        return m.loss(tokens)

    rows = []

    def run(name, budget=None):
        model = copy.deepcopy(base)
        apply_policy(model, name, loss, budget)
        if name == "none":  # audit needs wrapped blocks; no AC is its own baseline
            prime_ac.checkpoint_blocks(model, mode="full")
            report = prime_ac.audit(model, loss)
            prime_ac.unwrap_blocks(model)
            kept, replayed = report.held_bytes_no_ac, 0
        else:
            report = prime_ac.audit(model, loss)
            kept, replayed = report.held_bytes, report.replayed_flops
        row = {
            "policy": name,
            "budget": budget,
            "kept_bytes": kept,
            "kept_ratio": kept / report.held_bytes_no_ac,
            "replayed_flops": replayed,
            "replayed_ratio": replayed / report.forward_flops,
            "block_kept_bytes": report.block_kept_bytes() if name != "none" else None,
        }
        rows.append(row)
        return row

    run("none")
    run("full")
    run("selective")
    anchor = run("torchtitan")
    for fraction in budgets:
        run(f"budget {fraction:g}", fraction)
    run("budget = torchtitan bytes", anchor["block_kept_bytes"])
    return rows


def pareto_check(rows):
    """Budget points dominate the anchor: one at <= bytes and <= FLOPs, and one strictly better."""
    anchor = next(r for r in rows if r["policy"] == "torchtitan")
    budget_rows = [r for r in rows if r["policy"].startswith("budget")]
    covering = [
        r
        for r in budget_rows
        if r["kept_bytes"] <= anchor["kept_bytes"]
        and r["replayed_flops"] <= anchor["replayed_flops"]
    ]
    strictly = [
        r
        for r in covering
        if r["kept_bytes"] < anchor["kept_bytes"] or r["replayed_flops"] < anchor["replayed_flops"]
    ]
    return {
        "dominated": bool(covering),
        "strictly": bool(strictly),
        "witness": strictly[0]["policy"] if strictly else None,
    }


# matmuls scoped (kept in attention, forced to replay in the MLP): mm is then decided per call
SCOPED_TARGETS = ["attention/aten::mm", "!feed_forward/aten::mm", *prime_ac.DEFAULT_TARGETS]


def _decision_mix(targets=None):
    """A call of the policy on each of a mix of kept, replayed and host-sync ops, after warm-up.

    With scoped ``targets`` the calls run inside a submodule (``attention.wq``), so the scoped
    operator costs its per-call ``(operator, scope)`` lookup."""
    policy = prime_ac.make_policy("selective", targets)
    if policy.scoped is not None:
        tracker = policy.scoped.tracker
        tracker.stack.append(tracker.scope_id(("attention", "wq")))
    x = torch.zeros(4, 4)
    calls = [
        (aten.mm.default, (x, x), {}),
        (aten.add.Tensor, (x, x), {}),
        (aten.view.default, (x, [16]), {}),
        (aten.topk.default, (x, 2), {}),
        (aten._to_copy.default, (x,), {"dtype": torch.float16}),
    ]

    def mix():
        for op, args, kwargs in calls:
            policy(None, op, *args, **kwargs)

    mix()
    return mix, len(calls)


def decision_costs_ns(rounds: int = 5, number: int = 20000) -> dict[str, float]:
    """Policy cost per operator call, without and with scoped targets: thread CPU time, the two
    timed in alternating rounds, the best round of each."""
    mixes = {"plain": _decision_mix(), "scoped": _decision_mix(SCOPED_TARGETS)}
    best = dict.fromkeys(mixes, float("inf"))
    for _ in range(rounds):
        for name, (mix, calls) in mixes.items():
            start = time.thread_time()
            for _ in range(number):
                mix()
            best[name] = min(best[name], (time.thread_time() - start) / (number * calls) * 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one small size per model")
    args = parser.parse_args()
    from report import header, load_average, machine  # benchmarks/ (the script's own folder)

    torch.set_num_threads(1)  # the decision timing runs on this thread alone
    before = machine()
    if not args.json:
        print(header(before, None, "kept and replayed are exact; the decision cost is timed"))
    torch.manual_seed(0)
    sizes = {"small": {"n_layers": 4}, "wide": {"n_layers": 4, "dim": 128, "hidden_dim": 256}}
    if args.quick:
        sizes = {"small": sizes["small"]}
    budgets = (0.2, 0.3, 0.5, 0.75, 1.0)  # of the whole model's no-AC memory
    results = {}
    for kind in ("dense", "moe"):
        for size, overrides in sizes.items():
            rows = measure(kind, overrides, budgets, seq_len=128)
            name = f"{kind}/{size}"
            results[name] = {"rows": rows, "pareto": pareto_check(rows)}
            if not args.json:
                _print_table(name, results[name])
    costs = decision_costs_ns()
    cost, scoped_cost = costs["plain"], costs["scoped"]
    if args.json:
        print(
            json.dumps(
                {
                    "machine": before,
                    "load_average_after": load_average(),
                    "models": results,
                    "decision_ns_per_op": cost,
                    "decision_ns_per_op_scoped": scoped_cost,
                },
                indent=2,
            )
        )
        return
    print(f"\npolicy decision cost: {cost:.0f} ns per operator after warm-up")
    print(f"with scoped matmul targets: {scoped_cost:.0f} ns per operator")
    print(
        f"(thread CPU time, best of 5 alternating rounds; load average after: {load_average()[0]})"
    )


def _print_table(name, result):
    print(f"\n{name}: kept bytes vs no AC, replayed FLOPs vs one forward", flush=True)
    print(f"{'policy':<28} {'kept':>8} {'replayed':>9}")
    for r in result["rows"]:
        print(f"{r['policy']:<28} {r['kept_ratio']:>8.1%} {r['replayed_ratio']:>9.1%}")
    p = result["pareto"]
    print(
        f"budget policy dominates torchtitan rule: {p['dominated']}, strictly: "
        f"{p['strictly']} ({p['witness']})",
        flush=True,
    )


if __name__ == "__main__":
    main()
