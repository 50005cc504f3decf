"""Intercepting only the operators a policy decides about: a dispatch key instead of a mode.

A TorchDispatchMode hands every operator of a region to Python, 4-8 microseconds each on a CPU
core: in a small block that costs more than the recompute selective checkpointing saves. Here a
region instead includes one dispatch key (``_compat.INTERCEPT_KEY``) in its thread's dispatch key
set while it runs, and registers a kernel on that key for just the operators that need a
decision: those its policy can keep and those that write an argument (a write may hit a kept
result, which is then copied first). Every other operator falls through the key inside the
dispatcher, without entering Python.

The key sits below autograd, like the Python key a mode uses, so a kernel sees what a mode sees:
the operator after autograd recorded it. Two differences, both the same in forward and recompute:

- An intercepted operator runs with the key excluded, as a mode runs an operator with itself
  popped. An operator that falls through runs with the key still included, so the operators it
  calls internally (a composite's parts, a custom op's Python body) reach the kernels too.
- Python dispatch modes and tensor subclasses sit above the key and see each operator first.

Kernels are global and permanent (the dispatcher has no per-thread registrations) but do nothing
outside a region: no thread includes the key then, so no call reaches them. They are registered
as regions are created, for the operators in the registry then; an operator registered later gets
its kernel when a region is next created.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.library import Library, fallthrough_kernel

from prime_ac import _compat

__all__ = ["Intercepting", "available", "ensure_kernels", "registry", "resolve", "run_below"]

Handler = Callable[[Any, tuple, dict], Any]
Key = tuple[str, str, str]  # (namespace, op, overload)

RELIST_SECONDS = 1.0
"""How often regions look for operators registered since (listing them costs about 3 ms)."""

_local = threading.local()  # .handler: the innermost intercepting region's handler on this thread
_libraries: dict[str, Library] = {}  # namespace ("_" for the fallback) -> prime_ac's Library
_kernels: set[Any] = set()  # operators with prime_ac's kernel on the key
_names: set[str] = set()  # dispatcher names listed so far
_entries: list[tuple[Key, bool]] = []  # (key, mutable) per listed name, in the order first seen
_listed_at = [-math.inf]
_lock = threading.RLock()
_usable: list[bool] = []  # [] until the key was set up, then [whether it can be used]


def available() -> bool:
    """Whether regions can intercept through the key (else they use dispatch modes)."""
    if not _usable:
        with _lock:
            if not _usable:
                _usable.append(_install())
    return _usable[0]


def _install() -> bool:
    # Another library's fallback on the key would receive every operator of a region: keep out.
    if _compat.intercept_key_taken():
        return False
    _library("_").fallback(fallthrough_kernel, _compat.INTERCEPT_KEY_NAME)
    return True


def _library(namespace: str) -> Library:
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = Library(namespace, "IMPL")
    return library


def registry() -> list[tuple[Key, bool]]:
    """``(key, mutable)`` of every registered operator overload, append-only, in the order first
    seen; relisted at most every :data:`RELIST_SECONDS`.

    A new operator that has a composite kernel besides backend kernels gets an explicit
    fallthrough on the key: the composite would otherwise fill the key's slot (the key counts as
    a backend for alias keys) and run instead of the CPU or CUDA kernel, its parts reaching the
    written-argument kernels one Python call each.
    """
    now = time.monotonic()
    if now - _listed_at[0] < RELIST_SECONDS or not available():
        return _entries
    with _lock:
        _listed_at[0] = now
        for name in _compat.dispatch_op_names() - _names:
            try:
                mutable = _compat.schema_of(name).is_mutable
            except RuntimeError:  # a name without a schema yet: listed next time
                continue
            _names.add(name)
            qualified, _, overload = name.partition(".")
            namespace, _, op_name = qualified.partition("::")
            _entries.append(((namespace, op_name, overload or "default"), mutable))
            if not mutable and _compat.has_composite_and_backend_kernels(name):
                _library(namespace).impl(
                    name.partition("::")[2], fallthrough_kernel, _compat.INTERCEPT_KEY_NAME
                )
    return _entries


def resolve(key: Key) -> Any:
    """The OpOverload for ``key``, or None when it cannot be made (the operator went away)."""
    namespace, op_name, overload = key
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        return None


def ensure_kernels(ops: Iterable[Any]) -> None:
    """Register the key's kernel for each of ``ops`` (operator overloads or higher-order
    operators) that has none yet."""
    if not available():
        return
    with _lock:
        for op in ops:
            if op in _kernels:
                continue
            _kernels.add(op)
            if isinstance(op, _compat.HigherOrderOperator):
                op.py_impl(_compat.INTERCEPT_KEY)(_kernel(op))
                continue
            namespace, op_name, overload = _compat.operator_parts(op)
            name = op_name if overload == "default" else f"{op_name}.{overload}"
            with warnings.catch_warnings():  # replacing an explicit fallthrough warns
                warnings.simplefilter("ignore", UserWarning)
                _library(namespace).impl(
                    name, _kernel(op), _compat.INTERCEPT_KEY_NAME, allow_override=True
                )


def _kernel(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        prior = _compat.set_eval_frame(None)  # no dynamo inside (see _compat.DispatchMode)
        try:
            handler = getattr(_local, "handler", None)
            if handler is None:  # the key reached a thread without a region: just run
                return run_below(op, args, kwargs)
            return handler(op, args, kwargs)
        finally:
            _compat.set_eval_frame(prior)

    return kernel


def run_below(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` as if the key were not there (its internal calls skip the kernels too).

    Calling the operator again rather than redispatching keeps Python numbers working where the
    schema says Tensor (a kernel receives a wrapped number as a float). The keys above this one
    that already ran (autograd, ADInplaceOrView) are excluded by then, so nothing runs twice.
    """
    with _compat.excluding_intercept_key():
        return op(*args, **kwargs)


class Intercepting:
    """Route the intercepted operators of this thread to ``handler(op, args, kwargs)`` while
    active. Nests: the innermost region handles, and leaving restores the outer one."""

    __slots__ = ("_handler", "_included", "_prior")

    def __init__(self, handler: Handler):
        self._handler = handler

    def __enter__(self) -> Intercepting:
        self._prior = getattr(_local, "handler", None)
        _local.handler = self._handler
        self._included = _compat.set_intercept_key_included(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        _compat.set_intercept_key_included(self._included)
        _local.handler = self._prior
