"""End to end: a tiny MoE transformer trained on 2 gloo ranks against one unwrapped process.

The model is built only from the library's pieces: per block, RMSNorm, a fused qkv projection,
causal packed-sequence attention through ``prime_rl_attn`` (``varlen_attention`` with the
``sdpa`` backend, or ``ring_attention`` over the ranks), an output projection, RMSNorm and the
reference expert-parallel MoE (``prime_ops.expert_parallel``: routing, ``prime_rl_collectives``
all-to-alls, routing telemetry through ``prime_rl::record_moe_routing_statistics``). Dimensions:
dim 32, 2 heads, 2 blocks, 4 experts (top 2), vocabulary 64.

Layouts (both on the same 2 ranks; each is one ``run_distributed`` call):

- ``dp_ep``: data parallel + expert parallel. Each rank holds its own packed batch (rank 0:
  sequences of 5, 11, 3 and 13 tokens; rank 1: 7, 9 and 8), attends with ``varlen_attention``
  over its own ``cu_seqlens``, and owns 2 of the 4 experts of every block.
- ``cp_ep``: context parallel + expert parallel. One packed batch of the same 7 sequences
  (56 tokens) is split into two contiguous 28-token shards (the 13-token sequence crosses the
  border); ``ring_attention`` runs over both ranks; experts are sharded as above.

In both, FSDP2 ``fully_shard`` (per block, then the root) shards every parameter except the
experts over a 1-D CPU device mesh of the 2 ranks; the experts are already split by EP, so they
are ``ignored_params`` and their gradients arrive complete through the all-to-all backward.
Each rank's loss is its tokens' summed cross entropy divided by the global token count, so the
ranks' losses add up to the reference's mean and FSDP sums gradients (divide factor 1,
sum-only reductions: gloo has no PREMUL_SUM/AVG). The reference is the same model with every
expert local and plain ``varlen_attention``, built from the same seed in the same child process
and trained on the whole batch.

Per layout three stages run, each one test on a fresh pair of ranks (so that pytest-xdist spreads
them over the cores), each mode on a fresh model for three SGD steps (momentum 0.9), applied in
the order AC, then compile, then FSDP:

- ``eager``: no AC (the stage's baseline), then ``mode="full"``, ``mode="selective"`` (default
  targets) and ``targets="auto"`` (``budget=0.5``, profiled on the first batch; its profile
  step's routing counts are reset);
- ``aot_eager``: no AC (the stage's baseline), then one AC mode (dp_ep: full, cp_ep: selective),
  with ``block.compile(fullgraph=True, backend="aot_eager")`` per block (names unchanged), then
  FSDP: the Dynamo capture (a graph break raises), AOTAutograd and the partitioner obeying the
  checkpoint tags, without code generation;
- ``inductor``: the other AC mode (dp_ep: selective, cp_ep: full), compiled with Inductor.
  Inductor's C++ builds are what costs time, so each layout compiles one mode with it.

``targets="auto"`` stays eager: its plan names eager operator calls, and per-block compile
reuses one graph for both blocks (same code, guards pass), so block 1 would run with block 0's
plan.

Checked after every step: the summed loss, every gradient and every updated parameter (sharded
ones gathered with ``full_tensor()``; experts against this rank's slice of the reference), and
the routing counters summed over ranks, exactly (each forward counts once: a counter replayed by
recompute would double). Per rank and step, the number of all-to-all exchanges and of attention
forward kernel calls must be what the mode implies (full AC replays each block's forward
exchanges and attention once; selective keeps both), which shows each AC mode really takes
effect under FSDP and compile. Compiled modes must leave ``counters["graph_break"]`` empty.
A replay mismatch would raise ``prime_ac.ReplayMismatchError`` and fail the run.

Tolerances. Against the single-process reference: ``atol=1e-6, rtol=1e-5`` (fp32). The
distributed runs add the same terms in another order - FSDP's reduce-scatter sums the two ranks'
gradient contributions that the reference gets from one matmul over the whole batch, the losses
are summed per rank, the ring merges attention partials through their log-sum-exp, Inductor
fuses and reorders reductions - so values differ in the last bits: observed after three steps,
at most ~3e-8 on gradients, ~2.4e-7 on parameters, ~8e-6 on the confidence sums (values ~1e2),
about 3% of the allowed difference. Any real error (a lost or doubled gradient contribution, a
wrong expert slice, a forward counted twice) is orders of magnitude larger. Against the
stage's no-AC baseline, run under the same conditions (eager against eager, ``aot_eager``
against ``aot_eager``), every AC mode is bitwise equal (losses, gradients, parameters,
counters), and the test asserts that; the Inductor runs are compared with the tolerance alone.

Runtime, measured on 2 quiet cores with a cold Inductor cache: the Inductor stages 24 s (dp_ep)
and 14 s (cp_ep), the others under 12 s each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops.attn import ring_attention, varlen_attention
from prime_ops.expert_parallel import ExpertParallelMoE
from tests.dist_utils import run_distributed

DIM, HEADS, HIDDEN, EXPERTS, TOP_K, VOCAB, BLOCKS = 32, 2, 64, 4, 2, 64, 2
STEPS, LR, MOMENTUM = 3, 0.5, 0.9
LENGTHS = ([5, 11, 3, 13], [7, 9, 8])  # the dp_ep layout's per-rank batches; cp_ep packs all
TOL = dict(atol=1e-6, rtol=1e-5)
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class Block(nn.Module):
    def __init__(self, ep_group, cp_group):
        super().__init__()
        self.cp_group = cp_group
        self.attn_norm = nn.RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.moe_norm = nn.RMSNorm(DIM)
        self.moe = ExpertParallelMoE(DIM, HIDDEN, EXPERTS, TOP_K, ep_group=ep_group)

    def forward(self, x, cu_seqlens, max_seqlen: int):
        tokens = x.shape[0]
        qkv = self.qkv(self.attn_norm(x)).view(tokens, 3, HEADS, DIM // HEADS)
        q, k, v = (t.contiguous() for t in qkv.unbind(1))
        if self.cp_group is None:
            out, _ = varlen_attention(
                q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True
            )
        else:
            out, _ = ring_attention(
                q, k, v, cu_seqlens, max_seqlen, group=self.cp_group, causal=True
            )
        x = x + self.proj(out.reshape(tokens, DIM))
        return x + self.moe(self.moe_norm(x))


class Model(nn.Module):
    def __init__(self, ep_group=None, cp_group=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(ep_group, cp_group) for _ in range(BLOCKS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, targets, cu_seqlens, max_seqlen: int, total_tokens: int):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cu_seqlens, max_seqlen)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits, targets, reduction="sum") / total_tokens


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _batches(layout, rank, world):
    """Per step: the whole batch (reference) and this rank's part, as model arguments."""
    lengths = [n for part in LENGTHS for n in part]
    total = sum(lengths)
    if layout == "dp_ep":
        start = sum(LENGTHS[0]) if rank == 1 else 0
        mine = slice(start, start + sum(LENGTHS[rank]))
        local_cu, local_max = _cu(LENGTHS[rank]), max(LENGTHS[rank])
    else:  # cp_ep: equal contiguous shards, every rank sees the whole batch's cu_seqlens
        shard = total // world
        mine = slice(rank * shard, (rank + 1) * shard)
        local_cu, local_max = _cu(lengths), max(lengths)
    steps = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        tokens, targets = torch.randint(0, VOCAB, (2, total), generator=gen)
        full = (tokens, targets, _cu(lengths), max(lengths), total)
        local = (tokens[mine], targets[mine], local_cu, local_max, total)
        steps.append((full, local))
    return steps


def _optimizer(model):
    # foreach=False: the parameter list mixes FSDP's DTensors with the plain expert tensors.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)


def _stats(model):
    return [
        (b.moe.tokens_per_expert.clone(), b.moe.routing_confidence_sum.clone())
        for b in model.layers
    ]


def _reference(batches):
    """Loss, gradients, updated parameters and routing counters per step, on one process."""
    torch.manual_seed(0)
    model = Model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = _optimizer(model)
    record = []
    for full, _ in batches:
        opt.zero_grad()
        loss = model(*full)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        record.append((loss.detach(), grads, params, _stats(model)))
    return init, record


def _local_experts(model, name):
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    return slice(owner.local_experts.start, owner.local_experts.stop)


def _is_expert(name):
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def _gathered(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class _Counters:
    """Counts this rank's all-to-all exchanges and attention-forward kernel calls (installed in
    the child process only: it replaces ``dist.all_to_all_single``, which the
    ``prime_rl_collectives`` kernels call, and the sdpa entry of the attention registry, which
    both ``varlen_attention`` and every ring step look up when they run)."""

    def __init__(self):
        from prime_ops.attn import varlen

        self.exchanges = self.attention = 0
        real_all_to_all, spec = dist.all_to_all_single, varlen.BACKENDS["sdpa"]

        def all_to_all(*args, **kwargs):
            self.exchanges += 1
            return real_all_to_all(*args, **kwargs)

        def attention_forward(*args):
            self.attention += 1
            return spec.forward(*args)

        dist.all_to_all_single = all_to_all
        varlen.BACKENDS["sdpa"] = dataclasses.replace(spec, forward=attention_forward)


def _expected_counts(layout, mode, rank):
    """Exchanges and attention forwards per step on this rank. Per block and forward: 3
    exchanges (counts, rows out, rows back) and 2 in backward; the attention kernel runs once
    (dp_ep) or once per ring step that computes (cp_ep, causal: rank r attends to r + 1 shards).
    Full AC replays each block's forward once in backward; selective keeps the collectives and
    the attention (default targets), so it replays neither."""
    forwards = 2 if mode == "full" else 1
    ring_steps = rank + 1 if layout == "cp_ep" else 1
    return BLOCKS * (3 * forwards + 2), BLOCKS * forwards * ring_steps


def _train(rank, world, layout, mode, backend, batches, init, reference, baseline, counters):
    from torch._dynamo.utils import counters as dynamo_counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import prime_ac

    where = f"layout={layout} mode={mode} compile={backend} rank={rank}"
    group = dist.group.WORLD
    model = Model(ep_group=group, cp_group=group if layout == "cp_ep" else None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name][_local_experts(model, name)] if _is_expert(name) else init[name])
    names = [name for name, _ in model.named_parameters()]

    # 1. activation checkpointing
    if mode == "auto":
        first_batch = batches[0][1]
        wrapped = prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, profile=lambda m: m(*first_batch)
        )
        assert all(model.get_submodule(n)._prime_ac.plan is not None for n in wrapped), where
        for block in model.layers:  # the profile step counted routing: start from zero
            block.moe.tokens_per_expert.zero_()
            block.moe.routing_confidence_sum.zero_()
    elif mode is not None:
        wrapped = prime_ac.checkpoint_blocks(model, mode=mode)
    if mode is not None:
        assert wrapped == [f"layers.{i}" for i in range(BLOCKS)], where
    # 2. per-block compile (the module keeps its name: no _orig_mod)
    if backend is not None:
        torch._dynamo.reset()
        dynamo_counters.clear()
        for block in model.layers:
            block.compile(fullgraph=True, backend=backend)
    # 3. FSDP2, per block then root; experts are EP-sharded already
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        experts = {getattr(block.moe, w) for w in EXPERT_WEIGHTS}
        fully_shard(block, mesh=mesh, ignored_params=experts)
    fully_shard(model, mesh=mesh)
    for module in (*model.layers, model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    assert [name for name, _ in model.named_parameters()] == names, where

    opt = _optimizer(model)
    want_exchanges, want_attention = _expected_counts(layout, mode, rank)
    record = []
    for step, (_, local) in enumerate(batches):
        at = f"{where} step={step}"
        opt.zero_grad()
        counters.exchanges = counters.attention = 0
        loss = model(*local)
        loss.backward()
        if mode != "auto":  # the budget plan decides per call what auto replays
            got = (counters.exchanges, counters.attention)
            assert got == (want_exchanges, want_attention), (at, got)
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {name: _gathered(p.grad).clone() for name, p in model.named_parameters()}
        opt.step()
        params = {name: _gathered(p.detach()).clone() for name, p in model.named_parameters()}
        stats = []
        for tokens, conf in _stats(model):
            dist.all_reduce(tokens)
            dist.all_reduce(conf)
            stats.append((tokens, conf))
        record.append((total, grads, params, stats))

    if backend is not None:
        assert not dynamo_counters["graph_break"], (where, dict(dynamo_counters["graph_break"]))
        # Dynamo captured the blocks (one graph may serve both: same code, guards pass).
        assert dynamo_counters["stats"]["unique_graphs"] >= 1, (where, dynamo_counters["stats"])
    _compare(model, record, reference, where, close=True)
    if baseline is not None:
        _compare(model, record, baseline, where + " against no AC", close=False)
    return record


def _compare(model, record, reference, where, close):
    """Per step: summed loss, gradients, updated parameters (experts: this rank's slice of the
    reference's) and the routing counters summed over ranks. ``close=False``: bitwise."""

    def check(got, want, what):
        if close:
            torch.testing.assert_close(got, want, **TOL, msg=lambda text: f"{what}: {text}")
        else:
            assert torch.equal(got, want), (what, (got - want).abs().max())

    for step, (ours, theirs) in enumerate(zip(record, reference, strict=True)):
        at = f"{where} step={step}"
        (loss, grads, params, stats), (ref_loss, ref_grads, ref_params, ref_stats) = ours, theirs
        check(loss, ref_loss, f"loss {at}")
        for name in grads:
            # The reference holds every expert; a distributed record only this rank's.
            sliced = _is_expert(name) and len(ref_grads[name]) == EXPERTS
            mine = _local_experts(model, name) if sliced else slice(None)
            check(grads[name], ref_grads[name][mine], f"grad {name} {at}")
            check(params[name], ref_params[name][mine], f"{name} {at}")
        for block, ((tokens, conf), (ref_tokens, ref_conf)) in enumerate(
            zip(stats, ref_stats, strict=True)
        ):
            # Whole tokens: a forward counted twice (a replayed counter) cannot pass this.
            assert torch.equal(tokens, ref_tokens), (f"tokens_per_expert {block} {at}", tokens)
            check(conf, ref_conf, f"routing_confidence_sum {block} {at}")


# Per layout, three stages, each one test (one run_distributed call) so that xdist spreads them
# over the cores: (AC mode, compile backend or None for eager), in order. A stage's first run
# without AC, if it has one, is the baseline that its later runs must equal bitwise: eager AC
# against eager, aot_eager AC against aot_eager, like with like. See the module docstring.
STAGES = {
    "eager": {
        layout: [(None, None), ("full", None), ("selective", None), ("auto", None)]
        for layout in ("dp_ep", "cp_ep")
    },
    "aot_eager": {
        "dp_ep": [(None, "aot_eager"), ("full", "aot_eager")],
        "cp_ep": [(None, "aot_eager"), ("selective", "aot_eager")],
    },
    "inductor": {"dp_ep": [("selective", "inductor")], "cp_ep": [("full", "inductor")]},
}


def _body(rank, world, layout, stage):
    import torch._inductor.config

    counters = _Counters()
    batches = _batches(layout, rank, world)
    init, reference = _reference(batches)
    baseline = None  # the stage's run without AC: every later run of the stage equals it
    # Two compile workers: both ranks build the same kernels, and with one thread each the
    # second mostly waits for the first's (24 s instead of 35-38 s for the dp_ep stage, cold
    # cache). Dynamo runs with its defaults (no capture_scalar_outputs needed).
    with torch._inductor.config.patch(compile_threads=2):
        for mode, backend in STAGES[stage][layout]:
            record = _train(
                rank, world, layout, mode, backend, batches, init, reference, baseline, counters
            )
            if mode is None:
                baseline = record


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("layout", ["dp_ep", "cp_ep"])
def test_moe_transformer_trains_like_one_process(layout, stage):
    run_distributed(_body, 2, layout, stage, timeout=300)
