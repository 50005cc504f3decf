"""``ACConfig``: the ``[trainer.model.ac]`` table, validated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from prime_ac.scopes import parse_target

__all__ = ["ACConfig", "check_budget", "check_checkpoint_options"]

_MODES = ("full", "selective")
_DETERMINISM_CHECKS = ("default", "none")


@dataclass(frozen=True)
class ACConfig:
    """Activation-checkpointing settings as a trainer's config file states them.

    ``mode`` is ``"full"`` (keep only the mandatory operators) or ``"selective"`` (also keep
    ``targets``); ``freq=k`` checkpoints every k-th block; ``targets=None`` means the defaults;
    ``targets="auto"`` with ``budget`` (bytes per block, a fraction of the no-AC activation
    memory, or ``{block name: bytes}``) lets prime_ac choose from a profiled step.
    ``early_stop`` and ``determinism_check`` go to each region's
    ``torch.utils.checkpoint.checkpoint`` call (torch's defaults).

    Example (TOML)::

        [trainer.model.ac]
        mode = "selective"
        freq = 1
        targets = ["aten::mm", "prime_rl_collectives"]
    """

    mode: str = "full"
    freq: int = 1
    targets: tuple[str, ...] | str | None = None
    budget: int | float | Mapping[str, int] | None = None
    early_stop: bool = True
    determinism_check: str = "default"

    def __post_init__(self) -> None:
        check_checkpoint_options(self.early_stop, self.determinism_check)
        if self.mode not in _MODES:
            raise ValueError(
                f"mode={self.mode!r} is not a checkpoint mode: use one of {list(_MODES)}"
            )
        if isinstance(self.freq, bool) or not isinstance(self.freq, int) or self.freq < 1:
            raise ValueError(
                f"freq={self.freq!r} must be an integer >= 1 (1 checkpoints every block)"
            )
        if self.targets == "auto":
            if self.mode != "selective":
                raise ValueError(
                    'targets="auto" chooses what selective mode keeps: set mode="selective"'
                )
            if self.budget is None:
                raise ValueError(
                    'targets="auto" needs budget=: bytes per block (int) or a fraction of the '
                    "no-AC activation memory (float in [0, 1])"
                )
            check_budget(self.budget)
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
            if self.mode == "full":
                raise ValueError(
                    f"targets={list(self.targets)!r} has no effect with mode='full', which keeps "
                    "only the mandatory operators: set mode='selective' to keep the targets"
                )
            object.__setattr__(self, "targets", tuple(self.targets))

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> ACConfig:
        """Read the ``[trainer.model.ac]`` table; unknown keys raise ValueError naming them.

        A torchtitan ``activation_checkpoint`` table (``selective_ac_option``,
        ``memory_budget``, ``mode = "memory_budget"``, ...) is read by
        :func:`prime_ac.integrations.torchtitan.config_from_table`.
        """
        if not isinstance(table, Mapping):
            raise TypeError(
                f"ACConfig.from_dict(table): table must be a mapping of settings such as "
                f"{{'mode': 'selective', 'freq': 1}} (a parsed TOML table), got "
                f"{type(table).__name__} {table!r:.80}; for a string, parse it first "
                "(tomllib.loads) or pass ACConfig(mode=...)"
            )
        # imported here: the integration sits on top of the package and imports this module
        from prime_ac.integrations import torchtitan

        if torchtitan.is_torchtitan_table(table):
            return torchtitan.config_from_table(table)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(
                f"unknown activation-checkpointing key(s) {unknown}: accepted keys are {sorted(known)}"
            )
        return cls(**table)


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
    """Raise ValueError unless ``budget`` is bytes per block (int >= 0), a fraction of the whole
    model's no-AC activation memory (finite float in [0, 1]) or a ``{block name: bytes}``
    mapping."""
    if isinstance(budget, Mapping):
        for block, value in budget.items():
            if not isinstance(block, str):
                raise ValueError(f"budget keys are qualified block names (str), got {block!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"budget[{block!r}]={value!r}: per-block budgets are bytes (int >= 0)"
                )
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
        raise ValueError(
            f"budget={budget!r} must be bytes per block (int >= 0), a fraction of the whole "
            "model's no-AC activation memory (float in [0, 1]), or a {block name: bytes} mapping"
        )
    if isinstance(budget, float) and not (math.isfinite(budget) and budget <= 1):
        raise ValueError(f"budget={budget!r}: a fraction must lie in [0, 1]; bytes are an int")
