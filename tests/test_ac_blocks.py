"""Block discovery, wrapping in place, idempotence, unwrapping and names."""

from __future__ import annotations

import copy
import subprocess
import sys

import ac_models
import pytest
import torch
from ac_models import CountingModel, assert_bitwise_equal, grads
from torch import nn

import prime_ac
from prime_ac.models import build_model


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.experts = nn.ModuleList(Expert() for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return x + sum(e(h) for e in self.experts)


class HFInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(MoEBlock() for _ in range(3))


class HFStyle(nn.Module):
    """``model.model.layers`` with experts nested inside each block."""

    def __init__(self):
        super().__init__()
        self.model = HFInner()
        self.lm_head = nn.Linear(8, 10)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x).logsumexp(-1).sum()


class DoubleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Linear(8, 8)
        self.txt = nn.Linear(8, 8)

    def forward(self, img, txt):
        return img + torch.tanh(self.img(img)), txt + torch.tanh(self.txt(txt))


class SingleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.mod = nn.Linear(8, 8)

    def forward(self, x, *, scale=1.0):
        return x + scale * torch.tanh(self.lin(x)) * self.mod(x)


class DiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.double_blocks = nn.ModuleList(DoubleBlock() for _ in range(2))
        self.single_blocks = nn.ModuleList(SingleBlock() for _ in range(3))
        self.final = nn.Linear(8, 1)

    def forward(self, img, txt):
        for block in self.double_blocks:
            img, txt = block(img, txt)
        x = torch.cat([img, txt])
        for block in self.single_blocks:
            x = block(x, scale=0.5)
        return self.final(x).sum()


def _names(model):
    return (
        [n for n, _ in model.named_parameters()],
        [n for n, _ in model.named_buffers()],
        [n for n, _ in model.named_modules()],
        list(model.state_dict()),
    )


@pytest.mark.parametrize(
    "factory, inputs, expected",
    [
        (
            lambda: build_model("dense"),
            lambda: (torch.randint(0, 256, (2, 16)),),
            [f"layers.{i}" for i in range(4)],
        ),
        (HFStyle, lambda: (torch.randint(0, 10, (2, 5)),), [f"model.layers.{i}" for i in range(3)]),
        (
            DiT,
            lambda: (torch.randn(3, 8), torch.randn(2, 8)),
            [
                "double_blocks.0",
                "double_blocks.1",
                "single_blocks.0",
                "single_blocks.1",
                "single_blocks.2",
            ],
        ),
    ],
)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_discovery_wraps_outermost_stacks_and_keeps_names(factory, inputs, expected, mode):
    torch.manual_seed(0)
    model = factory()
    args = inputs()
    reference = copy.deepcopy(model)
    out = reference(*args)
    (out if out.dim() == 0 else out.float().mean()).backward()
    before = _names(model)
    assert prime_ac.checkpoint_blocks(model, mode=mode) == expected
    assert _names(model) == before
    out = model(*args)
    (out if out.dim() == 0 else out.float().mean()).backward()
    assert_bitwise_equal(grads(model), grads(reference))
    # the experts list inside each block is never taken for a block stack
    assert not any(
        type(m).__name__.startswith("Checkpointed")
        for n, m in model.named_modules()
        if ".experts." in n
    )


def test_state_dict_round_trips_between_wrapped_and_plain():
    model, plain = CountingModel(), CountingModel()
    prime_ac.checkpoint_blocks(model, mode="full")
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_reapplying_never_nests_and_replaces_settings():
    model = CountingModel()
    prime_ac.checkpoint_blocks(model, mode="full")
    cls = type(model.layers[0])
    assert prime_ac.checkpoint_blocks(model, mode="selective", freq=2) == ["layers.0", "layers.2"]
    assert type(model.layers[0]) is cls  # same wrapper class, not a wrapper of a wrapper
    assert type(model.layers[0]).__mro__.count(cls) == 1
    assert model.layers[0]._prime_ac.policy.mode == "selective"
    assert not hasattr(model.layers[1], "_prime_ac")
    assert type(model.layers[1]).__name__ == "CountingBlock"


def test_unwrap_restores_plain_modules():
    model = CountingModel()
    prime_ac.checkpoint_blocks(model, mode="full")
    assert prime_ac.unwrap_blocks(model) == [f"layers.{i}" for i in range(4)]
    assert all(type(layer).__name__ == "CountingBlock" for layer in model.layers)
    assert not any(hasattr(layer, "_prime_ac") for layer in model.layers)
    assert prime_ac.unwrap_blocks(model) == []


def test_blocks_paths_predicates_and_their_errors():
    model = DiT()
    assert prime_ac.checkpoint_blocks(model, blocks="single_blocks", freq=2) == [
        "single_blocks.0",
        "single_blocks.2",
    ]
    assert prime_ac.checkpoint_blocks(model, blocks=lambda name, m: isinstance(m, DoubleBlock)) == [
        "double_blocks.0",
        "double_blocks.1",
    ]
    assert not hasattr(model.single_blocks[0], "_prime_ac")  # re-applying unwrapped it
    assert prime_ac.checkpoint_blocks(model, blocks=["double_blocks", "single_blocks"], freq=2) == [
        "double_blocks.0",
        "single_blocks.0",
        "single_blocks.2",
    ]
    with pytest.raises(TypeError, match="dotted paths"):
        prime_ac.checkpoint_blocks(model, blocks=["single_blocks", 3])
    with pytest.raises(ValueError, match=r"blocks='blocks' does not exist in DiT.*double_blocks"):
        prime_ac.checkpoint_blocks(model, blocks="blocks")
    with pytest.raises(ValueError, match=r"blocks='final' is a Linear, not a ModuleList"):
        prime_ac.checkpoint_blocks(model, blocks="final")


def test_no_stack_found_lists_containers_and_the_fix():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ValueError) as info:
        prime_ac.checkpoint_blocks(model)
    message = str(info.value)
    assert "found no stack of blocks in Sequential" in message
    assert "<root> (Sequential of 3)" in message
    assert "blocks='model.layers'" in message


def test_bad_settings_name_the_argument():
    with pytest.raises(ValueError, match="freq=0"):
        prime_ac.checkpoint_blocks(CountingModel(), freq=0)
    with pytest.raises(ValueError, match="mode='fast'"):
        prime_ac.checkpoint_blocks(CountingModel(), mode="fast")


def test_unwrap_after_a_class_swapping_wrapper_turns_checkpointing_off_in_place():
    torch.manual_seed(0)
    model, reference = CountingModel(), CountingModel()
    reference.load_state_dict(model.state_dict())
    prime_ac.checkpoint_blocks(model, mode="full")
    block = model.layers[0]
    swapped = type("FSDPLike", (type(block),), {})  # what fully_shard does to a wrapped block
    block.__class__ = swapped
    assert prime_ac.unwrap_blocks(model) == [f"layers.{i}" for i in range(4)]
    assert type(block) is swapped  # its class cannot be restored without undoing FSDPLike
    assert type(model.layers[1]).__name__ == "CountingBlock"
    assert prime_ac.unwrap_blocks(model) == []
    x = torch.randn(3, 8)
    calls = ac_models.CALLS["count"]
    model(x).backward()
    assert ac_models.CALLS["count"] - calls == 4  # no block replays: nothing is checkpointed
    reference(x).backward()
    assert_bitwise_equal(grads(model), grads(reference))
    # and it can be checkpointed again, by state alone
    assert prime_ac.checkpoint_blocks(model, mode="selective")[0] == "layers.0"
    assert type(block) is swapped and block._prime_ac.policy.mode == "selective"


def test_prime_ac_imports_no_prime_ops_or_kernel_library():
    code = (
        "import sys, prime_ac, prime_ac.demo, prime_ac.models, prime_ac.measure;"
        "banned = ['prime_ops', 'flash_attn', 'flash_attn_3', 'deep_ep', 'deep_gemm', 'quack',"
        " 'triton'];"
        "print([m for m in banned if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_prime_ops_imports_no_prime_ac():
    code = "import sys, prime_ops; print('prime_ac' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
