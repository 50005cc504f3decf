"""``checkpoint_blocks``: the public entry that validates, plans and applies a configuration.

It sits on top of the package: settings (:mod:`prime_ac.config`), the policy, discovery
(:mod:`prime_ac.discovery`), the wrapping primitives (:mod:`prime_ac.wrapping`) and the budget
planner. A call is all or nothing: every argument is checked and every change planned before the
model is touched, and if anything fails while applying (a ``targets="auto"`` profile that
raises), every block gets back its class and settings.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from prime_ac import tables
from prime_ac.budget import budget_context_fn, plan_budget, profiled_modes
from prime_ac.config import ACConfig
from prime_ac.contexts import block_context_fn
from prime_ac.discovery import BlockSelector, find_blocks
from prime_ac.layer_modes import get_layer_modes, layer_policies
from prime_ac.offload_targets import offload_policies, offloading_context_fn
from prime_ac.policy import make_policy, refuse_typos
from prime_ac.remat import is_remat_checkpoint, remat_checkpoint_call
from prime_ac.scopes import scope_problems, split_targets, untrack
from prime_ac.targets import TargetSet, translate_composites
from prime_ac.watch import Watch, say_once, unloaded_namespaces
from prime_ac.wrapping import (
    BlockCheckpoint,
    changes_undone_on_error,
    checkpoint_state,
    own_class,
    unwrap_block,
    wrap_block,
    wrapped_blocks,
)

__all__ = ["checkpoint_blocks"]

logger = logging.getLogger("prime_ac")


def checkpoint_blocks(
    model: nn.Module,
    *,
    mode: str | None = None,
    freq: int | None = None,
    targets: Iterable[str] | str | None = None,
    blocks: BlockSelector = None,
    mandatory: Iterable[str] = (),
    preserve_rng_state: bool | None = None,
    strict: bool = False,
    config: ACConfig | None = None,
    budget: int | str | float | Mapping[str, int] | None = None,
    profile: Callable[[nn.Module], torch.Tensor] | None = None,
    early_stop: bool | None = None,
    determinism_check: str | None = None,
    skip_worse: bool = True,
    offload: Iterable[str] | None = None,
    group: Any = None,
    host_cap: int | str | None = None,
    respect_saved_tensors_hooks: bool = False,
) -> list[str]:
    """Wrap each selected block of ``model`` in its own non-reentrant checkpoint region.

    Works in place and returns the wrapped blocks' qualified names. ``mode`` is ``"full"`` (the
    default: keep only the mandatory operators) or ``"selective"`` (also keep ``targets``,
    :data:`prime_ac.DEFAULT_TARGETS` when None). ``freq=k`` wraps blocks whose index in their
    container is a multiple of k. ``blocks`` selects the blocks (see :func:`find_blocks`).
    ``config`` (an :class:`ACConfig`) supplies mode, freq, targets and budget instead of the
    arguments. Applying it again replaces the settings (blocks no longer selected stop being
    checkpointed); wrappers never nest. The call is atomic: on any error the model is left
    exactly as it was.

    Targets that no dispatch mode can see are logged on every call, or raise ValueError with
    ``strict=True``.

    ``targets="auto"`` chooses, per operator call, what to keep, offload or replay within
    ``budget``, measured on one step ``profile(model)`` that returns a loss
    (see :mod:`prime_ac.budget`). ``budget`` is the step's peak activation memory in bytes (an
    int, or a string such as ``"24GiB"``), a float fraction of the no-AC activation memory, or a
    ``{block name: bytes}`` mapping. Under ``torch.distributed`` the ranks of ``group`` (a
    process group; None: every rank; False: this rank alone) plan together and must all call
    this with the same blocks and kind of budget, or all raise (:mod:`prime_ac.ranks`).

    ``early_stop`` and ``determinism_check`` go to each region's
    ``torch.utils.checkpoint.checkpoint`` call (None: torch's defaults, ``True`` and
    ``"default"``; or set them in ``config``).

    ``skip_worse`` (default True): a block whose first step keeps at least what no AC holds for
    it (and at least ``prime_ac.watch.REPORTED_BYTES``) runs without checkpointing from then on,
    logged once naming the block and the bytes; False keeps checkpointing it, with a warning.

    ``offload`` names operators (as ``targets`` does) whose results go to host memory instead
    of staying on the device, kept even where the mode replays them (:mod:`prime_ac.offload_targets`).
    ``host_cap`` (bytes, an int or ``"64GiB"``) bounds the host memory a peak budget's plan
    offloads into; on CPU, where host and device are one memory, a plan offloads nothing
    unless it is given, and a named ``offload`` is logged once as freeing nothing there.

    ``respect_saved_tensors_hooks=True`` (torch 2.14's name, same meaning): the
    ``torch.autograd.graph.saved_tensors_hooks`` in effect around a block's forward pack the
    results it keeps too (at the end of its forward; unpacked when its recompute starts), and
    its inputs, each tagged with its kind (:func:`prime_ac.saved_tensor_kind`). False (the
    default): kept results bypass them, as torch's own selective checkpointing does today.

    Blocks already checkpointed by ``torch.distributed``'s ``CheckpointWrapper`` are refused;
    a Hugging Face model with its own gradient checkpointing on gets a warning. A block whose
    instance ``forward`` is torchtitan's ``torch_remat.checkpoint`` of its own forward is taken
    over (prime_ac's region runs instead; :func:`unwrap_blocks` puts it back); any other
    instance ``forward``, or a class ``forward`` that calls ``torch_remat.checkpoint``, is
    refused, naming the block (prime_ac's region would never run, or would nest).

    Example::

        import prime_ac
        wrapped = prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm"])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}: pass the model whose "
            "blocks to checkpoint"
        )
    config = _settings(
        config,
        mode=mode,
        freq=freq,
        targets=targets,
        budget=budget,
        early_stop=early_stop,
        determinism_check=determinism_check,
        preserve_rng_state=preserve_rng_state,
        offload=offload,
        host_cap=host_cap,
    )
    auto = config.targets == "auto"
    _check_profile(profile, auto)
    if group is not None and not auto:
        raise ValueError(
            'group= names the ranks that plan a budget together: it applies only with '
            'targets="auto"; drop it or set targets="auto"'
        )
    _check_respect(respect_saved_tensors_hooks, auto, config.offload)
    if not isinstance(skip_worse, bool):
        raise TypeError(
            f"skip_worse={skip_worse!r} must be True (run a block that holds at least what no AC "
            "holds without checkpointing) or False (keep checkpointing it, with a warning)"
        )
    # auto profiles with nothing but the mandatory set kept, then plans on top of full mode
    policy = make_policy(
        "full" if auto else config.mode,
        config.targets if config.mode == "selective" and not auto else None,
        mandatory,
    )
    # the targets a user named, reported when they cannot match; those an adapter supplied
    # (a trainer's list, its translations and device variants: prime_ac.tables) are not
    named = tables.user_named(config.targets or ()) if config.keeps_targets and not auto else []
    _report(
        TargetSet(split_targets(translate_composites(named))[0]).problems()
        + TargetSet(mandatory).problems(mandatory=True)
        + TargetSet(translate_composites(config.offload or ())).problems(),
        strict,
        targets=(*named, *(config.offload or ())),
    )

    selected, modes = _select(find_blocks(model, blocks), config)
    _say_offload_stays_in_memory(model, config.offload)
    policies = offload_policies(layer_policies(config, modes, mandatory, policy), config.offload)
    policy = policies.get(
        "selective", policies[config.mode]
    )  # the one with the named targets and scopes
    _check_not_nested(selected, "blocks=" if blocks is not None else "discovery")
    _check_no_checkpoint_wrapper(model, selected)
    taken_over = _remat_forwards(selected)
    _warn_on_own_checkpointing(model)
    if policy.scoped is not None:
        scoped = scope_problems(policy.scoped.targets, [block for _, block in selected])
        _report(scoped, strict)
    if auto and isinstance(config.budget, Mapping):
        _check_budget_names(config.budget, [name for name, _ in selected])

    chosen = {id(block) for _, block in selected}
    # what the first step did, said once: named targets that matched nothing, blocks holding
    # at least what no AC holds for them (prime_ac.watch)
    listed = config.targets if config.keeps_targets and not auto and config.targets else ()
    watch = Watch(
        split_targets(translate_composites(named))[0],
        [name for name, _ in selected],
        strict,
        listed=split_targets(translate_composites(listed))[0],
    )
    if skip_worse:
        watch.bypass = _bypass(watch, selected)
    with changes_undone_on_error(model):
        for name, block in selected:
            if id(block) in taken_over:
                del block.forward  # prime_ac's class runs; unwrap_block puts it back
            wrap_block(
                block,
                BlockCheckpoint(
                    name=name,
                    policy=policies[modes[name]],
                    context_fn=offloading_context_fn(
                        block_context_fn(policies[modes[name]], name, watch), policies[modes[name]]
                    ),
                    preserve_rng_state=config.preserve_rng_state,
                    early_stop=config.early_stop,
                    determinism_check=config.determinism_check,
                    watch=watch,
                    respect_saved_tensors_hooks=respect_saved_tensors_hooks,
                    shadowed_forward=taken_over.get(id(block)),
                ),
            )
        # blocks leaving: switched off first (reversible), unwrapped once nothing can fail
        leaving = [block for _, block in wrapped_blocks(model) if id(block) not in chosen]
        for block in leaving:
            wrap_block(block, dataclasses.replace(checkpoint_state(block), active=False))
        if auto:
            with profiled_modes(selected) as training:
                plans = plan_budget(
                    model, _checked_profile(profile), config.budget, group, config.host_cap
                )
            for name, block in selected:
                state = dataclasses.replace(
                    checkpoint_state(block),
                    context_fn=budget_context_fn(
                        policy,
                        frozenset(plans[name].kept),
                        f"block {name!r}",
                        frozenset(plans[name].offloaded),
                        plans[name].offloader,
                    ),
                    plan=dataclasses.replace(plans[name], training=training.get(name)),
                )
                wrap_block(block, state)
        for block in leaving:
            unwrap_block(block)
        _install_scope_hooks(model, policy)
    return [name for name, _ in selected]


_SAID_ONE_MEMORY: set[tuple[str, ...]] = set()


def _say_offload_stays_in_memory(model: nn.Module, offload: Iterable[str] | None) -> None:
    """Log once per operator list that a named offload on CPU frees nothing: host and device
    are one memory there, so each offloaded result is a copy in the same memory."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if not offload or device.type != "cpu" or tuple(offload) in _SAID_ONE_MEMORY:
        return
    _SAID_ONE_MEMORY.add(tuple(offload))
    logger.warning(
        "prime_ac: offload=%s on CPU: host and device are one memory, so the offloaded results "
        "stay in the same memory (copied, not freed). Offload on an accelerator, or drop offload=.",
        list(offload),
    )


def _bypass(watch: Watch, selected: list[tuple[str, nn.Module]]) -> Callable[[str, str], None]:
    """What the watch calls for a block better off without checkpointing: the block, while it
    still has this configuration, runs its own forward from then on (``BlockCheckpoint.bypassed``
    says why)."""
    refs = {name: weakref.ref(block) for name, block in selected}

    def bypass(name: str, why: str) -> None:
        block = refs[name]()
        state = checkpoint_state(block) if block is not None else None
        if state is not None and state.watch is watch:
            wrap_block(block, dataclasses.replace(state, bypassed=why))

    return bypass


def _install_scope_hooks(model: nn.Module, policy: Any) -> None:
    """Scope hooks on the wrapped blocks only when the policy has scoped targets, so a model
    without any pays nothing; hooks of an earlier configuration go."""
    scoped = policy.scoped if policy.scoped is not None and policy.scoped.needs_scope else None
    for module in model.modules():
        untrack(module)
    for _, block in wrapped_blocks(model) if scoped is not None else ():
        scoped.tracker.track(block)


def _select(
    groups: list[list[tuple[str, nn.Module]]], config: ACConfig
) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """The blocks to wrap and each one's mode (:func:`get_layer_modes` per group)."""
    if config.layer_modes is not None and len(groups) != 1:
        raise ValueError(
            f"layer_modes gives the layers of one stack a mode each, but the blocks form "
            f"{len(groups)} stacks ({', '.join(g[0][0] for g in groups if g)}, ...): pass "
            "blocks= naming one stack, or use mode= and freq="
        )
    chosen, modes = [], {}
    for group in groups:
        modes_here = get_layer_modes(config, [name for name, _ in group])
        for (name, block), mode in zip(group, modes_here, strict=True):
            if mode != "none":
                chosen.append((name, block))
                modes[name] = mode
    return chosen, modes


def _settings(config: Any, **explicit: Any) -> ACConfig:
    if config is None:
        defaults = {
            "mode": "full",
            "freq": 1,
            "early_stop": True,
            "determinism_check": "default",
            "preserve_rng_state": True,
        }
        return ACConfig(
            **{k: defaults[k] if v is None and k in defaults else v for k, v in explicit.items()}
        )
    if isinstance(config, Mapping):
        raise TypeError(
            "config= takes an ACConfig, got a dict: write config=prime_ac.ACConfig.from_dict(...) "
            "(or pass its keys as arguments)"
        )
    if not isinstance(config, ACConfig):
        raise TypeError(f"config= takes a prime_ac.ACConfig, got {type(config).__name__}")
    given = [name for name, value in explicit.items() if value is not None]
    if given:
        raise ValueError(
            f"pass {', '.join(f'{n}=' for n in given)} either as arguments or in config=, not "
            f"both: config={config!r} already sets them"
        )
    return config


def _check_profile(profile: Any, auto: bool) -> None:
    if auto and profile is None:
        raise ValueError(
            'targets="auto" needs profile=: a function that runs one forward of the model and '
            "returns the loss, e.g. profile=lambda model: model.loss(batch)"
        )
    if not auto and profile is not None:
        raise ValueError('profile= applies only with targets="auto"; drop it or set targets="auto"')
    if auto and not callable(profile):
        raise TypeError(
            f"profile={profile!r} is not callable: pass a function model -> loss, e.g. "
            "profile=lambda model: model.loss(batch)"
        )


def _checked_profile(profile: Callable[[nn.Module], Any]) -> Callable[[nn.Module], torch.Tensor]:
    def loss_fn(model: nn.Module) -> torch.Tensor:
        loss = profile(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise TypeError(
                f"profile= must return the loss of one forward (a one-element tensor that "
                f"requires grad) to run backward on; it returned {_describe(loss)}"
            )
        return loss

    return loss_fn


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, requires_grad={value.requires_grad}"
    return f"{type(value).__name__} {value!r}"[:200]


def _check_not_nested(selected: list[tuple[str, nn.Module]], source: str) -> None:
    names: dict[int, str] = {}
    for name, block in selected:
        if id(block) in names:
            raise ValueError(f"{source} selects {name!r} twice (also as {names[id(block)]!r})")
        names[id(block)] = name
    for name, block in selected:
        for inner in block.modules():
            if inner is not block and id(inner) in names:
                raise ValueError(
                    f"{source} selects {names[id(inner)]!r} inside the selected block {name!r}: "
                    "checkpoint regions cannot nest. Pass blocks= to select one level."
                )


_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def _check_no_checkpoint_wrapper(model: nn.Module, selected: list[tuple[str, nn.Module]]) -> None:
    """Refuse blocks inside, around or being a ``CheckpointWrapper`` (torchtitan's ``apply_ac``,
    FSDP1 recipes): the regions would nest, replaying every operator twice. Refused, not
    unwrapped: unwrapping another library's wrapper changes the model's state-dict keys
    (``_checkpoint_wrapped_module.``) under the code that saves and loads them."""
    module = sys.modules.get(_CHECKPOINT_WRAPPER)  # never imported: no module can be one
    if module is None:
        return
    wrappers = [(n, m) for n, m in model.named_modules() if isinstance(m, module.CheckpointWrapper)]
    covered = {id(m): name for name, wrapper in wrappers for m in wrapper.modules()}
    clashes = []
    for name, block in selected:  # the block is or sits inside a wrapper, or holds one
        wrapper = covered.get(id(block)) or next(
            (n for n, w in wrappers if any(m is w for m in block.modules())), None
        )
        if wrapper is not None:
            clashes.append(f"{name!r} (CheckpointWrapper {wrapper!r})")
    if clashes:
        raise ValueError(
            f"checkpoint_blocks: {len(clashes)} selected block(s) are already checkpointed by "
            f"torch.distributed's CheckpointWrapper: {', '.join(clashes[:4])}. Two checkpoint "
            "layers would nest and replay every operator twice. Build the model without it "
            "(torchtitan 0.3.0: activation_checkpoint=None, then "
            "prime_ac.integrations.torchtitan.apply_ac), or keep the "
            "CheckpointWrapper and leave these blocks out of blocks=."
        )


def _check_respect(respect: Any, auto: bool, offload: Any) -> None:
    if not isinstance(respect, bool):
        raise TypeError(
            f"respect_saved_tensors_hooks={respect!r} must be True (the saved_tensors_hooks "
            "around the forward pack kept results too) or False (they bypass them)"
        )
    if respect and (auto or offload):
        mover = 'targets="auto"' if auto else "offload="
        raise ValueError(
            f"respect_saved_tensors_hooks=True hands kept results to your saved_tensors_hooks, "
            f"and {mover} moves them itself: choose one (drop respect_saved_tensors_hooks, or "
            "let your hooks offload)"
        )


def _remat_forwards(selected: list[tuple[str, nn.Module]]) -> dict[int, Any]:
    """The instance ``forward`` of each selected block that is torch_remat's checkpoint of the
    block's own forward (torchtitan's ``block.forward = remat.checkpoint(...)(block.forward)``),
    to take over; raises naming every block whose forward prime_ac's class cannot reach (any
    other instance ``forward``) or whose class's forward runs a remat checkpoint itself."""
    taken, refused = {}, []
    for name, block in selected:
        cls = own_class(block)
        if is_remat_checkpoint(cls.forward) or remat_checkpoint_call(cls.forward):
            refused.append(
                f"{name!r} (class {cls.__name__} runs torch_remat.checkpoint in forward)"
            )
            continue
        shadow = block.__dict__.get("forward")
        if shadow is None:
            continue
        inner = getattr(shadow, "__wrapped__", None)
        if (
            is_remat_checkpoint(shadow)
            and getattr(inner, "__self__", None) is block
            and getattr(inner, "__func__", None) is cls.forward
        ):
            taken[id(block)] = shadow
        else:
            what = "torch_remat's checkpoint" if is_remat_checkpoint(shadow) else _kind(shadow)
            refused.append(f"{name!r} (instance attribute forward = {what})")
    if refused:
        raise ValueError(
            f"checkpoint_blocks: {len(refused)} selected block(s) would not run prime_ac's "
            f"checkpoint as they are: {', '.join(refused[:4])}. prime_ac checkpoints a block "
            "through its class, which an instance attribute forward shadows, and a "
            "torch_remat.checkpoint inside the class's forward would nest inside prime_ac's "
            "region (every operator replayed twice). Remove the instance attribute "
            "(del block.forward; torchtitan: build without its activation checkpointing and "
            "call prime_ac.integrations.torchtitan.apply_ac), take remat.checkpoint out of the "
            "class (its remat.region calls may stay: 'region:<name>' targets keep them), or "
            "leave these blocks out of blocks=."
        )
    if taken:
        logger.info(
            "prime_ac: %d block(s) had torch_remat's checkpoint as their forward; prime_ac's "
            "region runs instead (unwrap_blocks puts it back)",
            len(taken),
        )
    return taken


def _kind(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _warn_on_own_checkpointing(model: nn.Module) -> None:
    """Warn once per call when Hugging Face's own gradient checkpointing is on: a module's
    ``gradient_checkpointing`` flag, as transformers' GradientCheckpointingLayer and diffusers
    set it (what transformers' ``is_activation_checkpointing``, formerly
    ``is_gradient_checkpointing``, reads). Its regions would wrap prime_ac's."""
    on = [
        name or "<root>"
        for name, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]
    if not on:
        return
    # transformers 5.2x renamed the call; the old name warns that it is deprecated
    off = next(
        (
            f"model.{n}()"
            for n in ("activation_checkpointing_disable", "gradient_checkpointing_disable")
            if callable(getattr(type(model), n, None))
        ),
        "gradient_checkpointing=False on those modules",
    )
    shown = ", ".join(on[:3]) + ", ..." * (len(on) > 3)
    warnings.warn(
        f"prime_ac: {type(model).__name__} has its own gradient checkpointing on "
        f"(gradient_checkpointing=True on {shown}): two checkpoint layers. diffusers and "
        "transformers 4.x nest their regions around prime_ac's and replay each block twice; "
        "transformers 5.x stands down, but prime_ac.audit's no-AC baseline becomes its "
        f"checkpointing. Call {off} before prime_ac.checkpoint_blocks (with a transformers "
        "Trainer: gradient_checkpointing=False in its arguments).",
        stacklevel=3,
    )


def _check_budget_names(budget: Mapping[str, int], names: list[str]) -> None:
    unknown = sorted(set(budget) - set(names))
    missing = [name for name in names if name not in budget]
    if unknown:
        raise ValueError(
            f"budget= names {unknown}, which are not blocks this call checkpoints: {names}"
        )
    if missing:
        raise ValueError(f"budget= has no entry for checkpointed block(s) {missing}")


def _report(problems: list[tuple[str, str]], strict: bool, targets: Iterable[str] = ()) -> None:
    """Raise for names in torch's own namespaces that name no operator
    (:func:`prime_ac.policy.refuse_typos`); log the other problems once per process and target
    set (``targets``; a second model with the same targets says nothing), at debug level for
    names of a namespace no module of this process registered (an optional backend, which may
    never load), or raise for them too with ``strict=True``."""
    refuse_typos(problems)
    if strict and problems:
        raise ValueError(
            "targets that no dispatch mode can see (strict=True): "
            + "; ".join(f"{target!r} {reason}" for target, reason in problems)
        )
    names = [target.split("/")[-1].lstrip("!") for target, _ in problems]
    unloaded = unloaded_namespaces(names)
    optional = [p for p, n in zip(problems, names, strict=True) if n.split("::")[0] in unloaded]
    # one record for the lot: a list naming a backend's ops before it loads (FastVideo's nine
    # fastvideo:: ops) says so once, not once per op
    for level, found in (
        (logging.DEBUG, optional),
        (logging.WARNING, [p for p in problems if p not in optional]),
    ):
        if found and say_once(("match nothing for now", tuple(targets), tuple(found))):
            logger.log(
                level,
                "prime_ac: %d target(s) match nothing for now (said once per process and list): %s",
                len(found),
                "; ".join(f"{target!r} {reason}" for target, reason in found),
            )
