"""What a ``checkpoint_blocks(..., budget=...)`` call costs, counted, not timed: a peak budget's
audit runs no no-AC step (the full-mode step's phases stand in for it), and the ledgers walk
Python's objects (``gc.collect``, 0.3 s once torch._dynamo is imported) once per reading."""

from __future__ import annotations

import copy
import gc
import importlib

import pytest
import torch

import prime_ac
from prime_ac.measure import track_step_by_block
from prime_ac.models import build_model

audit_module = importlib.import_module("prime_ac.audit")  # prime_ac.audit is the function


@pytest.fixture
def llama():
    model = build_model("dense", vocab_size=512, n_layers=2)
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    return model, lambda m: m.loss(tokens)


def _counted(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_a_peak_budget_runs_no_no_ac_step_and_one_collection(llama, monkeypatch):
    model, loss = llama
    no_ac = _counted(monkeypatch, audit_module, "track_step_by_block")
    collections = _counted(monkeypatch, gc, "collect")
    planned = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(
        planned, mode="selective", targets="auto", budget=10**9, profile=loss
    )
    assert planned.layers[0]._prime_ac.plan.peak is not None
    assert no_ac == []
    assert len(collections) == 1  # the full-mode step's held bytes


def test_a_fraction_budget_still_measures_no_ac(llama, monkeypatch):
    model, loss = llama
    no_ac = _counted(monkeypatch, audit_module, "track_step_by_block")
    prime_ac.checkpoint_blocks(
        copy.deepcopy(model), mode="selective", targets="auto", budget=0.5, profile=loss
    )
    assert len(no_ac) == 1


def test_per_block_readings_share_one_collection(llama, monkeypatch):
    model, loss = llama
    collections = _counted(monkeypatch, gc, "collect")
    held, by_block, _ = track_step_by_block(model, loss, dict(model.layers.named_children()))
    assert len(collections) == 1
    assert all(by_block[name] > 0 for name in by_block)
    assert sum(by_block.values()) <= sum(held.values())
