"""``prime_ac.keep``: keep the result of a call that no dispatch mode sees.

prime_ac decides per operator call, in dispatch modes. A kernel launched from Python without
``torch.library`` (an ``autograd.Function`` whose forward calls Triton) never reaches them, so
a checkpointed block's recompute runs it again. ``keep(fn, name)`` names such a call, like
torch_remat's call-site ``region(fn, name, recompute=False)``:

- in a checkpointed block's forward, ``fn`` runs with prime_ac's mode stepped aside (its
  operators are neither counted nor kept: the recompute will not run them), the tensors its
  autograd nodes save are held as they are (not recomputed), and its output is kept in the
  block's store, key ``prime_ac.keep(name)``;
- in the recompute, the kept output is handed back and ``fn`` does not run (a tensor that
  required grad in the forward requires grad again, so the operators after it save what they
  saved in the forward: torch's checkpoint matches the saves one by one);
- anywhere else (no checkpointed block, ``torch.compile``), it is a plain call of ``fn``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from prime_ac import _compat
from prime_ac.modes import KeepMode, ReplayMode
from prime_ac.remat import region_names, route_regions
from prime_ac.store import KEPT_CALL, input_shapes, packed_as

__all__ = ["keep"]

_MODES = (KeepMode, ReplayMode)


class _KeptCall:
    """The store key of one ``keep`` name or kept region (read as ``op`` in the store's
    messages)."""

    __slots__ = ("label",)
    kept_call = True  # packed as KEPT_CALL by respect_saved_tensors_hooks (prime_ac.store)

    def __init__(self, label: str):
        self.label = label

    def __repr__(self) -> str:
        return self.label


_keys: dict[str, _KeptCall] = {}
# per store, per (key, call index): which output leaves required grad in the forward
_grads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keep(fn: Callable[..., Any] | None = None, name: str | None = None) -> Any:
    """``fn`` wrapped so that a checkpointed block keeps its output instead of calling it again
    in the recompute; as a decorator, ``@prime_ac.keep`` or ``@prime_ac.keep(name="...")``.

    ``name`` (default: ``fn``'s qualified name) keys the kept outputs; calls of one name are
    matched in order, and the recompute must call it with inputs of the same shapes (or
    :class:`prime_ac.ReplayMismatchError` names it). The output must not depend on state the
    recompute would change, as for any kept result. It costs what no checkpointing would for
    this call (its output and the tensors its backward saves stay held) and saves its compute
    in the recompute. Eager only: under ``torch.compile`` the call is traced like any other.

    Example::

        fused = prime_ac.keep(TritonSwiGLU.apply, "swiglu")  # an autograd.Function
        ...
        def forward(self, x):
            return self.down(fused(self.gate(x), self.up(x)))
    """
    if fn is None:
        return functools.partial(keep, name=name)
    if not callable(fn):
        raise TypeError(
            f"prime_ac.keep takes the function to keep the output of, got {fn!r}: write "
            "prime_ac.keep(fn, 'name') or decorate with @prime_ac.keep"
        )
    if name is None:
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"prime_ac.keep(..., name={name!r}): name the call with a non-empty string")
    key = _keys.setdefault(name, _KeptCall(f"prime_ac.keep({name!r})"))

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        mode = None if torch.compiler.is_compiling() else _compat.region_mode(_MODES)
        if mode is None:
            return fn(*args, **kwargs)
        return _run_kept(mode, key, fn, args, kwargs)

    return kept


def _run_kept(mode: Any, key: _KeptCall, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """One kept call inside a checkpointed block: run and keep (forward), or hand back."""
    store = mode.store
    if isinstance(mode, ReplayMode):
        index = store.replay_calls.get(key, 0)
        out = store.take(key, args, kwargs)
        if out is NotImplemented:
            return fn(*args, **kwargs)
        return _as_in_forward(out, _grads[store][key, index])
    index = store.forward_calls.get(key, 0)
    store.forward_calls[key] = index + 1
    # the tensors fn's backward saves are held, not recomputed (through the user's hooks
    # where the block respects them), shadowing torch's checkpoint hooks
    pack, unpack = store.hooks or (_same, _same)
    if store.hooks is not None:
        pack = packed_as(KEPT_CALL, pack)
    with (
        _compat.without_top_mode(mode),
        torch.autograd.graph.saved_tensors_hooks(pack, unpack),
    ):
        out = fn(*args, **kwargs)
    store.keep(key, index, out, input_shapes(args, kwargs))
    leaves = _compat.tree_leaves(out)
    grads = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]
    _grads.setdefault(store, {})[key, index] = grads
    return out


def _kept_region(rid: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A ``torch_remat.region`` call (:mod:`prime_ac.remat`): kept as a :func:`keep` call
    where the block's policy keeps the region by name (``"region:<glob>"``) and prime_ac's
    mode is the innermost one; NotImplemented leaves it to the per-operator decisions."""
    if torch.compiler.is_compiling():
        return NotImplemented
    mode = _compat.region_mode(_MODES)
    scoped = getattr(getattr(getattr(mode, "rules", None), "policy", None), "scoped", None)
    if scoped is None or not scoped.keeps_region(rid) or not _compat.is_top_mode(mode):
        return NotImplemented
    names = region_names(rid)
    key = _keys.setdefault(f"region:{names}", _KeptCall(f"remat.region({'/'.join(names)!r})"))
    return _run_kept(mode, key, fn, args, kwargs)


route_regions(_kept_region)


def _as_in_forward(out: Any, grads: list[bool]) -> Any:
    """``out`` with each leaf that required grad in the forward requiring grad again, through
    a node that saves nothing (so it adds no save for torch's checkpoint to match)."""
    if not any(grads):
        return out
    leaves, spec = _compat.tree_flatten(out)
    leaves = [
        _Rejoin.apply(t.detach().requires_grad_()) if g else t
        for t, g in zip(leaves, grads, strict=True)
    ]
    return _compat.tree_unflatten(leaves, spec)


class _Rejoin(torch.autograd.Function):
    """Identity giving a recomputed stand-in a grad_fn: the recompute's graph only refills
    saved tensors and is dropped, so this backward never runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("prime_ac.keep: a recompute-only node was reached by backward")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
