"""FastVideo's ops-mode checks, run with prime_ac and FastVideo's current list.

Each test mirrors one of FastVideo main's tests/train/utils/test_activation_checkpoint.py (the
policy in fastvideo/train/utils/activation_checkpoint.py @ 1728326dd9d8): the expensive-op call
counts per mode, bitwise outputs and gradients, one wrapper per block and none at the root. Its
toy transformer is rebuilt here, and its Wan DiT is diffusers' WanTransformer3DModel, tiny
(FastVideo itself does not install beside a CPU torch). The references are the unwrapped model
and FastVideo's own wrapping, torch's CheckpointWrapper with torch's SAC.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from wan_models import tiny_wan

import prime_ac
from prime_ac.integrations.fastvideo import FASTVIDEO_OP_LIST, targets_from_op_list
from prime_ac.measure import track_step

_CALLS = Counter()


@torch.library.custom_op("prime_ac_fastvideo_compat::expensive_op", mutates_args=())
def _expensive_op(value: torch.Tensor) -> torch.Tensor:
    _CALLS["expensive"] += 1
    return torch.sin(value)


@_expensive_op.register_fake
def _(value):
    return torch.empty_like(value)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (value,) = ctx.saved_tensors
    return grad * torch.cos(value)


_expensive_op.register_autograd(_backward, setup_context=_setup)
EXPENSIVE = "prime_ac_fastvideo_compat::expensive_op"


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.projection = nn.Linear(4, 4)

    def forward(self, value):
        return value + _expensive_op(self.projection(value))


class ToyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ToyBlock() for _ in range(4)])

    def forward(self, value):
        for block in self.blocks:
            value = block(value)
        return value


def fastvideo_ops(model: nn.Module, names: set[str]) -> None:
    """FastVideo's ``ops`` mode as it wraps each block (an independent reference)."""

    def context_fn():
        def policy(ctx, func, *args, **kwargs):
            save = func.name() in names
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    for name, block in list(model.blocks.named_children()):
        model.blocks.register_module(
            name, checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
        )


def run_toy(apply) -> tuple[int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(17)
    model = ToyTransformer().to(torch.float64)
    if apply is not None:
        apply(model)
    value = torch.linspace(-0.5, 0.5, 12, dtype=torch.float64).reshape(3, 4).requires_grad_()
    _CALLS.clear()
    output = model(value)
    output.square().mean().backward()
    grads = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()
    }
    return _CALLS["expensive"], output.detach(), value.grad, grads


def prime_ac_ops(retained: bool):
    targets = targets_from_op_list([*FASTVIDEO_OP_LIST, *([EXPENSIVE] if retained else [])])
    return lambda m: prime_ac.checkpoint_blocks(
        m, mode="selective", targets=targets, preserve_rng_state=False
    )


@pytest.mark.parametrize(
    ("label", "apply", "calls"),
    [
        ("no AC", None, 4),
        ("full", lambda m: prime_ac.checkpoint_blocks(m, mode="full"), 8),
        ("ops, the op listed", prime_ac_ops(True), 4),
        ("ops, the op not listed", prime_ac_ops(False), 8),
    ],
)
def test_checkpoint_policy_controls_expensive_op_recomputation(label, apply, calls):
    # mirrors test_checkpoint_policy_controls_expensive_op_recomputation
    assert run_toy(apply)[0] == calls, label


def test_checkpoint_modes_preserve_outputs_and_gradients():
    # mirrors test_checkpoint_modes_preserve_outputs_and_gradients (rtol=0, atol=0), with
    # FastVideo's own ops wrapping beside prime_ac's
    names = set(FASTVIDEO_OP_LIST) | {EXPENSIVE}
    baseline = run_toy(None)
    for label, apply in [
        ("full", lambda m: prime_ac.checkpoint_blocks(m, mode="full")),
        ("ops", prime_ac_ops(True)),
        ("FastVideo's ops", lambda m: fastvideo_ops(m, names)),
    ]:
        _, output, input_grad, grads = run_toy(apply)
        assert torch.equal(output, baseline[1]) and torch.equal(input_grad, baseline[2]), label
        assert grads.keys() == baseline[3].keys(), label
        assert all(torch.equal(grads[n], g) for n, g in baseline[3].items()), label


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_wraps_each_block_not_transformer_root(mode):
    # mirrors test_checkpointing_wraps_each_block_not_transformer_root: FastVideo asks
    # isinstance(block, CheckpointWrapper); a prime_ac block answers prime_ac.is_checkpointed
    model = ToyTransformer()
    keys = list(model.state_dict())
    wrapped = prime_ac.checkpoint_blocks(model, mode=mode, targets=None)
    assert wrapped == [f"blocks.{i}" for i in range(4)]
    assert not prime_ac.is_checkpointed(model)
    assert all(prime_ac.is_checkpointed(block) for block in model.blocks)
    assert not any(isinstance(block, CheckpointWrapper) for block in model.blocks)
    # FastVideo strips "_checkpoint_wrapped_module." from EMA keys: with prime_ac there is none
    assert list(model.state_dict()) == keys
    assert not any("_checkpoint_wrapped_module" in k for k in model.state_dict())


def test_checkpointing_rejects_transformers_without_known_block_lists():
    # mirrors the test of the same name: nothing to wrap is an error, not a silent no-op
    with pytest.raises(ValueError, match="found no stack of blocks"):
        prime_ac.checkpoint_blocks(nn.Linear(4, 4), mode="selective")


@pytest.mark.parametrize(
    ("checkpointing_type", "retain", "calls"),
    [("full", True, 8), ("ops", True, 4), ("ops", False, 8), ("block_skip", True, 6)],
)
def test_fastvideos_entry_point_reads_a_monkeypatched_list(
    monkeypatch, checkpointing_type, retain, calls
):
    # FastVideo's tests add their op to the list with monkeypatch.setattr; the entry point reads
    # the list when called (block_skip with n_layer=2 checks blocks 0 and 2 of 4)
    from prime_ac.integrations import fastvideo

    if retain:
        monkeypatch.setattr(fastvideo, "FASTVIDEO_OP_LIST", (*FASTVIDEO_OP_LIST, EXPENSIVE))
    apply = lambda m: fastvideo.apply_activation_checkpointing(m, checkpointing_type, n_layer=2)  # noqa: E731
    assert run_toy(apply)[0] == calls
    model = ToyTransformer()
    assert fastvideo.apply_activation_checkpointing(model, checkpointing_type) is model
    assert [prime_ac.is_checkpointed(b) for b in model.blocks] == [True] * 4


def test_fastvideos_entry_point_takes_its_list_as_an_argument_and_refuses_other_types():
    from prime_ac.integrations import fastvideo

    apply = lambda m: fastvideo.apply_activation_checkpointing(  # noqa: E731
        m, "ops", op_list={*FASTVIDEO_OP_LIST, EXPENSIVE}
    )
    assert run_toy(apply)[0] == 4
    with pytest.raises(ValueError, match="checkpointing_type='some'.*'full', 'ops', 'block_skip'"):
        fastvideo.apply_activation_checkpointing(ToyTransformer(), "some")


@pytest.mark.parametrize("checkpointing_type", ["full", "ops"])
def test_fastvideos_entry_point_rejects_transformers_without_its_block_lists(checkpointing_type):
    # FastVideo's test of that name matches its own message; prime_ac's names the lists
    from prime_ac.integrations import fastvideo

    with pytest.raises(ValueError, match="none of FastVideo's block lists"):
        fastvideo.apply_activation_checkpointing(nn.Linear(4, 4), checkpointing_type)


@pytest.mark.parametrize(("retain_test_op", "expected_warnings"), [(True, 0), (False, 1)])
def test_ops_warns_once_when_a_block_retains_nothing(
    monkeypatch, caplog, retain_test_op, expected_warnings
):
    # mirrors FastVideo's test of that name (tests/train/utils/test_activation_checkpoint.py, the
    # version beside 1728326dd9d8's policy) as docs/migration.md edits it: two steps over four
    # blocks, each step a new toy model; FastVideo's _RecordingLogger becomes caplog on prime_ac's
    # logger, its _warned_nothing_retained reset the fresh-process state tests/conftest.py gives
    from prime_ac.integrations import fastvideo

    if retain_test_op:
        monkeypatch.setattr(fastvideo, "FASTVIDEO_OP_LIST", (*FASTVIDEO_OP_LIST, EXPENSIVE))
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        for _ in range(2):
            run_toy(lambda m: fastvideo.apply_activation_checkpointing(m, "ops"))
    warnings = [r for r in caplog.records if r.name == "prime_ac" and r.levelno >= logging.WARNING]
    assert len(warnings) == expected_warnings, [r.getMessage() for r in warnings]
    if expected_warnings:
        assert "matched an operator call" in warnings[0].getMessage()


def test_fastvideos_list_names_optional_backends_without_a_warning(caplog):
    # its nine fastvideo:: / fastvideo_kernel:: ops register when its backends load; a run
    # loads one backend at most, so the others are never news: debug level only
    targets = targets_from_op_list([EXPENSIVE, *FASTVIDEO_OP_LIST])
    with caplog.at_level(logging.DEBUG, logger="prime_ac"):
        for _ in range(2):
            run_toy(lambda m: prime_ac.checkpoint_blocks(m, mode="selective", targets=targets))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    unregistered = [n for n in FASTVIDEO_OP_LIST if not n.startswith("aten::")]
    assert len(unregistered) == 9


def test_a_name_of_a_namespace_not_loaded_is_debug_once_and_a_loaded_one_warns_once(caplog):
    # the same names written by a user (not through targets_from_op_list): a namespace no
    # module registered is mentioned at debug level, once per process and list; a name in a
    # loaded namespace that no block calls warns, once per process and target set (not per model)
    targets = [EXPENSIVE, "fastvideo::_flash_attn_default_forward", "aten::_fft_r2c"]
    with caplog.at_level(logging.DEBUG, logger="prime_ac"):
        for _ in range(2):
            run_toy(lambda m: prime_ac.checkpoint_blocks(m, mode="selective", targets=targets))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(warned) == 1 and "'aten::_fft_r2c'" in warned[0] and "fastvideo" not in warned[0]
    mentioned = [m for m in debug if "fastvideo::_flash_attn_default_forward" in m]
    assert len(mentioned) == 2  # registration (when wrapping) and first step, each once


def test_the_current_list_is_fastvideos_main():
    # FastVideo main's names: the three SDPA kernels, six fastvideo:: and three
    # fastvideo_kernel:: attention ops; no matmul, no collective (its comment: keeping FSDP's
    # parameter all-gather would hold every block's unsharded weights)
    assert len(FASTVIDEO_OP_LIST) == 12 and len(set(FASTVIDEO_OP_LIST)) == 12
    assert {n.split("::")[0] for n in FASTVIDEO_OP_LIST} == {
        "aten",
        "fastvideo",
        "fastvideo_kernel",
    }
    assert not [n for n in FASTVIDEO_OP_LIST if "mm" in n or "_c10d" in n]
    assert {
        "fastvideo_kernel::block_sparse_attn_sm90",
        "fastvideo_kernel::block_sparse_attn_sm100a",
        "fastvideo_kernel::block_sparse_attn_triton",
    } <= set(FASTVIDEO_OP_LIST)


# --- the same checks on a Wan DiT ---------------------------------------------------------------

pytest.importorskip("diffusers")

_SDPA = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
}


class CountAttention(TorchDispatchMode):
    """Counts SDPA kernel runs. Entered outside the checkpoint regions, it sees only the calls a
    region's mode passes on: a kept result handed back never reaches it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in _SDPA
        return func(*args, **(kwargs or {}))


def wan_loss(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    out = model(
        hidden_states=torch.randn(2, 4, 2, 8, 8, generator=g),
        timestep=torch.tensor([10, 500]),
        encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
        return_dict=False,
    )[0]
    return out.square().mean()


def wan_with(apply) -> nn.Module:
    model = tiny_wan()
    if apply is not None:
        apply(model)
    return model


def wan_step(apply) -> tuple[int, dict[str, torch.Tensor], int]:
    """SDPA kernel runs in one step, the gradients, and the bytes held for backward."""
    model = wan_with(apply)
    counter = CountAttention()
    with counter:
        wan_loss(model).backward()
    grads = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()
    }
    return counter.calls, grads, held(apply)


def held(apply) -> int:
    return track_step(wan_with(apply), wan_loss)[0]


@pytest.mark.slow
def test_on_a_wan_dit_the_current_list_keeps_attention_bitwise():
    current = targets_from_op_list(FASTVIDEO_OP_LIST)
    runs = {
        "no AC": wan_step(None),
        "full": wan_step(lambda m: prime_ac.checkpoint_blocks(m, mode="full")),
        "ops": wan_step(
            lambda m: prime_ac.checkpoint_blocks(
                m, mode="selective", targets=current, preserve_rng_state=False
            )
        ),
        "FastVideo's ops": wan_step(lambda m: fastvideo_ops(m, set(FASTVIDEO_OP_LIST))),
    }
    calls = {label: r[0] for label, r in runs.items()}
    # two blocks, self- and cross-attention each: 4 kernel runs a forward
    assert calls == {"no AC": 4, "full": 8, "ops": 4, "FastVideo's ops": 8}
    # FastVideo's policy as written names the CUDA kernels only: on a CPU it keeps nothing,
    # while the recipe's list names the CPU kernel beside them
    reference = runs["no AC"][1]
    for label, (_, grads, _) in runs.items():
        assert grads.keys() == reference.keys(), label
        assert all(torch.equal(grads[n], g) for n, g in reference.items()), label
    held = {label: r[2] for label, r in runs.items()}
    assert held["full"] < held["ops"] < held["no AC"]


def test_on_a_wan_dit_the_older_list_holds_more_than_the_current_one():
    # FastVideo 0.2.x kept aten::mm and reduce_scatter; its fix dropped the matmuls
    older = [
        "aten::mm.default",
        "aten::_scaled_dot_product_efficient_attention.default",
        "aten::_scaled_dot_product_flash_attention.default",
        "_c10d_functional::reduce_scatter_tensor.default",
    ]

    def selective(names):
        targets = targets_from_op_list(names)
        return lambda m: prime_ac.checkpoint_blocks(m, mode="selective", targets=targets)

    kept = {
        label: held(selective(names))
        for label, names in [("older", older), ("current", FASTVIDEO_OP_LIST)]
    }
    assert kept["older"] > 2 * kept["current"]


def test_a_wan_dit_keeps_its_state_dict_keys_and_answers_is_checkpointed():
    model = tiny_wan()
    keys = list(model.state_dict())
    targets = targets_from_op_list(FASTVIDEO_OP_LIST)
    wrapped = prime_ac.checkpoint_blocks(model, mode="selective", targets=targets)
    assert wrapped == ["blocks.0", "blocks.1"]
    assert list(model.state_dict()) == keys
    assert [prime_ac.is_checkpointed(b) for b in model.blocks] == [True, True]
    assert not prime_ac.is_checkpointed(model)


def _checkpointing_type_of(transformer: nn.Module) -> str | None:
    """FastVideo's test helper of that name as docs/migration.md rewrites it: it read a
    CheckpointWrapper's context_fn; prime_ac's blocks carry their policy's mode."""
    from prime_ac.wrapping import checkpoint_state

    blocks = [m for m in transformer.modules() if prime_ac.is_checkpointed(m)]
    if not blocks:
        return None
    return {"selective": "ops", "full": "full"}[checkpoint_state(blocks[0]).policy.mode]


@pytest.mark.parametrize("checkpointing_type", ["full", "ops", None])
def test_checkpointing_type_of_reads_prime_acs_block_state(checkpointing_type):
    from prime_ac.integrations import fastvideo

    model = ToyTransformer()
    if checkpointing_type is not None:
        fastvideo.apply_activation_checkpointing(model, checkpointing_type)
    assert _checkpointing_type_of(model) == checkpointing_type
