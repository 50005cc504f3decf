"""FastVideo's op list through prime_ac.integrations.fastvideo, on a Wan DiT.

FastVideo 0.2.1 itself does not install beside a CPU torch 2.13 (it pins torch 2.12 and imports
torchvision, whose PyPI build needs CUDA libraries), so the Wan DiT here is diffusers'
WanTransformer3DModel: the same architecture (biased linears, SDPA), tiny. The framework's own
AC for it is diffusers' ``enable_gradient_checkpointing()``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from ac_compare import replayed, run, step  # noqa: E402
from wan_models import tiny_wan  # noqa: E402

import prime_ac  # noqa: E402
from prime_ac.integrations.fastvideo import FASTVIDEO_OP_LIST, targets_from_op_list  # noqa: E402


def loss(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    out = model(
        hidden_states=torch.randn(2, 4, 2, 8, 8, generator=g),
        timestep=torch.tensor([10, 500]),
        encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
        return_dict=False,
    )[0]
    return out.square().mean()


def test_each_kernel_gets_its_cpu_and_cuda_names():
    targets = targets_from_op_list(FASTVIDEO_OP_LIST)
    assert not {"aten::mm", "aten::addmm"} & set(targets)  # FastVideo main keeps no matmul
    assert {"aten::mm", "aten::addmm"} <= set(targets_from_op_list(["aten::mm.default"]))
    assert {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    } <= set(targets)
    assert "fastvideo_kernel::block_sparse_attn_sm90" in targets  # kept as named
    with pytest.raises(ValueError, match="aten::mm has no overload 'defualt'"):
        targets_from_op_list(["aten::mm.defualt"])  # a typo never drops silently


def test_operators_and_their_str_read_like_target_strings():
    ops = [torch.ops.aten.mm.default, "aten._scaled_dot_product_cudnn_attention.default"]
    assert targets_from_op_list(ops) == targets_from_op_list(
        ["aten::mm.default", "aten::_scaled_dot_product_cudnn_attention.default"]
    )
    assert targets_from_op_list([torch.ops.higher_order.flex_attention]) == [
        "higher_order::flex_attention"
    ]
    with pytest.raises(ValueError, match="one string"):
        targets_from_op_list("aten::mm")


def test_on_a_wan_dit_the_list_keeps_nothing_and_the_recipe_keeps_its_kernels():
    none = step(tiny_wan(), loss)
    own = run(tiny_wan, loss, lambda m: m.enable_gradient_checkpointing(), none, "diffusers")
    full = run(tiny_wan, loss, lambda m: prime_ac.checkpoint_blocks(m, mode="full"), none, "full")
    as_listed = run(
        tiny_wan,
        loss,
        lambda m: prime_ac.checkpoint_blocks(m, mode="selective", targets=list(FASTVIDEO_OP_LIST)),
        none,
        "FastVideo's list",
    )
    recipe = run(
        tiny_wan,
        loss,
        lambda m: prime_ac.checkpoint_blocks(
            m, mode="selective", targets=targets_from_op_list(FASTVIDEO_OP_LIST)
        ),
        none,
        "recipe",
    )
    assert (full.held, replayed(full, none)) == (own.held, replayed(own, none))
    # as listed: the CUDA kernels never run here, so it is full AC
    assert (as_listed.held, as_listed.backward_flops) == (full.held, full.backward_flops)
    # the recipe keeps the CPU attention kernel: attention is not replayed
    assert full.held < recipe.held < none.held
    assert replayed(recipe, none) < replayed(full, none)
