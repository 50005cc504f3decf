"""budget= as the step's peak activation memory ("24GiB"): parsing, plans, measurement."""

from __future__ import annotations

import copy

import pytest
import torch
from ac_models import assert_bitwise_equal, grads

import prime_ac
from prime_ac.measure import PeakTracker, measure_peak
from tests.test_ac_offload_plans import DIM, Model, _step


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model = Model(blocks=4)
    x = torch.randn(4, 16, DIM)
    reference = copy.deepcopy(model)
    _step(reference, x).backward()
    return model, x, grads(reference)


def _planned(base, budget):
    model, x, _ = base
    model = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(
        model, mode="selective", targets="auto", budget=budget, profile=lambda m: _step(m, x)
    )
    plans = [layer._prime_ac.plan for layer in model.layers]
    return model, plans


def test_budget_strings_parse_and_bad_ones_name_the_argument():
    assert prime_ac.ACConfig("selective", targets="auto", budget="512MiB").budget == "512MiB"
    with pytest.raises(ValueError, match=r"budget='24 parsecs'.*'24GiB'"):
        prime_ac.ACConfig("selective", targets="auto", budget="24 parsecs")
    with pytest.raises(ValueError, match=r"budget=.*'24GiB'"):
        prime_ac.checkpoint_blocks(
            Model(), mode="selective", targets="auto", budget="lots", profile=len
        )


def test_peak_plans_give_no_ac_gradients_and_smaller_budgets_smaller_peaks(base):
    _, x, expected = base
    peaks, mixes = [], set()
    for budget in ("1MiB", "160KiB", "120KiB", "100KiB"):
        model, plans = _planned(base, budget)
        peak = plans[0].peak
        assert all(p.peak is peak for p in plans)  # one plan for the whole step
        assert peak.measured is not None
        if peak.fits:
            assert peak.simulation.peak <= peak.budget
        peaks.append(peak.simulation.peak)
        mixes |= {d for row in peak.decisions for d in row}
        for _ in range(2):
            model.zero_grad()
            _step(model, x).backward()
            assert_bitwise_equal(grads(model), expected)
    assert peaks == sorted(peaks, reverse=True), peaks
    assert mixes == {"keep", "offload", "replay"}, mixes


def test_offloaded_plan_holds_less_than_keeping_it(base):
    model, x, _ = base
    loose, _ = _planned(base, "1GiB")
    tight, plans = _planned(base, "120KiB")
    assert any(p.offloaded for p in plans)
    offloader = next(p.offloader for p in plans if p.offloader is not None)
    held_tight = measure_peak(tight, lambda m: _step(m, x), lambda: offloader.ledger.host)
    held_loose = measure_peak(loose, lambda m: _step(m, x))
    assert held_tight < held_loose


def test_peak_tracker_counts_live_storages():
    tracker = PeakTracker()
    with tracker:
        a = torch.ones(1024)  # 4 KiB
        b = torch.ones(1024)
        del a, b
        c = torch.ones(256)
    assert tracker.peak == 8192 and tracker.alive == 1024
    del c


def test_plan_table_names_every_decision(base):
    _, plans = _planned(base, "120KiB")
    table = plans[0].peak.table()
    assert "predicted peak" in table and "measured peak" in table
    assert "exposed copy time" in table
    for decision in {d for row in plans[0].peak.decisions for d in row}:
        assert decision in table


def test_plan_command_prints_decisions_and_peak(capsys):
    from prime_ac.__main__ import main

    assert main(["plan", "--budget", "6MiB"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "(budget 6.00 MiB)" in out
    assert "offload" in out and "replay" in out and "exposed copy time" in out
    with pytest.raises(SystemExit):
        main(["plan", "--budget", "6 furlongs"])
    assert "--budget='6 furlongs'" in capsys.readouterr().err


def test_audit_prints_predicted_and_measured_peak(base):
    model, plans = _planned(base, "120KiB")
    _, x, _ = base
    report = prime_ac.audit(model, lambda m: _step(m, x))
    peak = plans[0].peak
    assert report.peak == (peak.budget, peak.simulation.peak, peak.measured)
    assert "peak activation memory: budget" in str(report) and "measured" in str(report)


def test_audit_command_takes_a_peak_budget(capsys):
    from prime_ac.__main__ import main

    assert main(["audit", "--targets", "auto", "--budget", "6MiB"]) == 0
    out = capsys.readouterr().out
    assert "peak activation memory: budget 6.000 MiB, predicted" in out and "measured" in out
