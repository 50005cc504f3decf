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
keeps one library per CPU kind). A build compiles into a private staging directory and
publishes the library by atomic rename, after its SHA-256 and size; a process loads a cached
library only once it verified it as whole (its ELF headers lie inside the file, size and
checksum match the record), and it loads a sealed private copy, so no later write to the cached
file can reach the pages it mapped. Builds of one directory take turns through a lock file that
names its owner (PID, host, boot, PID namespace, start time): a lock whose owner is gone, or is
this very process, or ran under another boot or container, is removed; a live one is waited on,
saying so, for at most ``LOCK_WAIT`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
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
    "why_not_loaded",
]

_loaded: Path | None = None  # the library this process loaded (a process can load it once)
# A load that found no build is final for the process (until it builds one itself): a library
# another process finishes meanwhile would switch ops from the Python chains to the native
# kernels halfway through a run, and their results differ in the last bits (router gradients).
_found_none = False
_why = "nothing was tried yet"  # why no library is loaded (load() returned False)
_in_process = threading.RLock()  # one build or load at a time within a process

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
STAGING = ".staging-"  # prefix of the private directory a build compiles in


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


# --- verification: a library is loaded only once it is known to be whole ------------------------


def _elf_problem(data: bytes) -> str | None:
    """Why ``data`` is not a whole 64-bit ELF file (None: it is). The linker writes the section
    table last, and ``dlopen`` maps every ``PT_LOAD`` segment: a file cut short anywhere ends
    before one of them, which a checksum written for the cut bytes would not tell."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:
        return "it is not a 64-bit ELF file"
    order = "<" if data[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(order + "QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if end <= len(data):
        for i in range(phnum):
            header = phoff + i * phentsize
            kind, _, offset, _, _, size = struct.unpack_from(order + "IIQQQQ", data, header)
            if kind == 1:  # PT_LOAD
                end = max(end, offset + size)
    if end > len(data):
        return f"it is truncated: its ELF headers describe {end} bytes, the file holds {len(data)}"
    return None


def _record(data: bytes) -> str:
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}\n"


def _read_verified(library: Path) -> tuple[bytes, str | None]:
    """The bytes of ``library`` and why they must not be loaded (None: a finished build wrote
    them): a record of its checksum and size, the same size, a whole ELF file, the same checksum.
    Read once, so the bytes checked are the bytes loaded."""
    try:
        data = library.read_bytes()
    except FileNotFoundError:
        return b"", "it does not exist"
    except IsADirectoryError:
        return b"", "a directory stands where the library belongs"
    try:
        recorded = _stamp(library).read_text().split()
    except FileNotFoundError:
        return data, f"no finished build recorded its checksum ({_stamp(library).name} is missing)"
    except IsADirectoryError:
        return data, f"a directory stands where its checksum record {_stamp(library).name} belongs"
    if len(recorded) > 1 and recorded[1] != str(len(data)):
        return data, f"it holds {len(data)} bytes, the build wrote {recorded[1]} (cut or replaced)"
    problem = _elf_problem(data)
    if problem is not None:
        return data, problem
    if not recorded or recorded[0] != hashlib.sha256(data).hexdigest():
        return data, "its bytes differ from those the build wrote (a truncated or overwritten file)"
    return data, None


def _load_private_copy(data: bytes, name: str) -> None:
    """``dlopen`` a sealed in-memory copy of a verified library, never the cached file: pages of
    a mapped file are read at first use, so a file truncated or rewritten in place after the
    load (an outside writer, a copy onto it) would be a SIGBUS at the next native call."""
    if not hasattr(os, "memfd_create"):  # not Linux: load the checked file itself
        torch.ops.load_library(name)
        return
    fd = os.memfd_create(Path(name).name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        _dlopen(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)  # the mapping keeps the copy alive
    torch.ops.loaded_libraries.add(name)


def _dlopen(path: str) -> None:
    """What ``torch.ops.load_library`` does, minus its ``realpath``: that turns a memfd's
    ``/proc/self/fd/N`` into a name no file has."""
    try:
        ctypes.CDLL(path)
    except OSError as exc:
        raise OSError(f"could not load {path}: {exc}") from exc


def _write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds either its old bytes or all of ``data``, never a part: written under a
    temporary name, flushed to disk, then renamed over it (a process that mapped the old file
    keeps its pages: a rename never rewrites a file in place)."""
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _remove(path, keep_files=True)  # a rename cannot replace a directory
    try:
        with open(staged, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        staged.replace(path)
    finally:
        staged.unlink(missing_ok=True)


def _remove(path: Path, *, keep_files: bool = False) -> None:
    """Remove ``path`` whether it is a file or a directory (nothing but prime_ops' own files
    belongs at the cache's names, so a directory there is in the way); ``keep_files`` removes
    only a directory."""
    if path.is_dir() and not path.is_symlink():
        _say(f"removing the directory {path}, which stands where a file of the build belongs")
        shutil.rmtree(path)
    elif not keep_files:
        path.unlink(missing_ok=True)


# --- the build lock: owned by a process that can be told apart from any other -------------------


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot): tells a PID's reuse from its first owner."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return None


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError):
        return Path(path).read_text().strip()
    return None


def _owner_record(pid: int) -> dict:
    """What identifies process ``pid`` of this process's container: its host, this boot, its PID
    namespace (a container of its own, where PIDs restart at 1) and its start time."""
    namespace = None
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": namespace,
        "start": _start_time(pid),
    }


def _lock_owner(lock: Path) -> dict | None:
    """The owner a lock names (older prime-ops wrote ``"<pid> <host>"``); None if unreadable."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
        text = lock.read_text()
        if text.startswith("{"):
            owner = json.loads(text)
            owner["pid"] = int(owner["pid"])
            return owner
        pid, host = text.split(maxsplit=1)
        return {"pid": int(pid), "host": host.strip()}
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists. Only PIDs >= 1 name one process: ``kill(0, 0)`` and
    ``kill(-1, 0)`` signal groups of processes and succeed, so a lock naming PID 0 or -1 would be
    waited on for the whole LOCK_WAIT; a PID beyond the C type raises OverflowError."""
    if pid < 1:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _why_stale(owner: dict | None, age: float) -> str | None:
    """Why the lock's owner cannot be building now (None: it may be, so wait for it)."""
    if owner is None:
        return "it names no owner" if age > 30 else None  # else: being written now
    pid, me = owner["pid"], _owner_record(os.getpid())
    if owner.get("host") != me["host"]:
        return None  # another machine sharing the directory: nothing here can tell
    elsewhere = {"boot": "before this machine's last boot", "pid_namespace": "in another container"}
    for key, where in elsewhere.items():  # its PID says nothing here
        if owner.get(key) and me[key] and owner[key] != me[key]:
            return f"process {pid} ran {where}"
    if pid < 1:
        return f"it names PID {pid}, which is no single process"
    if pid == me["pid"]:
        return f"it names this process's own PID {pid}, taken over from an earlier process"
    if not _alive(pid):
        return f"process {pid} no longer runs"
    if owner.get("start") and owner["start"] != _start_time(pid):
        return f"process {pid} is not the one that took it (its PID was reused)"
    return None


def _describe(owner: dict | None) -> str:
    return "a process" if owner is None else f"process {owner['pid']} on {owner.get('host')}"


def _wait_for_lock(lock: Path, deadline: float) -> None:
    """Return once ``lock`` is free: absent, or left by an owner that cannot be building now
    (reported and removed). A possibly live owner is waited on, saying so, until ``deadline``
    (``time.monotonic()``), then TimeoutError names it."""
    said = False
    while True:
        owner = _lock_owner(lock)
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        stale = _why_stale(owner, age)
        if stale is not None:
            _say(f"removing the stale build lock {lock}: {stale}")
            lock.unlink(missing_ok=True)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{lock} has been held for over {LOCK_WAIT:g} s by {_describe(owner)}; if no "
                f"build is running there, delete it and run {BUILD_COMMAND}"
            )
        if not said:
            _say(
                f"waiting up to {LOCK_WAIT:g} s for {_describe(owner)}, which is building the "
                f"native kernels into {lock.parent} (its lock is {age:.0f} s old)"
            )
            said = True
        time.sleep(0.2)


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Hold ``out/build.lock``, which records this process (:func:`_owner_record`)."""
    lock, deadline = out / LOCK, time.monotonic() + LOCK_WAIT
    me = _owner_record(os.getpid())
    while True:
        _wait_for_lock(lock, deadline)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # another process took it first
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    try:
        yield
    finally:
        if _lock_owner(lock) == me:  # not if another process removed it as stale meanwhile
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
    with _in_process:
        if _loaded is not None:
            return _loaded
        if not torch_supported():
            raise RuntimeError(
                f"the native kernels need torch >= {ABI_TARGET[0]}.{ABI_TARGET[1]} (LibTorch "
                f"stable ABI); this is torch {torch.__version__}"
            )
        cuda = _cuda_wanted() if cuda is None else cuda
        out = cache_dir(cuda)
        out.mkdir(parents=True, exist_ok=True)
        library = _library(out)
        data, problem = _read_verified(library)
        if problem is not None:
            with _build_lock(out):
                data, problem = _read_verified(library)  # finished by another process meanwhile?
                if problem is not None:
                    _compile(out, cuda, verbose)
                    return library
        _load_private_copy(data, str(library))
        _loaded = library
        return library


def _compile(out: Path, cuda: bool, verbose: bool) -> None:
    """Build into a fresh staging directory of ``out`` (the lock held), load the result, then
    publish it: its record, then the library, each by atomic rename. A killed build leaves its
    staging directory behind, never a partial library under the cached name."""
    from torch.utils import cpp_extension

    global _loaded
    for old in out.glob(STAGING + "*"):  # left by killed builds (a live one keeps touching its)
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > LOCK_WAIT:
                shutil.rmtree(old, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING, dir=out))
    start = time.perf_counter()
    _say(f"building the {'CPU + CUDA' if cuda else 'CPU'} kernels into {out} (once per machine)")
    os.environ.setdefault("MAX_JOBS", str(min(4, os.cpu_count() or 1)))
    try:
        cpp_extension.load(  # compiles, links and loads the library
            name=LIBRARY,
            sources=_sources(cuda),
            extra_cflags=_CFLAGS,
            extra_cuda_cflags=_NVCC_FLAGS,
            build_directory=str(staging),
            is_python_module=False,
            with_cuda=cuda,
            verbose=verbose,
        )
        library = _library(out)
        _loaded = library
        data = _library(staging).read_bytes()
        problem = _elf_problem(data)
        if problem is not None:
            raise RuntimeError(f"the linker wrote an unusable library ({problem})")
        _write_atomically(_stamp(library), _record(data).encode())
        _write_atomically(library, data)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # this process keeps its mapped copy
    _say(f"built {library} in {time.perf_counter() - start:.1f} s")


def _not_built(dirs: list[Path]) -> str:
    return (
        f"the native kernels of prime-ops are not built on this machine (no library in "
        f"{' or '.join(map(str, dirs))}). Build them once with: {BUILD_COMMAND}"
    )


def load() -> bool:
    """Load the cached library if a finished build exists (no compiler needed); True once loaded.

    A library another process is building is waited for (at most :data:`LOCK_WAIT` seconds,
    with a message). A library that fails its checks or does not load is rebuilt once, with the
    reason printed. Decided on the first call: a process that found no build keeps the Python
    paths until it calls :func:`build` itself. :func:`why_not_loaded` says why it returned False.
    """
    global _loaded, _found_none, _why
    with _in_process:
        if _loaded is not None:
            return True
        if _found_none:
            return False
        if not torch_supported():
            _why = f"the native kernels need torch >= 2.10, this is torch {torch.__version__}"
            return False
        try:
            dirs = [(cache_dir(True), True)] if torch.version.cuda else []
            dirs.append((cache_dir(False), False))
        except FileNotFoundError as exc:  # no sources, so no build of them either
            _why = str(exc)
            return False
        _found_none, _why = True, _not_built([out for out, _ in dirs])
        for out, cuda in dirs:
            library = _library(out)
            data, problem = _read_verified(library)
            if problem is not None and (out / LOCK).exists():  # a build may be writing it now
                try:
                    _wait_for_lock(out / LOCK, time.monotonic() + LOCK_WAIT)
                except TimeoutError as exc:
                    _why = str(exc)
                    return False
                data, problem = _read_verified(library)
            if problem is None:
                try:
                    _load_private_copy(data, str(library))
                except OSError as exc:
                    problem = f"it does not load: {exc}"
                else:
                    _loaded, _found_none = library, False
                    return True
            if not library.exists():
                continue
            _say(f"the cached library {library} is unusable ({problem}); rebuilding it once")
            _remove(_stamp(library))  # so build() compiles instead of reloading it
            try:
                build(cuda=cuda)
            except Exception as exc:  # noqa: BLE001 -- any failure: keep the Python paths, say why
                _say(f"the rebuild failed, the native ops stay off in this process: {exc}")
                _why = f"the cached library {library} is unusable ({problem}); rebuilding: {exc}"
                return False
            _found_none = False
            return True
        return False


def why_not_loaded() -> str:
    """Why :func:`load` returned False: no build, a build another process has held for too
    long, an unusable library whose rebuild failed, or a torch without the stable ABI."""
    return _why


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
