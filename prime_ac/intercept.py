"""Intercepting only the operators a policy decides about: a dispatch key instead of a mode.

A TorchDispatchMode hands every operator of a region to Python, 4-8 microseconds each on a CPU
core: in a small block that costs more than the recompute selective checkpointing saves. Here a
region instead includes one dispatch key (``_compat.INTERCEPT_KEY``) in its thread's dispatch key
set while it runs. The key has Python kernels for just the operators that need a decision: those
a policy can keep and those that write an argument (a write may hit a kept result, which is then
copied first). Every other operator reaches a small C++ fallback (``csrc/prime_ac/intercept.cpp``)
that runs it below the key with the key excluded, a fraction of a microsecond.

The key sits below autograd, like the Python key a mode uses, and an operator always runs with
the key excluded, as a mode runs an operator with itself popped: a region sees exactly the calls
a mode would see. Python dispatch modes and tensor subclasses sit above the key and see each
operator first.

The fallback is built with ``torch.utils.cpp_extension`` on first use (about 10 s, then cached per
torch release under ``~/.cache/prime_ac``, or ``$PRIME_AC_CACHE_DIR``). Without a compiler, with
``PRIME_AC_INTERCEPT=0``, or when another library has claimed the key, regions use dispatch modes.

Kernels are global and permanent (the dispatcher has no per-thread registrations) but do nothing
outside a region: no thread includes the key then, so no call reaches them. They are registered
as regions are created, for the operators in the registry then. An operator registered later gets
its kernel when a region is created at least :data:`RELIST_SECONDS` later while no region waits
for its recompute: a forward and its recompute always see the same kernels.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.library import Library

from prime_ac import _compat

__all__ = [
    "RELIST_SECONDS",
    "Intercepting",
    "available",
    "cache_dir",
    "ensure_kernels",
    "registry",
    "resolve",
    "run_below",
]

Handler = Callable[[Any, tuple, dict], Any]
Key = tuple[str, str, str]  # (namespace, op, overload)

RELIST_SECONDS = 1.0
"""How often regions look for operators registered since (listing them costs about 3 ms)."""

_STALE_BUILD_SECONDS = 300  # a build takes about 10 s; a baton this old belongs to no build
_SOURCE = Path(__file__).resolve().parent / "_csrc" / "intercept.cpp"
_LIBRARY = "prime_ac_intercept"

_local = threading.local()  # .handler: the innermost intercepting region's handler on this thread
_libraries: dict[str, Library] = {}  # namespace -> the Library holding prime_ac's Python kernels
_kernels: set[Any] = set()  # operators with a Python kernel on the key
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
    if os.environ.get("PRIME_AC_INTERCEPT", "1") == "0" or _compat.intercept_key_taken():
        return False
    try:
        _load_fallback()
    except Exception as error:  # no compiler or ninja, missing headers, a failed load
        warnings.warn(
            f"prime_ac could not build its operator interceptor ({type(error).__name__}: "
            f"{error}); checkpointed blocks use dispatch modes instead, which cost a few "
            "microseconds more per operator in eager mode. It needs a C++ compiler and ninja "
            "(pip install ninja); PRIME_AC_INTERCEPT=0 silences this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def cache_dir() -> Path:
    """Where the fallback is built: one directory per torch release and source version."""
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    root = os.environ.get("PRIME_AC_CACHE_DIR") or Path.home() / ".cache" / "prime_ac"
    return Path(root) / f"intercept-{digest}"


def _load_fallback() -> None:
    out = cache_dir()
    library, lock = out / f"{_LIBRARY}.so", out / "lock"  # lock: cpp_extension's build baton
    if library.is_file() and not lock.exists():  # built (the directory names its sources)
        torch.ops.load_library(str(library))
        return
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_BUILD_SECONDS:
        lock.unlink(missing_ok=True)  # left by a build that was killed: later ones would wait
    # cpp_extension holds the baton while it builds, so processes starting together (pytest -n,
    # one per rank) build once and load a finished library.
    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=_LIBRARY,
        sources=[str(_SOURCE)],
        extra_cflags=["-O2"],
        build_directory=str(out),
        is_python_module=False,
    )


def _library(namespace: str) -> Library:
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = Library(namespace, "IMPL")
    return library


def registry(relist: bool = True) -> list[tuple[Key, bool]]:
    """``(key, mutable)`` of every registered operator overload, append-only, in the order first
    seen; relisted at most every :data:`RELIST_SECONDS`, and only when ``relist``.

    A new operator with a composite kernel gets the C++ fallback as its kernel on the key: the
    composite would otherwise fill the key's slot and run with the key still included. That
    changes which calls a region sees, so the caller relists only while no region waits for its
    recompute (whose calls must match its forward's one for one).
    """
    now = time.monotonic()
    if not relist or now - _listed_at[0] < RELIST_SECONDS or not available():
        return _entries
    with _lock:
        _listed_at[0] = now
        composites = []
        for name in _compat.dispatch_op_names() - _names:
            try:
                mutable = _compat.schema_of(name).is_mutable
            except RuntimeError:  # a name without a schema yet: listed next time
                continue
            _names.add(name)
            qualified, _, overload = name.partition(".")
            namespace, _, op_name = qualified.partition("::")
            _entries.append(((namespace, op_name, overload or "default"), mutable))
            if _compat.has_composite_kernel(name):
                composites.append(name)
        if composites:
            torch.ops.prime_ac_intercept.run_below_for(composites)
    return _entries


def resolve(key: Key) -> Any:
    """The OpOverload for ``key``, or None when it cannot be made (the operator went away)."""
    namespace, op_name, overload = key
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        return None


def ensure_kernels(ops: Iterable[Any]) -> None:
    """Register the key's Python kernel for each of ``ops`` (operator overloads or higher-order
    operators) that has none yet; it replaces the C++ one a composite operator had."""
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
            with warnings.catch_warnings():  # replacing a composite's C++ kernel warns
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
