"""Trainer tables read with their trainer's meaning, and targets a trainer's adapter supplies.

A trainer's activation-checkpointing table (torchtitan's ``activation_checkpoint``) has keys and
modes of its own, and the same word can mean another thing there (torchtitan's ``"selective"``
keeps its own save list). :meth:`prime_ac.ACConfig.from_dict` reads its own keys itself and
offers any other table to the readers registered here: the one whose ``claims(table)`` is true
turns it into an ``ACConfig``. The core never imports an integration: the adapters shipped with
prime_ac are listed by module path and imported (which registers them) only when a table needs
a reader.

A list an adapter builds for the user (a trainer's save list, its translation into operators a
dispatch mode sees, each device's variant of a kernel) names operators that need not all run on
one model or device. :func:`supplied` marks such targets: they are kept like any other, and never
reported as matching nothing, which is said only of the targets a user named.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Supplied", "reader_for", "register_table_reader", "supplied", "user_named"]

# The adapters shipped with prime_ac that register a reader when imported.
_SHIPPED = ["prime_ac.integrations.torchtitan"]


@dataclass(frozen=True)
class _Reader:
    trainer: str
    claims: Callable[[Mapping[str, Any]], bool]
    read: Callable[[Mapping[str, Any]], Any]


_readers: dict[str, _Reader] = {}


def register_table_reader(
    trainer: str,
    claims: Callable[[Mapping[str, Any]], bool],
    read: Callable[[Mapping[str, Any]], Any],
) -> None:
    """Let :meth:`prime_ac.ACConfig.from_dict` read ``trainer``'s tables: ``claims(table)``
    says, by its keys, whether a table prime_ac's own keys cannot read is ``trainer``'s, and
    ``read(table)`` returns its ``ACConfig`` (or raises, naming the key and the fix). Registering
    a trainer again replaces its reader.

    Example::

        register_table_reader(
            "mytrainer",
            claims=lambda table: "recompute" in table,
            read=lambda table: ACConfig(mode="full" if table["recompute"] else "selective"),
        )
    """
    _readers[trainer] = _Reader(trainer, claims, read)


def reader_for(table: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Any] | None:
    """The ``read`` of the one registered reader claiming ``table``, or None; two claims raise."""
    while _SHIPPED:
        importlib.import_module(_SHIPPED.pop(0))
    claimed = [r for r in _readers.values() if r.claims(table)]
    if len(claimed) > 1:
        raise ValueError(
            f"the table {dict(table)!r:.200} reads as a table of "
            f"{' and of '.join(r.trainer for r in claimed)}: give it the keys of one trainer"
        )
    return claimed[0].read if claimed else None


class Supplied(str):
    """A target an adapter supplied on the user's behalf (see :func:`supplied`)."""

    __slots__ = ()


def supplied(targets: Iterable[str]) -> tuple[Supplied, ...]:
    """``targets`` marked as an adapter's: kept like any other target, never reported as
    matching nothing (a trainer's list names every device's kernels and optional backends).

    Example::

        ACConfig(mode="selective", targets=supplied(["aten::mm", "aten::addmm"]))
    """
    return tuple(Supplied(t) if isinstance(t, str) else t for t in targets)


def user_named(targets: Iterable[Any]) -> list[Any]:
    """The targets of ``targets`` a user named: those no adapter :func:`supplied`."""
    return [t for t in targets if not isinstance(t, Supplied)]
