"""torchtitan 0.3.0's activation-checkpointing configs, applied by prime_ac.

``apply_ac(model, ac_config)`` takes what torchtitan's ``parallelize_*`` functions take
(``FullAC.Config``, ``SelectiveAC.Config``, ``MemoryBudgetAC.Config``, a built policy, or None)
or the same settings as a config table, and gives each its meaning on prime_ac:

- ``FullAC``: ``mode="full"``.
- ``SelectiveAC``: torchtitan's save list (``get_save_ops()``, so a subclass's list too) as
  targets. Two of its names are ``CompositeImplicitAutograd`` operators that no dispatch mode
  ever sees: ``aten::linear`` becomes ``aten::mm`` and ``aten::addmm`` (what it decomposes to),
  ``aten::_scaled_dot_product_attention_math`` becomes the CPU fused SDPA kernel (its own
  decomposition is softmax and matmuls: keeping those is not what the name asks for). Added:
  ``aten::_grouped_mm`` (MoE experts) and the CPU SDPA kernel, which its list omits. Its rule
  "replay every second mm" becomes scoped targets naming the mm calls it keeps, found in one
  forward of ``profile``; mm calls whose weight shape is that of a
  ``force_recompute_mm_shapes_by_fqns`` Linear replay.
- ``MemoryBudgetAC``: torchtitan only hands ``memory_budget`` to the compile partitioner
  (0 = full AC's activation memory, 1 = no AC's). Here ``targets="auto"`` keeps the calls that
  save the most replay within that memory (a fraction of the whole model's no-AC activation
  memory, measured on one step of ``profile``), in eager and compiled code alike.

The targets built from torchtitan's list (translations, every device's kernels, optional
backends) are the adapter's (:func:`prime_ac.tables.supplied`): the first step never reports
them as matching nothing, so ``strict=True`` raises only for what a ``SelectiveAC`` subclass
adds to the list. Importing this module registers :func:`config_from_table` with
:mod:`prime_ac.tables`, which imports it when ``ACConfig.from_dict`` meets a torchtitan table.

torchtitan's main branch (after 0.3.0) moved these onto torch_remat; its configs are read by
class name and fields, so no torchtitan newer than 0.3.0 need be installed:

- ``FullAC``: ``mode="full"``.
- ``RegionAC(save_regions, recompute_regions)``: each glob becomes a ``"region:<glob>"``
  target (``"!region:<glob>"`` for ``recompute_regions``, which win, as in torchtitan): the calls
  inside the model's ``torch_remat.region`` call sites are kept, everything else replays.
  Blocks with ``configure_remat_regions`` get the patterns as torchtitan hands them, so the
  model names its regions relative to the block.
- ``SelectiveAC`` (every declared region, a fixed preset): ``RegionAC`` with its own fields.
- ``MemoryBudgetAC``: as for 0.3.0.
- Refused by name: a ``RegionAC`` policy whose ``get_saved_tensors_hooks`` is overridden
  (per-block hooks; prime_ac applies the ambient ones with ``respect_saved_tensors_hooks``),
  ``debug=True``, and any field this adapter does not know.

Blocks are torchtitan's: the children of ``model.layers``. Applying again replaces the
settings; ``None`` stops checkpointing. A block torchtitan already wrapped
(``block.forward = remat.checkpoint(...)(block.forward)``) is taken over by
:func:`prime_ac.checkpoint_blocks`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from prime_ac import ACConfig, audit, checkpoint_blocks, find_blocks, unwrap_blocks
from prime_ac._compat import TorchDispatchMode
from prime_ac.tables import register_table_reader, supplied

__all__ = ["SAVE_TARGETS", "apply_ac", "config_from_table", "is_torchtitan_table", "save_targets"]

logger = logging.getLogger("prime_ac")

_MM = "aten::mm.default"
_CPU_SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu.default"

# What each CompositeImplicitAutograd name in torchtitan's list is kept as.
_TRANSLATED = {
    "aten::linear.default": (_MM, "aten::addmm.default"),
    "aten::_scaled_dot_product_attention_math.default": (_CPU_SDPA,),
}
_ADDED = ("aten::_grouped_mm.default", _CPU_SDPA)

SAVE_TARGETS: tuple[str, ...] = (
    "_c10d_functional::all_to_all_single.default",
    "_c10d_functional::reduce_scatter_tensor.default",
    "aten::_efficient_attention_forward.default",
    "aten::_flash_attention_forward.default",
    "aten::_grouped_mm.default",
    "aten::_scaled_dot_product_cudnn_attention.default",
    "aten::_scaled_dot_product_efficient_attention.default",
    "aten::_scaled_dot_product_flash_attention.default",
    _CPU_SDPA,
    "aten::_scaled_dot_product_fused_attention_overrideable.default",
    "aten::_scaled_mm.default",
    "aten::addmm.default",
    "aten::bmm.default",
    "aten::convolution.default",
    "aten::convolution_backward.default",
    "aten::max.default",
    "aten::topk.default",
    "aten::upsample_bilinear2d.default",
    "higher_order::flex_attention",
    "higher_order::inductor_compiled_code",
)
"""torchtitan 0.3.0's ``SelectiveAC`` save list on torch 2.13 without the optional backends it
adds when they are registered (its varlen attention, DeepEP, HybridEP; :func:`apply_ac` reads
them from torchtitan itself), translated, ``aten::_grouped_mm`` and the CPU SDPA kernel added,
every mm left out (the rule decides those). :func:`save_targets` computes it from an installed
torchtitan."""

_MEMORY_BUDGET = ("memory_budget", "memory-budget")
_MODES = {
    "full": "full",
    "selective": "selective",
    "memory_budget": "memory_budget",
    "memory-budget": "memory_budget",
    "none": "none",
    "region": "region",  # torchtitan main's RegionAC (its tyro subcommand)
}
# torchtitan 0.3.0's field names, then the pre-0.3 TOML names they replaced
_KEYS = {
    "mode",
    "preserve_rng_state",
    "determinism_check",
    "debug",
    "early_stop",
    "force_recompute_mm_shapes_by_fqns",
    "memory_budget",
    "visualize_memory_budget_pareto",
    "selective_ac_option",
    "per_op_sac_force_recompute_mm_shapes_by_fqns",
    "save_regions",
    "recompute_regions",
}
# Keys that only some modes read, with their default (in the release that has the key): a
# table dumped from a config object holds every key, and torchtitan ignores the others' defaults
_READ_BY = {
    "force_recompute_mm_shapes_by_fqns": ("selective", ["moe.router.gate"]),
    "per_op_sac_force_recompute_mm_shapes_by_fqns": ("selective", ["moe.router.gate"]),
    "selective_ac_option": ("selective", "2"),
    "memory_budget": ("memory_budget", 0.5),
    "visualize_memory_budget_pareto": ("memory_budget", False),
    "save_regions": ("region", []),
    "recompute_regions": ("region", []),
}


@dataclasses.dataclass(frozen=True)
class _Settings:
    """One torchtitan AC configuration, from a config object or a table."""

    kind: str  # "full", "selective", "region", "memory_budget" or "none"
    freq: int = 1  # pre-0.3 layer-selective AC: every freq-th block, fully
    save: tuple[str, ...] = supplied(SAVE_TARGETS)  # what the user's own list adds is not
    force_fqns: tuple[str, ...] = ("moe.router.gate",)
    memory_budget: float = 0.5
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False
    # torchtitan 0.3.0's wrapper passes early_stop=False (the recompute runs the whole block);
    # None keeps prime_ac's default, which stops once backward has its inputs: same gradients,
    # less replay. A table's own early_stop is passed on.
    early_stop: bool | None = None
    # torchtitan main's RegionAC: torch_remat region name globs, relative to a block
    save_regions: tuple[str, ...] = ()
    recompute_regions: tuple[str, ...] = ()

    def region_targets(self) -> list[str]:
        return [f"region:{g}" for g in self.save_regions] + [
            f"!region:{g}" for g in self.recompute_regions
        ]


def save_targets(save_ops: Any) -> tuple[str, ...]:
    """prime_ac targets keeping what a torchtitan save list keeps (``SelectiveAC.get_save_ops()``,
    operator objects), mm aside: names no dispatch mode sees translated, ``_grouped_mm`` and the
    CPU SDPA kernel added.

    Example::

        from torchtitan.distributed.activation_checkpoint import SelectiveAC
        save_targets(SelectiveAC(SelectiveAC.Config()).get_save_ops())
    """
    return tuple(sorted((_translated(save_ops) | set(_ADDED)) - {_MM}))


def _translated(save_ops: Any) -> set[str]:
    names: set[str] = set()
    for op in save_ops:
        name = _target(op)
        names.update(_TRANSLATED.get(name, (name,)))
    return names


def _target(op: Any) -> str:
    """The target naming exactly ``op``: ``aten::mm.default``, ``higher_order::flex_attention``."""
    if isinstance(op, torch._ops.OpOverload):
        namespace, name, overload = str(op).split(".")
        return f"{namespace}::{name}.{overload}"
    return f"higher_order::{op.name()}"


def is_torchtitan_table(table: Mapping[str, Any]) -> bool:
    """Whether ``table`` has a key or mode of torchtitan's AC settings that prime_ac's own table
    lacks (``debug``, ``memory_budget``, ``mode = "memory_budget"``, ...), as every
    ``dataclasses.asdict`` of a 0.3.0 config has: :meth:`prime_ac.ACConfig.from_dict` then
    reads it with :func:`config_from_table`."""
    own = {f.name for f in dataclasses.fields(ACConfig)}
    return bool((_KEYS - own) & set(table)) or table.get("mode") in (
        "none",
        "region",
        *_MEMORY_BUDGET,
    )


def config_from_table(table: Mapping[str, Any]) -> ACConfig:
    """An :class:`~prime_ac.ACConfig` from a torchtitan ``activation_checkpoint`` table.

    Accepts torchtitan 0.3.0's keys (``mode`` ``"full"`` / ``"selective"`` /
    ``"memory_budget"``, ``force_recompute_mm_shapes_by_fqns``, ``memory_budget``, ...), torchtitan
    main's ``mode = "region"`` with ``save_regions`` / ``recompute_regions`` (``"region:"``
    targets; its remat-based ``"selective"`` preset is not a table: pass its config), and the
    pre-0.3 ones (``selective_ac_option = "op"``, or a number k: every k-th block, fully, i.e.
    ``freq=k``). A table without ``mode`` (``dataclasses.asdict`` of a 0.3.0 config) is the
    config whose keys it has: ``memory_budget`` MemoryBudgetAC's, ``force_recompute_...``
    SelectiveAC's, neither FullAC's. A key its mode does not read raises unless it holds its
    default (torchtitan would ignore it). A table holds no model, so two rules become their
    nearest config: selective keeps every mm (torchtitan replays every second one:
    :func:`apply_ac` with ``profile=`` does that), and ``memory_budget=b`` becomes ``budget=b``,
    a fraction of no AC's memory (torchtitan's 0 is full AC's memory, so prime_ac holds at most
    what torchtitan would). The targets it supplies are marked
    :func:`prime_ac.tables.supplied`: never reported as matching nothing.

    Example::

        config_from_table({"mode": "selective", "selective_ac_option": "op"})
    """
    settings = _from_table(table)
    if settings.kind == "none":
        raise ValueError(
            "mode='none' turns activation checkpointing off, which no ACConfig states: skip "
            "checkpoint_blocks (or call prime_ac.unwrap_blocks(model))"
        )
    if not settings.preserve_rng_state and "preserve_rng_state" not in _extra_fields(settings):
        raise ValueError(
            "preserve_rng_state=False is an argument of checkpoint_blocks, not an ACConfig "
            "field: drop it from the table and pass checkpoint_blocks(..., "
            "preserve_rng_state=False)"
        )
    _check_unsupported(settings)
    if settings.kind == "full":
        return ACConfig(mode="full", freq=settings.freq, **_extra_fields(settings))
    if settings.kind == "region":
        return ACConfig(
            mode="selective", targets=settings.region_targets(), **_extra_fields(settings)
        )
    if settings.kind == "memory_budget":
        return ACConfig(
            mode="selective",
            targets="auto",
            budget=float(settings.memory_budget),
            **_extra_fields(settings),
        )
    return ACConfig(
        mode="selective", targets=(*settings.save, *supplied([_MM])), **_extra_fields(settings)
    )


def apply_ac(
    model: nn.Module,
    ac_config: Any,
    *,
    profile: Callable[[nn.Module], torch.Tensor] | None = None,
    blocks: Any = "layers",
    strict: bool = False,
    respect_saved_tensors_hooks: bool = False,
) -> list[str]:
    """Apply a torchtitan AC config to ``model`` with prime_ac; returns the wrapped blocks.

    ``ac_config`` is a ``FullAC.Config`` / ``SelectiveAC.Config`` / ``MemoryBudgetAC.Config``,
    a policy built from one (``SelectiveAC`` subclasses keep their own ``get_save_ops()``), a
    table of the same settings (see :func:`config_from_table`), or None (no AC). ``profile``
    runs one forward of the model and returns the loss: ``SelectiveAC`` needs it for the
    every-second-mm rule (without it every mm is kept, and a warning says so), and
    ``MemoryBudgetAC`` to measure the memory it may use. ``blocks`` are torchtitan's unless
    given (see :func:`prime_ac.find_blocks`); ``strict`` and ``respect_saved_tensors_hooks``
    are checkpoint_blocks'. torchtitan main's torch_remat configs (``RegionAC.Config``, ...)
    are read by name and fields (see the module docstring).

    Call it where torchtitan's ``parallelize_*`` calls ``ac_config.build().apply(model)``:
    after the model is built, before ``torch.compile`` and FSDP.

    Example::

        from torchtitan.distributed.activation_checkpoint import SelectiveAC
        apply_ac(model, SelectiveAC.Config(), profile=lambda m: m(tokens).sum())
    """
    if profile is not None and not callable(profile):
        raise TypeError(f"profile={profile!r} is not callable: pass a function model -> loss")
    if not isinstance(strict, bool):
        raise TypeError(
            f"strict={strict!r} must be True (raise for named targets that match nothing) or "
            "False (log them)"
        )
    settings = _from_table(ac_config) if isinstance(ac_config, Mapping) else _from_object(ac_config)
    if settings.kind == "none":
        unwrap_blocks(model)
        return []
    _check_unsupported(settings)
    extra = _extra_fields(settings)
    common = dict(
        blocks=blocks, strict=strict, respect_saved_tensors_hooks=respect_saved_tensors_hooks
    )
    if "preserve_rng_state" not in extra:
        common["preserve_rng_state"] = settings.preserve_rng_state
    if settings.kind == "region":
        for group in find_blocks(model, blocks):
            for _, block in group:
                _configure_regions(block, settings)
        config = ACConfig(mode="selective", targets=settings.region_targets(), **extra)
        return checkpoint_blocks(model, config=config, **common)
    if settings.kind == "full":
        return checkpoint_blocks(
            model, config=ACConfig(mode="full", freq=settings.freq, **extra), **common
        )
    if settings.kind == "memory_budget":
        return _apply_memory_budget(model, settings, profile, common, extra)
    return _apply_selective(model, settings, profile, common, extra)


def _apply_selective(
    model: nn.Module,
    settings: _Settings,
    profile: Callable[[nn.Module], torch.Tensor] | None,
    common: dict[str, Any],
    extra: dict[str, Any],
) -> list[str]:
    selected = [pair for group in find_blocks(model, common["blocks"]) for pair in group]
    forced = {name: _forced_shapes(name, block, settings.force_fqns) for name, block in selected}
    if profile is None:
        logger.warning(
            "prime_ac.integrations.torchtitan: SelectiveAC replays every second mm, which "
            "needs one forward to name those calls; without profile= every mm is kept (more "
            "memory, less replay than torchtitan): pass apply_ac(..., profile=model -> loss)"
        )
        matmuls = [_MM] + sorted(
            {
                f"!{path}/{_MM}"
                for name, block in selected
                for path, module in block.named_modules()
                if isinstance(module, nn.Linear) and _linear_shape(module) in forced[name]
            }
        )
    else:
        # wrapped first, so the forward runs through the blocks as they will be checkpointed
        checkpoint_blocks(model, config=ACConfig(mode="full", **extra), **common)
        with _MatmulCalls(selected) as calls, torch.enable_grad():
            profile(model)
        matmuls = _every_second_mm(calls.calls, forced)
    config = ACConfig(mode="selective", targets=(*settings.save, *supplied(matmuls)), **extra)
    return checkpoint_blocks(model, config=config, **common)


def _apply_memory_budget(
    model: nn.Module,
    settings: _Settings,
    profile: Callable[[nn.Module], torch.Tensor] | None,
    common: dict[str, Any],
    extra: dict[str, Any],
) -> list[str]:
    """torchtitan's budget b, between full AC's memory (0) and no AC's (1), as prime_ac's: a
    fraction of the whole model's no-AC activation memory, measured on one step."""
    if profile is None:
        raise ValueError(
            "MemoryBudgetAC needs profile=: a function that runs one forward of the model and "
            "returns the loss, so that prime_ac can measure the memory of full and of no AC"
        )
    _check_fraction(settings.memory_budget)
    checkpoint_blocks(model, config=ACConfig(mode="full", **extra), **common)
    report = audit(model, profile)
    full, none = report.held_bytes, max(report.held_bytes_no_ac, 1)
    fraction = min((full + settings.memory_budget * max(none - full, 0)) / none, 1.0)
    config = ACConfig(mode="selective", targets="auto", budget=fraction, **extra)
    return checkpoint_blocks(model, config=config, profile=profile, **common)


class _MatmulCalls(TorchDispatchMode):
    """The ``aten.mm`` calls of one forward in each block, in order: (submodule path relative
    to the block, weight shape ``args[1].shape``), as torchtitan's policy sees them."""

    def __init__(self, blocks: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.calls: dict[str, list[tuple[str, tuple[int, ...]]]] = {name: [] for name, _ in blocks}
        self._where: list[tuple[str, str]] = []
        self._handles = []
        for name, block in blocks:
            for path, module in block.named_modules():
                self._handles.append(
                    module.register_forward_pre_hook(partial(self._enter, name, path))
                )
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def _enter(self, block: str, path: str, module: nn.Module, args: Any) -> None:
        self._where.append((block, path))

    def _exit(self, module: nn.Module, args: Any, out: Any) -> None:
        self._where.pop()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default and self._where:
            block, path = self._where[-1]
            self.calls[block].append((path, tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def _every_second_mm(
    calls: dict[str, list[tuple[str, tuple[int, ...]]]], forced: dict[str, set[tuple[int, int]]]
) -> list[str]:
    """Scoped targets keeping the mm calls torchtitan keeps: in each block's forward, the 1st,
    3rd, 5th... mm whose weight shape is not forced to replay."""
    kept_at: dict[str, set[bool]] = defaultdict(set)
    for block, block_calls in calls.items():
        count = 0
        for path, shape in block_calls:
            if shape in forced[block]:
                kept_at[path].add(False)
                continue
            count += 1
            kept_at[path].add(count % 2 == 1)
    mixed = sorted(path or "<block>" for path, kept in kept_at.items() if len(kept) == 2)
    if mixed:
        logger.warning(
            "prime_ac.integrations.torchtitan: SelectiveAC keeps some mm calls in %s and "
            "replays others there (different blocks or repeated calls); a scoped target names "
            "all calls of a submodule, so prime_ac keeps them all",
            mixed,
        )
    kept = {path for path, decisions in kept_at.items() if True in decisions}
    if "" in kept:  # mm in the block's own code: keep mm everywhere, replay where torchtitan does
        return [_MM] + [f"!{path}/{_MM}" for path in sorted(kept_at) if path not in kept]
    return [f"{path}/{_MM}" for path in sorted(kept)]


def _forced_shapes(
    block_name: str, block: nn.Module, fqns: tuple[str, ...]
) -> set[tuple[int, int]]:
    """torchtitan's ``force_recompute_mm_shapes_by_fqns`` for one block: the (in, out) weight
    shapes of the Linears whose qualified name contains one of ``fqns``."""
    shapes = set()
    for path, module in block.named_modules():
        fqn = f"{block_name}.{path}" if path else block_name
        if not any(f in fqn for f in fqns):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"force_recompute_mm_shapes_by_fqns={list(fqns)!r} matches {fqn!r}, a "
                f"{type(module).__name__}; it must name nn.Linear modules (their mm replays)"
            )
        shapes.add(_linear_shape(module))
    return shapes


def _linear_shape(module: nn.Linear) -> tuple[int, int]:
    out_features, in_features = module.weight.shape
    return (in_features, out_features)


def _from_object(config: Any) -> _Settings:
    if config is None:
        return _Settings("none")
    if isinstance(config, str):
        raise TypeError(
            f"ac_config={config!r} is a string: pass a torchtitan config (FullAC.Config(), "
            f"SelectiveAC.Config(), MemoryBudgetAC.Config()) or a table such as "
            f"{{'mode': {config!r}}}"
        )
    remat = _remat_settings(config)
    if remat is not None:
        return remat
    from torchtitan.distributed import activation_checkpoint as tt

    policy = config if isinstance(config, tt.ActivationCheckpointing) else None
    if policy is not None:
        config = policy.config
    if not isinstance(config, tt.ActivationCheckpointing.Config):
        raise TypeError(_NOT_A_CONFIG.format(config=config))
    common = dict(
        preserve_rng_state=config.preserve_rng_state,
        determinism_check=config.determinism_check,
        debug=config.debug,
    )
    if isinstance(config, tt.FullAC.Config):
        return _Settings("full", **common)
    if isinstance(config, tt.SelectiveAC.Config):
        if policy is None:
            policy = tt.SelectiveAC(config)
        ops = set(policy.get_save_ops())
        # what a subclass adds to torchtitan's list is the user's, reported if it matches nothing
        own = _translated(ops - set(tt.SelectiveAC.get_save_ops(policy))) - {_MM}
        return _Settings(
            "selective",
            save=(*supplied(t for t in save_targets(ops) if t not in own), *sorted(own)),
            force_fqns=tuple(config.force_recompute_mm_shapes_by_fqns),
            **common,
        )
    if isinstance(config, tt.MemoryBudgetAC.Config):
        if config.visualize_memory_budget_pareto:
            raise ValueError(_PARETO)
        return _Settings("memory_budget", memory_budget=config.memory_budget, **common)
    raise TypeError(_NOT_A_CONFIG.format(config=config))


_NOT_A_CONFIG = (
    "ac_config={config!r} is not a torchtitan AC config: pass FullAC.Config(), "
    "SelectiveAC.Config(), MemoryBudgetAC.Config(), a policy built from one, a table, or None"
)
_PARETO = (
    "visualize_memory_budget_pareto=True draws the compile partitioner's trade-off curve, which "
    "prime_ac's eager budget does not have: drop it (prime_ac.audit(model, loss_fn) reports "
    "what the budget keeps)"
)


# torchtitan main's torch_remat-based configs (not in 0.3.0): the fields each reads
_REMAT_COMMON = {"preserve_rng_state", "determinism_check", "debug"}
_REMAT_FIELDS = {
    "FullAC": _REMAT_COMMON,
    "RegionAC": _REMAT_COMMON | {"save_regions", "recompute_regions"},
    "SelectiveAC": _REMAT_COMMON | {"save_regions", "recompute_regions"},
    "MemoryBudgetAC": _REMAT_COMMON | {"memory_budget", "visualize_memory_budget_pareto"},
}
_OP_SAC_FIELDS = {"force_recompute_mm_shapes_by_fqns", "early_stop"}  # 0.3.0's, not main's


def _remat_settings(config: Any) -> _Settings | None:
    """The settings of a torchtitan main config (``RegionAC.Config``, ...) or a policy built
    from one, read by class name and fields; None for anything else (0.3.0's classes, which
    :func:`_from_object` reads from torchtitan itself)."""
    policy = None
    if hasattr(config, "config") and any(c.__name__ in _REMAT_FIELDS for c in type(config).__mro__):
        policy, config = config, config.config
    owner, _, inner = type(config).__qualname__.rpartition(".")
    if inner != "Config" or owner not in _REMAT_FIELDS or not dataclasses.is_dataclass(config):
        return None
    fields = {f.name for f in dataclasses.fields(config)}
    if _installed_0_3(config) or (owner != "RegionAC" and fields & _OP_SAC_FIELDS):
        return None
    unknown = sorted(fields - _REMAT_FIELDS[owner])
    if unknown:
        raise ValueError(
            f"{owner}.Config field(s) {unknown} have no meaning prime_ac knows: "
            f"prime_ac reads {sorted(_REMAT_FIELDS[owner])}; leave them at their defaults and "
            "drop them, or use prime_ac.checkpoint_blocks directly"
        )
    hooks = getattr(type(policy), "get_saved_tensors_hooks", None)
    if policy is not None and hooks is not None and hooks.__qualname__.split(".")[-2] != "RegionAC":
        raise ValueError(
            f"{type(policy).__name__}.get_saved_tensors_hooks hands torch_remat saved-tensor "
            "hooks per block; prime_ac takes none per block: wrap the step in "
            "torch.autograd.graph.saved_tensors_hooks(pack, unpack) and pass "
            "apply_ac(..., respect_saved_tensors_hooks=True) (prime_ac.saved_tensor_kind() tells "
            "pack what it packs)"
        )
    common = dict(
        preserve_rng_state=config.preserve_rng_state,
        determinism_check=config.determinism_check,
        debug=config.debug,
    )
    if owner == "FullAC":
        return _Settings("full", **common)
    if owner == "MemoryBudgetAC":
        if config.visualize_memory_budget_pareto:
            raise ValueError(_PARETO)
        return _Settings("memory_budget", memory_budget=config.memory_budget, **common)
    # SelectiveAC without fields of its own saves every declared region (torchtitan: ["*"])
    save = getattr(config, "save_regions", ["*"])
    recompute = getattr(config, "recompute_regions", [])
    for name, value in (("save_regions", save), ("recompute_regions", recompute)):
        if isinstance(value, str) or not all(isinstance(g, str) for g in value):
            raise ValueError(f"{owner}.Config.{name}={value!r} must be a list of glob strings")
    return _Settings(
        "region", save_regions=tuple(save), recompute_regions=tuple(recompute), **common
    )


def _installed_0_3(config: Any) -> bool:
    """Whether ``config``'s class is the installed torchtitan's (0.3.0, read by isinstance)."""
    module = sys.modules.get("torchtitan.distributed.activation_checkpoint")
    return (
        module is not None
        and type(config).__module__ == module.__name__
        and not hasattr(module, "RegionAC")
    )


def _configure_regions(block: nn.Module, settings: _Settings) -> None:
    """What torchtitan's RegionAC does before it wraps a block: hand its save patterns to a
    block that takes them (``configure_remat_regions``: the model names its regions relative to
    the block). Its one-argument form takes the save patterns; the two-argument form also the
    recompute patterns."""
    configure = getattr(block, "configure_remat_regions", None)
    if not callable(configure):
        return
    required = [
        p
        for p in inspect.signature(configure).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) >= 2:
        configure(list(settings.save_regions), list(settings.recompute_regions))
    else:
        configure(list(settings.save_regions))


def _from_table(table: Mapping[str, Any]) -> _Settings:
    unknown = sorted(set(table) - _KEYS)
    own = sorted(set(unknown) & {f.name for f in dataclasses.fields(ACConfig)})
    if own:
        raise ValueError(
            f"the table mixes prime_ac's key(s) {own} with torchtitan's "
            f"{sorted(set(table) & _KEYS - {'mode'})}; it is read as torchtitan's, which has no "
            f"such key: write the table of one of the two (docs/integrations.md)"
        )
    if unknown:
        raise ValueError(
            f"unknown torchtitan activation-checkpointing key(s) {unknown}: accepted keys are "
            f"{sorted(_KEYS)}"
        )
    mode = table["mode"] if "mode" in table else _mode_by_keys(table)
    if mode not in _MODES:
        raise ValueError(
            f"mode={mode!r} is not a torchtitan AC mode: use one of {sorted(set(_MODES))}"
        )
    kind = _MODES[mode]
    for key, (reader, default) in _READ_BY.items():
        value = table.get(key, default)
        if reader != kind and str(_plain(value)) != str(_plain(default)):
            raise ValueError(
                f"{key}={value!r} is read only with mode={reader!r}, and this table's mode is "
                f"{mode!r} (torchtitan ignores it there): set mode={reader!r} to use it, or "
                f"drop {key}"
            )
    freq = 1
    option = table.get("selective_ac_option", "op")
    if kind == "selective" and str(option) != "op":
        if not str(option).isdigit() or int(option) < 1:
            raise ValueError(
                f"selective_ac_option={option!r} must be 'op' (per-operator) or a positive "
                "number k (every k-th block, fully)"
            )
        kind, freq = "full", int(option)
    fqns = table.get(
        "force_recompute_mm_shapes_by_fqns",
        table.get("per_op_sac_force_recompute_mm_shapes_by_fqns", ["moe.router.gate"]),
    )
    if isinstance(fqns, str):
        raise ValueError(f"force_recompute_mm_shapes_by_fqns={fqns!r} must be a list: [{fqns!r}]")
    if table.get("visualize_memory_budget_pareto"):
        raise ValueError(_PARETO)
    if kind == "memory_budget":
        _check_fraction(table.get("memory_budget", 0.5))
    regions = {key: table.get(key, []) for key in ("save_regions", "recompute_regions")}
    for key, value in regions.items():
        if isinstance(value, str) or not all(isinstance(g, str) for g in value):
            raise ValueError(f"{key}={value!r} must be a list of glob strings: [{value!r}]")
    return _Settings(
        kind,
        save_regions=tuple(regions["save_regions"]),
        recompute_regions=tuple(regions["recompute_regions"]),
        freq=freq,
        force_fqns=tuple(fqns),
        memory_budget=table.get("memory_budget", 0.5),
        preserve_rng_state=table.get("preserve_rng_state", True),
        determinism_check=table.get("determinism_check", "default"),
        debug=table.get("debug", False),
        early_stop=table.get("early_stop"),
    )


def _mode_by_keys(table: Mapping[str, Any]) -> str:
    """The mode of a table without one, as 0.3.0's configs have none: the config whose own keys
    it has (SelectiveAC's, MemoryBudgetAC's), else FullAC (whose keys every config has)."""
    modes = {_READ_BY[key][0] for key in table if key in _READ_BY}
    if len(modes) > 1:
        keys = sorted(set(table) & set(_READ_BY))
        raise ValueError(
            f"the table has no mode and keys of both SelectiveAC and MemoryBudgetAC ({keys}): "
            "set mode = 'selective' or 'memory_budget'"
        )
    return modes.pop() if modes else "full"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _extra_fields(settings: _Settings) -> dict[str, Any]:
    """The checkpoint options torchtitan sets that this prime_ac's ACConfig has fields for."""
    fields = {f.name for f in dataclasses.fields(ACConfig)}
    wanted = {
        "early_stop": settings.early_stop,
        "determinism_check": settings.determinism_check,
        "preserve_rng_state": settings.preserve_rng_state,
    }
    return {name: v for name, v in wanted.items() if name in fields and v is not None}


def _check_unsupported(settings: _Settings) -> None:
    if settings.debug:
        raise ValueError(
            "debug=True: torch's checkpoint refuses debug with a context_fn, which prime_ac "
            "always passes; drop it (prime_ac.audit(model, loss_fn) shows what each block "
            "keeps and replays)"
        )
    if settings.determinism_check != "default" and "determinism_check" not in _extra_fields(
        settings
    ):
        raise ValueError(
            f"determinism_check={settings.determinism_check!r}: this prime_ac has no such "
            "option; drop it"
        )


def _check_fraction(budget: Any) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(
            f"memory_budget={budget!r} must be a number in [0, 1] (0: full AC's activation "
            "memory, 1: no AC's)"
        )


register_table_reader("torchtitan", claims=is_torchtitan_table, read=config_from_table)
