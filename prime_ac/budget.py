"""``targets="auto"``: keep what saves the most replay under a memory budget.

From one profiled step in full mode, every operator call that the recompute re-executed is an
item: keeping it costs the bytes of its outputs (held from forward to backward) and saves its
FLOPs (not replayed in backward). Calls the recompute never reaches (it stops once backward has
what it needs) save nothing and are never chosen. Per block, prime_ac solves this 0/1 knapsack exactly over the
Pareto frontier of (bytes, FLOPs) and keeps the chosen calls, identified as the same operator
overload at the same position in the block's forward (the way checkpoint replay itself is
keyed). Mandatory operators are kept regardless and their bytes are charged first.

Because the solution is exact, a larger budget never replays more (estimated) FLOPs, and any
rule that keeps calls within the same bytes - such as "every other matmul" - is a feasible
point the knapsack can only match or beat.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prime_ac._compat import schema_is_mutable
from prime_ac.audit import audit, op_name
from prime_ac.contexts import checkpoint_contexts
from prime_ac.modes import Rules
from prime_ac.policy import OperatorPolicy
from prime_ac.scopes import ScopeRules, split_targets
from prime_ac.targets import Target, TargetSet

__all__ = [
    "BlockPlan",
    "budget_context_fn",
    "choose_calls",
    "per_block_budget",
    "plan_block",
    "plan_budget",
]


@dataclass(frozen=True)
class BlockPlan:
    """What the budget policy keeps in one block, with the profile's estimates."""

    block: str
    budget_bytes: int
    kept: tuple[tuple[str, int], ...]  # (operator overload, call index in the block's forward)
    kept_bytes: int  # chosen calls plus mandatory operators
    replayed_flops: int  # of the calls left to replay
    # (submodule path, operator, "kept" / "replayed" / "mandatory") of every profiled call
    calls: tuple[tuple[str, str, str], ...] = field(default=(), repr=False, compare=False)

    def as_targets(self) -> list[str]:
        """Scoped targets that keep exactly the calls this plan keeps, for a config file.

        ``checkpoint_blocks(model, mode="selective", targets=plan.as_targets())`` then keeps the
        same calls (the same bytes, the same replayed FLOPs) and, unlike the plan, compiles.
        An operator kept in its own submodule becomes ``"<path>/<op>"``; one kept in the block's
        own code becomes ``"<op>"`` with ``"!<path>/<op>"`` for the submodules where it replays.
        Raises ValueError when the plan keeps some calls of an operator in a submodule but not
        others (targets name a submodule's calls all together).

        Example::

            plan = prime_ac.blocks.checkpoint_state(model.layers[0]).plan
            print(plan.as_targets())  # ['attention.wq/aten::mm.default', ...]
        """
        scopes: dict[str, dict[str, set[bool]]] = defaultdict(lambda: defaultdict(set))
        for scope, op, decision in self.calls:
            if decision != "mandatory":
                scopes[op][scope].add(decision == "kept")
        targets = []
        for op, seen in scopes.items():
            kept = [scope for scope, flags in seen.items() if True in flags]
            mixed = [scope or "<block>" for scope in kept if False in seen[scope]]
            if mixed:
                raise ValueError(
                    f"{self.block}: the plan keeps some calls of {op} in {mixed} and replays "
                    "others there; a target names all of a submodule's calls, so this plan has "
                    "no target list (keep the plan, or give that code its own submodule)"
                )
            if "" in kept:
                targets.append(op)
                targets += [f"!{scope}/{op}" for scope in seen if scope not in kept]
            else:
                targets += [f"{scope}/{op}" for scope in kept]
        self._check_reproduces(targets)
        return targets

    def _check_reproduces(self, targets: list[str]) -> None:
        plain, scoped = split_targets(targets)
        rules = ScopeRules(scoped, TargetSet(plain))
        for scope, op, decision in self.calls:
            path = tuple(scope.split(".")) if scope else ()
            key = Target.parse(op)
            keeps = rules.decide((key.namespace, key.op, key.overload), path)
            if decision != "mandatory" and keeps != (decision == "kept"):
                raise ValueError(
                    f"{self.block}: no target list reproduces this plan: {targets} would "
                    f"{'keep' if keeps else 'replay'} {op} in {scope or '<block>'}, which the "
                    "plan does not"
                )


def choose_calls(items: Sequence[tuple[int, int]], capacity: int) -> list[int]:
    """Indices of ``(bytes, flops)`` items maximising total FLOPs with total bytes <= capacity.

    Exact: dynamic programming over the Pareto frontier of (bytes used, FLOPs saved); among
    equally good choices the one using the fewest bytes wins.
    """
    frontier: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for i, (size, flops) in enumerate(items):
        if flops <= 0 or size > capacity:
            continue
        grown = dict(frontier)
        for used, (saved, chosen) in frontier.items():
            total = used + size
            if total <= capacity and saved + flops > grown.get(total, (-1,))[0]:
                grown[total] = (saved + flops, (*chosen, i))
        frontier, best = {}, -1
        for used in sorted(grown):  # drop points that use more bytes for no more FLOPs
            if grown[used][0] > best:
                frontier[used], best = grown[used], grown[used][0]
    return list(frontier[max(frontier)][1])


def per_block_budget(budget: Any, held_bytes_no_ac: int, n_blocks: int, block: str = "") -> int:
    """Bytes for one block: an int is bytes per block; a float is that fraction of an even share
    of the no-AC activation memory; a mapping gives each block (by qualified name) its bytes."""
    if isinstance(budget, Mapping):
        if block not in budget:
            raise ValueError(f"budget has no entry for checkpointed block {block!r}")
        budget = budget[block]
        if isinstance(budget, float):
            raise ValueError(f"budget[{block!r}]={budget!r}: per-block budgets are bytes (int)")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
        raise ValueError(
            f"budget={budget!r} must be bytes per block (int >= 0), a fraction of the no-AC "
            "activation memory (float in [0, 1]), or a {block name: bytes} mapping"
        )
    if isinstance(budget, float):
        if budget > 1:
            raise ValueError(f"budget={budget!r}: a fraction must lie in [0, 1]; bytes are an int")
        return int(budget * held_bytes_no_ac / n_blocks)
    return budget


def plan_block(block: str, calls: list[Any], capacity: int) -> BlockPlan:
    """Knapsack over one block's profiled calls (``prime_ac.audit.CallRecord``)."""
    mandatory = sum(c.bytes for c in calls if c.decision == "mandatory")
    candidates = [c for c in calls if c.replayed and c.flops > 0 and not schema_is_mutable(c.op)]
    chosen = choose_calls([(c.bytes, c.flops) for c in candidates], max(capacity - mandatory, 0))
    kept = [candidates[i] for i in chosen]
    chosen_calls = {(c.op, c.index) for c in kept}
    return BlockPlan(
        block=block,
        budget_bytes=capacity,
        kept=tuple((c.op, c.index) for c in kept),
        kept_bytes=mandatory + sum(c.bytes for c in kept),
        replayed_flops=sum(c.flops for c in candidates) - sum(c.flops for c in kept),
        calls=tuple(
            (
                c.scope,
                op_name(c.op),
                "mandatory"
                if c.decision == "mandatory"
                else ("kept" if (c.op, c.index) in chosen_calls else "replayed"),
            )
            for c in calls
        ),
    )


def budget_context_fn(
    policy: OperatorPolicy, kept: frozenset[tuple[Any, int]], name: str
) -> Callable[[], tuple[Any, Any]]:
    """Checkpoint contexts keeping the planned calls on top of ``policy`` (full mode).

    A planned call is named by its operator overload and its index among that overload's calls
    in the block's forward; the recompute counts the same calls, so it finds them again.
    """
    plan: dict[Any, set[int]] = defaultdict(set)
    for op, index in kept:
        plan[op].add(index)
    return checkpoint_contexts(
        Rules(policy, {op: frozenset(indices) for op, indices in plan.items()}), name
    )


def plan_budget(
    model: nn.Module, profile: Callable[[nn.Module], torch.Tensor], budget: Any
) -> dict[str, BlockPlan]:
    """Profile one step of the full-mode-wrapped ``model`` and plan each checkpointed block.

    Returns ``{block name: plan}``; the model is left as it was (the caller applies the plans).
    """
    report = audit(model, profile)
    plans = {}
    for name in report.blocks:
        capacity = per_block_budget(budget, report.held_bytes_no_ac, len(report.blocks), name)
        plans[name] = plan_block(name, report.calls.get(name, []), capacity)
    return plans
