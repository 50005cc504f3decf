"""Keep prime_ops' custom ops its own: another module's registration of one raises.

``torch.library.custom_op`` of a name already registered that way destroys the earlier
registration (torch allows it for notebooks), so whichever module is imported last owns the op.
Both orders are caught here, through torch's table of those registrations
(``torch._library.custom_ops``): an op registered before ``import prime_ops`` is found when
prime_ops registers over it; after the import, each of prime_ops' entries in the table is a
guard that raises when a later ``custom_op`` asks it to step aside.
"""

from __future__ import annotations

import sys
from typing import Any

try:  # torch-private (2.4 on); under a torch that reorganised it nothing is guarded
    from torch._library import custom_ops as _torch_ops
except ImportError:  # pragma: no cover
    _torch_ops = None
if not (hasattr(_torch_ops, "OPDEFS") and hasattr(_torch_ops, "OPDEF_TO_LIB")):
    _torch_ops = None  # pragma: no cover

_PREFIX = "prime_ops"


def _module(opdef: Any) -> str:
    return getattr(getattr(opdef, "_init_fn", None), "__module__", None) or "an unknown module"


def _ours(opdef: Any) -> bool:
    return _module(opdef).split(".")[0] == _PREFIX


def snapshot() -> dict[str, Any]:
    """Every ``custom_op`` registered so far, held until :func:`claim` compares."""
    return {} if _torch_ops is None else dict(_torch_ops.OPDEFS.items())


def _clash(qualname: str, other: str, ours: str) -> RuntimeError:
    return RuntimeError(
        f"{qualname} is registered by both {other} and prime_ops ({ours}); torch would let the "
        "module imported last replace the other's op in silence. Remove the other module's "
        "registration and call prime_ops' op (docs/migration.md), or do not import prime_ops"
    )


def _caller() -> str:
    """The module that called into torch.library (the first frame outside torch and here)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != __name__ and name.split(".")[0] != "torch":
            return name or "an unknown module"
        frame = frame.f_back
    return "an unknown module"


class _Guard:
    """Stands in torch's table for the library that holds one of prime_ops' ops: torch calls
    ``_destroy`` on it only to re-register the name, which only prime_ops may do."""

    def __init__(self, library: Any, qualname: str, module: str) -> None:
        self._library, self._qualname, self._module = library, qualname, module

    def _destroy(self) -> None:
        caller = _caller()
        if caller.split(".")[0] != _PREFIX:
            raise _clash(self._qualname, caller, self._module)
        self._library._destroy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._library, name)


def claim(before: dict[str, Any]) -> None:
    """After prime_ops registered its ops: raise if one replaced another module's, then guard
    each against a later replacement."""
    if _torch_ops is None:
        return
    ours = {name: op for name, op in _torch_ops.OPDEFS.items() if _ours(op)}
    for name, op in ours.items():
        earlier = before.get(name)
        if earlier is not None and earlier is not op and not _ours(earlier):
            raise _clash(name, _module(earlier), _module(op))
    table = _torch_ops.OPDEF_TO_LIB
    for name, op in ours.items():
        library = table.get(name)
        if library is not None and not isinstance(library, _Guard):
            table[name] = _Guard(library, name, _module(op))
