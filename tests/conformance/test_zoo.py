"""prime_ac on model families with state beside the blocks' inputs, and with helper stacks.

Per model (tests/conformance/zoo_models.py), called as in training with the default
``use_cache``: discovery wraps exactly the blocks (no helper MLP stacks), and two steps in full
and selective mode leave gradients, losses and every buffer (BatchNorm statistics) bitwise equal
to the plain model's two steps. Also: Hugging Face's own checkpointing and torch's
CheckpointWrapper under prime_ac, on a real model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from real_models import CASES  # noqa: E402
from zoo_models import ZOO  # noqa: E402

import prime_ac  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:prime_ac. checkpointed block .* runs without")


def _steps(case, model, batch, n=2):
    """Losses, then gradients and buffers after ``n`` steps (gradients of the last step)."""
    losses = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        loss = case.loss(model, batch)
        loss.backward()
        losses.append(loss.detach())
    grads = {name: p.grad for name, p in model.named_parameters()}
    return losses, grads, {name: b.clone() for name, b in model.named_buffers()}


def _differing(a, b):
    return [
        name
        for name, x in a.items()
        if (x is None) != (b[name] is None) or (x is not None and not torch.equal(x, b[name]))
    ]


@pytest.fixture(scope="module", params=ZOO, ids=lambda case: case.name)
def reference(request):
    case = request.param
    model, batch = case.build(), case.batch()
    plain = copy.deepcopy(model)
    return case, model, batch, _steps(case, plain, batch)


def test_discovery_wraps_the_blocks_and_no_helper_stack(reference):
    case, model, *_ = reference
    assert [name for group in prime_ac.find_blocks(model) for name, _ in group] == list(case.blocks)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_and_buffers_are_bitwise_those_of_no_checkpointing(reference, mode):
    case, plain, batch, (losses0, grads0, buffers0) = reference
    model = copy.deepcopy(plain)
    assert prime_ac.checkpoint_blocks(model, mode=mode) == list(case.blocks)

    losses, grads, buffers = _steps(case, model, batch)

    assert all(torch.equal(a, b) for a, b in zip(losses, losses0, strict=True)), case.name
    assert grads.keys() == grads0.keys()
    assert not _differing(grads0, grads), f"{case.name} {mode}: gradients differ"
    assert buffers.keys() == buffers0.keys()
    assert not _differing(buffers0, buffers), f"{case.name} {mode}: buffers differ"


def _llama():
    case = next(case for case in CASES if case.name == "llama")
    return case, case.build(), case.batch()


def test_hugging_face_checkpointing_on_warns_naming_the_call_that_turns_it_off():
    _, model, _ = _llama()
    model.activation_checkpointing_enable()
    with pytest.warns(
        UserWarning, match=r"own gradient checkpointing on.*activation_checkpointing_d"
    ):
        prime_ac.checkpoint_blocks(model)
    model.activation_checkpointing_disable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prime_ac.checkpoint_blocks(model)


def test_layers_under_torch_checkpoint_wrapper_are_refused_and_the_model_left_as_it_was():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    case, model, batch = _llama()
    layer = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer))
    keys = list(model.state_dict())
    with pytest.raises(ValueError, match=r"2 selected block\(s\) are already checkpointed by"):
        prime_ac.checkpoint_blocks(model)
    with pytest.raises(ValueError, match=r"model.layers.0._checkpoint_wrapped_module"):
        prime_ac.checkpoint_blocks(model, blocks=lambda name, m: isinstance(m, layer))
    assert list(model.state_dict()) == keys and prime_ac.unwrap_blocks(model) == []
    case.loss(model, batch).backward()  # still trains under its own wrapper


def _wan_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    model = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[True],
        attn_scales=[],
    ).train()
    return model, torch.randn(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(1))


def _vae_steps(model, x):
    losses = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(x).sample.square().mean()
        loss.backward()
        losses.append(loss.detach())
    return losses, {name: p.grad for name, p in model.named_parameters()}


def test_the_wan_vae_is_refused_by_discovery_and_trains_exactly_with_its_blocks_named():
    """AutoencoderKLWan declares _supports_gradient_checkpointing = False: its blocks get
    feat_cache and feat_idx lists that they change in place. Named, they train bitwise."""
    plain, x = _wan_vae()
    with pytest.raises(ValueError, match=r"AutoencoderKLWan._supports_gradient_checkpointing"):
        prime_ac.checkpoint_blocks(copy.deepcopy(plain))
    losses0, grads0 = _vae_steps(copy.deepcopy(plain), x)
    for mode in ("full", "selective"):
        model = copy.deepcopy(plain)
        blocks = ["encoder.down_blocks", "decoder.up_blocks"]
        prime_ac.checkpoint_blocks(model, mode=mode, blocks=blocks)
        losses, grads = _vae_steps(model, x)
        assert all(torch.equal(a, b) for a, b in zip(losses, losses0, strict=True)), mode
        assert not _differing(grads0, grads), f"{mode}: gradients differ"


def test_reformers_reversible_layers_are_reported_as_saving_nothing():
    """Reformer runs its layers inside its reversible autograd function, without gradients, and
    recomputes them in backward itself: checkpointing them saves nothing, and the audit says so."""
    import transformers

    config = transformers.ReformerConfig(
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=2,
        attention_head_size=16,
        feed_forward_size=64,
        attn_layers=["local", "local"],
        axial_pos_embds=False,
        max_position_embeddings=64,
        local_attn_chunk_length=4,
        is_decoder=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(config).train()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    wrapped = prime_ac.checkpoint_blocks(model, mode="full")
    report = prime_ac.audit(model, lambda m: m(input_ids=ids, labels=ids).loss)
    assert wrapped == [f"reformer.encoder.layers.{i}" for i in (0, 1)]
    assert report.blocks_saving_nothing == wrapped
    assert report.held_bytes == report.held_bytes_no_ac
