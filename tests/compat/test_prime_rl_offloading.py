"""prime-rl's activation offloading (``[trainer.model.ac_offloading]``), run against prime_ac.

prime-rl (src/prime_rl/utils/act_offloading.py, torchtune's ``OffloadActivations`` with its
streams turned off) enters a saved-tensor-hooks context around each micro-batch's forward in
its trainers' loops, computes the loss outside it and calls backward:

    with maybe_activation_offloading(config.model.ac_offloading):
        logits = forward(model, input_ids, position_ids)
    loss = compute_loss(logits, ...)
    loss.backward()

and its reward-model loop runs two forwards (chosen, rejected), each in its own context, before
one backward. prime_ac reads both tables with ``ACConfig.from_dict`` and ``config.input_offload()``
is the context. The tables come from prime-rl's configs (tests/compat/prime_rl_ac_tables.py: the
``{freq = 1}`` most of them write); the ``[trainer.model.ac_offloading]`` table is empty there
(prime-rl's defaults, ``pin_memory = true``, ``max_inflight_activations = 5``). Each run is
compared bitwise with the same model without AC and without offload.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac import ACConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ac_models import assert_bitwise_equal, grads  # noqa: E402
from prime_rl_ac_tables import TABLES  # noqa: E402

VOCAB, DIM, TOKENS = 64, 32, 24
# the [trainer.model.ac] table of most of prime-rl's configs and examples
FREQ_1 = next(entry for entry in TABLES if entry["table"] == {"freq": 1})["table"]


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.gate_up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, hidden):
        gate, up = self.gate_up(self.norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down(nn.functional.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(3))
        self.norm = nn.RMSNorm(DIM)


class CausalLM(nn.Module):
    """The shape of an HF causal LM: model.embed_tokens, model.layers.N, model.norm, lm_head."""

    def __init__(self):
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden)
        return self.lm_head(self.model.norm(hidden))


def _loss(logits, input_ids):  # outside the offload, as prime-rl's loss
    logprobs = logits[:, :-1].float().log_softmax(-1)
    return -logprobs.gather(-1, input_ids[:, 1:, None]).mean()


def _micro_batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, TOKENS), generator=generator) for _ in range(n)]


@pytest.fixture
def base():
    torch.manual_seed(0)
    return CausalLM()


def _config(table: dict) -> ACConfig:
    config = ACConfig.from_dict(table)
    assert config.mode == "full" and config.freq == 1
    return config


def _tables() -> dict[str, dict]:
    # prime-rl's configs write an empty [trainer.model.ac_offloading]: its defaults
    return {
        "nested": {**FREQ_1, "ac_offloading": {}},
        "defaults written out": {
            **FREQ_1,
            "ac_offloading": {"pin_memory": True, "max_inflight_activations": 5},
        },
    }


@pytest.mark.parametrize("form", list(_tables()))
def test_prime_rls_micro_batch_loop_offloads_each_block_input(base, form):
    batches = _micro_batches(3)
    reference = copy.deepcopy(base)
    for input_ids in batches:
        _loss(reference(input_ids), input_ids).backward()

    model = copy.deepcopy(base)
    config = _config(_tables()[form])
    assert prime_ac.checkpoint_blocks(model, config=config) == [
        f"model.layers.{i}" for i in range(3)
    ]
    offload = config.input_offload()
    assert offload.pin_memory is True and offload.max_inflight == 5
    inputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach().clone()))
        for layer in model.model.layers
    ]
    for step, input_ids in enumerate(batches):
        inputs.clear()
        with offload:
            logits = model(input_ids)
        host = [h for h, _ in offload._saved]
        # each block's input went to the host (and what the final norm and lm_head save)
        for i, x in enumerate(inputs):
            assert any(h.shape == x.shape and torch.equal(h, x) for h in host), (step, i)
        assert offload.ledger.host >= len(inputs) * inputs[0].numel() * 4
        loss = _loss(logits, input_ids)
        loss.backward()
        del logits, loss
        assert offload.ledger.host == 0
    for hook in hooks:
        hook.remove()
    assert_bitwise_equal(grads(model), grads(reference))
    per_step = offload.ledger.offloaded // 3
    assert per_step >= 3 and offload.ledger.offloaded == 3 * per_step
    assert offload.buffer_allocations == per_step  # steps 2 and 3 drew from the pool


def test_prime_rls_reward_model_loop_two_forwards_then_one_backward(base):
    """prime-rl's reward-model trainer: chosen and rejected forwards, each under the offload,
    then one backward of both."""
    chosen, rejected = _micro_batches(2)
    reference = copy.deepcopy(base)
    (reference(chosen).mean() - reference(rejected).mean()).backward()
    model = copy.deepcopy(base)
    config = _config(_tables()["nested"])
    prime_ac.checkpoint_blocks(model, config=config)
    offload = config.input_offload()
    for _ in range(2):
        model.zero_grad()
        with offload:
            chosen_scores = model(chosen)
        with offload:
            rejected_scores = model(rejected)
        (chosen_scores.mean() - rejected_scores.mean()).backward()
        del chosen_scores, rejected_scores
        assert_bitwise_equal(grads(model), grads(reference))
        assert offload.ledger.host == 0


def test_the_offloading_table_alone_and_the_ac_table_alone():
    alone = ACConfig.from_dict({"pin_memory": True, "max_inflight_activations": 5})
    assert alone.input_offload() is not None
    assert _config(FREQ_1).input_offload() is None  # no [trainer.model.ac_offloading]
