"""prime_ac beside torch_remat 0.2.2, torchtitan's checkpointing engine on its main branch.

A small torchtitan-style model declares its regions with ``remat.region`` and is wrapped the way
torchtitan wraps it (``block.forward = remat.checkpoint(...)(block.forward)``). Checked: prime_ac
takes such a block over and gives it back, refuses what it cannot run, keeps declared regions by
name (``"region:<glob>"``), reads torchtitan main's remat configs (stand-ins with their exact
fields: they are not in torchtitan 0.3.0), and measures alike with remat: gradients bitwise those
of no AC, held bytes and replayed FLOPs from prime_ac.measure.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from fnmatch import fnmatch

import pytest
import torch
from torch import nn

remat = pytest.importorskip(
    "torch_remat", reason="torch-remat is not installed (scripts/test_trainers.sh installs it)"
)

from ac_compare import assert_bitwise, replayed, step  # noqa: E402

import prime_ac  # noqa: E402
from prime_ac.integrations import torchtitan as adapter  # noqa: E402

D, T = 16, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(D, D)
        self.wo = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq(x)
        return self.wo(torch.softmax(q @ q.transpose(-1, -2) / 4, dim=-1) @ q)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, 4 * D)
        self.w2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)))


class Block(nn.Module):
    """A block as torchtitan main writes one: call sites named by ``remat.region``, saved
    outputs read by bare ops declared, save decisions handed down by
    ``configure_remat_regions``."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(D)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(D)
        self.feed_forward = FeedForward()
        self.save_patterns: list[str] = []

    def configure_remat_regions(self, save_patterns: list[str]) -> None:
        self.save_patterns = list(save_patterns)

    def _recompute(self, name: str) -> bool:
        return not any(fnmatch(name, p) for p in self.save_patterns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = remat.region(self.attention, "attention", recompute=self._recompute("attention"))(
            self.attention_norm(x)
        )
        remat.recompute_needs_tensor(a)
        h = x + a
        f = remat.region(
            self.feed_forward, "feed_forward", recompute=self._recompute("feed_forward")
        )(self.ffn_norm(h))
        remat.recompute_needs_tensor(f)
        return h + f


class Model(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build() -> Model:
    torch.manual_seed(0)
    return Model()


def loss_fn(model: nn.Module) -> torch.Tensor:
    torch.manual_seed(1)
    return model(torch.randn(2, T, D)).square().mean()


def titan_wrap(model: Model, save: list[str]) -> list:
    """What torchtitan main's RegionAC.apply does to each block."""
    wrappers = []
    for i, block in enumerate(model.layers):
        block.configure_remat_regions(save)
        block.forward = remat.checkpoint(region_name=f"layers.{i}")(block.forward)
        wrappers.append(block.forward)
    return wrappers


@pytest.fixture(scope="module")
def no_ac():
    return step(build(), loss_fn)


def measured(no_ac, apply, label):
    model = build()
    apply(model)
    result = step(model, loss_fn)
    assert_bitwise(result, no_ac, label)
    return result


# --- taking a remat-wrapped block over, and giving it back --------------------------------------


def test_remat_checkpoint_on_the_instance_is_taken_over_and_restored(no_ac):
    model = build()
    wrappers = titan_wrap(model, ["attention"])
    as_remat = step(model, loss_fn)
    assert_bitwise(as_remat, no_ac, "torch_remat RegionAC")
    assert prime_ac.is_checkpointed(model.layers[0])  # remat checkpoints it

    names = prime_ac.checkpoint_blocks(model, mode="full")
    assert names == ["layers.0", "layers.1"]
    assert all("forward" not in block.__dict__ for block in model.layers)
    full = step(model, loss_fn)
    assert_bitwise(full, no_ac, "prime_ac full over remat's blocks")
    plain_full = measured(no_ac, lambda m: prime_ac.checkpoint_blocks(m, mode="full"), "full")
    # prime_ac's region ran, not remat's: exactly what prime_ac full does on an unwrapped model
    assert (full.held, replayed(full, no_ac)) == (plain_full.held, replayed(plain_full, no_ac))
    assert full.held < as_remat.held  # remat kept "attention"; full keeps nothing

    assert prime_ac.unwrap_blocks(model) == names
    assert [block.__dict__["forward"] for block in model.layers] == wrappers
    assert all(type(block) is Block for block in model.layers)
    again = step(model, loss_fn)
    assert_bitwise(again, no_ac, "remat again after unwrap_blocks")
    assert (again.held, again.backward_flops) == (as_remat.held, as_remat.backward_flops)


def test_reconfiguring_a_taken_over_block_still_restores_remat():
    model = build()
    wrappers = titan_wrap(model, [])
    prime_ac.checkpoint_blocks(model, mode="full")
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["region:attention"])
    prime_ac.unwrap_blocks(model)
    assert [block.__dict__["forward"] for block in model.layers] == wrappers


def test_a_failed_configuration_leaves_the_remat_wrapper_in_place():
    model = build()
    wrappers = titan_wrap(model, [])

    def profile(m):
        raise RuntimeError("profile failed")

    with pytest.raises(RuntimeError, match="profile failed"):
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, profile=profile
        )
    assert [block.__dict__["forward"] for block in model.layers] == wrappers
    assert all(type(block) is Block for block in model.layers)


def test_any_other_instance_forward_is_refused_naming_the_block():
    model = build()
    shadow = functools.partial(Block.forward, model.layers[1])
    model.layers[1].forward = shadow
    with pytest.raises(ValueError, match=r"'layers\.1'.*del block\.forward"):
        prime_ac.checkpoint_blocks(model)
    assert model.layers[1].__dict__["forward"] is shadow  # nothing changed
    assert not any(prime_ac.is_checkpointed(block) for block in model.layers)

    # a remat checkpoint of something other than the block's own forward
    model.layers[1].forward = remat.checkpoint(region_name="x")(model.layers[0].forward)
    with pytest.raises(ValueError, match=r"'layers\.1' \(instance attribute forward = torch_remat"):
        prime_ac.checkpoint_blocks(model)


class NestedBlock(Block):
    """A block whose own forward runs a remat checkpoint: prime_ac's region would wrap it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(region_name="inner")(super().forward)(x)


class DecoratedBlock(Block):
    @remat.checkpoint(region_name="decorated")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


@pytest.mark.parametrize("cls", [NestedBlock, DecoratedBlock])
def test_a_class_forward_running_remat_checkpoint_is_refused(cls):
    model = Model()
    model.layers[0] = cls()
    with pytest.raises(ValueError, match=rf"'layers\.0' \(class {cls.__name__} runs torch_remat"):
        prime_ac.checkpoint_blocks(model)


def test_is_checkpointed_answers_for_the_forward_that_runs():
    model = build()
    prime_ac.checkpoint_blocks(model)
    block = model.layers[0]
    assert prime_ac.is_checkpointed(block)
    block.forward = functools.partial(Block.forward, block)  # prime_ac's class never runs
    assert not prime_ac.is_checkpointed(block)
    block.forward = remat.checkpoint(region_name="layers.0")(
        functools.partial(Block.forward, block)
    )
    assert prime_ac.is_checkpointed(block)


# --- region targets -------------------------------------------------------------------------------


def selective(targets):
    return lambda m: prime_ac.checkpoint_blocks(m, mode="selective", targets=targets)


def test_region_targets_keep_declared_regions_as_remat_saves_them(no_ac):
    full = measured(no_ac, lambda m: prime_ac.checkpoint_blocks(m, mode="full"), "full")
    attention = measured(no_ac, selective(["region:attention"]), "region:attention")
    both = measured(no_ac, selective(["region:*"]), "region:*")
    assert replayed(full, no_ac) > replayed(attention, no_ac) > replayed(both, no_ac)
    assert full.held < attention.held < both.held

    # forced replay wins, as torchtitan's recompute_regions do
    ffn = measured(no_ac, selective(["region:feed_forward"]), "region:feed_forward")
    all_but = measured(no_ac, selective(["region:*", "!region:attention"]), "all but attention")
    assert (all_but.held, all_but.backward_flops) == (ffn.held, ffn.backward_flops)

    # remat itself, saving the same regions, replays at least as much
    for save, ours in ((["attention"], attention), (["*"], both)):
        theirs = measured(no_ac, lambda m, save=save: titan_wrap(m, save), f"remat {save}")
        assert replayed(ours, no_ac) <= replayed(theirs, no_ac)


class ScopedBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with remat.name_scope("attn"):
            a = remat.region(self.attention, "core", recompute=True)(self.attention_norm(x))
        return x + a + self.feed_forward(self.ffn_norm(x))


def test_region_names_under_name_scope_are_qualified(no_ac):
    def build_scoped():
        torch.manual_seed(0)
        model = Model()
        model.layers = nn.ModuleList(ScopedBlock() for _ in range(2))
        return model

    reference = step(build_scoped(), loss_fn)
    results = {}
    for target in ("region:attn/core", "region:core", "region:attn/*"):
        model = build_scoped()
        prime_ac.checkpoint_blocks(model, mode="selective", targets=[target])
        results[target] = step(model, loss_fn)
        assert_bitwise(results[target], reference, target)
    kept, missed = results["region:attn/core"], results["region:core"]
    assert replayed(kept, reference) < replayed(missed, reference)
    assert results["region:attn/*"].backward_flops == kept.backward_flops


def test_region_targets_refuse_torch_compile():
    model = build()
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["region:attention"])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="region targets"):
        loss_fn(compiled).backward()


def test_a_bad_region_target_says_how_to_write_one():
    with pytest.raises(ValueError, match="region:attention"):
        prime_ac.checkpoint_blocks(build(), mode="selective", targets=["region:"])


# --- torchtitan main's remat configs, read by the adapter --------------------------------------
# Stand-ins with the fields of torchtitan main's torchtitan/distributed/activation_checkpoint.py
# (the classes are not in 0.3.0, which the trainers job installs).


class ActivationCheckpointing:
    @dataclass(kw_only=True, slots=True)
    class Config:
        preserve_rng_state: bool = True
        determinism_check: str = "default"
        debug: bool = False

    def __init__(self, config, dump_folder: str = ""):
        self.config = config


class FullAC(ActivationCheckpointing):
    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        pass


class RegionAC(ActivationCheckpointing):
    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        save_regions: list[str]
        recompute_regions: list[str] = field(default_factory=list)
        preserve_rng_state: bool = False

    def get_saved_tensors_hooks(self, module, *, base_fqn):
        return None


class SelectiveAC(RegionAC):
    @dataclass(kw_only=True, slots=True)
    class Config(RegionAC.Config):
        save_regions: list[str] = field(default_factory=lambda: ["*"])
        recompute_regions: list[str] = field(default_factory=lambda: ["*routed_experts.w13.*"])


class MemoryBudgetAC(ActivationCheckpointing):
    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        memory_budget: float = 0.5
        visualize_memory_budget_pareto: bool = False


def test_region_ac_maps_to_region_targets(no_ac):
    model = build()
    adapter.apply_ac(model, RegionAC.Config(save_regions=["attention"]))
    assert all(block.save_patterns == ["attention"] for block in model.layers)
    got = step(model, loss_fn)
    assert_bitwise(got, no_ac, "RegionAC")
    want = measured(no_ac, selective(["region:attention"]), "region:attention")
    assert (got.held, got.backward_flops) == (want.held, want.backward_flops)

    # a policy built from the config reads the same
    model = build()
    adapter.apply_ac(model, RegionAC(RegionAC.Config(save_regions=["attention"])))
    assert step(model, loss_fn).backward_flops == want.backward_flops


def test_selective_and_full_ac_map(no_ac):
    model = build()
    adapter.apply_ac(model, SelectiveAC.Config())
    selective_ac = step(model, loss_fn)
    want = measured(no_ac, selective(["region:*", "!region:*routed_experts.w13.*"]), "preset")
    assert (selective_ac.held, selective_ac.backward_flops) == (want.held, want.backward_flops)

    model = build()
    titan_wrap(model, [])  # torchtitan applied its own first: taken over
    adapter.apply_ac(model, FullAC.Config())
    full_ac = step(model, loss_fn)
    assert_bitwise(full_ac, no_ac, "FullAC")
    want = measured(no_ac, lambda m: prime_ac.checkpoint_blocks(m, mode="full"), "full")
    assert (full_ac.held, full_ac.backward_flops) == (want.held, want.backward_flops)


def test_memory_budget_ac_maps_to_a_budget():
    model = build()
    adapter.apply_ac(model, MemoryBudgetAC.Config(memory_budget=0.5), profile=loss_fn)
    state = prime_ac.wrapping.checkpoint_state(model.layers[0])
    assert state is not None and state.plan is not None


def test_what_does_not_map_is_refused_by_name():
    class OffloadingRegionAC(RegionAC):
        def get_saved_tensors_hooks(self, module, *, base_fqn):
            return (lambda t: t, lambda t: t)

    policy = OffloadingRegionAC(RegionAC.Config(save_regions=["*"]))
    with pytest.raises(ValueError, match="OffloadingRegionAC.get_saved_tensors_hooks"):
        adapter.apply_ac(build(), policy)

    @dataclass(kw_only=True, slots=True)
    class Config(RegionAC.Config):
        offload_regions: list[str] = field(default_factory=list)

    Config.__qualname__ = "RegionAC.Config"
    with pytest.raises(ValueError, match=r"\['offload_regions'\]"):
        adapter.apply_ac(build(), Config(save_regions=["*"]))
    with pytest.raises(ValueError, match="debug=True"):
        adapter.apply_ac(build(), FullAC.Config(debug=True))
    with pytest.raises(ValueError, match="save_regions"):
        adapter.apply_ac(build(), RegionAC.Config(save_regions="attention"))


def test_audit_refuses_blocks_a_remat_wrapper_shadows_after_wrapping():
    model = build()
    prime_ac.checkpoint_blocks(model, mode="full")
    titan_wrap(model, [])  # torchtitan applied after prime_ac: remat runs, prime_ac does not
    assert all(prime_ac.is_checkpointed(block) for block in model.layers)  # by remat
    with pytest.raises(ValueError, match=r"\['layers\.0', 'layers\.1'\].*del block\.forward"):
        prime_ac.audit(model, loss_fn)
    with pytest.raises(ValueError, match="torch_remat's checkpoint"):  # it wraps prime_ac's
        prime_ac.checkpoint_blocks(model, mode="full")
    for block in model.layers:
        del block.forward
    assert prime_ac.audit(model, loss_fn).replayed_ops > 0  # prime_ac's own again


def test_region_tables_read_as_region_targets():
    table = {"mode": "region", "save_regions": ["attention"], "recompute_regions": ["x.*"]}
    config = prime_ac.ACConfig.from_dict(table)
    assert (config.mode, list(config.targets)) == ("selective", ["region:attention", "!region:x.*"])
    # dataclasses.asdict of RegionAC.Config: no mode, its own keys
    table = dataclasses.asdict(RegionAC.Config(save_regions=["feed_forward"]))
    assert list(prime_ac.ACConfig.from_dict(table).targets) == ["region:feed_forward"]
    with pytest.raises(ValueError, match="save_regions='attention' must be a list"):
        prime_ac.ACConfig.from_dict({"mode": "region", "save_regions": "attention"})


def test_a_kept_region_runs_once_and_holds_what_remat_holds_plus_its_output(no_ac):
    def counted(apply):
        model = build()
        apply(model)
        calls = []
        for block in model.layers:
            block.attention.register_forward_pre_hook(lambda m, a: calls.append(m))
        loss_fn(model).backward()
        return len(calls)

    assert counted(lambda m: None) == 2  # one per block
    assert counted(lambda m: prime_ac.checkpoint_blocks(m, mode="full")) == 4
    assert counted(selective(["region:attention"])) == 2  # not run again in the recompute
    assert counted(lambda m: titan_wrap(m, ["attention"])) == 2

    ours = measured(no_ac, selective(["region:attention"]), "region:attention")
    theirs = measured(no_ac, lambda m: titan_wrap(m, ["attention"]), "remat attention")
    output = 2 * T * D * 4  # the region's output, float32, per block
    assert ours.held == theirs.held + 2 * output
