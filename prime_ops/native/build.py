"""Build and load the native kernels in ``csrc/``: a cached build, run once per machine.

``python -m prime_ops.native`` compiles the C++ (and, with a CUDA build of torch and
``nvcc``, the CUDA) sources with ``torch.utils.cpp_extension`` into a cache directory and loads
the library; later processes load the cached library without a compiler. The kernels use only
the LibTorch stable ABI, targeting torch 2.10, so one build keeps loading after torch upgrades.
Nothing is compiled at ``pip install`` time: the package installs and imports where no compiler
exists, and the native ops raise :class:`~prime_ops.BackendUnavailable` until the build ran.

``python -m prime_ops.native --check-cuda`` compiles the CUDA sources to object files
only (no CUDA torch or GPU needed), which is how CI keeps a CUDA build error from landing.

The cache is safe to share: its key holds the sources, the flags and the instruction set
``-march=native`` resolves to on this CPU (a home directory shared by nodes of different CPUs
keeps one library per CPU kind); a build records the SHA-256 of the library it wrote, and a
library that does not match it (a killed or truncated write) or does not load is rebuilt once,
with the reason printed; builds of one directory take turns through a lock file that names its
owner, so a lock left by a killed build is detected and removed, and one held by a live build
is waited on for at most ``LOCK_WAIT`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
LOCK = "build.lock"  # ours, naming its owner; cpp_extension's own baton is "lock"
LOCK_WAIT = 900.0  # seconds to wait for a live build of the same directory before giving up


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


@functools.cache  # the CPU does not change under a running process
def _isa() -> str:
    """What ``-march=native`` targets here: the CPU's feature flags from /proc/cpuinfo, else the
    compiler's resolution of it, else the architecture's name."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86, Arm
                return f"{platform.machine()}: {' '.join(sorted(value.split()))}"
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            command = [compiler, "-march=native", "-Q", "--help=target"]
            return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    return platform.machine()


def cache_dir(cuda: bool) -> Path:
    """``$PRIME_OPS_NATIVE_DIR`` (else ``~/.cache/prime_ops/native``)
    ``/<abi>-<cpu|cuda>-<hash of the sources>-<hash of the flags and instruction set>``.

    An upgraded prime-ops never loads a library built from older kernels, and a node never loads
    one compiled for another CPU's instruction set: each asks for a build instead.
    """
    root = os.environ.get("PRIME_OPS_NATIVE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "prime_ops" / "native"
    abi = f"abi{ABI_TARGET[0]}.{ABI_TARGET[1]}"
    flags = [*_CFLAGS, *(_NVCC_FLAGS if cuda else []), _isa()]
    target = hashlib.sha256("\0".join(flags).encode()).hexdigest()[:8]
    return base / f"{abi}-{'cuda' if cuda else 'cpu'}-{_sources_digest()}-{target}"


def _say(message: str) -> None:
    print(f"prime_ops.native: {message}", file=sys.stderr, flush=True)


def _library(out: Path) -> Path:
    return out / f"{LIBRARY}.so"


def _stamp(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _problem(library: Path) -> str | None:
    """Why ``library`` must not be loaded (None: it is the one a finished build wrote). Checked
    before ``dlopen``: a truncated library can crash the process (bus error) instead of failing."""
    if not library.is_file():
        return "it does not exist"
    stamp = _stamp(library)
    if not stamp.is_file():
        return f"no finished build recorded its checksum ({stamp.name} is missing)"
    if stamp.read_text().strip() != _digest(library):
        return "its bytes differ from those the build wrote (a truncated or overwritten file)"
    return None


def _lock_owner(lock: Path) -> tuple[int, str] | None:
    with contextlib.suppress(OSError, ValueError):
        pid, host = lock.read_text().split(maxsplit=1)
        return int(pid), host.strip()
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _held(out: Path) -> bool:
    """Whether a live process on this host holds the build lock of ``out`` (a build is writing)."""
    owner = _lock_owner(out / LOCK)
    return owner is not None and owner[1] == socket.gethostname() and _alive(owner[0])


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Hold ``out/build.lock`` (``"<pid> <host>"``). A lock whose owner no longer runs on this
    host is reported and removed; a live owner (or one on another host) is waited on for at most
    :data:`LOCK_WAIT` seconds."""
    lock, since = out / LOCK, None
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            owner = _lock_owner(lock)
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:  # released meanwhile
                continue
            here = owner is not None and owner[1] == socket.gethostname()
            if (owner is None and age > 30) or (here and not _alive(owner[0])):
                who = "an unreadable owner" if owner is None else f"process {owner[0]}"
                _say(f"removing the stale build lock {lock} of {who}, which no longer runs")
                lock.unlink(missing_ok=True)
                continue
            if since is None:
                who = "a process" if owner is None else f"process {owner[0]} on {owner[1]}"
                _say(f"waiting for the build of {who} ({lock})")
                since = time.monotonic()
            if time.monotonic() - since > LOCK_WAIT:
                raise TimeoutError(
                    f"{lock} has been held for over {LOCK_WAIT:.0f} s by {owner}; if no build "
                    f"is running there, delete it and run {BUILD_COMMAND}"
                ) from None
            time.sleep(0.2)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}")
        break
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


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
    """Compile the native library unless a finished build of these sources exists, and load it;
    returns its path.

    ``cuda=None`` adds the CUDA kernels when torch is a CUDA build, ``nvcc`` is found and a GPU
    is visible. A compile prints one line when it starts and one when it ends. A process loads
    the library once: after the first load this returns that library (restart to load a rebuilt
    one).
    """
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
    library = _library(out)
    if _problem(library) is not None:
        with _build_lock(out):
            if _problem(library) is not None:  # not finished by another process meanwhile
                _compile(out, cuda, verbose)
    if _loaded is None:
        torch.ops.load_library(str(library))
        _loaded = library
    return _loaded


def _compile(out: Path, cuda: bool, verbose: bool) -> None:
    """A clean build into ``out`` (the lock held): whatever a killed build left is removed, so
    ninja cannot take a partial object file for a finished one."""
    from torch.utils import cpp_extension

    global _loaded
    for path in out.iterdir():
        if path.name != LOCK:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    start = time.perf_counter()
    _say(f"building the {'CPU + CUDA' if cuda else 'CPU'} kernels into {out} (once per machine)")
    os.environ.setdefault("MAX_JOBS", str(min(4, os.cpu_count() or 1)))
    cpp_extension.load(  # compiles, links and loads the library
        name=LIBRARY,
        sources=_sources(cuda),
        extra_cflags=_CFLAGS,
        extra_cuda_cflags=_NVCC_FLAGS,
        build_directory=str(out),
        is_python_module=False,
        with_cuda=cuda,
        verbose=verbose,
    )
    library = _library(out)
    _loaded = library
    staged = _stamp(library).with_suffix(".tmp")
    staged.write_text(_digest(library))
    staged.replace(_stamp(library))  # the record appears only once the library is complete
    _say(f"built {library} in {time.perf_counter() - start:.1f} s")


def load() -> bool:
    """Load the cached library if a finished build exists (no compiler needed); True once loaded.

    A library that fails its checksum or does not load is rebuilt once, with the reason
    printed. Decided on the first call: a process that found no build (or only one being
    written by another process) keeps the Python paths until it calls :func:`build` itself.
    """
    global _loaded, _found_none
    if _loaded is not None:
        return True
    if _found_none or not torch_supported():
        return False
    try:
        dirs = [(cache_dir(True), True)] if torch.version.cuda else []
        dirs.append((cache_dir(False), False))
    except FileNotFoundError:  # no sources, so no build of them either
        return False
    for out, cuda in dirs:
        library = _library(out)
        if not library.exists() or _held(out):  # none, or a build is writing it now
            continue
        problem = _problem(library)
        if problem is None:
            try:
                torch.ops.load_library(str(library))
            except OSError as exc:
                problem = f"it does not load: {exc}"
            else:
                _loaded = library
                return True
        _say(f"the cached library {library} is unusable ({problem}); rebuilding it once")
        _stamp(library).unlink(missing_ok=True)  # so build() compiles instead of reloading it
        try:
            build(cuda=cuda)
        except Exception as exc:  # noqa: BLE001 -- any failure: keep the Python paths, say why
            _say(f"the rebuild failed, the native ops stay off in this process: {exc}")
            break
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
    print(f"{path} is built and loads ({time.perf_counter() - start:.1f} s)")
