"""torchtitan config tables read as prime_ac.ACConfig (no torchtitan needed: a table is data)."""

from __future__ import annotations

import pytest

import prime_ac
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
        ({"mode": "full", "preserve_rng_state": False, "debug": False}, "preserve_rng_state"),
        ({"mode": "selective", "memory_budget": 0.5, "lr": 1}, r"unknown torchtitan .*\['lr'\]"),
        ({"mode": "selective", "force_recompute_mm_shapes_by_fqns": "gate"}, "must be a list"),
    ],
)
def test_bad_tables_say_what_to_do(table, message):
    with pytest.raises(ValueError, match=message):
        prime_ac.ACConfig.from_dict(table)
