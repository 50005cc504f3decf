"""docs/migration.md's prime-rl steps, each made as prime-rl's newest sources write the call.

Sources mirrored (PrimeIntellect-ai/prime-rl in the search index):
- src/prime_rl/trainer/activation_checkpointing.py, the version with ``get_layer_modes(config,
  layer_names, num_layers, parts)`` (index file id 70073298312; the index names no commit):
  ``layer_names`` are the layers' indices in the full model, ``parts`` picks a half's mode from a
  pair entry, ``parts or [None] * len(layer_names)``; ``_mandatory_checkpoint_policy`` and
  ``_selective_checkpoint_policy(ctx, op, *args, targets=...)``.
- src/prime_rl/configs/trainer.py (index file id 70119220815): ``ModelConfig.ac_offloading =
  ActivationOffloadingConfig()`` (on by default: ``pin_memory=True``,
  ``max_inflight_activations=5``) and ``ac = ActivationCheckpointConfig()`` (``full``, freq 1).
- src/prime_rl/utils/act_offloading.py @ 0202477d4dd4: ``maybe_activation_offloading(None)`` is a
  ``nullcontext``.
- tests/unit/utils/test_activation_offloading.py @ 7cbf687e80d2:
  ``test_selective_checkpoint_preserves_cached_metadata_identity`` and the reuse tests
  (``test_context_can_be_reused_after_backward``,
  ``test_reentry_preserves_pending_backward_graph``).
- src/prime_rl/trainer/models/layers/fp8_linear.py @ 0dc9cd7d9906: ``Float8BlockwiseLinear.forward``
  returns ``_fp8_blockwise_mm(x, self.weight, self.block_size)``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import prime_ac
import prime_ops  # noqa: F401  (registers prime_rl::fp8_blockwise_mm)
from prime_ac import ACConfig

MIGRATION = (Path(__file__).parents[2] / "docs" / "migration.md").read_text()
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


# --- get_layer_modes with prime-rl's fourth argument ------------------------------------------


def test_get_layer_modes_takes_prime_rls_parts():
    # a stage boundary cuts layer 1: this stage holds its MoE half and layer 2 whole
    config = ACConfig.from_dict({"layer_modes": ["full", ["attention", "selective"], "none"]})
    get = prime_ac.get_layer_modes
    assert get(config, ["1", "2"], 3, ["moe", None]) == ["selective", "none"]
    assert get(config, ["0", "1"], 3, [None, "attention"]) == ["full", "attention"]
    assert get(config, ["model.layers.0"], 3, []) == ["full"]  # prime-rl: `parts or [None] * n`
    with pytest.raises(ValueError, match="mode per half.*pass parts="):
        get(config, ["1"], 3)  # prime-rl raises too: no stage boundary cuts it
    with pytest.raises(ValueError, match="parts=.*'attention' or 'moe'"):
        get(config, ["1"], 3, ["mlp"])
    # without layer_modes, parts is unused, freq counts this rank's layers
    assert get(ACConfig(mode="full", freq=2), ["4", "5", "6"], 8, ["moe", None, None]) == [
        "full",
        "none",
        "full",
    ]


# --- make_policy for prime-rl's two policy functions ----------------------------------------------


def test_make_policy_replaces_prime_rls_policy_functions():
    ctx = SelectiveCheckpointContext(is_recompute=False)
    aten = torch.ops.aten
    mandatory = prime_ac.make_policy("full")  # _mandatory_checkpoint_policy
    selective = prime_ac.make_policy("selective", ["aten::mm"])  # partial(..., targets=...)
    assert mandatory(ctx, aten.mm.default) is RECOMPUTE
    assert selective(ctx, aten.mm.default) is SAVE
    assert selective(ctx, aten.sin.default) is RECOMPUTE
    for policy in (mandatory, selective):  # both keep what prime-rl mandates (topk)
        assert policy(ctx, aten.topk.default) is SAVE
    assert '_mandatory_checkpoint_policy` is `prime_ac.make_policy("full")`' in MIGRATION
    assert 'prime_ac.make_policy("selective", targets)' in MIGRATION


# --- ACConfig.from_dict: the offloading keys un-nested -----------------------------------------


@pytest.mark.parametrize("key", ["pin_memory", "max_inflight_activations"])
def test_offloading_keys_beside_the_ac_keys_say_to_nest_them(key):
    value = True if key == "pin_memory" else 5
    with pytest.raises(ValueError, match=rf"\['{key}'\] belong to prime-rl's .*ac_offloading"):
        ACConfig.from_dict({"mode": "full", key: value})
    nested = ACConfig.from_dict({"mode": "full", "ac_offloading": {key: value}})
    assert nested.input_offload() is not None


# --- the offloading snippet, as the doc writes it -------------------------------------------------


def _snippet() -> str:
    match = re.search(r"```python\n(import contextlib\n.*?)```", MIGRATION, re.S)
    assert match, "migration.md's offloading snippet"
    return match.group(1)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.SiLU()) for _ in range(3)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _run_snippet(ac_table: dict, ac_offloading_table: dict | None, steps: int):
    """migration.md's offloading snippet, run as written (the names it leaves to prime-rl bound
    to a toy model), for ``steps`` steps of two micro-batches; returns its namespace."""
    torch.manual_seed(0)
    model = _Model()
    code = _snippet()
    table = {} if ac_offloading_table is None else {"ac_offloading": ac_offloading_table}
    if ac_offloading_table is None:  # a table left out: the key is not passed
        code = code.replace(', "ac_offloading": ac_offloading_table', "")
    setup, loop = code.split("for micro_batch in micro_batches:")
    namespace = {
        "prime_ac": prime_ac,
        "model": model,
        "ac_table": ac_table,
        "ac_offloading_table": table.get("ac_offloading"),
        "forward": lambda model, ids, positions: model(ids),
        "compute_loss": lambda logits, *_: logits.square().mean(),
    }
    exec(setup, namespace)
    allocations = []
    for step in range(steps):
        namespace["micro_batches"] = [
            {
                "input_ids": torch.randn(
                    4, 64, generator=torch.Generator().manual_seed(step * 2 + i)
                ),
                "position_ids": None,
            }
            for i in range(2)
        ]
        exec("for micro_batch in micro_batches:" + loop, namespace)
        offload = namespace["offload"]
        allocations.append(getattr(offload, "buffer_allocations", None))
    namespace["allocations"] = allocations
    return namespace


def test_the_snippet_without_the_table_runs_with_no_offload():
    namespace = _run_snippet({"freq": 1}, None, steps=1)
    assert isinstance(namespace["offload"], contextlib.nullcontext)


def test_the_snippet_creates_the_offloader_once_and_the_pool_serves_later_steps():
    namespace = _run_snippet({"freq": 1}, {}, steps=3)
    offload = namespace["offload"]
    assert isinstance(offload, prime_ac.offload.SavedInputOffload)
    first, *later = namespace["allocations"]
    assert first > 0 and later == [first, first]  # cumulative: steps 2 and 3 allocated none
    assert offload.ledger.host == 0


def test_one_offloader_per_step_allocates_every_step():
    """The pattern the doc warns against, for the record: a new offloader per step starts with
    an empty pool, so each step allocates its buffers again."""
    config = ACConfig.from_dict({"ac_offloading": {}})
    model = _Model()
    prime_ac.checkpoint_blocks(model, config=config)
    per_step = []
    for _ in range(3):
        offload = config.input_offload()
        with offload:
            loss = model(torch.randn(4, 64)).square().mean()
        loss.backward()
        per_step.append(offload.buffer_allocations)
    assert per_step[0] > 0 and per_step == [per_step[0]] * 3


def test_prime_rls_default_is_kept_by_passing_its_validated_table():
    # ModelConfig().ac_offloading.model_dump() on a config file without the table
    prime_rl_default = {"pin_memory": True, "max_inflight_activations": 5}
    config = ACConfig.from_dict({"mode": "full", "freq": 1, "ac_offloading": prime_rl_default})
    offload = config.input_offload()
    assert offload.pin_memory is True and offload.max_inflight == 5
    assert "config.model.ac_offloading.model_dump()" in MIGRATION
    assert 'toml_model.get("ac_offloading", {})' in MIGRATION
    # the TOML reading the doc gives: an absent table is prime-rl's default, on
    toml_model: dict = {"ac": {"freq": 1}}
    table = {**toml_model["ac"], "ac_offloading": toml_model.get("ac_offloading", {})}
    assert ACConfig.from_dict(table).input_offload() is not None


# --- FP8: the Python name the doc binds -----------------------------------------------------------


def test_fp8_linear_calls_the_name_the_doc_binds():
    line = r"^_fp8_blockwise_mm = (torch\.ops\.prime_rl\.fp8_blockwise_mm)$"
    match = re.search(line, MIGRATION, re.M)
    assert match, "migration.md binds _fp8_blockwise_mm"
    namespace = {"torch": torch}
    exec(match.group(0), namespace)  # the line, in fp8_linear.py's namespace
    _fp8_blockwise_mm = namespace["_fp8_blockwise_mm"]

    class Float8BlockwiseLinear(torch.nn.Linear):  # its forward, as prime-rl writes it
        def __init__(self, *args, block_size: int = 128, **kwargs):
            super().__init__(*args, **kwargs)
            self.block_size = block_size

        def forward(self, x):
            return _fp8_blockwise_mm(x, self.weight, self.block_size)

    linear = Float8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    out = linear(x)
    assert out.shape == (4, 128) and out.dtype == torch.bfloat16
    out.sum().backward()
    assert x.grad is not None and linear.weight.grad is not None
    assert "read\nthe same dict prime_ops'" not in MIGRATION  # the old, wrong sentence


# --- identity: what the offload leaves in place is handed back as it was -----------------------


def _prime_rls_full_context_fn():
    """prime-rl's ``get_checkpoint_context_fn(SimpleNamespace(mode="full"))``: torch's SAC with
    a policy recomputing all but the mandatory set; prime_ac's ``full`` policy stands in."""
    return functools.partial(create_selective_checkpoint_contexts, prime_ac.make_policy("full"))


def test_selective_checkpoint_preserves_cached_metadata_identity():
    metadata = torch.tensor([0, 2, 4], dtype=torch.int32)
    cache = []

    def cached_lengths(value):
        for key, result in cache:
            if key is value:
                return result
        result = torch.diff(value)
        cache.append((value, result))
        return result

    cached_lengths(metadata)

    def block(value, cu_seqlens):
        scale = cached_lengths(cu_seqlens).sum()
        return value.sin().sin() * scale

    value = torch.ones(1024, requires_grad=True)
    offload = ACConfig.from_dict({"pin_memory": False}).input_offload()
    with offload:
        output = checkpoint(
            block, value, metadata, use_reentrant=False, context_fn=_prime_rls_full_context_fn()
        )
    output.sum().backward()
    expected = 4 * torch.cos(value.detach()) * torch.cos(torch.sin(value.detach()))
    torch.testing.assert_close(value.grad, expected)
    assert len(cache) == 1  # the recompute saw the same metadata tensor object


def test_a_saved_tensor_without_a_graph_comes_back_as_the_same_object():
    """What the offload leaves in place (here: under 1 KiB) and has no graph is the object
    saved; prime-rl's offloader hands it back the same way."""
    seen = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value, lengths):
            ctx.save_for_backward(lengths)
            return value * lengths.sum()

        @staticmethod
        def backward(ctx, grad):
            (lengths,) = ctx.saved_tensors
            seen.append(lengths)
            return grad * lengths.sum(), None

    lengths = torch.tensor([2, 2], dtype=torch.int32)
    value = torch.ones(1024, requires_grad=True)
    with prime_ac.offload.SavedInputOffload(pin_memory=False):
        out = Scale.apply(value, lengths)
    out.sum().backward()
    assert seen[0] is lengths
