"""Block discovery, wrapping in place, idempotence, unwrapping and names."""

from __future__ import annotations

import copy
import io
import pickle
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


def test_a_module_or_a_one_argument_predicate_as_blocks_names_blocks_and_the_fix():
    model = DiT()
    with pytest.raises(TypeError, match=r"blocks= takes where the blocks are.*got Linear"):
        prime_ac.checkpoint_blocks(model, blocks=nn.Linear(8, 8))
    with pytest.raises(TypeError, match=r"blocks=.* must take two arguments.*lambda name, module"):
        prime_ac.checkpoint_blocks(model, blocks=lambda m: isinstance(m, DoubleBlock))
    assert prime_ac.unwrap_blocks(model) == []  # refused before anything changed


def test_a_block_in_two_stacks_is_discovered_once_under_its_first_path():
    model = nn.Module()
    shared = SingleBlock()
    model.enc = nn.ModuleList([shared, SingleBlock()])
    model.dec = nn.ModuleList([shared, SingleBlock()])
    assert prime_ac.checkpoint_blocks(model) == ["enc.0", "enc.1", "dec.1"]
    # naming it twice is the caller's choice, and the error says so
    with pytest.raises(ValueError, match=r"blocks= selects 'dec.0' twice \(also as 'enc.0'\)"):
        prime_ac.checkpoint_blocks(model, blocks=["enc", "dec"])


def _loss(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids).float().mean().backward()
    return grads(model)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_wrapped_model_pickles_and_stays_checkpointed(mode):
    torch.manual_seed(0)
    model, ids = build_model("dense"), torch.randint(0, 256, (2, 16))
    expected = _loss(copy.deepcopy(model), ids)
    prime_ac.checkpoint_blocks(model, mode=mode, freq=2)
    for restore in (
        lambda m: pickle.loads(pickle.dumps(m)),
        lambda m: _torch_round_trip(m),
        copy.deepcopy,
    ):
        copied = restore(model)
        assert [n for n, _ in prime_ac.wrapping.wrapped_blocks(copied)] == ["layers.0", "layers.2"]
        assert type(copied.layers[0]) is type(model.layers[0])  # the same wrapper class
        assert copied.layers[0]._prime_ac.policy.mode == mode
        assert_bitwise_equal(_loss(copied, ids), expected)
        assert prime_ac.unwrap_blocks(copied) == ["layers.0", "layers.2"]
        assert type(copied.layers[0]).__name__ == "TransformerBlock"
    assert_bitwise_equal(_loss(model, ids), expected)


def _torch_round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


class ConvBlock(nn.Module):
    """Conv2d -> BatchNorm2d -> ReLU: BatchNorm updates its running statistics in train mode."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_batchnorm_statistics_are_updated_once(mode, early_stop):
    torch.manual_seed(0)
    plain, x = nn.Sequential(ConvBlock(), ConvBlock()), torch.randn(2, 3, 6, 6)
    model = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(model, mode=mode, early_stop=early_stop)
    for _ in range(2):
        plain(x).square().mean().backward()
        model(x).square().mean().backward()
    assert_bitwise_equal(grads(model), grads(plain))
    assert model[0].norm.num_batches_tracked.item() == 2
    assert_bitwise_equal(dict(model.named_buffers()), dict(plain.named_buffers()))


class StatefulBlock(nn.Module):
    """Reads and reassigns a tensor attribute in its forward (RecurrentGemma's conv state)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        start = torch.zeros_like(x) if self.last is None else self.last
        out = torch.tanh(self.lin(x) + start)
        self.last = out.detach()
        return out


def test_tensor_attributes_the_forward_reassigns_are_as_the_forward_saw_them():
    torch.manual_seed(0)
    plain, x = nn.Sequential(StatefulBlock(), StatefulBlock()), torch.randn(3, 4)
    model = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(model, mode="full")
    for _ in range(2):  # the second step starts from the state the first left
        plain(x).sum().backward()
        model(x).sum().backward()
    assert_bitwise_equal(grads(model), grads(plain))
    assert torch.equal(model[1].last, plain[1].last)


class RecurrentBlock(nn.Module):
    """xLSTM-style: reads its per-layer state, given positionally; the model writes the new
    state into it in place after the call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, state):
        out = torch.tanh(self.lin(x) + state[0])
        return out, out.detach().mean(0)


class RecurrentModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(RecurrentBlock() for _ in range(2))

    def forward(self, x, states):
        for block, state in zip(self.blocks, states, strict=True):
            x, new = block(x, state)
            state[0].copy_(new)
        return x.sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_per_layer_state_the_model_updates_in_place_is_read_as_the_forward_read_it(mode):
    torch.manual_seed(0)
    plain, x = RecurrentModel(), torch.randn(3, 4)
    model = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(model, mode=mode)
    expected, states = ([[torch.randn(4)] for _ in range(2)] for _ in range(2))
    for state, reference in zip(states, expected, strict=True):
        state[0].copy_(reference[0])
    plain(x, expected).backward()
    model(x, states).backward()
    assert_bitwise_equal(grads(model), grads(plain))
    assert all(torch.equal(s[0], e[0]) for s, e in zip(states, expected, strict=True))


class EmptyCache:
    """transformers' Cache protocol: get_seq_length() is 0 until the first update."""

    def __init__(self):
        self.states = []

    def get_seq_length(self):
        return len(self.states)


class MambaStyleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, cache_params=None):
        out = torch.tanh(self.lin(x))
        if cache_params is not None:
            cache_params.states.append(out.detach())
        return out


class MambaStyleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MambaStyleBlock() for _ in range(2))

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache)  # positional, as RecurrentGemma passes its cache
        return x.sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_an_empty_cache_passed_positionally_is_left_out(mode):
    torch.manual_seed(0)
    plain, x = MambaStyleModel(), torch.randn(3, 4)
    model = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(model, mode=mode)
    plain(x, EmptyCache()).backward()
    cache = EmptyCache()
    with pytest.warns(UserWarning, match=r"'layers.0' runs without its empty cache_params.*use_c"):
        model(x, cache).backward()
    assert cache.states == []  # as transformers' checkpointing: the training call has no cache
    assert_bitwise_equal(grads(model), grads(plain))
    filled = EmptyCache()
    filled.states.append(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"'layers.0' got cache_params=EmptyCache.*use_cache"):
        model(x, filled)


class StopCounting(nn.Module):
    """Counts its forward runs after the last tensor autograd saves."""

    def __init__(self):
        super().__init__()
        self.lin, self.after_last_save = nn.Linear(4, 4), 0

    def forward(self, x):
        out = torch.tanh(self.lin(x))
        self.after_last_save += 1
        return out * 2.0


@pytest.mark.parametrize("early_stop, runs", [(None, 1), (True, 1), (False, 2)])
def test_early_stop_reaches_the_region(early_stop, runs):
    model = nn.Sequential(StopCounting(), StopCounting())
    prime_ac.checkpoint_blocks(model, mode="full", early_stop=early_stop)
    model(torch.randn(3, 4)).sum().backward()
    assert [block.after_last_save for block in model] == [runs, runs]


def test_determinism_check_reaches_the_region(monkeypatch):
    seen = []
    real = prime_ac.region.checkpoint

    def recording(*args, **kwargs):
        seen.append((kwargs.get("determinism_check"), kwargs.get("early_stop")))
        return real(*args, **kwargs)

    monkeypatch.setattr(prime_ac.region, "checkpoint", recording)
    model = CountingModel(2)
    config = prime_ac.ACConfig(early_stop=False, determinism_check="none")
    prime_ac.checkpoint_blocks(model, config=config)
    model(torch.randn(3, 8)).backward()
    assert seen == [("none", False)] * 2
    with pytest.raises(ValueError, match="pass early_stop= either as arguments or in config="):
        prime_ac.checkpoint_blocks(model, config=config, early_stop=True)
    with pytest.raises(ValueError, match=r"determinism_check='off' must be one of"):
        prime_ac.checkpoint_blocks(model, determinism_check="off")


def _checkpoint_wrapped(block):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(block)


def test_blocks_under_torch_checkpoint_wrapper_are_refused_naming_them():
    model = CountingModel(3)  # torchtitan's apply_ac: each layer in a CheckpointWrapper
    model.layers = nn.ModuleList(_checkpoint_wrapped(layer) for layer in model.layers)
    with pytest.raises(ValueError, match=r"3 selected block\(s\) are already checkpointed.*'l"):
        prime_ac.checkpoint_blocks(model)
    inner = lambda name, m: isinstance(m, ac_models.CountingBlock)  # noqa: E731
    with pytest.raises(ValueError, match=r"'layers.0._checkpoint_wrapped_module' \(Checkpoint"):
        prime_ac.checkpoint_blocks(model, blocks=inner)
    outer = nn.Sequential(nn.Sequential(model))  # a selected block that holds one
    with pytest.raises(ValueError, match=r"CheckpointWrapper '0.0.layers.0'"):
        prime_ac.checkpoint_blocks(outer, blocks="0")
    assert prime_ac.unwrap_blocks(outer) == []


class CachedConv(nn.Module):
    """Wan-VAE style: each block reads ``feat[idx[0]]``, replaces it and advances ``idx`` (lists
    shared by every block of the model), and records in ``log`` (a dict) what it saw."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, feat, idx, log):
        i = idx[0]
        h = self.lin(x) * (1.0 if feat[i] is None else feat[i])
        feat[i] = h.detach()[:1].clone()
        idx[0] += 1
        log.setdefault("seen", []).append(i)
        return torch.tanh(h)


class CachedStack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList(CachedConv() for _ in range(n))

    def forward(self, x, feat):
        idx, log = [0], {}
        for layer in self.layers:
            x = layer(x, feat, idx, log)
        self.last = (list(feat), idx[0], log)  # what the forward left, for the test
        return x


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_list_and_dict_arguments_the_forward_changes_are_restored_for_the_recompute(mode):
    torch.manual_seed(0)
    plain, x = CachedStack(), torch.randn(4, 8, requires_grad=True)
    model = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(model, mode=mode)
    for step in range(2):  # the second step reads the cache the first one filled
        results = []
        for m in (plain, model):
            feat = [None, None, None] if step == 0 else list(m.feat)
            m.zero_grad(set_to_none=True)
            m(x, feat).square().sum().backward()
            m.feat = feat
            results.append((grads(m), feat, m.last))
        (g0, feat0, last0), (g, feat, last) = results
        assert_bitwise_equal(g, g0)
        # the containers hold what the forward left, not what a recompute would have left
        assert [f is not None for f in feat] == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(feat, feat0, strict=True))
        assert last[1] == last0[1] == 3 and last[2] == last0[2] == {"seen": [0, 1, 2]}


class Unsupported(nn.Module):
    _supports_gradient_checkpointing = False  # as diffusers' AutoencoderKLWan declares

    def __init__(self):
        super().__init__()
        self.stack = CachedStack()

    def forward(self, x, feat):
        return self.stack(x, feat)


def test_a_model_declaring_no_gradient_checkpointing_is_refused_unless_blocks_are_named():
    model = Unsupported()
    with pytest.raises(ValueError, match=r"Unsupported._supports_gradient_checkpointing = False"):
        prime_ac.checkpoint_blocks(model)
    with pytest.raises(ValueError, match=r"blocks=\['stack.layers'\]"):
        prime_ac.find_blocks(model)
    assert prime_ac.unwrap_blocks(model) == []
    assert prime_ac.checkpoint_blocks(model, blocks="stack.layers") == [
        f"stack.layers.{i}" for i in range(3)
    ]
