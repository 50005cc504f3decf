"""torch_remat interop: its checkpoint wrappers, which prime_ac must see, and its region names,
which prime_ac's targets can name.

torch_remat (PyPI ``torch-remat``, torchtitan's checkpointing engine) is never imported here
unless a policy names one of its regions: a model that does not use it pays nothing.

- A block torchtitan wrapped has ``block.forward = remat.checkpoint(...)(block.forward)``: an
  instance attribute that shadows the class, where prime_ac puts its own region.
  :func:`is_remat_checkpoint` recognises such a wrapper, :func:`remat_checkpoint_call` a class
  ``forward`` that calls ``remat.checkpoint`` itself.
- ``remat.region(fn, "attention.qkv", recompute=False)(x)`` outside a remat checkpoint is a
  plain call of ``fn``. :func:`track_region_names` makes every such call also push its name
  here (:func:`current_region`), so that a ``"!region:<glob>"`` target replays the operator
  calls made inside it (:mod:`prime_ac.scopes`), and a ``"region:<glob>"`` target keeps the
  call whole: run once, its backward's saves held and its output kept, handed back in the
  recompute without running it (:func:`prime_ac.keep`'s machinery, through :func:`route_regions`),
  as remat's saved region does.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import sys
from typing import Any

import torch

__all__ = [
    "current_region",
    "is_remat_checkpoint",
    "region_names",
    "remat_available",
    "remat_checkpoint_call",
    "route_regions",
    "track_region_names",
]

_API = "torch_remat._api"


def remat_available() -> bool:
    """Whether torch_remat can be imported (without importing it)."""
    return "torch_remat" in sys.modules or importlib.util.find_spec("torch_remat") is not None


def is_remat_checkpoint(fn: Any) -> bool:
    """Whether ``fn`` is what ``torch_remat.checkpoint(...)(f)`` returns (0.2.x: a closure
    defined in ``torch_remat/_api.py`` named ``checkpointed_function``, ``__wrapped__`` = f)."""
    api = sys.modules.get(_API)  # not imported: nothing can be one
    code = getattr(fn, "__code__", None)
    return (
        api is not None
        and code is not None
        and code.co_name == "checkpointed_function"
        and code.co_filename == getattr(api, "__file__", None)
    )


def remat_checkpoint_call(function: Any) -> bool:
    """Whether ``function``'s own code calls ``torch_remat.checkpoint`` (``remat.checkpoint``
    on the imported module, or the function imported by name): a region nested inside it."""
    remat = sys.modules.get("torch_remat")
    code = getattr(function, "__code__", None)
    if remat is None or code is None:
        return False
    names = getattr(function, "__globals__", {})
    previous = None
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            value = names.get(instruction.argval)
            if value is remat.checkpoint:
                return True
            previous = value
            continue
        if (
            instruction.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and previous is remat
            and instruction.argval == "checkpoint"
        ):
            return True
        previous = None
    return False


# --- region names -------------------------------------------------------------------------------

# The enclosing remat.region names of the code running now, interned: ``_stack`` holds ids into
# ``_paths`` (0: outside every region). Global as the scope tracker's stack is: model code that
# calls remat.region holds no policy.
_paths: list[tuple[str, ...]] = [()]
_ids: dict[tuple[str, ...], int] = {(): 0}
_stack: list[int] = []


def current_region() -> int:
    """The id of the remat.region names enclosing the code running now (0: none)."""
    return _stack[-1] if _stack else 0


def region_names(rid: int) -> tuple[str, ...]:
    """The region names (outermost first) of the id :func:`current_region` returned."""
    return _paths[rid]


# What runs a region call a policy keeps whole (prime_ac.keep's machinery, one layer up):
# (region id, the call, args, kwargs) -> its output, or NotImplemented to call it as it is.
_router: Any = None


def route_regions(router: Any) -> None:
    """Have ``router`` decide each tracked ``remat.region`` call first (see ``_router``)."""
    global _router
    _router = router


def _enter(name: str) -> None:
    path = (*_paths[current_region()], name)
    rid = _ids.get(path)
    if rid is None:
        rid = _ids[path] = len(_paths)
        _paths.append(path)
    _stack.append(rid)


def track_region_names() -> bool:
    """Make ``torch_remat.region`` calls push their names here, once per process; False when
    torch_remat is not installed.

    Replaces ``torch_remat.region`` (and ``torch_remat._api.region``) by a wrapper that returns
    what the original returns, called inside :func:`current_region`'s bookkeeping: remat's own
    checkpoints behave exactly as before. Code that bound ``region`` by name before this ran
    (``from torch_remat import region``) keeps the original, whose calls name nothing.
    """
    if not remat_available():
        return False
    import torch_remat

    api = sys.modules[_API]
    original = api.region
    if getattr(original, "_prime_ac_names", False):
        return True

    @functools.wraps(original)
    def region(function: Any, name: str, *, recompute: bool) -> Any:
        inner = original(function, name, recompute=recompute)
        if torch.compiler.is_compiling():
            return inner
        qualified = _qualified(name)

        @functools.wraps(inner)
        def named(*args: Any, **kwargs: Any) -> Any:
            _enter(qualified)
            try:
                if _router is not None:
                    out = _router(current_region(), inner, args, kwargs)
                    if out is not NotImplemented:
                        return out
                return inner(*args, **kwargs)
            finally:
                _stack.pop()

        return named

    region._prime_ac_names = True
    api.region = torch_remat.region = region
    return True


def _qualified(name: str) -> str:
    """``name`` under the enclosing ``remat.name_scope`` prefixes, as remat names it (0.2.x:
    ``torch_remat._region._qualified_name``); ``name`` itself where that is gone."""
    qualify = getattr(sys.modules.get("torch_remat._region"), "_qualified_name", None)
    return name if qualify is None else qualify(name)
