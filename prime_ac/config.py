"""``ACConfig``: the ``[trainer.model.ac]`` table, validated."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from prime_ac import tables
from prime_ac.offload import SavedInputOffload
from prime_ac.pipeline_offload import (
    PIPELINE_KEYS,
    PipelineActivationOffload,
    PipelineOffloadConfig,
)
from prime_ac.planner import parse_bytes
from prime_ac.policy import MODES
from prime_ac.scopes import parse_target
from prime_ac.targets import Target

__all__ = ["ACConfig", "check_budget", "check_checkpoint_options"]

logger = logging.getLogger("prime_ac")

_DETERMINISM_CHECKS = ("default", "none")
_LAYER_MODES = (*MODES, "none")
# Keys of older prime-rl releases that checkpointed parts of a layer, not whole blocks by operator
# (src/prime_rl/trainer/models/layers/checkpointing.py and the scope flags beside it).
_PART_TARGETS = ("norm", "attn_proj", "mlp", "mla_up_proj", "routed_experts", "linear_attn")
_PART_FLAGS = ("attention", "attn_norm", "feed_forward", "ffn_norm", "moe", "shared_expert")


@dataclass(frozen=True)
class ACConfig:
    """Activation-checkpointing settings as a trainer's config file states them.

    ``mode`` is one of prime-rl's modes (:data:`prime_ac.MODES`): ``"full"`` keeps only the
    mandatory operators, ``"full_moe"`` also replays the FP8 Mega MoE, ``"projections"``,
    ``"attention"`` and ``"matmul"`` keep fixed sets, ``"selective"`` keeps ``targets``.
    ``freq=k`` checkpoints every k-th block; ``targets=None`` means the defaults;
    ``targets="auto"`` with ``budget`` (the step's peak activation memory in bytes, an int or a
    string such as ``"24GiB"``; a float fraction of the no-AC activation memory; or
    ``{block name: bytes}``) lets prime_ac choose from a profiled step; with a peak budget,
    ``host_cap`` bounds the host bytes its offloads hold (on CPU, where host and device are one
    memory, nothing is offloaded unless it is given).
    ``early_stop`` and ``determinism_check`` go to each region's
    ``torch.utils.checkpoint.checkpoint`` call (torch's defaults), and so does
    ``preserve_rng_state``.

    ``layer_modes`` gives each decoder layer its own mode (or ``"none"``: not checkpointed), one
    entry per layer of the full model, found by the block's index (``model.layers.7`` is entry
    7, also on a pipeline stage that holds layers 6-11); it replaces ``mode`` and ``freq``, as in
    prime-rl. ``targets`` then apply to the ``"selective"`` layers.

    Example (TOML)::

        [trainer.model.ac]
        mode = "selective"
        freq = 1
        targets = ["aten::mm", "prime_rl_collectives"]
    """

    mode: str = "full"
    freq: int = 1
    targets: tuple[str, ...] | str | None = None
    budget: int | float | str | Mapping[str, int] | None = None
    early_stop: bool = True
    determinism_check: str = "default"
    layer_modes: tuple[str | tuple[str, str], ...] | None = None
    preserve_rng_state: bool = True
    # prime-rl's [trainer.model.ac_offloading] as sorted (key, value) pairs (see input_offload)
    ac_offloading: tuple[tuple[str, Any], ...] | None = None
    # operators whose results go to host memory instead of staying on the device
    offload: tuple[str, ...] | None = None
    # the most host memory a peak budget's offloads may hold (bytes: an int or "64GiB")
    host_cap: int | str | None = None
    # prime-rl's [trainer.model.pp_activation_offload] (see pipeline_offload)
    pp_activation_offload: PipelineOffloadConfig | None = None

    def __post_init__(self) -> None:
        check_checkpoint_options(self.early_stop, self.determinism_check)
        if isinstance(self.pp_activation_offload, Mapping):
            table = PipelineOffloadConfig.from_dict(self.pp_activation_offload)
            object.__setattr__(self, "pp_activation_offload", table)
        elif self.pp_activation_offload is not None and not isinstance(
            self.pp_activation_offload, PipelineOffloadConfig
        ):
            raise ValueError(
                f"pp_activation_offload={self.pp_activation_offload!r} must be a table of "
                f"{list(PIPELINE_KEYS)} (prime-rl's [trainer.model.pp_activation_offload])"
            )
        if self.ac_offloading is not None:
            table = _offloading_table(self.ac_offloading)
            _check_offloading(table)
            object.__setattr__(self, "ac_offloading", tuple(sorted(table.items())))
        if self.mode not in MODES:
            raise ValueError(
                f"mode={self.mode!r} is not a checkpoint mode: use one of {list(MODES)}"
            )
        if isinstance(self.freq, bool) or not isinstance(self.freq, int) or self.freq < 1:
            raise ValueError(
                f"freq={self.freq!r} must be an integer >= 1 (1 checkpoints every block)"
            )
        if not isinstance(self.preserve_rng_state, bool):
            raise ValueError(
                f"preserve_rng_state={self.preserve_rng_state!r} must be True (replay dropout "
                "with the forward's random numbers, torch's default) or False"
            )
        self._check_layer_modes()
        self._check_offload()
        if self.targets == "auto":
            if self.mode != "selective":
                raise ValueError(
                    'targets="auto" chooses what selective mode keeps: set mode="selective"'
                )
            if self.budget is None:
                raise ValueError(
                    'targets="auto" needs budget=: the peak activation memory in bytes (an int, '
                    "or a string such as '24GiB') or a fraction of the no-AC activation memory "
                    "(float in [0, 1])"
                )
            check_budget(self.budget)
            self._check_host_cap()
        elif self.host_cap is not None:
            raise ValueError(
                f'host_cap={self.host_cap!r} bounds what a peak budget\'s plan offloads: it '
                'applies only with targets="auto" and budget= in bytes ("24GiB")'
            )
        elif self.budget is not None:
            raise ValueError(f'budget={self.budget!r} applies only with targets="auto"')
        elif self.targets is not None:
            if isinstance(self.targets, str) or not isinstance(self.targets, (list, tuple)):
                raise ValueError(
                    f"targets={self.targets!r} must be a list of operator names or namespaces, "
                    "e.g. ['aten::mm', 'prime_rl_attn'], or omitted for the defaults"
                )
            for target in self.targets:
                parse_target(target)
            if not self.keeps_targets:
                raise ValueError(
                    f"targets={list(self.targets)!r} has no effect with mode={self.mode!r}, "
                    "which keeps "
                    + (
                        "only the mandatory operators"
                        if self.mode in ("full", "full_moe")
                        else "a fixed set (prime_ac.targets.LEVEL_TARGETS)"
                    )
                    + ": set mode='selective' (or a 'selective' entry in layer_modes) to keep "
                    "the targets"
                )
            object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def keeps_targets(self) -> bool:
        """Whether some checkpointed layer runs ``mode="selective"`` (the one that reads
        ``targets``)."""
        return _keeps_targets(self.mode, self.layer_modes)

    def _check_layer_modes(self) -> None:
        if self.layer_modes is None:
            return
        if isinstance(self.layer_modes, (str, Mapping)) or not isinstance(
            self.layer_modes, (list, tuple)
        ):
            raise ValueError(
                f"layer_modes={self.layer_modes!r} must be a list with one mode per decoder "
                f"layer of the full model, each one of {list(_LAYER_MODES)}"
            )
        entries = []
        for index, mode in enumerate(self.layer_modes):
            pair = isinstance(mode, (list, tuple)) and len(mode) == 2
            if not all(m in _LAYER_MODES for m in (mode if pair else (mode,))):
                raise ValueError(
                    f"layer_modes[{index}]={mode!r} is not a mode: use one of "
                    f"{list(_LAYER_MODES)}, or a pair [attention half, moe half] for a layer a "
                    "pipeline stage boundary cuts"
                )
            entries.append(tuple(mode) if pair else mode)
        if self.freq != 1:
            raise ValueError(
                f"freq={self.freq!r} with layer_modes: layer_modes replaces mode and freq (as in "
                "prime-rl); write 'none' for the layers to leave unchecked and drop freq"
            )
        if self.targets == "auto":
            raise ValueError(
                'targets="auto" plans what each block keeps; layer_modes sets a mode per layer: '
                "use one of them"
            )
        object.__setattr__(self, "layer_modes", tuple(entries))

    def _check_host_cap(self) -> None:
        if self.host_cap is None:
            return
        if isinstance(self.budget, (float, Mapping)):
            raise ValueError(
                f"host_cap={self.host_cap!r} bounds what a peak budget's plan offloads; "
                f"budget={self.budget!r} is not a peak in bytes: give budget as bytes "
                "(an int or '24GiB') or drop host_cap"
            )
        parse_bytes(self.host_cap, "host_cap")

    def _check_offload(self) -> None:
        if self.offload is None:
            return
        if isinstance(self.offload, str) or not isinstance(self.offload, (list, tuple)):
            raise ValueError(
                f"offload={self.offload!r} must be a list of operator names or namespaces whose "
                "results go to host memory, e.g. offload=['aten::_scaled_dot_product_flash_"
                "attention']"
            )
        for target in self.offload:
            if not isinstance(parse_target(target), Target):
                raise ValueError(
                    f"offload={list(self.offload)!r}: {target!r} is a scoped, forced-replay or "
                    "tag target; offload names operators or namespaces only (ns::op, "
                    "ns::op.overload, ns)"
                )
        if self.targets == "auto":
            raise ValueError(
                'offload= names what to offload; targets="auto" with a peak budget ("24GiB") '
                "chooses it: use one of them"
            )
        object.__setattr__(self, "offload", tuple(self.offload))

    def input_offload(self) -> SavedInputOffload | None:
        """prime-rl's activation offloading with prime-rl's meaning: what autograd saves
        outside the checkpointed blocks (with full AC, each block's input) goes to host memory,
        at most ``max_inflight_activations`` copies in flight, into pinned memory when
        ``pin_memory``; done on a side stream with prefetch. None without the table.

        Example::

            offload = ACConfig.from_dict({"pin_memory": True}).input_offload()
            with offload:
                loss = model(batch)
            loss.backward()
        """
        if self.ac_offloading is None:
            return None
        table = {**_OFFLOADING_KEYS, **dict(self.ac_offloading)}
        return SavedInputOffload(table["pin_memory"], table["max_inflight_activations"])

    def pipeline_offload(self, model_parts: Any) -> PipelineActivationOffload | None:
        """prime-rl's pipeline activation offloading with its meaning, for the stage modules
        this rank holds (``model_parts``): what each in-flight micro-batch passed into the stage
        and its blocks goes to host memory between its forward and backward
        (:mod:`prime_ac.pipeline_offload`). None without the table. prime-rl applies
        ``ac_offloading`` only without pipeline parallelism; this is its pipeline counterpart."""
        if self.pp_activation_offload is None:
            return None
        return PipelineActivationOffload(model_parts, self.pp_activation_offload)

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> ACConfig:
        """Read the ``[trainer.model.ac]`` table; unknown keys raise ValueError naming them.

        prime-rl's table is prime_ac's own, read with prime-rl's meaning (its newest modes,
        ``layer_modes``, and its older releases' tables): ``targets`` with a mode that keeps no
        targets, and ``freq`` beside ``layer_modes``, are dropped, as prime-rl ignores them,
        with a log line; an older release's part-of-a-layer settings (``moe = true``, or module
        targets such as ``targets = ["norm"]`` where they would be read) and
        ``recompute_engram = true`` raise, saying what to use instead. ``preserve_rng_state``
        and the other keys prime-rl's class lacks are prime_ac's own.

        Another trainer's table (torchtitan's ``activation_checkpoint``: ``memory_budget``,
        ``debug``, ``mode = "memory_budget"``, ...) is read by the reader that claims it in
        :mod:`prime_ac.tables`, with that trainer's meaning.
        """
        if not isinstance(table, Mapping):
            raise TypeError(
                f"ACConfig.from_dict(table): table must be a mapping of settings such as "
                f"{{'mode': 'selective', 'freq': 1}} (a parsed TOML table), got "
                f"{type(table).__name__} {table!r:.80}; for a string, parse it first "
                "(tomllib.loads) or pass ACConfig(mode=...)"
            )
        table = dict(table)
        if table and set(table) <= set(_OFFLOADING_KEYS):  # [trainer.model.ac_offloading]
            table = {"ac_offloading": table}
        elif table and set(table) <= set(PIPELINE_KEYS):  # [trainer.model.pp_activation_offload]
            table = {"pp_activation_offload": table}
        if isinstance(table.get("ac_offloading"), Mapping):
            _check_offloading(table["ac_offloading"])
            table["ac_offloading"] = tuple(sorted(table["ac_offloading"].items()))
        # a key or mode prime_ac's table lacks: another trainer's table, if a reader claims it
        own = {f.name for f in fields(cls)}
        if set(table) - own or table.get("mode", "full") not in MODES:
            read = tables.reader_for(table)
            if read is not None:
                return read(table)
        table = _prime_rl_meaning(table)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            misplaced = [key for key in unknown if key in _OFFLOADING_KEYS]
            nested = ", ".join(f"{key!r}: ..." for key in misplaced)
            raise ValueError(
                f"unknown activation-checkpointing key(s) {unknown}: accepted keys are {sorted(known)}"
                + (
                    f"; {misplaced} belong to prime-rl's [trainer.model.ac_offloading] table: nest "
                    f"them, {{'ac_offloading': {{{nested}}}}}, or pass that table alone"
                    if misplaced
                    else ""
                )
            )
        return cls(**table)


# prime-rl's [trainer.model.ac_offloading] keys and defaults (prime_rl/trainer/config.py)
_OFFLOADING_KEYS = {"pin_memory": True, "max_inflight_activations": 5}


def _offloading_table(value: Any) -> dict[str, Any]:
    """``ac_offloading`` (a mapping, or its sorted ``(key, value)`` pairs) as a dict; anything
    else raises, naming what the table holds."""
    if not isinstance(value, Mapping):
        pairs = isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in value
        )
        if not pairs:
            raise ValueError(
                f"ac_offloading={value!r:.80} must be a table (TOML [trainer.model.ac_offloading]) "
                "such as {'pin_memory': True, 'max_inflight_activations': 5}; leave it out for no "
                "offloading"
            )
    return dict(value)


def _check_offloading(table: Mapping[str, Any]) -> None:
    unknown = sorted(set(table) - set(_OFFLOADING_KEYS))
    if unknown:
        raise ValueError(
            f"unknown ac_offloading key(s) {unknown}: accepted keys are {sorted(_OFFLOADING_KEYS)}"
        )
    if not isinstance(table.get("pin_memory", True), bool):
        raise ValueError(f"ac_offloading.pin_memory={table['pin_memory']!r} must be true or false")
    inflight = table.get("max_inflight_activations", 5)
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 1:
        raise ValueError(
            f"ac_offloading.max_inflight_activations={inflight!r} must be an integer >= 1: how "
            "many copies to the host may run at once"
        )


def check_checkpoint_options(early_stop: Any, determinism_check: Any) -> None:
    """Raise ValueError unless the options are ones ``torch.utils.checkpoint`` takes."""
    if not isinstance(early_stop, bool):
        raise ValueError(
            f"early_stop={early_stop!r} must be True (stop the recompute once every saved "
            "tensor is back, torch's default) or False"
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check={determinism_check!r} must be one of {list(_DETERMINISM_CHECKS)}: "
            '"default" compares the shape, dtype and device of recomputed tensors, "none" skips it'
        )


def check_budget(budget: Any) -> None:
    """Raise ValueError unless ``budget`` is the step's peak activation memory (bytes: an int
    >= 0 or a string with a unit, ``"24GiB"``), a fraction of the whole model's no-AC activation
    memory (finite float in [0, 1]) or a ``{block name: bytes}`` mapping."""
    if isinstance(budget, Mapping):
        for block, value in budget.items():
            if not isinstance(block, str):
                raise ValueError(f"budget keys are qualified block names (str), got {block!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"budget[{block!r}]={value!r}: per-block budgets are bytes (int >= 0)"
                )
        return
    if isinstance(budget, str):  # the step's peak activation memory, "24GiB" (prime_ac.planner)
        parse_bytes(budget)
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
        raise ValueError(
            f"budget={budget!r} must be the step's peak activation memory in bytes (an int >= 0, "
            "or a string with a unit such as '24GiB'), a fraction of the whole model's no-AC "
            "activation memory (float in [0, 1]) or a {block name: bytes} mapping"
        )
    if isinstance(budget, float) and not (math.isfinite(budget) and budget <= 1):
        raise ValueError(
            f"budget={budget!r}: a fraction must lie in [0, 1]; peak bytes are an int or "
            "a string such as '24GiB'"
        )


def _prime_rl_meaning(table: Mapping[str, Any]) -> dict[str, Any]:
    """prime-rl's ``[trainer.model.ac]`` table as ACConfig's keys, with prime-rl's meaning."""
    table = dict(table)
    if table.pop("recompute_engram", False):
        raise ValueError(
            "recompute_engram=true is prime-rl's DeepSeek-V4.1 model code (its Engram layers "
            "recompute their value/key projection), not an operator policy: keep it in prime-rl's "
            "model setup and drop the key here"
        )
    parts = [key for key in _PART_FLAGS if key in table and table[key] is not False]
    if parts:
        raise _part_error([f"{key}={table[key]!r}" for key in parts])
    for key in _PART_FLAGS:
        table.pop(key, None)
    layer_modes = table.get("layer_modes")
    if isinstance(layer_modes, list):
        table["layer_modes"] = tuple(tuple(m) if isinstance(m, list) else m for m in layer_modes)
    if layer_modes is not None and "freq" in table:
        freq = table.pop("freq")
        if freq != 1:
            logger.info(
                "prime_ac: [trainer.model.ac] freq=%r is unused with layer_modes, which gives "
                "each layer its mode (prime-rl ignores freq there too)",
                freq,
            )
    mode = table.get("mode", "full")
    targets = table.get("targets")
    if not isinstance(targets, (list, tuple)):
        return table
    if _keeps_targets(mode, table.get("layer_modes")):
        named_parts = [t for t in targets if t in _PART_TARGETS]
        if named_parts:
            raise _part_error([f"targets={named_parts!r}"])
        return table
    for target in targets:
        parse_target(target)  # a typo is an error even where the list is unused
    # prime-rl's newest class loads targets under any mode and reads them only in "selective"
    # (its older releases' module targets, ["norm"] their default, included)
    logger.info(
        "prime_ac: [trainer.model.ac] targets=%r are unused with mode=%r (prime-rl ignores "
        "them too); they apply to 'selective' layers",
        targets,
        mode,
    )
    table.pop("targets")
    return table


def _part_error(named: list[str]) -> ValueError:
    return ValueError(
        f"{', '.join(named)}: an older prime-rl release's setting that checkpoints parts of "
        "each layer (norms, projections, the MLP or MoE) instead of whole blocks by operator "
        "(prime-rl's newest release reads these names as operators and keeps nothing for them). "
        "prime_ac checkpoints blocks: to checkpoint only a part, select it as the block, e.g. "
        "checkpoint_blocks(model, blocks=lambda name, module: name.endswith('.mlp')), or "
        "keep whole layers with mode='selective' and operator targets (docs/migration.md)"
    )


def _keeps_targets(mode: Any, layer_modes: Any) -> bool:
    """Whether ``mode``, or an entry of ``layer_modes`` when given, is ``"selective"``."""
    if not isinstance(layer_modes, (list, tuple)):
        return mode == "selective"
    return any(
        m == "selective" or (isinstance(m, (list, tuple)) and "selective" in m) for m in layer_modes
    )
