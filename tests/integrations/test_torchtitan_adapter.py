"""prime_ac.integrations.torchtitan against torchtitan 0.3.0's own apply_ac, on its models.

For each tiny torchtitan model (llama3, qwen3, qwen3-MoE, deepseek_v3; SDPA attention on a CPU)
torchtitan's own AC is applied the way its parallelize functions do
(``config.build().apply(model)``) and compared with the adapter on the same model and batch:
gradients bitwise those of no AC, held bytes and replayed FLOPs measured alike.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict

import pytest
import torch

pytest.importorskip("torchtitan")

import test_torchtitan_tables as tables_test  # noqa: E402
import titan_models  # noqa: E402
from ac_compare import assert_bitwise, replayed, run, step  # noqa: E402
from torchtitan.distributed.activation_checkpoint import (  # noqa: E402
    FullAC,
    MemoryBudgetAC,
    SelectiveAC,
)

import prime_ac  # noqa: E402
from prime_ac.integrations import torchtitan as adapter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


class SelectiveACWithCPUKernels(SelectiveAC):
    """torchtitan's SelectiveAC, its save list extended the way its docs say (override
    ``get_save_ops``) by what the adapter adds: the CPU SDPA kernel and ``_grouped_mm``."""

    def get_save_ops(self) -> set:
        return super().get_save_ops() | {
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._grouped_mm.default,
        }


@functools.cache
def measured(name: str) -> dict:
    build = functools.partial(titan_models.build, name)
    loss = titan_models.loss
    none = step(build(), loss)

    def case(label, apply):
        return run(build, loss, apply, none, f"{name}: {label}")

    results = {
        "none": none,
        "torchtitan full": case("torchtitan full", lambda m: FullAC.Config().build().apply(m)),
        "prime_ac full": case("prime_ac full", lambda m: adapter.apply_ac(m, FullAC.Config())),
        "torchtitan selective": case(
            "torchtitan selective", lambda m: SelectiveAC.Config().build().apply(m)
        ),
        "torchtitan selective + CPU kernels": case(
            "torchtitan selective + CPU kernels",
            lambda m: SelectiveACWithCPUKernels(SelectiveAC.Config()).apply(m),
        ),
        "prime_ac selective": case(
            "prime_ac selective",
            lambda m: adapter.apply_ac(m, SelectiveAC.Config(), profile=loss),
        ),
    }
    # torchtitan's budget scale: 0 is full AC's memory, 1 no AC's; this is its selective's
    full, target = results["prime_ac full"].held, results["torchtitan selective"].held
    fraction = (target - full) / (none.held - full)
    results["prime_ac auto at torchtitan selective's memory"] = case(
        "auto",
        lambda m: adapter.apply_ac(m, MemoryBudgetAC.Config(memory_budget=fraction), profile=loss),
    )
    return results


def _topk_bytes(name: str) -> int:
    """Bytes of the routers' top-k outputs: float32 scores and int64 indices per token."""
    tokens = titan_models.TOKENS.numel()
    model = titan_models.build(name)
    return sum(
        tokens * m.top_k * (4 + 8)
        for m in model.modules()
        if type(m).__name__ == "TokenChoiceTopKRouter"
    )


@pytest.mark.parametrize("name", titan_models.MODELS)
def test_full_ac_holds_what_torchtitans_holds(name):
    r = measured(name)
    # prime_ac keeps the routers' top-k in every mode (the recompute must route the same)
    assert r["prime_ac full"].held == r["torchtitan full"].held + _topk_bytes(name)
    # torchtitan's wrapper replays the whole block (early_stop=False); prime_ac stops once
    # backward has what it needs
    assert replayed(r["prime_ac full"], r["none"]) <= replayed(r["torchtitan full"], r["none"])


@pytest.mark.parametrize("name", titan_models.MODELS)
def test_selective_is_torchtitans_policy_with_the_cpu_kernels_kept(name):
    """The save list, the every-second-mm rule and the router's forced replay, exactly: same
    bytes, same replay as torchtitan's own policy given the same two extra kernels."""
    r = measured(name)
    own, ours = r["torchtitan selective + CPU kernels"], r["prime_ac selective"]
    assert ours.held == own.held
    assert replayed(ours, r["none"]) == replayed(own, r["none"])
    # stock torchtitan replays CPU attention (and grouped GEMMs): more replay, less memory
    stock = r["torchtitan selective"]
    assert ours.held > stock.held
    assert replayed(ours, r["none"]) < replayed(stock, r["none"])


@pytest.mark.parametrize("name", titan_models.MODELS)
def test_budget_at_torchtitans_memory_replays_no_more(name):
    r = measured(name)
    auto, own = r["prime_ac auto at torchtitan selective's memory"], r["torchtitan selective"]
    assert auto.held <= own.held
    assert replayed(auto, r["none"]) <= replayed(own, r["none"])


def test_save_targets_are_installed_torchtitans_list():
    ops = SelectiveAC(SelectiveAC.Config()).get_save_ops()
    found = set(adapter.save_targets(ops))
    # optional backends torchtitan resolves when registered (its models register varlen's op)
    assert found - set(adapter.SAVE_TARGETS) <= {"torch_attn::_varlen_attn.default"}
    assert set(adapter.SAVE_TARGETS) <= found


def test_a_table_applies_like_the_config_object():
    loss = titan_models.loss
    model = titan_models.build("llama3")
    adapter.apply_ac(model, {"mode": "selective", "selective_ac_option": "op"}, profile=loss)
    by_table = step(model, loss)
    assert by_table.held == measured("llama3")["prime_ac selective"].held
    assert by_table.backward_flops == measured("llama3")["prime_ac selective"].backward_flops


def test_without_profile_every_mm_is_kept_and_a_warning_says_so(caplog):
    loss = titan_models.loss
    model = titan_models.build("llama3")
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        adapter.apply_ac(model, SelectiveAC.Config())
    assert "pass apply_ac(..., profile=" in caplog.text
    r = measured("llama3")
    kept_all = step(model, loss)
    assert_bitwise(kept_all, r["none"], "every mm kept")
    assert kept_all.held > r["prime_ac selective"].held
    assert replayed(kept_all, r["none"]) < replayed(r["prime_ac selective"], r["none"])


def test_none_stops_checkpointing():
    model = titan_models.build("llama3")
    assert adapter.apply_ac(model, FullAC.Config()) == ["layers.0", "layers.1"]
    assert adapter.apply_ac(model, None) == []
    assert prime_ac.unwrap_blocks(model) == []


def test_memory_budget_needs_a_profile():
    with pytest.raises(ValueError, match="MemoryBudgetAC needs profile="):
        adapter.apply_ac(titan_models.build("llama3"), MemoryBudgetAC.Config())


def test_debug_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="debug=True"):
        adapter.apply_ac(titan_models.build("llama3"), FullAC.Config(debug=True))


def test_a_model_torchtitan_already_checkpointed_is_refused():
    model = titan_models.build("llama3")
    SelectiveAC.Config().build().apply(model)
    with pytest.raises(ValueError, match="CheckpointWrapper"):
        adapter.apply_ac(model, SelectiveAC.Config(), profile=titan_models.loss)


def _configs():
    return {
        "FullAC": (FullAC.Config(), None),
        "SelectiveAC": (SelectiveAC.Config(), titan_models.loss),
        "SelectiveAC, no profile": (SelectiveAC.Config(), None),
        "MemoryBudgetAC": (MemoryBudgetAC.Config(memory_budget=0.3), titan_models.loss),
        "a selective table": ({"mode": "selective"}, titan_models.loss),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", titan_models.MODELS)
def test_strict_works_with_every_config_and_nothing_is_reported(name, caplog):
    """The adapter's own targets (torchtitan's list: collectives, CUDA kernels, _grouped_mm,
    addmm, flex attention, ...) are its, not the user's: never reported as matching nothing."""
    caplog.set_level(logging.WARNING, logger="prime_ac")
    for label, (config, profile) in _configs().items():
        model = titan_models.build(name)
        adapter.apply_ac(model, config, profile=profile, strict=True)
        caplog.clear()
        titan_models.loss(model).backward()  # the first step, where a target would be reported
        assert "matched no operator call" not in caplog.text, f"{name}: {label}"


class SelectiveACWithOwnOp(SelectiveAC):
    """A user's save list: torchtitan's and one operator these models never call."""

    def get_save_ops(self) -> set:
        return super().get_save_ops() | {torch.ops.aten.cholesky.default}


def test_what_a_users_save_list_adds_is_reported():
    model = titan_models.build("llama3")
    adapter.apply_ac(model, SelectiveACWithOwnOp(SelectiveAC.Config()), strict=True)
    with pytest.raises(ValueError, match="matched no operator call") as raised:
        titan_models.loss(model).backward()
    reported = str(raised.value).split("keep nothing: ")[1]
    assert reported.startswith("'aten::cholesky.default'") and ";" not in reported


def test_the_configs_dicts_are_read_as_their_config():
    """``dataclasses.asdict`` of each 0.3.0 config has no mode: its keys say which it is."""
    assert asdict(FullAC.Config()) == tables_test.FULL
    assert asdict(SelectiveAC.Config()) == tables_test.SELECTIVE
    assert asdict(MemoryBudgetAC.Config(memory_budget=0.2)) == tables_test.MEMORY_BUDGET
    full = prime_ac.ACConfig.from_dict(asdict(FullAC.Config()))
    assert (full.mode, full.targets) == ("full", None)
    budget = prime_ac.ACConfig.from_dict(asdict(MemoryBudgetAC.Config(memory_budget=0.2)))
    assert (budget.targets, budget.budget) == ("auto", 0.2)
    selective = prime_ac.ACConfig.from_dict(asdict(SelectiveAC.Config()))
    assert set(selective.targets) == {*adapter.SAVE_TARGETS, "aten::mm.default"}


@pytest.mark.parametrize(
    "ac_config, kwargs, error, message",
    [
        ("full", {}, TypeError, r"ac_config='full' is a string: .*\{'mode': 'full'\}"),
        (object(), {}, TypeError, "is not a torchtitan AC config"),
        (FullAC.Config(), {"profile": 42}, TypeError, "profile=42 is not callable"),
        (FullAC.Config(), {"strict": "yes"}, TypeError, "strict='yes' must be True"),
    ],
)
def test_bad_arguments_raise_before_the_model_is_touched(ac_config, kwargs, error, message):
    model = titan_models.build("llama3")
    with pytest.raises(error, match=message):
        adapter.apply_ac(model, ac_config, **kwargs)
    assert prime_ac.unwrap_blocks(model) == []
