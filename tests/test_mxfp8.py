"""MXFP8 quantisation against its definition, and the quantised all-to-all on 2 and 4 gloo ranks.

The multi-rank checks run in one spawned group per world size (process start dominates):
the transport equals quantise -> all_to_all -> dequantise computed on one process, bit for bit;
its error against the unquantised exchange stays within the MXFP8 bound; the wire carries about
half the bytes of bf16; the expert-parallel layer trains close to the plain transport;
prime_ac keeps the op (selective) or replays it (full) with unchanged gradients; and the op
passes opcheck and compiles with fullgraph=True.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import prime_ops
from prime_ops import collectives as C
from prime_ops._compat import COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS
from prime_ops.expert_parallel import ExpertParallelMoE
from prime_ops.groups import set_checked
from prime_ops.mxfp8 import (
    _check_quantizer,
    _torchao_quantize,
    dequantize_mx,
    mxfp8_all_to_all_combine,
    mxfp8_all_to_all_dispatch,
    mxfp8_all_to_all_single,
    quantize_mx,
)

E4M3 = torch.float8_e4m3fn


def _expected_exponent(x: torch.Tensor, rule: str) -> torch.Tensor:
    """Per 32-block scale exponent from the definition, in float64 (clamped to E8M0's range)."""
    amax = x.double().unflatten(-1, (-1, 32)).abs().amax(-1)
    if rule == "rceil":
        exp = torch.ceil(torch.log2(amax / 448))
    else:
        exp = torch.floor(torch.log2(amax)) - 8
    return exp.clamp(-127, 127).nan_to_num(-127.0, 127.0, -127.0)  # amax 0 -> log2 = -inf


def _blocks_with_extremes(dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[0, :32] = 0.0  # an all-zero block
    x[1, 32:64] *= 1e-6  # elements that land in e4m3 subnormals relative to a large block max
    x[1, 32] = 1.0
    x[2, 64:96] = torch.tensor(2.0**-140).float()  # fp32 subnormal block (scale clamps at 2^-127)
    return x.to(dtype)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_definition(rule, dtype):
    x = _blocks_with_extremes(dtype)
    data, scale = quantize_mx(x, rule)
    assert data.dtype == E4M3 and data.shape == x.shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (6, 4)
    exponent = _expected_exponent(x, rule)
    assert torch.equal(scale.view(torch.uint8).long(), (exponent + 127).long())
    expected = (x.double().unflatten(-1, (-1, 32)) / torch.exp2(exponent)[..., None]).flatten(-2)
    expected = expected.clamp(-448, 448).float().to(E4M3)
    assert torch.equal(data.view(torch.uint8), expected.view(torch.uint8))


def test_round_trip_error_within_mxfp8_bound():
    """|deq(q(x)) - x| <= 2^-4 |x| (3 mantissa bits) + 2^-10 * scale (half the e4m3 subnormal
    step), with no saturation under the rceil rule."""
    x = _blocks_with_extremes()
    out = dequantize_mx(*quantize_mx(x), torch.float32)
    scale = torch.exp2(_expected_exponent(x, "rceil")).repeat_interleave(32, -1)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale
    assert ((out.double() - x.double()).abs() <= bound).all()
    assert out[0, :32].eq(0).all()


def test_floor_rule_saturates_and_nan_propagates():
    x = torch.ones(2, 32)
    x[0, 0] = 500.0  # floor: scale 2^(8-8) = 1, so 500 saturates to 448
    x[1, 3] = float("inf")
    for rule, first in (("floor", 448.0), ("rceil", 512.0)):
        out = dequantize_mx(*quantize_mx(x, rule), torch.float32)
        assert out[0, 0] == first and out[0, 1] == 1.0
        assert out[1].isnan().all()  # the E8M0 NaN scale


@pytest.mark.parametrize(
    "x, kwargs, message",
    [
        (torch.randn(4, 48), {}, "multiple of 32"),
        (torch.randn(4, 64), {"scale_rule": "even"}, "scale_rule must be one of"),
        (torch.randn(4, 64, dtype=torch.float64), {}, "x must be one of"),
    ],
)
def test_quantize_rejects_bad_input(x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_mx(x, **kwargs)


def test_torchao_quantizer_exact_call(monkeypatch):
    calls = []

    def triton_to_mxfp8_dim0(x, inner_block_size=32, scaling_mode="rceil"):
        calls.append(dict(x=x, inner_block_size=inner_block_size, scaling_mode=scaling_mode))
        data, scale = quantize_mx(x, scaling_mode)
        return data, scale.view(torch.uint8)  # some torchao versions return raw bytes

    module = types.ModuleType("torchao.prototype.mx_formats.kernels")
    module.triton_to_mxfp8_dim0 = triton_to_mxfp8_dim0
    monkeypatch.setitem(sys.modules, "torchao.prototype.mx_formats.kernels", module)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    data, scale = _torchao_quantize(x, "floor")
    (call,) = calls
    assert call["x"] is x and call["inner_block_size"] == 32 and call["scaling_mode"] == "floor"
    assert scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(data.view(torch.uint8), quantize_mx(x, "floor")[0].view(torch.uint8))


def test_torchao_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.prototype.mx_formats.kernels", None)
    with pytest.raises(prime_ops.BackendUnavailable, match=r"prime-ops\[mxfp8\]"):
        _torchao_quantize(torch.randn(2, 32, dtype=torch.bfloat16), "rceil")


def _simulate_device(monkeypatch, capability, cuda="12.8", hip=None, gcn="gfx942"):
    """torch.cuda as a machine with one device of ``capability`` reports it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    props = types.SimpleNamespace(gcnArchName=gcn)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)


def _fake_cuda_bf16():
    with FakeTensorMode():
        return torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize(
    "capability, cuda, hip, gcn, refused",
    [
        ((8, 0), "12.8", None, "", "SM80"),
        ((9, 0), "12.8", None, "", "SM90"),
        ((12, 0), "12.8", None, "", None),  # SM120: torchao's gate is major >= 10
        ((10, 0), "12.8", None, "", None),
        ((10, 0), "12.6", None, "", "CUDA 12.6"),
        ((9, 4), None, "6.4", "gfx942:sramecc+:xnack-", "ROCm gfx942"),
        ((9, 5), None, "6.4", "gfx950:sramecc+:xnack-", None),
    ],
)
def test_torchao_quantizer_refused_where_torchao_has_no_cast(
    monkeypatch, capability, cuda, hip, gcn, refused
):
    """torchao 0.16-0.18 define triton_to_mxfp8_dim0 only on SM100+ with CUDA 12.8+ or MI350
    (tests/libraries/test_torchao_gate.py checks the installed torchao's gate agrees); elsewhere
    the call would fail inside torchao with "needs triton"."""
    x = _fake_cuda_bf16()
    _simulate_device(monkeypatch, capability, cuda, hip, gcn)
    if refused is None:
        _check_quantizer(x, "torchao")
        return
    with pytest.raises(ValueError, match="quantizer='torchao'") as info:
        _check_quantizer(x, "torchao")
    message = str(info.value)
    assert refused in message and "quantizer='torch'" in message, message
    _check_quantizer(x, "torch")  # the quantizer the error names works there


@pytest.mark.parametrize("version, refused", [((0, 16), True), ((0, 17), False), (None, False)])
def test_mi350_needs_torchao_0_17(monkeypatch, version, refused):
    """torchao 0.16's gate has no ROCm branch; 0.17 added MI350 (gfx950)."""
    x = _fake_cuda_bf16()
    _simulate_device(monkeypatch, (9, 5), None, "6.4", "gfx950:sramecc+:xnack-")
    monkeypatch.setattr("prime_ops.mxfp8._installed_torchao", lambda: version)
    if not refused:
        _check_quantizer(x, "torchao")
        return
    with pytest.raises(ValueError, match="MI350 with torchao 0.16"):
        _check_quantizer(x, "torchao")


def test_torchao_quantizer_refused_before_the_exchange(monkeypatch):
    """On SM90 the front raises while checking, before the op or any all-to-all runs."""
    x = _fake_cuda_bf16()
    _simulate_device(monkeypatch, (9, 0))
    group = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0, group_name="0")
    monkeypatch.setattr("prime_ops.mxfp8.resolve_call", lambda group, op: group)
    monkeypatch.setattr("prime_ops.mxfp8._run_checks", lambda op, group, describe, local: local())
    sent = []
    monkeypatch.setattr(
        torch.ops.prime_rl_collectives, "all_to_all_single", lambda *a: sent.append(a)
    )
    for front in (mxfp8_all_to_all_single, mxfp8_all_to_all_dispatch):
        with pytest.raises(ValueError, match="SM90"):
            front(x, [4], [4], group, quantizer="torchao")
    assert sent == []


# --------------------------------------------------------------------------- on gloo ranks


def _inputs(matrix, trailing, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(sum(row), *trailing, generator=g) * 3).to(dtype) for row in matrix], g


def _exchange(xs, matrix, world):
    """Single-process all-to-all of every rank's rows: result of each rank."""
    pieces = [x.split(matrix[s]) for s, x in enumerate(xs)]
    return [torch.cat([pieces[s][r] for s in range(world)]) for r in range(world)]


def _roundtrip(x):
    rows = x.flatten(1)
    return dequantize_mx(*quantize_mx(rows), x.dtype).view(x.shape)


def _check_transport(rank, world, matrix, trailing, dtype, seed):
    """Forward and both gradient modes equal the single-process composition, bit for bit."""
    xs, g = _inputs(matrix, trailing, dtype, seed)
    send = matrix[rank]
    recv = [matrix[s][rank] for s in range(world)]
    expected = _exchange([_roundtrip(x) for x in xs], matrix, world)
    grads_out = [torch.randn(e.shape, generator=g).to(dtype) for e in expected]
    transposed = [list(col) for col in zip(*matrix, strict=True)]
    for quantize_grad, transform in ((False, lambda t: t), (True, _roundtrip)):
        x = xs[rank].clone().requires_grad_()
        out = mxfp8_all_to_all_single(x, recv, send, quantize_grad=quantize_grad)
        torch.testing.assert_close(out, expected[rank], atol=0, rtol=0)
        (grad,) = torch.autograd.grad((out * grads_out[rank]).sum(), x)
        # The adjoint exchange sends each gradient row back: rank r sent matrix[r][s] rows to s.
        back = _exchange([transform(go) for go in grads_out], transposed, world)
        torch.testing.assert_close(grad, back[rank], atol=0, rtol=0)


def _count_wire_bytes(monkeypatch_target):
    """Wrap dist.all_to_all_single to record the bytes each call sends."""
    sent = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    monkeypatch_target.all_to_all_single = counting
    return sent, original


def _transport_body(rank, world):
    uneven = [[(s + 2 * r) % 3 + s for r in range(world)] for s in range(world)]
    silent = [[0] * world] + [[r + s + 1 for r in range(world)] for s in range(1, world)]
    seed = 0
    for dtype in (torch.bfloat16, torch.float32):
        for matrix, trailing in ((uneven, (64,)), (silent, (2, 32))):
            seed += 1
            _check_transport(rank, world, matrix, trailing, dtype, seed)

    # Error against the unquantised exchange, and bytes on the wire, for bf16 rows of 256.
    x = (torch.randn(8 * world, 256, generator=torch.Generator().manual_seed(rank)) * 2).bfloat16()
    splits = [8] * world
    sent, original = _count_wire_bytes(dist)
    try:
        plain = C.all_to_all_single(x, splits, splits)
        quantised = mxfp8_all_to_all_single(x, splits, splits)
    finally:
        dist.all_to_all_single = original
    assert sent == [x.numel() * 2, x.numel() + x.numel() // 32], sent
    assert 0.5 < sent[1] / sent[0] < 0.53
    scale = torch.exp2(_expected_exponent(plain, "rceil")).repeat_interleave(32, -1)
    err = (quantised.double() - plain.double()).abs()
    assert (err <= 2.0**-4 * plain.double().abs() + 2.0**-10 * scale).all()
    rel = (err.norm() / plain.double().norm()).item()
    assert rel < 2.0**-4
    if rank == 0:
        print(
            f"\nMXFP8 world={world}: wire ratio {sent[1] / sent[0]:.4f}, relative error {rel:.4f}"
        )

    # The fake checks the splits and gives a run-time row count, like the plain all-to-all.
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = mxfp8_all_to_all_single(mode.from_tensor(x), splits, splits)
        assert fake.shape[1:] == x.shape[1:] and fake.dtype == x.dtype
        with pytest.raises(ValueError, match=f"the group has {world} ranks"):
            mxfp8_all_to_all_single(mode.from_tensor(x), splits[:-1] + [0, 0], splits)


def _ep_body(rank, world):
    """The EP layer with the MXFP8 flag trains close to the plain transport."""
    group = dist.group.WORLD
    grads = {}
    for flag in (False, True):
        torch.manual_seed(0)
        layer = ExpertParallelMoE(64, 32, 4, 2, ep_group=group, mxfp8_transport=flag)
        torch.manual_seed(1 + rank)
        x = torch.randn(10, 64, requires_grad=True)
        out = layer(x)
        out.square().mean().backward()
        grads[flag] = [out.detach(), x.grad, *(p.grad for p in layer.parameters())]
    # Rows are quantised twice (dispatch, combine), each within 2^-4 relative per element.
    rels = [
        ((quantised - plain).norm() / plain.norm()).item()
        for plain, quantised in zip(grads[False], grads[True], strict=True)
    ]
    assert max(rels) < 2 * 2.0**-4, rels
    if rank == 0:
        print(f"MXFP8 EP layer: relative error of output, dx, grads {[round(r, 4) for r in rels]}")
    assert not torch.equal(grads[True][0], grads[False][0])  # the flag did change the transport


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        world = dist.get_world_size()
        splits = [x.shape[0] // world] * world
        return x + mxfp8_all_to_all_single(self.proj(x), splits, splits)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block()])

    def forward(self, x):
        return self.layers[0](x).square().sum()


def _ac_body(rank, world):
    """Selective AC keeps the transport (one exchange each way); full AC replays it."""
    import prime_ac

    torch.manual_seed(0)
    x = torch.randn(4 * world, 32)
    reference = _Model()
    reference(x).backward()
    for mode, exchanges in (("none", 2), ("full", 3), ("selective", 2)):
        model = _Model()
        model.load_state_dict(reference.state_dict())
        if mode != "none":
            prime_ac.checkpoint_blocks(model, mode=mode, blocks="layers")
        sent, original = _count_wire_bytes(dist)
        try:
            model(x).backward()
        finally:
            dist.all_to_all_single = original
        assert len(sent) == exchanges, (mode, sent)
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad, atol=0, rtol=0)


def _opcheck_body(rank, world):
    send = torch.tensor([1, 0]) if rank == 0 else torch.tensor([3, 2])
    recv = torch.tensor([1, 3]) if rank == 0 else torch.tensor([0, 2])
    x = torch.randn(int(send.sum()), 32).requires_grad_()
    op = torch.ops.prime_rl_collectives.mxfp8_all_to_all_single.default
    # quantize_grad=True: the backward is this op again (False calls the checked plain op).
    torch.library.opcheck(op, (x, recv, send, dist.group.WORLD.group_name, True, "rceil", "torch"))


def _compile_body(rank, world):
    """fullgraph=True raises on a graph break; the compiled gradient equals eager's bitwise."""
    send = torch.tensor([1, 2]) if rank == 0 else torch.tensor([2, 1])

    def step(x):
        return mxfp8_all_to_all_single(x * 2, send, send).square().sum()

    x = torch.randn(3, 64, requires_grad=True)
    (eager,) = torch.autograd.grad(step(x), x)
    # torch 2.9 traces a data-dependent output size only when asked (docs/collectives.md)
    with torch._dynamo.config.patch(
        capture_dynamic_output_shape_ops=COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS
    ):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        (grad,) = torch.autograd.grad(compiled(x), x)
    torch.testing.assert_close(grad, eager, atol=0, rtol=0)


def _fault_body(rank, world):
    """One rank's bad call: the error says first that the peers may wait (default mode), and
    checked mode makes every rank raise, also for a dispatch meeting a combine."""
    group = dist.group.WORLD
    x = torch.randn(2 * world, 32)
    splits = torch.tensor([2] * world)
    raw = torch.ops.prime_rl_collectives.mxfp8_all_to_all
    for bad in ({"quantized": None}, {"quantized": True, "quantizer": "mine"}):
        with pytest.raises((TypeError, ValueError)) as info:  # every rank calls it alike
            raw(x, splits, splits, group.group_name, **bad)
        message = str(info.value)
        assert message.startswith(f"[mxfp8_all_to_all raised this on rank {rank} of"), message
        assert "may be waiting" in message and "Checked mode catches it" in message
    set_checked(True, group)
    try:
        front = mxfp8_all_to_all_dispatch if rank == 0 else mxfp8_all_to_all_combine
        with pytest.raises(ValueError, match="do not fit together"):
            front(x, [2] * world, [2] * world)
        quantizer = "torchao" if rank == 0 else "torch"  # CPU: only rank 0's call is refused
        with pytest.raises(ValueError, match="rank 0 of the group rejected its call"):
            mxfp8_all_to_all_dispatch(x, [2] * world, [2] * world, quantizer=quantizer)
    finally:
        set_checked(False, group)


def _body(rank, world):
    _transport_body(rank, world)
    if world == 2:
        _fault_body(rank, world)
        _ep_body(rank, world)
        _ac_body(rank, world)
        _opcheck_body(rank, world)
        _compile_body(rank, world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_mxfp8_transport_on_gloo_ranks(world):
    run_distributed(_body, world)
