"""prime_ac.integrations.hf on transformers (and peft LoRA) models, against Hugging Face's own
activation checkpointing on the same model and batch."""

from __future__ import annotations

import functools
import logging

import pytest

pytest.importorskip("transformers")

import hf_models  # noqa: E402
from ac_compare import replayed, run, step  # noqa: E402

from prime_ac.integrations.hf import checkpoint_hf_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def test_hf_checkpointing_is_turned_off_and_said(caplog):
    model = hf_models.llama()
    hf_models.hf_checkpointing_on(model)
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        blocks = checkpoint_hf_model(model, mode="full")
    assert blocks == ["model.layers.0", "model.layers.1"]
    assert not model.is_activation_checkpointing
    assert model.config.use_cache is False
    assert "activation_checkpointing_disable()" in caplog.text
    assert "gradient_checkpointing=False" in caplog.text


def test_nothing_is_said_when_hf_checkpointing_was_off(caplog):
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        checkpoint_hf_model(hf_models.llama(), mode="full")
    assert "Hugging Face" not in caplog.text


@pytest.mark.parametrize("lora", [False, True], ids=["llama", "lora-llama"])
def test_full_holds_what_hf_checkpointing_holds(lora):
    if lora:
        pytest.importorskip("peft")
    build = functools.partial(hf_models.llama, lora)
    none = step(build(), hf_models.loss)
    own = run(build, hf_models.loss, hf_models.hf_checkpointing_on, none, "HF checkpointing")
    ours = run(
        build,
        hf_models.loss,
        lambda m: checkpoint_hf_model(m, mode="full"),
        none,
        "prime_ac full",
    )
    assert ours.held == own.held < none.held
    assert 0 < replayed(ours, none) <= replayed(own, none)


def test_hf_checkpointing_on_top_of_prime_ac_is_turned_off_again():
    """Turned on after prime_ac (as a trainer would), then checkpoint_hf_model again: one layer
    of checkpointing, the replay of prime_ac's alone."""
    build = hf_models.llama
    none = step(build(), hf_models.loss)
    once = run(build, hf_models.loss, lambda m: checkpoint_hf_model(m, mode="full"), none, "once")

    def twice(model):
        checkpoint_hf_model(model, mode="full")
        hf_models.hf_checkpointing_on(model)
        checkpoint_hf_model(model, mode="full")

    again = run(build, hf_models.loss, twice, none, "re-applied")
    assert (again.held, again.backward_flops) == (once.held, once.backward_flops)


def test_hf_checkpointing_turned_on_after_prime_ac_is_turned_off_and_said(caplog):
    """checkpoint_hf_model first, then what a Trainer's train() does for
    gradient_checkpointing=True: one layer, prime_ac's, from the next forward on."""
    build = hf_models.llama
    none = step(build(), hf_models.loss)
    once = run(build, hf_models.loss, lambda m: checkpoint_hf_model(m, mode="full"), none, "once")
    model = build()
    checkpoint_hf_model(model, mode="full")
    hf_models.hf_checkpointing_on(model)
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        after = step(model, hf_models.loss)
    assert not model.is_activation_checkpointing
    assert "gradient_checkpointing=False" in caplog.text
    assert (after.held, after.backward_flops) == (once.held, once.backward_flops)
    # said once: off now, the next forward says nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        step(model, hf_models.loss)
    assert "prime_ac" not in caplog.text


def test_hf_checkpointing_is_left_alone_once_prime_ac_unwrapped_the_blocks():
    import prime_ac

    model = hf_models.llama()
    checkpoint_hf_model(model, mode="full")
    prime_ac.unwrap_blocks(model)
    hf_models.hf_checkpointing_on(model)
    step(model, hf_models.loss)
    assert model.is_activation_checkpointing


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"mode": "fulll"}, ValueError, "mode='fulll' is not a checkpoint mode"),
        ({"modes": "full"}, TypeError, r"no argument 'modes' \(did you mean 'mode'\?\)"),
        ({"model": None}, TypeError, "no argument 'model'"),
        ({"targets": ["aten::mm"]}, ValueError, "has no effect with mode='full'"),
        ({"config": {"mode": "full"}}, TypeError, "takes a prime_ac.ACConfig"),
    ],
)
def test_the_callback_checks_its_arguments_when_built(kwargs, error, message):
    from prime_ac.integrations.hf import PrimeACCallback

    with pytest.raises(error, match=message):
        PrimeACCallback(**kwargs)
