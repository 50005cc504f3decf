"""Lazy, explicit imports of the kernel libraries behind prime_ops.

A backend is part of an op's call: there is no silent fallback. The library is imported on the
first real call, never at ``import prime_ops`` and never from a fake, so registration works on
machines without the kernels.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["BackendUnavailable", "import_backend"]


class BackendUnavailable(ImportError):
    """A kernel library an op needs is not installed (or does not import on this machine)."""


def import_backend(module: str, *, extra: str | None, build: str | None = None) -> ModuleType:
    """Import ``module`` or raise :class:`BackendUnavailable` saying how to install it.

    ``extra`` is the pip extra that installs it; ``build`` is the documented build step for
    source-built libraries (DeepEP, DeepGEMM, FA3). A library with nothing on the package index
    passes ``extra=None``, so the message gives only the build step. Modules already in
    ``sys.modules`` (tests' stand-ins included) are returned as they are.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        steps = [f"pip install 'prime-ops[{extra}]'"] if extra else []
        if build:
            steps.append(build)
        how = "; ".join(steps)
        raise BackendUnavailable(
            f"{module!r} is needed for this call but could not be imported ({exc}). "
            f"Install it with: {how}"
        ) from exc
