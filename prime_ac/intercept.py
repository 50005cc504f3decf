"""Intercepting only the operators a policy decides about: a dispatch key instead of a mode.

A TorchDispatchMode hands every operator of a region to Python, 4-8 microseconds each on a CPU
core: in a small block that costs more than the recompute selective checkpointing saves. Here a
region instead includes one dispatch key (``_compat.INTERCEPT_KEY``) in its thread's dispatch key
set while it runs. The key falls through for every operator except those with a gate: operators
a policy can keep and operators that write an argument (a write may hit a kept result, which is
then copied first). A gate (``csrc/prime_ac/intercept.cpp``) looks the operator up in the
region's table of action codes and calls the region's Python handler only for the calls it acts
on: kept operators, and writes to a storage holding a kept result. Every other call runs below
the key in C++, for a table lookup.

The key sits below autograd, like the Python key a mode uses, and a handled operator runs with
the key excluded, as a mode runs an operator with itself popped. Python dispatch modes and tensor
subclasses sit above the key and see each operator first.

The gates are built with ``torch.utils.cpp_extension`` on first use (about 20 s, then cached per
torch release and Python version under ``~/.cache/prime_ac``, or ``$PRIME_AC_CACHE_DIR``). Without
a compiler, with ``PRIME_AC_INTERCEPT=0``, or when another library has claimed the key, regions use
dispatch modes.

Gates are global and permanent (the dispatcher has no per-thread registrations) but do nothing
outside a region: no thread includes the key then, so no call reaches them. They are added as
regions are created, for the operators in the registry then. An operator registered later gets
its gate when a region is created at least :data:`RELIST_SECONDS` later while no region waits
for its recompute: a forward and its recompute always see the same gates.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from prime_ac import _compat

__all__ = [
    "RELIST_SECONDS",
    "available",
    "cache_dir",
    "ensure_gates",
    "enter",
    "gated",
    "is_gated",
    "new_store",
    "new_table",
    "resolve_schema",
    "registry",
    "resolve",
    "run_below",
    "take",
]

Handler = Callable[[Any, tuple, dict], Any]
Key = tuple[str, str, str]  # (namespace, op, overload)

RELIST_SECONDS = 1.0
"""How often regions look for operators registered since (listing them costs about 3 ms)."""

_STALE_BUILD_SECONDS = 300  # a build takes about 20 s; a baton this old belongs to no build
_SOURCE = Path(__file__).resolve().parent / "_csrc" / "intercept.cpp"
_LIBRARY = "prime_ac_intercept"

_native: list[Any] = []  # [] until the key was set up, then [the built module, or None]
_gated: list[Any] = []  # operators with a gate, in the order they got it (append-only)
_gated_set: set[Any] = set()
_hops: set[Any] = set()  # higher-order operators with a kernel on the key
_names: set[str] = set()  # dispatcher names listed so far
_entries: list[tuple[Key, bool]] = []  # (key, mutable) per listed name, in the order first seen
_listed_at = [-math.inf]
_lock = threading.RLock()


def available() -> bool:
    """Whether regions can intercept through the key (else they use dispatch modes)."""
    if not _native:
        with _lock:
            if not _native:
                _native.append(_install())
    return _native[0] is not None


def _install() -> Any:
    # Another library's fallback on the key would receive every operator of a region: keep out.
    if os.environ.get("PRIME_AC_INTERCEPT", "1") == "0" or _compat.intercept_key_taken():
        return None
    try:
        return _load_native()
    except Exception as error:  # no compiler or ninja, missing headers, a failed load
        warnings.warn(
            f"prime_ac could not build its operator interceptor ({type(error).__name__}: "
            f"{error}); checkpointed blocks use dispatch modes instead, which cost a few "
            "microseconds more per operator in eager mode. It needs a C++ compiler and ninja "
            "(pip install ninja); PRIME_AC_INTERCEPT=0 silences this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def cache_dir() -> Path:
    """Where the gates are built: one directory per source, torch release and Python version."""
    build = f"{torch.__version__} {sys.implementation.cache_tag}".encode()
    digest = hashlib.sha256(_SOURCE.read_bytes() + build).hexdigest()[:12]
    root = os.environ.get("PRIME_AC_CACHE_DIR") or Path.home() / ".cache" / "prime_ac"
    return Path(root) / f"intercept-{digest}"


def _load_native() -> Any:
    out = cache_dir()
    library, lock = out / f"{_LIBRARY}.so", out / "lock"  # lock: cpp_extension's build baton
    if library.is_file() and not lock.exists():  # built (the directory names its sources)
        spec = importlib.util.spec_from_file_location(_LIBRARY, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_BUILD_SECONDS:
        lock.unlink(missing_ok=True)  # left by a build that was killed: later ones would wait
    # cpp_extension holds the baton while it builds, so processes starting together (pytest -n,
    # one per rank) build once and load a finished library.
    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=_LIBRARY,
        sources=[str(_SOURCE)],
        extra_cflags=["-O2"],
        build_directory=str(out),
    )


def registry(relist: bool = True) -> list[tuple[Key, bool]]:
    """``(key, mutable)`` of every registered operator overload, append-only, in the order first
    seen; relisted at most every :data:`RELIST_SECONDS`, and only when ``relist``.

    A new operator with a composite kernel gets a fall-through on the key: the composite would
    otherwise fill the key's slot and run instead of the backend kernel. That can change which
    calls a region sees (the composite's inner calls), so the caller relists only while no region
    waits for its recompute, whose calls must match its forward's one for one.
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
            _native[0].fall_through(composites)
    return _entries


def resolve(key: Key) -> Any:
    """The OpOverload for ``key``, or None when it cannot be made (the operator went away)."""
    namespace, op_name, overload = key
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
    except (AttributeError, RuntimeError):
        return None


def gated() -> list[Any]:
    """The operators with a gate, in the order they got it (append-only)."""
    return _gated


def is_gated(op: Any) -> bool:
    """Whether operator overload ``op`` has a gate."""
    return op in _gated_set


def ensure_gates(ops: Iterable[Any]) -> None:
    """Give each of ``ops`` (operator overloads or higher-order operators) a gate on the key, if
    it has none yet; a gate replaces the kernel a composite operator had there."""
    if not available():
        return
    with _lock:
        new = []
        for op in ops:
            if isinstance(op, _compat.HigherOrderOperator):
                if op not in _hops:
                    _hops.add(op)
                    op.py_impl(_compat.INTERCEPT_KEY)(_hop_kernel(op))
            elif op not in _gated_set:
                _gated_set.add(op)
                _gated.append(op)
                new.append((op._schema.name, op._schema.overload_name, op))
        if new:
            _native[0].add_gates(new)


def _hop_kernel(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        handler = _native[0].current_handle()
        if handler is None:  # the key reached a thread without a region: just run
            return run_below(op, args, kwargs)
        return handler(op, args, kwargs)

    return kernel


def run_below(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` as if the key were not there (its internal calls skip the gates too).

    The keys above this one that already ran (autograd, ADInplaceOrView) are excluded by then,
    so nothing runs twice.
    """
    with _compat.excluding_intercept_key():
        return op(*args, **kwargs)


def new_table() -> Any:
    """An empty table of action codes for one policy, which gates read: ``set(schema name,
    overload name, code)``."""
    return _native[0].Table()


def new_store() -> Any:
    """An empty native store for the results a region keeps of operators kept every call."""
    return _native[0].Store()


def take(store: Any, op: Any, refuse: Callable[..., Exception]) -> Any:
    """The recompute's next kept result of ``op`` from ``store``, or NotImplemented when the call
    runs (for a dispatch mode that sees the call before the key does)."""
    return store.take(op._schema.name, op._schema.overload_name, op, refuse)


def resolve_schema(name: str, overload: str) -> Any:
    """The OpOverload of a schema's name (``ns::op``) and overload name (``""`` for default)."""
    namespace, _, op_name = name.partition("::")
    return resolve((namespace, op_name, overload or "default"))


def enter(
    table: Any,
    store: Any,
    recompute: bool,
    handler: Handler,
    decide: Callable[[Any], int],
    refuse: Callable[..., Exception],
) -> Any:
    """Route this thread's gated operators to one side of a region until ``exit()`` is called
    on the returned region. Nests: the innermost region handles, and leaving restores the outer
    one.

    ``table`` holds the policy's action codes and ``store`` the region's natively kept results
    (``recompute`` says which side this is). ``handler(op, args, kwargs)`` takes the calls the
    codes send to Python (with dynamo off: see ``_compat.DispatchMode``), ``decide(op)`` codes an
    operator the table lacks, and ``refuse(kind, op, index, ran)`` builds the error for a kept
    result the recompute cannot have. Drop the region after leaving it: it holds the callbacks,
    usually bound methods of its owner, a cycle the garbage collector cannot see.
    """
    region = _native[0].Region(table, store, recompute, handler, decide, refuse)
    region.enter()
    return region
