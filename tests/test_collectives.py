"""prime_rl_collectives: results and gradients against a single-process reference, on gloo ranks.

Every rank builds every rank's inputs from one seed, so each can compute the single-process
reference (split/cat/sum over the list of inputs, differentiated by autograd) and compare its own
slice. Values are multiples of 1/4 in [-2, 2], which bf16 and fp32 hold exactly, so sums agree
bit for bit whatever order the backend adds in.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops import collectives as C
from prime_ops._compat import COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS
from prime_ops.attn import ring_attention
from prime_ops.groups import CHECK_ENV, set_checked

OPS = torch.ops.prime_rl_collectives
DTYPES = (torch.float32, torch.bfloat16)


def _exact(generator: torch.Generator, shape, dtype) -> torch.Tensor:
    return (torch.randint(-8, 9, shape, generator=generator) / 4).to(dtype)


def _reference(kind: str, xs: list[torch.Tensor], arg):
    """Single-process result of collective ``kind`` for every rank, from all ranks' inputs."""
    world = len(xs)
    if kind == "all_to_all":  # arg[s][r]: rows rank s sends to rank r
        pieces = [x.split(arg[s]) for s, x in enumerate(xs)]
        return [torch.cat([pieces[s][r] for s in range(world)]) for r in range(world)]
    if kind == "all_gather":
        return [torch.cat(xs, arg)] * world
    if kind == "reduce_scatter":
        return list(torch.stack(xs).sum(0).chunk(world, arg))
    raise AssertionError(kind)


def _check_against_reference(rank, world, kind, shapes, arg, front, seed, dtype):
    """Forward and input gradient of ``front(x)`` on this rank equal the reference's."""
    g = torch.Generator().manual_seed(seed)
    xs = [_exact(g, shape, dtype).requires_grad_() for shape in shapes]
    expected = _reference(kind, xs, arg)
    grads_out = [_exact(g, e.shape, dtype) for e in expected]
    loss = sum((e * go).sum() for e, go in zip(expected, grads_out, strict=True))
    expected_grads = torch.autograd.grad(loss, xs)

    x = xs[rank].detach().clone().requires_grad_()
    out = front(x)
    torch.testing.assert_close(out, expected[rank], atol=0, rtol=0)
    (grad,) = torch.autograd.grad((out * grads_out[rank]).sum(), x)
    torch.testing.assert_close(grad, expected_grads[rank], atol=0, rtol=0)


def _check_all_to_all(rank, world, matrix, dtype, seed, as_tensors=False, trailing=(3,)):
    shapes = [(sum(row), *trailing) for row in matrix]
    send = list(matrix[rank])
    recv = [matrix[s][rank] for s in range(world)]
    if as_tensors:
        send, recv = torch.tensor(send), torch.tensor(recv)
    _check_against_reference(
        rank,
        world,
        "all_to_all",
        shapes,
        matrix,
        lambda x: C.all_to_all_single(x, recv, send),
        seed,
        dtype,
    )


def _split_matrices(world: int) -> list[list[list[int]]]:
    """Uneven splits; zero splits; a rank that sends nothing (0 rows); one that receives nothing."""
    uneven = [[(s + 2 * r) % 3 + s for r in range(world)] for s in range(world)]
    silent = [[0] * world] + [[r + s for r in range(world)] for s in range(1, world)]
    deaf = [[*row[:-1], 0] for row in uneven]
    return [uneven, silent, deaf]


def _reference_body(rank, world):
    seed = 0
    for dtype in DTYPES:
        for i, matrix in enumerate(_split_matrices(world)):
            seed += 1
            _check_all_to_all(rank, world, matrix, dtype, seed, as_tensors=i % 2 == 1)
        seed += 1
        _check_all_to_all(rank, world, _split_matrices(world)[0], dtype, seed, trailing=(2, 3))

        seed += 1
        equal = [[2] * world] * world
        _check_against_reference(
            rank,
            world,
            "all_to_all",
            [(2 * world, 3)] * world,
            equal,
            C.all_to_all_single_equal,
            seed,
            dtype,
        )
        for dim, shape in ((0, (2, 3)), (1, (2, 3, 2)), (-1, (2, 3))):
            seed += 1
            _check_against_reference(
                rank,
                world,
                "all_gather",
                [shape] * world,
                dim,
                lambda x, dim=dim: C.all_gather(x, dim=dim),
                seed,
                dtype,
            )
        for dim, shape in ((0, (2 * world, 3)), (1, (3, world, 2)), (-1, (3, 2 * world))):
            seed += 1
            _check_against_reference(
                rank,
                world,
                "reduce_scatter",
                [shape] * world,
                dim,
                lambda x, dim=dim: C.reduce_scatter_sum(x, dim=dim),
                seed,
                dtype,
            )

    # An explicit sub-group: its group_name reaches the op, and only its members take part.
    halves = [
        dist.new_group(list(range(0, world // 2))),
        dist.new_group(list(range(world // 2, world))),
    ]
    half = halves[rank * 2 // world]
    gathered = C.all_gather(torch.tensor([float(rank)]), group=half)
    first = rank - rank % (world // 2)
    assert gathered.tolist() == [float(r) for r in range(first, first + world // 2)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process_reference(world):
    run_distributed(_reference_body, world)


def _contract_body(rank, world):
    x = torch.ones(4, 2)
    bad_calls = [
        (
            lambda: C.all_to_all_single(x, [2, 2], [1, 2]),
            r"input_splits \[1, 2\] sum to 3 .* 4 rows",
        ),
        (lambda: C.all_to_all_single(x, [2, 2], [5, -1]), "must not contain negative sizes"),
        (
            lambda: C.all_to_all_single(x, [2, -2], [2, 2]),
            "output_splits must not contain negative",
        ),
        (
            lambda: C.all_to_all_single(x, [2, 1, 1], [2, 2]),
            r"output_splits has shape \(3,\) .* 2 ranks",
        ),
        (lambda: C.all_to_all_single(x, [2, 2], [[2, 2]]), r"input_splits has shape \(1, 2\)"),
        (lambda: C.all_to_all_single(x, torch.tensor([2.0, 2.0]), [2, 2]), "integer"),
        (lambda: C.all_to_all_single(torch.tensor(1.0), [0, 0], [0, 0]), "at least one dimension"),
        (
            lambda: C.all_to_all_single_equal(torch.ones(3, 2)),
            r"x.shape\[0\]=3 is not divisible by the group size 2",
        ),
        (lambda: C.all_gather(x, dim=2), r"dim=2 is out of range .* \[-2, 1\]"),
        (lambda: C.reduce_scatter_sum(x, dim=-3), "dim=-3 is out of range"),
        (lambda: C.reduce_scatter_sum(torch.ones(3, 3), dim=1), r"x.shape\[1\]=3 is not divisible"),
        (
            lambda: OPS.all_gather(x, 0, 2, "no-such-group"),
            "group_name='no-such-group' names no live",
        ),
        (
            lambda: OPS.all_gather(x, 0, 3, dist.group.WORLD.group_name),
            r"group_size=3 but the group .* has 2 ranks",
        ),
    ]
    for call, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            call()
    # Default mode: an error raised on one rank says its peers may be left waiting, and how to
    # make every rank raise instead.
    with pytest.raises(
        ValueError,
        match=r"^\[all_to_all_single raised this on rank \d of 2 .* may be waiting .*CHECK_COLLECTIVES=1.*input_splits",
    ):
        C.all_to_all_single(x, [2, 2], [1, 2])
    # Mixed devices: split sizes on meta with x on the CPU would run the fake as the kernel.
    meta = torch.tensor([2, 2], device="meta")
    with pytest.raises(ValueError, match="output_splits is on meta but x is on cpu"):
        C.all_to_all_single(x, meta, [2, 2])
    with pytest.raises(ValueError, match="output_splits is on meta but x is on cpu"):
        OPS.all_to_all_single(x, meta, torch.tensor([2, 2]), dist.group.WORLD.group_name)
    # Groups: by name, one this rank is not in.
    with pytest.raises(ValueError, match="group must be a torch.distributed.ProcessGroup"):
        C.all_gather(x, group="WORLD")
    only_zero = dist.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match="rank 1 is not a member of the group"):
            C.reduce_scatter_sum(x, group=only_zero)
    # Fakes validate too, so torch.compile reports shape errors at trace time.
    with torch._subclasses.FakeTensorMode(), pytest.raises(ValueError, match="not divisible"):
        C.reduce_scatter_sum(torch.empty(3, 3), dim=0)
    # Nothing was sent by the calls that failed: the group is still in step.
    assert C.all_gather(torch.tensor([rank])).tolist() == list(range(world))

    name = dist.group.WORLD.group_name
    # Fakes on a non-CPU device (meta stands in for an accelerator; fake CUDA works the same but
    # costs seconds to set up): device kept, data-dependent row count symbolic.
    with torch._subclasses.FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(4, 3, device="meta")
        splits = torch.empty(2, dtype=torch.int64, device="meta")
        received = OPS.all_to_all_single(x, splits, splits, name)
        assert received.device.type == "meta" and received.shape[1] == 3
        assert isinstance(received.shape[0], torch.SymInt)
        assert C.all_gather(x, dim=1).shape == (4, 6)
        assert C.reduce_scatter_sum(x, dim=0).shape == (2, 3)
        assert C.all_to_all_single_equal(x).device.type == "meta"

    send = torch.tensor([1, 0]) if rank == 0 else torch.tensor([3, 2])
    recv = torch.tensor([1, 3]) if rank == 0 else torch.tensor([0, 2])
    cases = [
        (OPS.all_to_all_single, (torch.randn(int(send.sum()), 3), recv, send, name)),
        (OPS.all_to_all_single_equal, (torch.randn(4, 3), name)),
        (OPS.all_gather, (torch.randn(2, 3), 1, world, name)),
        (OPS.reduce_scatter_sum, (torch.randn(3, 4), -1, world, name)),
        (OPS.mxfp8_all_to_all, (torch.randn(int(send.sum()), 32), recv, send, name, True)),
        (OPS.mxfp8_all_to_all, (torch.randn(int(send.sum()), 32), recv, send, name, False)),
    ]
    for op, args in cases:
        args = (args[0].requires_grad_(), *args[1:])
        torch.library.opcheck(op, args)


@pytest.mark.slow
def test_validation_errors_and_opcheck_in_gloo_group():
    run_distributed(_contract_body, 2)


def _raises_everywhere(call, message):
    """``call`` raises ValueError matching ``message`` on this rank; every rank runs this, so
    a rank that did not raise would leave the check (and the test) failing, not hanging."""
    with pytest.raises(ValueError, match=message):
        call()


def _checked_body(rank, world):
    """Checked mode on 2 ranks: each mismatch raises the same error on both ranks before the
    collective starts; afterwards the group is still in step."""
    set_checked(True)
    x = torch.ones(4, 3)
    every = r"Every rank raises this error"
    cases = [
        # output_splits that disagree with what the peer sends (here rank 1 sends 1 row, rank 0
        # expects 3): without the check, rank 0 gets uninitialised rows.
        (
            lambda: C.all_to_all_single(x, [2, 3], [2, 2] if rank == 0 else [1, 3]),
            r"rank 1 sends 1 rows to rank 0 \(its input_splits\[0\]\) but rank 0 expects 3",
        ),
        # Rows of different widths, and dtypes that differ: gloo would abort the process.
        (
            lambda: C.all_to_all_single(torch.ones(4, 3 + rank), [2, 2], [2, 2]),
            r"x.shape\[1:\] must be the same on every rank; got rank 0: \(3,\), rank 1: \(4,\)",
        ),
        (
            lambda: C.all_gather(x.to(torch.bfloat16 if rank else torch.float32)),
            "bfloat16",
        ),
        (lambda: C.all_gather(torch.ones(2 + rank, 3)), r"\(3, 3\)"),
        (lambda: C.reduce_scatter_sum(torch.ones(4, 4), dim=rank), "dim"),
        (lambda: C.all_to_all_single_equal(torch.ones(2 * (rank + 1), 3)), "shape"),
        # One rank's own ValueError reaches every rank.
        (
            lambda: C.all_to_all_single(x, [2, 2], [2, 2] if rank == 0 else [1, 2]),
            r"rank 1 of the group rejected its call: ValueError: .*input_splits \[1, 2\] sum to 3",
        ),
        (
            lambda: C.reduce_scatter_sum(torch.ones(3 + rank, 2)),
            r"rank 0 of the group rejected its call: ValueError: .*not divisible",
        ),
    ]
    for call, message in cases:
        _raises_everywhere(call, f"{message}.*{every}")

    # Ring attention: cu_seqlens (or flags) that differ per rank give a wrong result unchecked.
    q = torch.randn(8, 2, 8)
    cu = torch.tensor([0, 16] if rank == 0 else [0, 5, 16], dtype=torch.int32)
    _raises_everywhere(lambda: ring_attention(q, q, q, cu, 16), f"cu_seqlens .*{every}")
    same_cu = torch.tensor([0, 16], dtype=torch.int32)
    _raises_everywhere(
        lambda: ring_attention(q, q, q, same_cu, 16, causal=rank == 0),
        f"causal must be the same on every rank; got rank 0: True, rank 1: False.*{every}",
    )
    _raises_everywhere(  # one rank's local error (its q has a different head dim)
        lambda: ring_attention(torch.randn(8, 2, 8 + 8 * rank), q, q, same_cu, 16),
        f"rank 1 of the group rejected its call: ValueError: q and k must have the same head dim.*{every}",
    )

    # The environment variable sets the mode of a group at its first call.
    os.environ[CHECK_ENV] = "1"
    try:
        fresh = dist.new_group()
        _raises_everywhere(lambda: C.all_gather(torch.ones(2 + rank, 3), group=fresh), every)
    finally:
        del os.environ[CHECK_ENV]

    # Nothing half-started: the group is in step, and checked calls that fit run normally.
    assert C.all_gather(torch.tensor([rank])).tolist() == [0, 1]
    send = [1, 2] if rank == 0 else [3, 0]
    recv = [1, 3] if rank == 0 else [2, 0]
    out = C.all_to_all_single(torch.full((sum(send), 2), float(rank)), recv, send)
    assert out[:, 0].tolist() == [0.0] * recv[0] + [1.0] * recv[1]
    out, _ = ring_attention(q, q, q, same_cu, 16)
    assert out.shape == q.shape


@pytest.mark.slow
def test_checked_mode_raises_on_every_rank():
    run_distributed(_checked_body, 2, timeout=60)


def _uses_every_op(x, y, send, recv, group):
    a = C.all_to_all_single(x, recv, send)  # tensor splits: data-dependent row count
    b = C.all_to_all_single(x, [2, 2], [2, 2], group=group)  # list splits, explicit group
    gathered = C.all_gather(y, dim=1)
    scattered = C.reduce_scatter_sum(gathered * 2, dim=0)
    return a.sum(0) + b.sum(0), C.all_to_all_single_equal(scattered + 1)


def _compile_body(rank, world):
    from torch._dynamo.utils import counters

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 2, requires_grad=True)
    send = recv = torch.tensor([3, 1]) if rank == 0 else torch.tensor([1, 3])
    # torch 2.9 traces a data-dependent output size only when asked (docs/collectives.md)
    with torch._dynamo.config.patch(
        capture_dynamic_output_shape_ops=COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS
    ):
        compiled = torch.compile(_uses_every_op, fullgraph=True)
        got = compiled(x, y, send, recv, dist.group.WORLD)
    assert counters["stats"]["unique_graphs"] == 1
    got_grads = torch.autograd.grad(sum(o.sum() for o in got), (x, y))
    want = _uses_every_op(x, y, send, recv, dist.group.WORLD)
    want_grads = torch.autograd.grad(sum(o.sum() for o in want), (x, y))
    for a, b in zip((*got, *got_grads), (*want, *want_grads), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_compile_fullgraph_no_graph_break():
    run_distributed(_compile_body, 2)


def _property_body(rank, world, matrices):
    for seed, matrix in enumerate(matrices):
        _check_all_to_all(rank, world, matrix, torch.float32, seed, as_tensors=seed % 2 == 0)


@st.composite
def _split_batches(draw):
    world = draw(st.sampled_from([2, 3]))
    row = st.lists(st.integers(0, 5), min_size=world, max_size=world)
    matrix = st.lists(row, min_size=world, max_size=world)
    return world, draw(st.lists(matrix, min_size=1, max_size=8))


@pytest.mark.slow
@settings(
    max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(_split_batches())
def test_all_to_all_any_split_sizes(batch):
    # One process group per drawn batch of split matrices: each process start costs ~1 s.
    world, matrices = batch
    run_distributed(_property_body, world, matrices)


def test_schemas_are_the_public_contract():
    assert str(OPS.all_to_all_single.default._schema) == (
        "prime_rl_collectives::all_to_all_single(Tensor x, Tensor output_splits, "
        "Tensor input_splits, str group_name) -> Tensor"
    )
    assert str(OPS.all_to_all_single_equal.default._schema).endswith(
        "(Tensor x, str group_name) -> Tensor"
    )
    for name in ("all_gather", "reduce_scatter_sum"):  # prime-rl's, see tests/compat
        schema = str(getattr(OPS, name).default._schema)
        want = "(Tensor x, SymInt dim, SymInt group_size, str group_name) -> Tensor"
        assert schema.endswith(want)


@pytest.mark.skipif(dist.is_initialized(), reason="needs an uninitialized default group")
def test_front_without_process_group_says_how_to_fix():
    with pytest.raises(RuntimeError, match="init_process_group"):
        C.all_gather(torch.ones(2))
