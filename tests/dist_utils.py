"""Run a test body on N gloo ranks in child processes (CPU).

Children come from a forkserver that has imported torch once, so each rank starts in well under
a second and no OpenMP state is forked from the pytest process. Batch many checks into one
body: every call pays for process start and group set-up.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed"])


def _entry(rank, world_size, init_file, fn, args, errors):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
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

    ``fn`` must be a module-level function (it is pickled by reference).
    """
    errors = _CTX.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            _CTX.Process(target=_entry, args=(r, world_size, init_file, fn, args, errors))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
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
