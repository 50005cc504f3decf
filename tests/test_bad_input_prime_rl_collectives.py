"""Bad input to the ``prime_rl_collectives`` ops on 2 gloo ranks: every rank raises, none hangs.

``CASES`` names every case the multi-process run covers; each asserts its message.

One multi-process run covers every case (process start and group set-up are paid once). Each
group times out after 30 s, so a rank left waiting fails the test with a timeout instead of
stalling CI; a case passes only when every rank raised the expected ``ValueError`` or
``TypeError`` and the group is still in step afterwards.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from prime_ops import collectives as C
from prime_ops.groups import CHECK_ENV, set_checked
from prime_ops.mxfp8 import mxfp8_all_to_all_dispatch, mxfp8_all_to_all_single

OPS = torch.ops.prime_rl_collectives
EVERY = "Every rank raises this error"
WAITING = (
    r"\[\S+ raised this on rank \d of 2 before sending anything; the other ranks may be waiting"
)


def _raises(kind, message, call):
    with pytest.raises(kind, match=message):
        call()


def _in_step(rank):
    """Nothing half-started: the next collective pairs up."""
    assert C.all_gather(torch.tensor([rank])).tolist() == [0, 1]


def _checked_cases(rank):
    """Checked mode: an error of any type raised on one rank before the exchange reaches every
    rank (before, anything but a ValueError left the peer waiting the whole group timeout)."""
    x = torch.ones(4, 3)
    one = rank == 1
    cases = {
        "dim_str_on_one_rank":
        (lambda: C.all_gather(x, dim="0" if one else 0), "rank 1 .*TypeError: all_gather: dim "
         "must be an int, got str '0'"),
        "split_str_on_one_rank":
        (lambda: C.all_to_all_single(x, [2, 2], [2, "2"] if one else [2, 2]),
         r"rank 1 .*TypeError: input_splits must be a list of ints .*\[2, '2'\]"),
        "x_none_on_rank_0":
        (lambda: C.reduce_scatter_sum(None if rank == 0 else x),
         "rank 0 .*TypeError: reduce_scatter_sum: x must be a torch.Tensor, got NoneType"),
        "equal_x_none_on_one_rank":
        (lambda: C.all_to_all_single_equal(None if one else x), "rank 1 .*x must be a torch"),
        "float_splits_on_one_rank":
        (lambda: C.all_to_all_single(x, [2, 2], torch.tensor([2.0, 2.0]) if one else [2, 2]),
         "rank 1 .*ValueError: input_splits must be an integer"),
        "mxfp8_width_33_on_one_rank":
        (lambda: mxfp8_all_to_all_single(torch.ones(4, 33 if one else 32), [2, 2], [2, 2]),
         "rank 1 .*multiple of 32"),
        "mxfp8_x_none_on_one_rank":
        (lambda: mxfp8_all_to_all_single(None if one else torch.ones(4, 32), [2, 2], [2, 2]),
         "rank 1 .*TypeError: mxfp8_all_to_all_single: x must be a torch.Tensor"),
        # valid on each rank, but not together: what default mode cannot see (issue 24)
        "splits_that_do_not_fit":
        (lambda: C.all_to_all_single(x, [2, 3], [2, 2] if rank == 0 else [1, 3]),
         r"rank 1 sends 1 rows to rank 0 .* but rank 0 expects 3"),
        "dim_differs":
        (lambda: C.all_gather(torch.ones(2, 2), dim=rank),
         "dim must be the same on every rank; got rank 0: 0, rank 1: 1"),
        "scale_rule_differs":
        (lambda: mxfp8_all_to_all_single(x.new_ones(4, 32), [2, 2], [2, 2],
         scale_rule="floor" if one else "rceil"), "scale_rule must be the same on every rank"),
        "dispatch_torchao_on_cpu_on_one_rank":
        (lambda: mxfp8_all_to_all_dispatch(x.new_ones(4, 32), [2, 2], [2, 2],
         quantizer="torchao" if one else "torch"), "rank 1 .*quantizer='torchao' casts bf16 CUDA"),
        "async_splits_that_do_not_fit":
        (lambda: C.all_to_all_single_async(x, [2, 2], [2, 2] if rank == 0 else [1, 3]),
         r"rank 1 sends 1 rows to rank 0 .* but rank 0 expects 2"),
        # one rank's sparse tensor: the fingerprints carry the layout, the check reaches all
        "sparse_x_on_one_rank":
        (lambda: C.all_to_all_single_equal(x.to_sparse() if one else x),
         "rank 1 .*layout torch.sparse_coo"),
    }  # fmt: skip
    for call, message in cases.values():
        _raises(ValueError, f"{message}.*{EVERY}", call)
        _in_step(rank)
    return list(cases)


def _mode_cases(rank):
    """The mode is the group's: ranks that disagree all raise instead of pairing a fingerprint
    exchange with a collective (before: all-to-all hung, all_gather aborted gloo)."""
    agreement = r"checked mode must be the same on every rank of the group; got rank 0: on, "
    _raises(ValueError, agreement + "rank 1: off", lambda: set_checked(rank == 0))
    _raises(
        ValueError,
        f"rank 1 .*TypeError.*{EVERY}",
        lambda: C.all_gather(torch.ones(1) if rank == 0 else [1]),
    )
    fresh = dist.new_group()  # the environment variable, read at the group's first call
    if rank == 0:
        os.environ[CHECK_ENV] = "1"
    try:
        _raises(
            ValueError,
            agreement + f"rank 1: off \\(from {CHECK_ENV}\\)",
            lambda: C.all_gather(torch.ones(2), group=fresh),
        )
    finally:
        os.environ.pop(CHECK_ENV, None)
    assert C.all_gather(torch.tensor([rank]), group=fresh).tolist() == [0, 1]  # now both off
    return ["mode_set_checked_differs", "mode_type_error_joins_exchange", "mode_env_differs"]


def _default_cases(rank, name):
    """Default mode: every rank makes the same bad call (so no one is left waiting); the error
    names the argument, and says the peers may be waiting, whatever its type."""
    x = torch.ones(4, 3)
    cases = {
        "dim_str":
        (TypeError, lambda: C.all_gather(x, dim="0"), "dim must be an int, got str"),
        "dim_float":
        (TypeError, lambda: C.all_gather(x, dim=1.0), "dim must be an int, got float"),
        "output_splits_str":
        (TypeError, lambda: C.all_to_all_single(x, [1, "1"], [2, 2]), "output_splits must be"),
        "input_splits_float":
        (TypeError, lambda: C.all_to_all_single(x, [2, 2], [2.5, 1.5]), "input_splits must be"),
        "input_splits_bool":
        (TypeError, lambda: C.all_to_all_single(x, [2, 2], [True, 3]), "input_splits must be"),
        "output_splits_int":
        (TypeError, lambda: C.all_to_all_single(x, 4, [2, 2]), "output_splits must be a list"),
        "reduce_scatter_x_none":
        (TypeError, lambda: C.reduce_scatter_sum(None), "x must be a torch.Tensor, got None"),
        "all_to_all_x_none":
        (TypeError, lambda: C.all_to_all_single(None, [0, 0], [0, 0]), "x must be a torch"),
        "mxfp8_x_none":
        (TypeError, lambda: mxfp8_all_to_all_single(None, [0, 0], [0, 0]), "x must be a torch"),
        "mxfp8_width_33":
        (ValueError, lambda: mxfp8_all_to_all_single(torch.ones(2, 33), [1, 1], [1, 1]), "32"),
        "dispatch_width_16":
        (ValueError, lambda: mxfp8_all_to_all_dispatch(torch.ones(2, 16), [1, 1], [1, 1]), "32"),
        "meta_x":
        (ValueError, lambda: C.all_gather(torch.ones(2, device="meta")), "meta device"),
        "sparse_x":
        (ValueError, lambda: C.reduce_scatter_sum(torch.ones(2, 2).to_sparse()),
         "layout torch.sparse_coo; .* pass x.to_dense"),
        "async_splits_str":
        (TypeError, lambda: C.all_to_all_single_async(x, [2, 2], "22"), "input_splits must be"),
        # the raw ops: the same checks, inside the op
        "raw_all_gather_dim_5":
        (ValueError, lambda: OPS.all_gather(x, 5, 2, name), r"dim=5 is out of range"),
        "raw_all_gather_group_size_4":
        (ValueError, lambda: OPS.all_gather(x, 0, 4, name),
         r"group_size=4 but the group .* has 2 ranks; pass group.size\(\)"),
        "raw_reduce_scatter_indivisible":
        (ValueError, lambda: OPS.reduce_scatter_sum(torch.ones(3), 0, 2, name), "not divisible"),
        "raw_reduce_scatter_group_size_1":
        (ValueError, lambda: OPS.reduce_scatter_sum(x, 0, 1, name), "group_size=1"),
        "raw_equal_indivisible":
        (ValueError, lambda: OPS.all_to_all_single_equal(torch.ones(3), name), "not divisible"),
        "raw_all_to_all_splits_sum":
        (ValueError, lambda: OPS.all_to_all_single(x, torch.tensor([2, 2]),
         torch.tensor([3, 3]), name), r"input_splits \[3, 3\] sum to 6"),
        "raw_all_to_all_negative":
        (ValueError, lambda: OPS.all_to_all_single(x, torch.tensor([2, 2]),
         torch.tensor([5, -1]), name), "negative"),
        "raw_mxfp8_single_scale_rule":
        (ValueError, lambda: OPS.mxfp8_all_to_all_single(torch.ones(2, 32), torch.tensor([1, 1]),
         torch.tensor([1, 1]), name, False, "round", "torch"), "scale_rule must be one of"),
        "raw_mxfp8_width_48":
        (ValueError, lambda: OPS.mxfp8_all_to_all(torch.ones(2, 48), torch.tensor([1, 1]),
         torch.tensor([1, 1]), name, False), "multiple of 32"),
        "raw_mxfp8_int32":
        (ValueError, lambda: OPS.mxfp8_all_to_all(torch.ones(2, 32, dtype=torch.int32),
         torch.tensor([1, 1]), torch.tensor([1, 1]), name, True), "x must be one of"),
        "raw_async_splits_sum":
        (ValueError, lambda: OPS.all_to_all_single_async(x, torch.tensor([2, 2]),
         torch.tensor([3, 3]), name), r"input_splits \[3, 3\] sum to 6"),
    }  # fmt: skip
    for kind, call, message in cases.values():
        _raises(kind, f"(?s)^{WAITING}.*{message}", call)
    _in_step(rank)
    return list(cases)


def _sync_cases(rank):
    """sync_all_to_all's own argument errors (local: it never communicates)."""
    x = torch.ones(4, 3)
    _, handle = C.all_to_all_single_async(x, [2, 2], [2, 2])
    C.sync_all_to_all(handle)
    C.sync_all_to_all(handle)  # a handle already waited for: nothing left to wait for
    cases = {
        "sync_handle_never_issued":
        (ValueError, lambda: C.sync_all_to_all(torch.tensor([10**6])), "was never issued"),
        "sync_handle_two_elements":
        (ValueError, lambda: C.sync_all_to_all(torch.tensor([1, 2])), "one element"),
        "sync_handle_str":
        (TypeError, lambda: C.sync_all_to_all("1"), "handle must be the tensor"),
    }  # fmt: skip
    for kind, call, message in cases.values():
        _raises(kind, message, call)
    _in_step(rank)
    return list(cases)


def _body(rank, world):
    name = dist.group.WORLD.group_name
    covered = _default_cases(rank, name) + _sync_cases(rank)
    set_checked(True)
    covered += _checked_cases(rank) + _mode_cases(rank)
    set_checked(False)
    _in_step(rank)
    assert covered == list(CASES)


# Every case the run above covers, by name (in the order it runs them); the four mistakes of
# issue 31 follow, one test each.
CASES = (
    # default mode: every rank makes the same bad call; the message says the peers may wait
    "dim_str", "dim_float", "output_splits_str", "input_splits_float", "input_splits_bool",
    "output_splits_int", "reduce_scatter_x_none", "all_to_all_x_none", "mxfp8_x_none",
    "mxfp8_width_33", "dispatch_width_16", "meta_x", "sparse_x", "async_splits_str",
    "raw_all_gather_dim_5", "raw_all_gather_group_size_4", "raw_reduce_scatter_indivisible",
    "raw_reduce_scatter_group_size_1", "raw_equal_indivisible", "raw_all_to_all_splits_sum",
    "raw_all_to_all_negative", "raw_mxfp8_single_scale_rule", "raw_mxfp8_width_48",
    "raw_mxfp8_int32", "raw_async_splits_sum",
    # sync_all_to_all's handle
    "sync_handle_never_issued", "sync_handle_two_elements", "sync_handle_str",
    # checked mode: one rank's error, or calls that do not fit, raise on every rank
    "dim_str_on_one_rank", "split_str_on_one_rank", "x_none_on_rank_0",
    "equal_x_none_on_one_rank", "float_splits_on_one_rank", "mxfp8_width_33_on_one_rank",
    "mxfp8_x_none_on_one_rank", "splits_that_do_not_fit", "dim_differs", "scale_rule_differs",
    "dispatch_torchao_on_cpu_on_one_rank", "async_splits_that_do_not_fit",
    "sparse_x_on_one_rank",
    # the mode itself differs across ranks
    "mode_set_checked_differs", "mode_type_error_joins_exchange", "mode_env_differs",
)  # fmt: skip


def test_bad_collective_calls_raise_on_every_rank():
    run_distributed(_body, 2, timeout=60)


# Issue 31: in checked mode, rank 0 calls all_gather(ones(4, 2), 0) while rank 1 makes a mistake
# only it can see. Before, rank 0 waited out the group timeout. Each run gets a 10 s group
# timeout (a regression fails in seconds, not minutes), and both ranks must raise.


def _rank1_mistake(rank, world, case):
    set_checked(True)
    x = torch.ones(4, 2)
    mistakes = {
        "group":
        (lambda: C.all_gather(x, 0, group="WORLD"),
                  "rank 1 of the group rejected its call: ValueError: all_gather: group must be "
                  "a torch.distributed.ProcessGroup"),
        "meta":
        (lambda: C.all_gather(torch.ones(4, 2, device="meta"), 0),
                 "rank 1 .*x is on the meta device, which holds no data"),
        "sparse":
        (lambda: C.all_gather(x.to_sparse(), 0),
                   "rank 1 .*x has layout torch.sparse_coo"),
        "op":
        (lambda: C.reduce_scatter_sum(x, 0),
               "op must be the same on every rank; got rank 0: all_gather, rank 1: "
               "reduce_scatter_sum"),
    }  # fmt: skip
    call, message = mistakes[case]
    _raises(ValueError, f"{message}.*{EVERY}", call if rank == 1 else lambda: C.all_gather(x, 0))
    _in_step(rank)


@pytest.mark.parametrize("case", ["group", "meta", "sparse", "op"])
def test_checked_mode_one_ranks_mistake_never_hangs(case):
    run_distributed(_rank1_mistake, 2, case, timeout=20)


# Issue 37: handles never synced stayed in collectives._pending for the life of the process
# (50 calls: 819,200 bytes of send buffers plus their Work objects).


def _unsynced_handles(rank, world):
    before = len(C._pending)
    outs = []
    for step in range(50):
        x = torch.full((4096, 2), float(10 * rank + step))  # 32 KiB sent per call
        out, handle = C.all_to_all_single_async(x, [2048, 2048], [2048, 2048])
        outs.append(out)
        assert len(C._pending) == before + 1  # held while the handle lives
        del handle  # never synced (its last reference: freed at once)
        assert len(C._pending) == before, "a dropped handle kept its exchange"
    # the dropped handle's exchange was waited for: every output holds the received rows
    for step, out in enumerate(outs):
        assert out[:2048].eq(step).all() and out[2048:].eq(10 + step).all()
    _, kept = C.all_to_all_single_async(torch.ones(4, 2), [2, 2], [2, 2])
    C.sync_all_to_all(kept)
    assert len(C._pending) == before
    fake = torch.empty(1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="handle is a meta or fake tensor.*no exchange"):
        C.sync_all_to_all(fake)
    _in_step(rank)


def test_unsynced_async_handles_are_released():
    run_distributed(_unsynced_handles, 2, timeout=120)


def _shapes_differ(rank, world):
    """Issue 37: locally valid shapes that differ across ranks aborted the job (gloo); checked
    mode raises on every rank, and a raw op's own error says first that the peers may wait."""
    name = dist.group.WORLD.group_name
    raw = torch.ops.prime_rl_collectives
    default = [  # every rank alike
        (lambda: raw.all_gather(torch.ones(4, 2), 0, 2, "no such group"),
         r"\[all_gather raised this on this rank before sending anything; the other ranks may "
         r"be waiting.*group_name='no such group'"),
        (lambda: raw.reduce_scatter_sum(torch.ones(3, 2), 0, 2, name),
         f"{WAITING}.*not divisible by the group size 2"),
        (lambda: raw.all_to_all_single_async(torch.ones(4, 2), torch.tensor([2, 2]),
                                             torch.tensor([3, 2]), name),
         f"{WAITING}.*input_splits \\[3, 2\\] sum to 5"),
    ]  # fmt: skip
    for call, message in default:
        _raises(ValueError, f"(?s)^{message}", call)
    set_checked(True)
    x = torch.ones(4 + 2 * rank, 2)
    for front in (C.all_gather, C.reduce_scatter_sum):
        with pytest.raises(ValueError, match=f"x.shape must be the same on every rank.*{EVERY}"):
            front(x)
    _raises(
        ValueError,
        f"x.dtype must be the same on every rank.*{EVERY}",
        lambda: C.all_gather(torch.ones(4, 2, dtype=torch.float64 if rank else torch.float32)),
    )
    set_checked(False)
    _in_step(rank)


def test_shapes_that_differ_across_ranks_are_caught_in_checked_mode():
    run_distributed(_shapes_differ, 2, timeout=60)
