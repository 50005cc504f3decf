"""prime-rl's calls of its FP8 GEMM ops and its routing telemetry, made as prime-rl makes them.

Contract (the newest versions in the search index; the index names no commit for them):
prime-rl ``src/prime_rl/trainer/models/layers/fp8_linear.py`` (``prime_rl::fp8_blockwise_mm``
with ``wgrad_key``, ``x_fp8``, ``x_sf``; its ``_backward`` with ``needs_grad_x/weight``;
``Float8BlockwiseLinear`` and ``fp8_clamped_swiglu_mlp`` call it), ``fp8_grouped_gemm.py``
(``prime_rl::grouped_fp8_gemm(x, weight [G, K, N], offs)``, "a drop-in replacement for
torch._grouped_mm") and the MoE layer's ``record_moe_routing_statistics`` (``MoE.forward``).
References are plain PyTorch in float64: the exact product (FP8 error bounded by norms), or the
product of the FP8 operands prime-rl hands over, dequantized by their definition.
"""

from __future__ import annotations

import pytest
import torch

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops import fp8

OPS = torch.ops.prime_rl
# prime-rl's arguments (torch infers SymInt from ``int``), then prime_ops' extras with defaults.
PRIME_RL_SCHEMAS = {
    "fp8_blockwise_mm": (
        "Tensor x, Tensor weight, SymInt block_size, SymInt wgrad_key=0, Tensor? x_fp8=None, "
        "Tensor? x_sf=None"
    ),
    "fp8_blockwise_mm_backward": (
        "Tensor grad_output, Tensor x, Tensor weight, SymInt block_size, bool needs_grad_x, "
        "bool needs_grad_weight, SymInt wgrad_key=0"
    ),
    "grouped_fp8_gemm": "Tensor x, Tensor weight, Tensor offs",
    "grouped_fp8_gemm_backward": (
        "Tensor grad_output, Tensor x, Tensor weight, Tensor offs, bool needs_grad_x, "
        "bool needs_grad_weight"
    ),
    "fp8_gate_up_mm": "Tensor x, Tensor gate_weight, Tensor up_weight, SymInt block_size",
    "fp8_clamped_swiglu": "Tensor gate_up, float limit",
    "fp8_gate_up_clamped_swiglu_backward": (
        "Tensor grad_h, Tensor x, Tensor gate_weight, Tensor up_weight, Tensor gate_up, "
        "float limit, SymInt block_size, bool needs_grad_x, bool needs_grad_weight, "
        "SymInt gate_wgrad_key=0, SymInt up_wgrad_key=0"
    ),
    "record_moe_routing_statistics": (
        "Tensor(a0!) tokens_per_expert, Tensor(a1!) routing_confidence_sum, "
        "Tensor token_counts, Tensor confidence"
    ),
}
RETURNS = {
    "fp8_blockwise_mm": "Tensor",
    "fp8_blockwise_mm_backward": "(Tensor, Tensor)",
    "grouped_fp8_gemm": "Tensor",
    "grouped_fp8_gemm_backward": "(Tensor, Tensor)",
    "fp8_gate_up_mm": "Tensor",
    "fp8_clamped_swiglu": "(Tensor, Tensor, Tensor)",
    "fp8_gate_up_clamped_swiglu_backward": "(Tensor, Tensor, Tensor)",
    "record_moe_routing_statistics": "()",
}


def test_schemas_have_prime_rls_arguments_first():
    for name, arguments in PRIME_RL_SCHEMAS.items():
        schema = str(getattr(OPS, name).default._schema)
        ours, returns = schema.split("(", 1)[1].rsplit(") -> ", 1)
        ours, theirs = ours.split(", "), arguments.split(", ")
        assert ours[: len(theirs)] == theirs, name
        assert all("=" in extra for extra in ours[len(theirs) :]), name
        assert returns == RETURNS[name], name


def _relative_error(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- fp8_linear.py ----------------------------------------------------------------------------


def _linear_case(seed=0):
    gen = _gen(seed)
    x = torch.randn(2, 3, 256, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(384, 256, generator=gen) / 16).bfloat16().requires_grad_()
    return x, weight


def test_float8_blockwise_linear_forward_and_backward():
    """``Float8BlockwiseLinear.forward``: ``_fp8_blockwise_mm(x, self.weight, self.block_size,
    self.wgrad_key)`` with a 3-D bf16 ``x``, ``block_size`` 128 and ``wgrad_key`` 0."""
    x, weight = _linear_case()
    out = OPS.fp8_blockwise_mm(x, weight, 128, 0)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 384)
    xd, wd = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = xd @ wd.T
    assert _relative_error(out, exact) < 0.05
    grad = torch.randn(out.shape, generator=_gen(1)).bfloat16()
    out.backward(grad)
    exact.backward(grad.double())
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert _relative_error(x.grad, xd.grad) < 0.05
    assert _relative_error(weight.grad, wd.grad) < 0.05


def test_backward_op_called_as_the_autograd_formula_calls_it():
    """``_fp8_blockwise_mm_autograd_backward``: the backward op with ``needs_grad_x`` /
    ``needs_grad_weight`` from ``ctx.needs_input_grad``; a gradient not asked for is skipped."""
    x, weight = (t.detach() for t in _linear_case())
    grad = torch.randn(2, 3, 384, generator=_gen(1)).bfloat16()
    gx, gw = OPS.fp8_blockwise_mm_backward(grad, x, weight, 128, True, True, 0)
    only_x = OPS.fp8_blockwise_mm_backward(grad, x, weight, 128, True, False, 0)
    only_w = OPS.fp8_blockwise_mm_backward(grad, x, weight, 128, False, True, 0)
    assert torch.equal(only_x[0], gx) and torch.equal(only_w[1], gw)
    assert gx.shape == x.shape and gw.shape == weight.shape
    exact_x = grad.double() @ weight.double()
    assert _relative_error(gx, exact_x) < 0.05


def test_accumulate_wgrad_fp32():
    """``Float8BlockwiseLinear.accumulate_wgrad_fp32``: with an accumulator for the module's key
    the weight gets no gradient and the fp32 buffer receives each micro-batch's product."""
    x, weight = _linear_case()
    plain = OPS.fp8_blockwise_mm(x, weight, 128, 0)
    grad = torch.randn(plain.shape, generator=_gen(1)).bfloat16()
    plain.backward(grad)
    bf16_grad, weight.grad = weight.grad, None
    buffer = torch.zeros(weight.shape)
    key = id(buffer)
    fp8.accumulate_wgrad_fp32(key, lambda: buffer)
    try:
        for _ in range(2):  # two micro-batches
            OPS.fp8_blockwise_mm(x, weight, 128, key).backward(grad)
    finally:
        fp8.accumulate_wgrad_fp32(key, None)
    assert weight.grad is None
    single = buffer / 2  # both micro-batches added the same fp32 product
    assert torch.equal(single.bfloat16(), bf16_grad)  # the bf16 gradient is that product rounded


class _Float8BlockwiseLinear(torch.nn.Linear):
    """prime-rl's ``Float8BlockwiseLinear`` (fp8_linear.py, the newest version in the index) after
    the switch: its forward calls the op with ``self.wgrad_key``; ``accumulate_wgrad_fp32`` sets
    ``wgrad_key = id(self)`` and stores the accumulator in the module's ``_wgrad_accumulators``
    dict, which migration.md binds to ``prime_ops.fp8.wgrad_accumulators``."""

    def __init__(self, *args, registry, **kwargs):
        super().__init__(*args, bias=False, **kwargs)
        self.block_size, self.wgrad_key, self._registry = 128, 0, registry

    def forward(self, x):
        return OPS.fp8_blockwise_mm(x, self.weight, self.block_size, self.wgrad_key)

    def accumulate_wgrad_fp32(self, accumulator):
        self.wgrad_key = id(self)
        self._registry[self.wgrad_key] = accumulator


def _switched_linear(registry):
    linear = _Float8BlockwiseLinear(256, 384, registry=registry, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(_linear_case()[1])
    return linear


def test_prime_rls_accumulator_registration_after_the_switch():
    """migration.md's step (``from prime_ops.fp8 import wgrad_accumulators as
    _wgrad_accumulators`` in fp8_linear.py): prime-rl's own registration reaches prime_ops, the
    fp32 buffer receives the weight gradient and the weight gets no bf16 ``.grad``."""
    from prime_ops.fp8 import wgrad_accumulators as _wgrad_accumulators

    linear = _switched_linear(_wgrad_accumulators)
    x = _linear_case()[0].detach()
    grad = torch.randn(2, 3, 384, generator=_gen(1)).bfloat16()
    linear(x).backward(grad)
    plain = linear.weight.grad
    linear.weight.grad = None
    buffer = torch.zeros(linear.weight.shape)
    linear.accumulate_wgrad_fp32(lambda: buffer)
    try:
        linear(x).backward(grad)
    finally:
        fp8.accumulate_wgrad_fp32(linear.wgrad_key, None)
    assert linear.weight.grad is None
    assert torch.equal(buffer.bfloat16(), plain)  # the same product, kept in fp32


def test_an_accumulator_prime_ops_cannot_see_raises():
    """A half-done switch (prime-rl's own dict kept) used to lose the gradient in silence: the
    buffer stayed at zero and the weight got a bf16 ``.grad``. Now the backward (and its fake)
    raises, naming the key and the fix."""
    linear = _switched_linear({})  # prime-rl's dict, not bound to prime_ops'
    buffer = torch.zeros(linear.weight.shape)
    linear.accumulate_wgrad_fp32(lambda: buffer)
    out = linear(_linear_case()[0].detach())
    with pytest.raises(
        KeyError, match=rf"wgrad_key={linear.wgrad_key} has no fp32 accumulator.*wgrad_accumulators"
    ):
        out.backward(torch.ones_like(out))
    assert torch.all(buffer == 0)
    x = torch.empty(4, 256, dtype=torch.bfloat16, device="meta")
    w = torch.empty(384, 256, dtype=torch.bfloat16, device="meta")
    g = torch.empty(4, 384, dtype=torch.bfloat16, device="meta")
    with pytest.raises(KeyError, match="migration.md"):
        OPS.fp8_blockwise_mm_backward(g, x, w, 128, False, True, linear.wgrad_key)
    # The data gradient alone needs no accumulator.
    OPS.fp8_blockwise_mm_backward(g, x, w, 128, True, False, linear.wgrad_key)


def _per_token_cast(t):
    """The activation cast prime-rl's producers store (``clamped_swiglu_fp8``): 1x128 blocks,
    scale amax / 448, float8_e4m3fn, scales transposed to [K / 128, tokens padded to 4]."""
    rows, cols = t.shape
    blocks = t.float().view(rows, cols // 128, 128)
    scale = blocks.abs().amax(-1).clamp(min=1e-12) / 448.0
    q = (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, cols)
    sf = torch.zeros(cols // 128, (rows + 3) // 4 * 4)
    sf[:, :rows] = scale.T
    return q, sf


def test_fp8_clamped_swiglu_mlp_hands_over_its_cast():
    """``fp8_clamped_swiglu_mlp``: ``_fp8_blockwise_mm(h, down_proj.weight, block_size,
    wgrad_key, h_fp8, h_sf)``; the forward multiplies the given cast, the backward reads ``h``."""
    gen = _gen(2)
    h = torch.randn(6, 256, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(128, 256, generator=gen) / 16).bfloat16().requires_grad_()
    h_fp8, h_sf = _per_token_cast(h.detach() * 1.5)  # a cast of other values: it must be used
    out = OPS.fp8_blockwise_mm(h, weight, 128, 0, h_fp8, h_sf)
    given = h_fp8.double() * h_sf[:, :6].T.double().repeat_interleave(128, 1)
    w_blocks = weight.detach().double().view(1, 128, 2, 128)
    w_scale = (w_blocks.abs().amax((1, 3), keepdim=True).float() / 448.0).double()
    w_q = (w_blocks / w_scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * w_scale
    ref = given @ w_q.view(128, 256).T
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-3)
    grad = torch.randn(out.shape, generator=gen).bfloat16()
    out.backward(grad)
    h2 = h.detach().requires_grad_()
    OPS.fp8_blockwise_mm(h2, weight.detach(), 128, 0).backward(grad)
    assert torch.equal(h.grad, h2.grad)


class _FP8GateUpClampedSwiglu(torch.autograd.Function):
    """prime-rl's autograd.Function of its fused FP8 MLP (fp8_linear.py), which stays prime-rl's:
    ``fp8_gate_up_mm`` then ``fp8_clamped_swiglu`` forward, ``fp8_gate_up_clamped_swiglu_backward``
    backward with ``needs_grad_gate or needs_grad_up`` and both modules' ``wgrad_key``s."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, limit, block_size, gate_key, up_key):
        gate_up = OPS.fp8_gate_up_mm(x, gate_weight, up_weight, block_size)
        h, h_fp8, h_sf = OPS.fp8_clamped_swiglu(gate_up, limit)
        ctx.save_for_backward(x, gate_weight, up_weight, gate_up)
        ctx.limit, ctx.block_size, ctx.keys = limit, block_size, (gate_key, up_key)
        ctx.mark_non_differentiable(h_fp8, h_sf)
        return h, h_fp8, h_sf

    @staticmethod
    def backward(ctx, grad_h, _grad_h_fp8, _grad_h_sf):
        x, gate_weight, up_weight, gate_up = ctx.saved_tensors
        needs_x, needs_gate, needs_up = ctx.needs_input_grad[:3]
        grad_x, grad_gate, grad_up = OPS.fp8_gate_up_clamped_swiglu_backward(
            grad_h, x, gate_weight, up_weight, gate_up, ctx.limit, ctx.block_size,
            needs_x, needs_gate or needs_up, *ctx.keys,
        )  # fmt: skip
        keep_gate, keep_up = (k not in fp8.wgrad_accumulators for k in ctx.keys)
        return (
            grad_x if needs_x else None,
            grad_gate if needs_gate and keep_gate else None,
            grad_up if needs_up and keep_up else None,
            *[None] * 4,
        )


def _mlp_case(seed=5):
    gen = _gen(seed)
    x = torch.randn(2, 3, 256, generator=gen).bfloat16()
    gate, up = ((torch.randn(256, 256, generator=gen) / 8).bfloat16() for _ in range(2))
    down = (torch.randn(128, 256, generator=gen) / 8).bfloat16()
    grad = torch.randn(2, 3, 128, generator=gen).bfloat16()
    return x, gate, up, down, grad


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def test_fused_clamped_swiglu_mlp_is_the_unfused_mlp():
    """``fp8_clamped_swiglu_mlp``: one gate/up GEMM, the fused SwiGLU with its cast handed to the
    down projection, the fused backward; bitwise the three fp8_blockwise_mm projections with
    the eager bf16 clamped SwiGLU between them, forward and every gradient."""
    limit = 1.5  # small enough that both clamps bite
    x, gate, up, down, grad = _mlp_case()
    fx, fg, fu, fd = _leaves(x, gate, up, down)
    h, h_fp8, h_sf = _FP8GateUpClampedSwiglu.apply(fx.flatten(0, 1), fg, fu, limit, 128, 0, 0)
    fused = OPS.fp8_blockwise_mm(h, fd, 128, 0, h_fp8, h_sf).view(2, 3, 128)
    fused.backward(grad)
    ux, ug, uu, ud = _leaves(x, gate, up, down)
    gate_out, up_out = OPS.fp8_blockwise_mm(ux, ug, 128), OPS.fp8_blockwise_mm(ux, uu, 128)
    hidden = torch.nn.functional.silu(gate_out.clamp(max=limit)) * up_out.clamp(-limit, limit)
    unfused = OPS.fp8_blockwise_mm(hidden, ud, 128)
    unfused.backward(grad)
    assert torch.equal(fused, unfused)
    for a, b in ((fx, ux), (fg, ug), (fu, uu), (fd, ud)):
        assert a.grad.dtype == torch.bfloat16 and torch.equal(a.grad, b.grad)


def test_fused_mlp_accumulates_each_weight_under_its_key():
    """With ``accumulate_wgrad_fp32`` on gate_proj and up_proj, their gradients land in the fp32
    buffers (the same products as the bf16 gradients, unrounded) and the weights get none."""
    x, gate, up, _, _ = _mlp_case(seed=6)
    grad_h = torch.randn(6, 256, generator=_gen(7)).bfloat16()
    fx, fg, fu = _leaves(x.flatten(0, 1), gate, up)
    _FP8GateUpClampedSwiglu.apply(fx, fg, fu, 2.0, 128, 0, 0)[0].backward(grad_h)
    buffers = {"gate": torch.zeros(gate.shape), "up": torch.zeros(up.shape)}
    keys = {name: id(buf) for name, buf in buffers.items()}
    for name, buf in buffers.items():
        fp8.accumulate_wgrad_fp32(keys[name], lambda b=buf: b)
    try:
        ax, ag, au = _leaves(x.flatten(0, 1), gate, up)
        h = _FP8GateUpClampedSwiglu.apply(ax, ag, au, 2.0, 128, keys["gate"], keys["up"])[0]
        h.backward(grad_h)
    finally:
        for key in keys.values():
            fp8.accumulate_wgrad_fp32(key, None)
    assert ag.grad is None and au.grad is None and torch.equal(ax.grad, fx.grad)
    assert torch.equal(buffers["gate"].bfloat16(), fg.grad)
    assert torch.equal(buffers["up"].bfloat16(), fu.grad)


@pytest.mark.slow
def test_compiled_fullgraph_matches_eager():
    """prime-rl compiles its decoder layers: the op traces whole, forward and backward."""
    x, weight = _linear_case()
    grad = torch.randn(2, 3, 384, generator=_gen(1)).bfloat16()

    def layer(x, weight):
        return torch.relu(OPS.fp8_blockwise_mm(x, weight, 128, 0))

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x, weight)
    out.backward(grad)
    grads = x.grad, weight.grad
    x.grad = weight.grad = None
    eager = layer(x, weight)
    eager.backward(grad)
    assert torch.equal(out, eager)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], weight.grad)


# --- fp8_grouped_gemm.py ------------------------------------------------------------------------


def test_grouped_fp8_gemm_is_grouped_mm():
    """``grouped_fp8_gemm(x, weight, offs)``: ``x [M, K]``, ``weight [G, K, N]``, int32
    cumulative ``offs``, as ``torch._grouped_mm`` takes them; an empty group included."""
    gen = _gen(3)
    counts = (3, 0, 5)
    x = torch.randn(sum(counts), 128, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(3, 128, 256, generator=gen) / 8).bfloat16().requires_grad_()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = OPS.grouped_fp8_gemm(x, weight, offs)
    assert out.shape == (8, 256) and out.dtype == torch.bfloat16
    xd, wd = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    groups = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
    exact = torch.einsum("mk,mkn->mn", xd, wd[groups])
    assert _relative_error(out, exact) < 0.05
    grad = torch.randn(out.shape, generator=gen).bfloat16()
    out.backward(grad)
    exact.backward(grad.double())
    assert _relative_error(x.grad, xd.grad) < 0.05
    nonempty = [0, 2]
    assert _relative_error(weight.grad[nonempty], wd.grad[nonempty]) < 0.05
    assert torch.all(weight.grad[1] == 0)


# --- the MoE layer: routing telemetry ----------------------------------------------------------


def _router_outputs(gen, tokens=10, experts=4, top_k=2):
    scores = torch.rand(tokens, experts, generator=gen).softmax(-1)
    top_scores, selected = torch.topk(scores, top_k)
    counts = torch.histc(selected.reshape(-1).float(), bins=experts, min=0, max=experts)
    return top_scores.sum(), counts.to(torch.int64), selected


def test_moe_forward_records_routing_statistics():
    """``MoE.forward``: under ``torch.no_grad()``, ``record_moe_routing_statistics(
    self.tokens_per_expert, self.routing_confidence_sum, num_tokens_per_expert,
    routing_confidence_sum)`` with fp32 buffers and int64 ``histc`` counts; eager and compiled
    (fullgraph) each count once per call."""
    tokens_per_expert = torch.zeros(4, dtype=torch.float32)
    routing_confidence_sum = torch.tensor(0.0, dtype=torch.float32)

    def record(confidence, counts):
        with torch.no_grad():
            OPS.record_moe_routing_statistics(
                tokens_per_expert, routing_confidence_sum, counts, confidence
            )

    compiled = torch.compile(record, fullgraph=True, backend="aot_eager")
    gen = _gen(4)
    expected_counts, expected_sum = torch.zeros(4, dtype=torch.float64), 0.0
    for step in range(4):
        confidence, counts, selected = _router_outputs(gen)
        (record if step % 2 else compiled)(confidence, counts)
        expected_counts += torch.bincount(selected.flatten(), minlength=4).double()
        expected_sum += confidence.item()
    assert torch.equal(tokens_per_expert.double(), expected_counts)
    assert abs(routing_confidence_sum.item() - expected_sum) < 1e-5
