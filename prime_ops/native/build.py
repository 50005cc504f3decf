"""Build and load the native kernels in ``csrc/``: a cached build, run once per machine.

``python -m prime_ops.native`` compiles the C++ (and, with a CUDA build of torch and
``nvcc``, the CUDA) sources with ``torch.utils.cpp_extension`` into a cache directory and loads
the library; later processes load the cached library without a compiler. The kernels use only
the LibTorch stable ABI, targeting torch 2.10, so one build keeps loading after torch upgrades.
Nothing is compiled at ``pip install`` time: the package installs and imports where no compiler
exists, and the native ops raise :class:`~prime_ops.BackendUnavailable` until the build ran.

``python -m prime_ops.native --check-cuda`` compiles the CUDA sources to object files
only (no CUDA torch or GPU needed), which is how CI keeps a CUDA build error from landing.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

__all__ = [
    "BUILD_COMMAND",
    "build",
    "cache_dir",
    "check_cuda_sources",
    "csrc_dir",
    "load",
    "torch_supported",
]

_loaded: Path | None = None  # the library this process loaded (a process can load it once)
# A load that found no build is final for the process (until it builds one itself): a library
# another process finishes meanwhile would switch ops from the Python chains to the native
# kernels halfway through a run, and their results differ in the last bits (router gradients).
_found_none = False

BUILD_COMMAND = "python -m prime_ops.native"
LIBRARY = "prime_ops_native"
ABI_TARGET = (2, 10)  # oldest torch whose stable ABI the library may load into
_TARGET = f"-DTORCH_TARGET_VERSION=0x{ABI_TARGET[0]:02x}{ABI_TARGET[1]:02x}000000000000"
# -O3: at -O2 GCC's loop vectoriser runs its 'very cheap' model and skips most kernel loops.
# -march=native: the build runs on the machine that uses it (as Inductor's CPU code does), so
# the loops vectorise for its widest ISA. -ffp-contract=off: no FMA contraction, so the CPU
# kernels round like the eager chains.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", _TARGET]
_NVCC_FLAGS = ["-O2", "-std=c++17", "--expt-relaxed-constexpr", _TARGET]


def csrc_dir() -> Path:
    """The kernel sources: ``$PRIME_OPS_CSRC``, else ``prime_ops/_csrc`` (a link to the
    checkout's ``csrc/``, package data in a wheel)."""
    path = Path(os.environ.get("PRIME_OPS_CSRC", Path(__file__).resolve().parents[1] / "_csrc"))
    if not (path / "common.h").is_file():
        raise FileNotFoundError(
            f"the native kernel sources are not at {path}; reinstall prime-ops or point "
            "PRIME_OPS_CSRC at the csrc/ directory of a source checkout"
        )
    return path


@functools.cache  # the sources do not change under a running process
def _sources_digest() -> str:
    digest = hashlib.sha256()
    root = csrc_dir()
    files = [*root.glob("*"), *(root / "cpu").glob("*"), *(root / "cuda").glob("*")]
    for path in sorted(p for p in files if p.suffix in (".h", ".cuh", ".cpp", ".cu")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def cache_dir(cuda: bool) -> Path:
    """``$PRIME_OPS_NATIVE_DIR`` (else ``~/.cache/prime_ops/native``) ``/<abi>-<cpu|cuda>-<hash>``.

    The hash of the sources is part of the name, so an upgraded prime-ops never loads a library
    built from older kernels: it asks for a build instead.
    """
    root = os.environ.get("PRIME_OPS_NATIVE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "prime_ops" / "native"
    abi = f"abi{ABI_TARGET[0]}.{ABI_TARGET[1]}"
    return base / f"{abi}-{'cuda' if cuda else 'cpu'}-{_sources_digest()}"


def torch_supported() -> bool:
    """The stable-ABI pieces the kernels use (parallel_for, new_empty, ...) exist from 2.10."""
    release = torch.torch_version.TorchVersion(torch.__version__)
    return release >= ".".join(map(str, ABI_TARGET))


def _cuda_wanted() -> bool:
    """A CUDA build of torch, nvcc, and a GPU to run on (a CUDA wheel on a CPU-only CI machine
    builds the CPU kernels only; ``--cuda`` forces the CUDA ones)."""
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None and torch.cuda.is_available()


def _sources(cuda: bool) -> list[str]:
    root = csrc_dir()
    files = sorted((root / "cpu").glob("*.cpp"))
    if cuda:
        files += sorted((root / "cuda").glob("*.cu"))
    return [str(f) for f in files]


def build(*, cuda: bool | None = None, verbose: bool = False) -> Path:
    """Compile (if sources changed) and load the native library; returns its path.

    ``cuda=None`` adds the CUDA kernels when torch is a CUDA build, ``nvcc`` is found and a GPU
    is visible.
    Re-running is cheap: ninja rebuilds only what changed. A process loads the library once:
    after the first load this returns that library (restart to load a rebuilt one).
    """
    from torch.utils import cpp_extension

    global _loaded
    if _loaded is not None:
        return _loaded
    if not torch_supported():
        raise RuntimeError(
            f"the native kernels need torch >= {ABI_TARGET[0]}.{ABI_TARGET[1]} (LibTorch stable "
            f"ABI); this is torch {torch.__version__}"
        )
    cuda = _cuda_wanted() if cuda is None else cuda
    out = cache_dir(cuda)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(min(4, os.cpu_count() or 1)))
    path = cpp_extension.load(
        name=LIBRARY,
        sources=_sources(cuda),
        extra_cflags=_CFLAGS,
        extra_cuda_cflags=_NVCC_FLAGS,
        build_directory=str(out),
        is_python_module=False,
        with_cuda=cuda,
        verbose=verbose,
    )
    _loaded = Path(path) if path else out / f"{LIBRARY}.so"
    return _loaded


def load() -> bool:
    """Load the cached library if a build exists (no compiler needed); True once loaded.

    Decided on the first call: a process that found no build keeps the Python paths until it
    calls :func:`build` itself.
    """
    global _loaded, _found_none
    if _loaded is not None:
        return True
    if _found_none or not torch_supported():
        return False
    try:
        dirs = [cache_dir(True)] if torch.version.cuda else []
        dirs.append(cache_dir(False))
    except FileNotFoundError:  # no sources, so no build of them either
        return False
    for out in dirs:
        if (out / "lock").exists():  # cpp_extension's baton: a build is writing the library now
            continue
        libs = sorted(out.glob(f"{LIBRARY}*.so"), key=lambda p: p.stat().st_mtime)
        if libs:
            torch.ops.load_library(str(libs[-1]))
            _loaded = libs[-1]
            return True
    _found_none = True
    return False


def check_cuda_sources(out_dir: Path | None = None) -> list[Path]:
    """Compile every ``csrc/cuda/*.cu`` to an object file with ``nvcc -c``; returns the objects.

    Needs only ``nvcc`` and torch's headers (the CPU wheel ships the stable-ABI headers the
    CUDA files use), so it runs where no CUDA build of torch or GPU exists.
    """
    from torch.utils.cpp_extension import include_paths

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on the PATH; install the CUDA toolkit")
    out_dir = out_dir or Path(tempfile.mkdtemp(prefix="prime_ops_cuda_check_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in include_paths()]
    jobs = []
    for src in sorted((csrc_dir() / "cuda").glob("*.cu")):  # one nvcc per file, in parallel
        obj = out_dir / (src.stem + ".o")
        cmd = [nvcc, "-c", str(src), "-o", str(obj), "-Xcompiler=-fPIC", *_NVCC_FLAGS, *includes]
        jobs.append((src, obj, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
    objects = []
    for src, obj, job in jobs:
        _, err = job.communicate()
        if job.returncode:
            raise RuntimeError(f"nvcc failed on {src.name}:\n{err}")
        objects.append(obj)
    return objects


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=BUILD_COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--check-cuda", action="store_true", help="nvcc -c the CUDA sources only")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.check_cuda:
        objects = check_cuda_sources()
        print(f"compiled {len(objects)} CUDA sources in {time.perf_counter() - start:.1f} s")
        return
    path = build(cuda=args.cuda, verbose=args.verbose)
    print(f"built {path} in {time.perf_counter() - start:.1f} s")
