"""Run a test body on N gloo ranks in child processes (CPU).

Children come from a forkserver that has imported torch once, so each rank starts in well under
a second and no OpenMP state is forked from the pytest process. The server also preloads what
the first custom-op call (``torch._dynamo``, seconds) and ``opcheck`` would import in every
child. Batch many checks into one body: every call pays for process start and group set-up.

The ranks meet through a file store in a fresh temporary directory and gloo connects on ports
the OS assigns, so concurrent runs (``pytest -n 2``) never share an address. Every group gets a
timeout, and the whole run a deadline: a collective that hangs fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(
    ["torch", "torch.distributed", "torch._dynamo", "torch.testing._internal.optests"]
)


def _entry(rank, world_size, init_file, group_timeout, fn, args, errors):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout),
        )
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure, not just the first rank's exit code
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise any failure.

    ``fn`` must be a module-level function (it is pickled by reference). ``timeout`` bounds the
    whole run; each collective times out after half of it.
    """
    errors = _CTX.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            _CTX.Process(
                target=_entry, args=(r, world_size, init_file, timeout / 2, fn, args, errors)
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        failures.sort()
        raise AssertionError("\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in failures))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with non-zero codes: {bad}")
