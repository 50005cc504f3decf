"""The peak planner's cost grows about linearly with the model (counted, not timed), its
incremental simulator agrees with simulate() at every step, and identical blocks share a plan."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest

from prime_ac.planner import (
    KEEP,
    OFFLOAD,
    REPLAY,
    BlockProfile,
    Call,
    _least,
    _Step,
    plan,
    simulate,
)

_spec = importlib.util.spec_from_file_location(
    "plan_scale", Path(__file__).parents[1] / "benchmarks" / "plan_scale.py"
)
plan_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_scale)


@pytest.mark.parametrize("identical", [False, True])
def test_planning_work_grows_about_linearly_with_the_calls(identical):
    """Four times the calls (blocks or calls per block) costs about four times the simulator's
    nodes evaluated (measured: 4.6-5.1x); re-simulating the step per upgrade (the planner
    before) grew with the square, 16x."""
    counts = {}
    for blocks, calls in ((8, 40), (32, 40), (8, 160)):
        profile = plan_scale.stack(blocks, calls, identical)
        chosen = plan(profile, plan_scale.budget(profile))
        assert chosen.fits and chosen.evaluations > 0
        counts[blocks, calls] = chosen.evaluations
    # the trees' depth grows too: up to 4 x 1.5 allowed, far from 16
    assert counts[32, 40] <= 6 * counts[8, 40], counts
    assert counts[8, 160] <= 6 * counts[8, 40], counts


def _random_blocks(rng: random.Random, n: int) -> list[BlockProfile]:
    shapes = [
        tuple(
            Call(f"op{j}", j, rng.choice([0, 1, 3, 8]) * 2**20, rng.uniform(0, 2e-3), kind)
            for j, kind in enumerate(rng.choice(["plain", "mandatory", "view"]) for _ in range(4))
        )
        for _ in range(2)
    ]
    blocks = []
    for i in range(n):
        calls = rng.choice(shapes)  # some blocks alike
        saved = rng.choice([None, 2**20, 2**23])
        blocks.append(
            BlockProfile(
                f"b{i}",
                calls,
                rng.choice([0, 2**20]),
                saved,
                forward_extra=rng.choice([0, 2**19]),
                backward_extra=rng.choice([0, 2**21]),
                after_bytes=rng.choice([0, 0, 2**22]),
            )
        )
    return blocks


@pytest.mark.parametrize("seed", range(25))
def test_incremental_step_agrees_with_simulate(seed):
    """After every upgrade the incremental step's peak, host bytes and cost are what
    simulate() computes from scratch for the same decisions."""
    rng = random.Random(seed)
    blocks = _random_blocks(rng, rng.randrange(1, 6))
    least = _least(blocks, 2**62)
    classes: dict = {}
    for i, b in enumerate(blocks):
        classes.setdefault((b.structure(), tuple(least[i])), []).append(i)
    step = _Step(blocks, least, list(classes.values()), 1e9)
    for _ in range(30):
        c = rng.randrange(len(step.classes))
        j = rng.randrange(len(blocks[step.classes[c][0]].calls))
        old = step.decided[c][j]
        new = rng.choice([d for d in (OFFLOAD, KEEP) if d != old])
        call = blocks[step.classes[c][0]].calls[j]
        if old == KEEP or new not in call.choices() or (old, new) == (OFFLOAD, OFFLOAD):
            continue
        budget = rng.choice([math.inf, int(step.peak) + 2**20])
        step.upgrade(c, j, new, budget, math.inf)
        decisions = [list(step.decided[step.of[i]]) for i in range(len(blocks))]
        sim = simulate(blocks, decisions, 1e9)
        assert step.peak == sim.peak and step.host == sim.host_bytes
        assert step.peak <= budget or budget == math.inf
        assert sum(step.exposed(i) for i in range(len(blocks))) == pytest.approx(
            sim.exposed_copy_seconds, abs=1e-12
        )
        replayed = sum(
            c.seconds for b, d in zip(blocks, decisions) for c, x in zip(b.calls, d) if x == REPLAY
        )
        assert sum(step.replay) == pytest.approx(replayed, abs=1e-12)


def test_identical_blocks_share_one_plan_and_the_last_its_own():
    blocks = plan_scale.stack(8, 30, identical=True)
    chosen = plan(blocks, plan_scale.budget(blocks))
    assert all(d == chosen.decisions[0] for d in chosen.decisions[:-1])
    assert len({tuple(d) for d in chosen.decisions}) <= 2
    # a block differing in one call's bytes plans on its own
    odd = list(blocks)
    calls = list(odd[3].calls)
    calls[0] = Call(calls[0].op, 0, calls[0].bytes + 1, calls[0].seconds, calls[0].kind)
    odd[3] = BlockProfile("layers.3", tuple(calls), odd[3].input_bytes, odd[3].saved_bytes)
    assert {b.structure() for b in odd[:-1]} == {blocks[0].structure(), odd[3].structure()}


def test_a_stacks_identical_layers_get_the_same_kept_calls():
    """A fraction plans the built-in model's identical layers as one (one option for all); a
    peak budget gives all but the last layer one plan. Their kept and offloaded calls are the
    same sets, so one compiled graph can serve them."""
    import copy

    import torch

    import prime_ac
    from prime_ac.measure import measure_peak
    from prime_ac.models import build_model

    base = build_model("dense", n_layers=4)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    full = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(full, mode="full")
    floor = measure_peak(full, lambda m: m.loss(tokens))
    for budget, shared in ((0.4, 4), (int(1.3 * floor), 3)):
        model = copy.deepcopy(base)
        prime_ac.checkpoint_blocks(
            model,
            mode="selective",
            targets="auto",
            budget=budget,
            profile=lambda m: m.loss(tokens),
        )
        plans = [layer._prime_ac.plan for layer in model.layers]
        assert any(p.kept for p in plans), budget
        sets = {(frozenset(p.kept), frozenset(p.offloaded)) for p in plans[:shared]}
        assert len(sets) == 1, (budget, sets)
