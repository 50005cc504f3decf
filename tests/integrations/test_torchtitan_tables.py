"""torchtitan config tables read as prime_ac.ACConfig (no torchtitan needed: a table is data)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import prime_ac
from prime_ac import tables
from prime_ac.integrations import torchtitan as adapter


def test_selective_op_table_keeps_the_save_list_and_every_mm():
    config = prime_ac.ACConfig.from_dict({"mode": "selective", "selective_ac_option": "op"})
    assert config.mode == "selective"
    assert set(config.targets) == {*adapter.SAVE_TARGETS, "aten::mm.default"}
    # translated: what no dispatch mode sees is not named; what CPUs and MoE run is
    assert "aten::linear.default" not in config.targets
    assert "aten::_scaled_dot_product_attention_math.default" not in config.targets
    assert "aten::_scaled_dot_product_flash_attention_for_cpu.default" in config.targets
    assert "aten::_grouped_mm.default" in config.targets
    assert "higher_order::inductor_compiled_code" in config.targets


def test_a_0_3_table_with_torchtitan_only_keys_is_read_the_same():
    table = {"mode": "selective", "force_recompute_mm_shapes_by_fqns": ["moe.router.gate"]}
    assert prime_ac.ACConfig.from_dict(table) == adapter.config_from_table(
        {"mode": "selective", "selective_ac_option": "op"}
    )


def test_layer_selective_option_is_freq():
    config = prime_ac.ACConfig.from_dict({"mode": "selective", "selective_ac_option": "2"})
    assert (config.mode, config.freq) == ("full", 2)


@pytest.mark.parametrize("mode", ["memory_budget", "memory-budget"])
def test_memory_budget_is_an_auto_budget(mode):
    config = prime_ac.ACConfig.from_dict({"mode": mode, "memory_budget": 0.25})
    assert (config.mode, config.targets, config.budget) == ("selective", "auto", 0.25)


def test_a_table_passes_the_checkpoint_options_on():
    config = adapter.config_from_table(
        {"mode": "full", "early_stop": False, "determinism_check": "none"}
    )
    assert (config.early_stop, config.determinism_check) == (False, "none")


def test_a_prime_ac_table_is_not_read_as_torchtitans():
    assert prime_ac.ACConfig.from_dict({"mode": "full", "freq": 2}) == prime_ac.ACConfig(
        mode="full", freq=2
    )


@pytest.mark.parametrize(
    "table, message",
    [
        ({"mode": "none"}, "turns activation checkpointing off"),
        ({"mode": "selective", "selective_ac_option": "x"}, "must be 'op'"),
        ({"mode": "memory_budget", "memory_budget": 1.5}, r"memory_budget=1.5 must be"),
        ({"mode": "memory_budget", "visualize_memory_budget_pareto": True}, "partitioner"),
        ({"mode": "full", "debug": True}, "debug=True"),
        ({"mode": "selective", "memory_budget": 0.5, "lr": 1}, r"unknown torchtitan .*\['lr'\]"),
        ({"mode": "selective", "force_recompute_mm_shapes_by_fqns": "gate"}, "must be a list"),
        # a key its mode does not read, set: torchtitan would ignore it, prime_ac says so
        ({"mode": "selective", "memory_budget": 0.3}, r"memory_budget=0.3 .*mode='memory_budget'"),
        ({"mode": "full", "force_recompute_mm_shapes_by_fqns": ["w1"]}, r"mode='selective'"),
        ({"mode": "memory_budget", "selective_ac_option": "op"}, r"selective_ac_option='op'"),
        # no mode, keys of two configs
        ({"memory_budget": 0.3, "force_recompute_mm_shapes_by_fqns": []}, "set mode"),
        # a prime_ac key in a torchtitan table
        ({"debug": False, "targets": ["aten::mm"]}, r"mixes prime_ac's key\(s\) \['targets'\]"),
    ],
)
def test_bad_tables_say_what_to_do(table, message):
    with pytest.raises(ValueError, match=message):
        prime_ac.ACConfig.from_dict(table)


# dataclasses.asdict of torchtitan 0.3.0's configs (test_torchtitan_adapter checks these are
# what the installed torchtitan gives): they have no mode
FULL = {"preserve_rng_state": True, "determinism_check": "default", "debug": False}
SELECTIVE = {**FULL, "force_recompute_mm_shapes_by_fqns": ["moe.router.gate"]}
MEMORY_BUDGET = {**FULL, "memory_budget": 0.2, "visualize_memory_budget_pareto": False}


def test_a_table_without_mode_is_the_config_whose_keys_it_has():
    full = prime_ac.ACConfig.from_dict(FULL)
    assert (full.mode, full.freq, full.targets) == ("full", 1, None)
    budget = prime_ac.ACConfig.from_dict(MEMORY_BUDGET)
    assert (budget.mode, budget.targets, budget.budget) == ("selective", "auto", 0.2)
    selective = prime_ac.ACConfig.from_dict(SELECTIVE)
    assert selective == adapter.config_from_table({"mode": "selective"})
    assert set(selective.targets) == {*adapter.SAVE_TARGETS, "aten::mm.default"}


def test_keys_other_modes_read_load_at_their_defaults():
    """A table dumped whole from a pre-0.3 config holds every key; torchtitan ignores the other
    modes' keys, and at their defaults they say nothing."""
    table = {
        "mode": "full",
        "selective_ac_option": "2",
        "per_op_sac_force_recompute_mm_shapes_by_fqns": ["moe.router.gate"],
        "memory_budget": 0.5,
        "visualize_memory_budget_pareto": False,
        **FULL,
    }
    assert prime_ac.ACConfig.from_dict(table) == prime_ac.ACConfig(mode="full")


def test_preserve_rng_state_false_is_never_dropped():
    table = {"mode": "full", "preserve_rng_state": False}
    for read in (prime_ac.ACConfig.from_dict, adapter.config_from_table):
        try:
            config = read(table)
        except ValueError as error:  # an ACConfig without the field points to the argument
            assert "checkpoint_blocks(..., preserve_rng_state=False)" in str(error)
        else:
            assert config.mode == "full" and config.preserve_rng_state is False


def test_the_targets_a_table_supplies_are_never_reported():
    config = prime_ac.ACConfig.from_dict({"mode": "selective", "selective_ac_option": "op"})
    assert tables.user_named(config.targets) == []


def test_prime_ac_reads_its_own_tables_without_importing_an_integration():
    code = (
        "import sys, prime_ac\n"
        "prime_ac.ACConfig.from_dict({'mode': 'full', 'freq': 2})\n"
        "assert 'prime_ac.integrations.torchtitan' not in sys.modules\n"
        "prime_ac.ACConfig.from_dict({'mode': 'memory_budget', 'memory_budget': 0.3})\n"
        "assert 'prime_ac.integrations.torchtitan' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def readers(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(tables, "_readers", dict(tables._readers))
    tables.reader_for({})  # the shipped readers registered


def test_a_registered_reader_claims_its_tables(readers):
    tables.register_table_reader(
        "recomputer",
        claims=lambda table: "recompute" in table,
        read=lambda table: prime_ac.ACConfig(mode="full" if table["recompute"] else "selective"),
    )
    assert prime_ac.ACConfig.from_dict({"recompute": True}) == prime_ac.ACConfig(mode="full")
    # torchtitan's tables stay torchtitan's; prime_ac's own keys are never offered
    assert prime_ac.ACConfig.from_dict({"mode": "memory_budget"}).targets == "auto"
    assert prime_ac.ACConfig.from_dict({"mode": "full", "freq": 3}).freq == 3


def test_a_table_two_readers_claim_raises(readers):
    tables.register_table_reader("greedy", claims=lambda table: True, read=dict)
    with pytest.raises(ValueError, match="torchtitan and of greedy"):
        prime_ac.ACConfig.from_dict({"mode": "memory_budget"})
