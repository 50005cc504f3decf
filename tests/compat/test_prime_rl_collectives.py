"""prime-rl's calls of the ``prime_rl_collectives`` ops, made as prime-rl makes them, on 2 ranks.

Contract: prime-rl ``src/prime_rl/trainer/distributed/collectives.py`` @ 3be02f75c7b9 (the op
schemas and the fronts that call them; @ cf91f97754ed has the same schemas, without the async
all-to-all). Each body names the prime-rl call site it mirrors and calls the op with prime-rl's
arguments; the reference is plain PyTorch on every rank's inputs (every rank builds them all from
one seed): row exchanges by split/cat, gathers by cat, MXFP8 by its definition in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops import collectives as C
from prime_ops.mxfp8 import mxfp8_all_to_all_combine, mxfp8_all_to_all_dispatch

OPS = torch.ops.prime_rl_collectives
PRIME_RL_COMMIT = "3be02f75c7b9"

# prime-rl's schemas (torch infers SymInt from its ``int`` annotations); prime_ops' extras follow.
PRIME_RL_SCHEMAS = {
    "all_to_all_single": "Tensor x, Tensor output_splits, Tensor input_splits, str group_name",
    "all_to_all_single_equal": "Tensor x, str group_name",
    "all_gather": "Tensor x, SymInt dim, SymInt group_size, str group_name",
    "reduce_scatter_sum": "Tensor x, SymInt dim, SymInt group_size, str group_name",
    "mxfp8_all_to_all": (
        "Tensor x, Tensor output_splits, Tensor input_splits, str group_name, bool quantized"
    ),
    "all_to_all_single_async": (
        "Tensor x, Tensor output_splits, Tensor input_splits, str group_name"
    ),
}
PRIME_RL_RETURNS = {"all_to_all_single_async": "(Tensor, Tensor)"}
# Arguments prime_ops widens: ``bool?`` so that None reaches the op and raises (a ``bool`` turns
# None into False before the op sees it); prime-rl's calls pass a bool, which both accept.
WIDENED = {("mxfp8_all_to_all", "bool quantized"): "bool? quantized"}


def test_schemas_have_prime_rls_arguments_first():
    for name, arguments in PRIME_RL_SCHEMAS.items():
        schema = str(getattr(OPS, name).default._schema)
        ours, returns = schema.split("(", 1)[1].rsplit(") -> ", 1)
        ours, theirs = ours.split(", "), arguments.split(", ")
        theirs = [WIDENED.get((name, argument), argument) for argument in theirs]
        assert ours[: len(theirs)] == theirs, name
        assert all("=" in extra for extra in ours[len(theirs) :]), name  # extras have defaults
        assert returns == PRIME_RL_RETURNS.get(name, "Tensor"), name


# --- plain-PyTorch references -----------------------------------------------------------------


def _exact(g: torch.Generator, shape, dtype=torch.float32) -> torch.Tensor:
    """Multiples of 1/4 in [-2, 2]: sums are exact whatever order a backend adds in."""
    return (torch.randint(-8, 9, shape, generator=g) / 4).to(dtype)


def _exchange(tensors: list[torch.Tensor], matrix: list[list[int]]) -> list[torch.Tensor]:
    """What every rank receives when rank s sends ``matrix[s][r]`` rows (in order) to rank r."""
    pieces = [t.split(row) for t, row in zip(tensors, matrix, strict=True)]
    return [torch.cat([p[r] for p in pieces]) for r in range(len(tensors))]


def _transpose(matrix: list[list[int]]) -> list[list[int]]:
    return [list(col) for col in zip(*matrix, strict=True)]


def _mx_round_trip(t: torch.Tensor) -> torch.Tensor:
    """MXFP8 by definition (OCP MX v1.0, rceil scale): per 32 elements of the last dim,
    scale = 2 ** ceil(log2(amax / 448)); elements rounded to float8_e4m3fn; in float64."""
    blocks = t.double().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448))), 2.0**-127)
    elements = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (elements * scale).flatten(-2).to(t.dtype)


# --- token_dispatcher.py: TorchTokenDispatcher.dispatch / combine --------------------------------

NUM_EXPERTS = 4


def _counts(rank: int) -> torch.Tensor:
    """Rows per global expert that rank ``rank`` routes (one empty expert on rank 1)."""
    return torch.tensor([[2, 1, 0, 3], [1, 0, 2, 2]][rank])


def _torch_dispatcher_exchange(x, num_tokens_per_expert, group):
    """prime-rl src/prime_rl/trainer/distributed/token_dispatcher.py, TorchTokenDispatcher:
    ``dispatch`` (counts by all_to_all_single_equal, splits, tokens by all_to_all_single) and
    ``combine`` (the reverse exchange), each front calling the op with ``group.group_name``."""
    ep_degree = group.size()
    with torch.no_grad():
        num_tokens_per_expert_group = OPS.all_to_all_single_equal(
            num_tokens_per_expert, group.group_name
        )
        input_splits = num_tokens_per_expert.view(ep_degree, -1).sum(dim=1)
        output_splits = num_tokens_per_expert_group.view(ep_degree, -1).sum(dim=1)
    routed_input = OPS.all_to_all_single(x, output_splits, input_splits, group.group_name)
    routed_output = routed_input * 2  # the experts
    combined = OPS.all_to_all_single(routed_output, input_splits, output_splits, group.group_name)
    return num_tokens_per_expert_group, routed_input, combined


def _dispatcher_matrix(world: int) -> list[list[int]]:
    return [_counts(s).view(world, -1).sum(1).tolist() for s in range(world)]


def _check_dispatcher(rank, world, exchange, g):
    xs = [_exact(g, (int(_counts(s).sum()), 8)) for s in range(world)]
    up_routed = [_exact(g, (int(sum(col)), 8)) for col in _transpose(_dispatcher_matrix(world))]
    up_combined = [_exact(g, x.shape) for x in xs]
    x = xs[rank].clone().requires_grad_()
    counts, routed, combined = exchange(x, _counts(rank), dist.group.WORLD)

    matrix = _dispatcher_matrix(world)
    want_counts = torch.cat([_counts(s).view(world, -1)[rank] for s in range(world)])
    assert torch.equal(counts, want_counts)
    torch.testing.assert_close(routed, _exchange(xs, matrix)[rank], rtol=0, atol=0)
    torch.testing.assert_close(combined, 2 * xs[rank], rtol=0, atol=0)
    ((routed * up_routed[rank]).sum() + (combined * up_combined[rank]).sum()).backward()
    # Adjoints: the routed rows' gradients come back the way the rows went; the round trip
    # (x2) sends each rank's own upstream gradient out and back.
    want_grad = _exchange(up_routed, _transpose(matrix))[rank] + 2 * up_combined[rank]
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=0)


# --- token_dispatcher.py: MXFP8TorchTokenDispatcher (collectives.py's mxfp8 fronts) ------------


def _mxfp8_dispatcher_exchange(x, y, output_splits, input_splits, group):
    """prime-rl token_dispatcher.py, MXFP8TorchTokenDispatcher._dispatch_tokens /
    _combine_tokens through collectives.py's mxfp8_all_to_all_dispatch (quantized=True) and
    mxfp8_all_to_all_combine (quantized=False)."""
    dispatched = OPS.mxfp8_all_to_all(x, output_splits, input_splits, group.group_name, True)
    combined = OPS.mxfp8_all_to_all(y, input_splits, output_splits, group.group_name, False)
    return dispatched, combined


def _check_mxfp8(rank, world, g):
    matrix = _dispatcher_matrix(world)
    send, recv = torch.tensor(matrix[rank]), torch.tensor(_transpose(matrix)[rank])
    # Normal values at several magnitudes: quantisation is lossy, so a wrong scale shows.
    xs = [torch.randn(int(sum(r)), 64, generator=g) * 4.0 ** torch.arange(-2, 2).repeat(16)
          for r in matrix]  # fmt: skip
    ys = [torch.randn(int(sum(c)), 64, generator=g) for c in _transpose(matrix)]
    up_x = [torch.randn(y.shape, generator=g) for y in ys]  # dispatched has ys' shapes
    up_y = [torch.randn(x.shape, generator=g) for x in xs]
    x, y = xs[rank].clone().requires_grad_(), ys[rank].clone().requires_grad_()
    dispatched, combined = _mxfp8_dispatcher_exchange(x, y, recv, send, dist.group.WORLD)

    # dispatch: MXFP8 forward, full-precision backward; combine: the reverse.
    want = _exchange([_mx_round_trip(t) for t in xs], matrix)[rank]
    torch.testing.assert_close(dispatched, want, rtol=0, atol=0)
    assert not torch.equal(dispatched, _exchange(xs, matrix)[rank])  # it did quantise
    torch.testing.assert_close(combined, _exchange(ys, _transpose(matrix))[rank], rtol=0, atol=0)
    ((dispatched * up_x[rank]).sum() + (combined * up_y[rank]).sum()).backward()
    want_x = _exchange(up_x, _transpose(matrix))[rank]
    want_y = _exchange([_mx_round_trip(u) for u in up_y], matrix)[rank]
    torch.testing.assert_close(x.grad, want_x, rtol=0, atol=0)
    torch.testing.assert_close(y.grad, want_y, rtol=0, atol=0)
    # prime_ops' fronts with prime-rl's front arguments (the import swap): the same values.
    group = dist.group.WORLD
    dispatched = mxfp8_all_to_all_dispatch(xs[rank], recv, send, group)
    torch.testing.assert_close(dispatched, want, rtol=0, atol=0)
    combined = mxfp8_all_to_all_combine(ys[rank], send, recv, group)
    torch.testing.assert_close(combined, _exchange(ys, _transpose(matrix))[rank], rtol=0, atol=0)


# --- models/gpt_oss/modeling_gpt_oss.py: substitute_gpt_oss_ring_attention ----------------------


def _gpt_oss_ring_gather(key, value, local_k_slice, group):
    """prime-rl src/prime_rl/trainer/models/gpt_oss/modeling_gpt_oss.py,
    substitute_gpt_oss_ring_attention.ring_attention: per key-head block,
    ``all_gather(key[:, start:stop], 0, process_group)[local_k_slice]``, where prime-rl's front
    calls ``_all_gather(x, dim, group.size(), group.group_name)``. The prime_ops front with the
    same arguments stands in for prime-rl's (the import swap) for the values."""
    gathered_key = OPS.all_gather(key[:, 0:1], 0, group.size(), group.group_name)[local_k_slice]
    gathered_value = C.all_gather(value[:, 1:2], 0, group)[local_k_slice]
    return gathered_key, gathered_value


def _check_gather(rank, world, gather, g):
    keys = [_exact(g, (3, 2, 4)).requires_grad_() for _ in range(world)]
    values = [_exact(g, (3, 2, 4)).requires_grad_() for _ in range(world)]
    local_k_slice = slice(0, 3 * (rank + 1))  # causal: the keys up to this rank's queries
    up = [_exact(g, (3 * (r + 1), 1, 4)) for r in range(world)]
    want_k = [torch.cat([k[:, 0:1] for k in keys])[: 3 * (r + 1)] for r in range(world)]
    want_v = [torch.cat([v[:, 1:2] for v in values])[: 3 * (r + 1)] for r in range(world)]
    loss = sum(((wk + 2 * wv) * u).sum() for wk, wv, u in zip(want_k, want_v, up, strict=True))
    want_grads = torch.autograd.grad(loss, [keys[rank], values[rank]])

    key, value = (t[rank].detach().clone().requires_grad_() for t in (keys, values))
    gathered_key, gathered_value = gather(key, value, local_k_slice, dist.group.WORLD)
    torch.testing.assert_close(gathered_key, want_k[rank], rtol=0, atol=0)
    torch.testing.assert_close(gathered_value, want_v[rank], rtol=0, atol=0)
    ((gathered_key + 2 * gathered_value) * up[rank]).sum().backward()
    torch.testing.assert_close(key.grad, want_grads[0], rtol=0, atol=0)
    torch.testing.assert_close(value.grad, want_grads[1], rtol=0, atol=0)


# --- collectives.py: _all_gather_backward / _reduce_scatter_backward ---------------------------


def _check_reduce_scatter(rank, world, g):
    """prime-rl collectives.py, _all_gather_backward: ``_reduce_scatter_sum(grad_output,
    ctx.dim, ctx.group_size, ctx.group_name)`` (prime-rl calls reduce_scatter_sum only there;
    its own backward is the all-gather)."""
    xs = [_exact(g, (3, 2 * world)).requires_grad_() for _ in range(world)]
    want = list(torch.stack(xs).sum(0).chunk(world, 1))
    up = [_exact(g, w.shape) for w in want]
    want_grad = torch.autograd.grad(
        sum((w * u).sum() for w, u in zip(want, up, strict=True)), xs[rank]
    )[0]
    x = xs[rank].detach().clone().requires_grad_()
    out = OPS.reduce_scatter_sum(x, 1, world, dist.group.WORLD.group_name)
    torch.testing.assert_close(out, want[rank], rtol=0, atol=0)
    (out * up[rank]).sum().backward()
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=0)


# --- collectives.py: all_to_all_single_async / sync_all_to_all -----------------------------------


def _check_async(rank, world, g):
    """prime-rl collectives.py, all_to_all_single_async(x, output_splits, input_splits, group)
    (the op with ``group.group_name``; output and handle back at once), other work, then
    ``sync_all_to_all(handle)`` before the output is read."""
    matrix = _dispatcher_matrix(world)
    send, recv = torch.tensor(matrix[rank]), torch.tensor(_transpose(matrix)[rank])
    xs = [_exact(g, (int(sum(r)), 5)) for r in matrix]
    up = [_exact(g, (int(sum(c)), 5)) for c in _transpose(matrix)]
    x = xs[rank].clone().requires_grad_()
    output, handle = OPS.all_to_all_single_async(x, recv, send, dist.group.WORLD.group_name)
    assert handle.dtype == torch.int64 and handle.shape == (1,) and handle.device.type == "cpu"
    overlapped = (x.detach() * 3).sum()  # independent work while the rows travel
    C.sync_all_to_all(handle)
    torch.testing.assert_close(output, _exchange(xs, matrix)[rank], rtol=0, atol=0)
    assert overlapped == 3 * xs[rank].sum()
    (output * up[rank]).sum().backward()
    torch.testing.assert_close(x.grad, _exchange(up, _transpose(matrix))[rank], rtol=0, atol=0)
    # prime_ops' front: the same pair with a ProcessGroup (and list splits).
    output, handle = C.all_to_all_single_async(xs[rank], recv.tolist(), send.tolist())
    C.sync_all_to_all(handle)
    torch.testing.assert_close(output, _exchange(xs, matrix)[rank], rtol=0, atol=0)


def _eager_body(rank, world):
    g = torch.Generator().manual_seed(0)
    _check_dispatcher(rank, world, _torch_dispatcher_exchange, g)
    _check_mxfp8(rank, world, g)
    _check_gather(rank, world, _gpt_oss_ring_gather, g)
    _check_reduce_scatter(rank, world, g)
    _check_async(rank, world, g)


@pytest.mark.slow
def test_prime_rl_call_sites_eager():
    run_distributed(_eager_body, 2, timeout=60)


def _compiled_body(rank, world):
    """prime-rl compiles its decoder layers (``apply_compile``; fullgraph for dense models) and
    its CP exchanges (tests/unit: ``fullgraph=True, dynamic=True``): the dispatcher's exchange
    and the gpt-oss gather, traced whole with ``fullgraph=True``. The ``aot_eager`` backend runs
    everything inductor's does up to code generation (Dynamo, the fakes, AOT autograd's joint
    graph), in seconds instead of minutes of C++ builds."""
    from torch._dynamo.utils import counters

    from prime_ops._compat import COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS

    g = torch.Generator().manual_seed(1)
    # torch 2.9 traces a data-dependent output size only when asked (docs/collectives.md)
    with torch._dynamo.config.patch(
        capture_dynamic_output_shape_ops=COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS
    ):
        dispatcher = torch.compile(_torch_dispatcher_exchange, fullgraph=True, backend="aot_eager")
        _check_dispatcher(rank, world, dispatcher, g)
        gather = torch.compile(
            _gpt_oss_ring_gather, fullgraph=True, dynamic=True, backend="aot_eager"
        )
        _check_gather(rank, world, gather, g)
    assert counters["graph_break"] == {}


@pytest.mark.slow
def test_prime_rl_call_sites_compiled_fullgraph():
    run_distributed(_compiled_body, 2, timeout=120)
