"""prime_ac for Hugging Face models and trainers (transformers, peft, TRL).

A transformers model has checkpointing of its own (``activation_checkpointing_enable()``, the
``gradient_checkpointing=True`` of ``TrainingArguments``, on by default in TRL's ``SFTConfig``).
Under prime_ac it would checkpoint each block a second time (transformers 4.x nests its region
around prime_ac's: every operator replays twice; 5.x stands down while its flag stays on, and
prime_ac's audit would measure its checkpointing as no AC). :func:`checkpoint_hf_model` turns it
off, turns the KV cache off for training and then checkpoints the blocks; when something turns
it on afterwards (a ``Trainer``'s ``train()``), the model's next forward turns it off again,
saying so. :data:`PrimeACCallback` does the same inside a ``Trainer`` at ``on_train_begin``.

transformers is imported only when ``PrimeACCallback`` is first looked up.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import weakref
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from prime_ac import ACConfig, checkpoint_blocks

__all__ = ["PrimeACCallback", "checkpoint_hf_model", "hf_checkpointing_off"]  # noqa: F822 (module __getattr__)

logger = logging.getLogger("prime_ac")


def hf_checkpointing_off(model: nn.Module) -> bool:
    """Turn a transformers model's own activation checkpointing off; True if it was on.

    Uses ``activation_checkpointing_disable`` (transformers 5), else
    ``gradient_checkpointing_disable`` (4.x). A peft model forwards both to its base model.
    """
    for is_on, turn_off in (
        ("is_activation_checkpointing", "activation_checkpointing_disable"),
        ("is_gradient_checkpointing", "gradient_checkpointing_disable"),
    ):
        if hasattr(type(_base(model)), is_on):
            if not getattr(model, is_on):
                return False
            getattr(model, turn_off)()
            return True
    return False


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (whose attributes forward to it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def checkpoint_hf_model(model: nn.Module, **checkpoint_blocks_kwargs: Any) -> list[str]:
    """:func:`prime_ac.checkpoint_blocks` for a transformers (or peft) model.

    Turns the model's own checkpointing off first (logged when it was on), sets
    ``model.config.use_cache = False`` (a training forward needs no KV cache), then wraps the
    blocks; keyword arguments go to ``checkpoint_blocks``. Returns the wrapped blocks' names.
    Hugging Face checkpointing turned on later (a ``Trainer`` does so in ``train()`` for
    ``gradient_checkpointing=True``, TRL's default) is turned off again by the model's next
    forward, with a warning, for as long as prime_ac checkpoints these blocks.

    Example::

        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, vocab_size=128))
        checkpoint_hf_model(model, mode="selective")  # ['model.layers.0', 'model.layers.1']
    """
    if hf_checkpointing_off(model):
        logger.warning(
            "prime_ac: %s had Hugging Face activation checkpointing on; turned it off "
            "(model.activation_checkpointing_disable()) so that blocks are not checkpointed "
            "twice (in a Trainer's arguments: gradient_checkpointing=False)",
            type(model).__name__,
        )
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    blocks = checkpoint_blocks(model, **checkpoint_blocks_kwargs)
    _keep_hf_checkpointing_off(model, blocks)
    return blocks


# the forward pre-hook of each model checkpoint_hf_model wrapped, replaced when it runs again
_guards: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _keep_hf_checkpointing_off(model: nn.Module, blocks: list[str]) -> None:
    """Before each forward, while ``blocks`` are still prime_ac's (their class unchanged since
    wrapping), turn Hugging Face checkpointing off if something turned it on: a flag read per
    module that has one, nothing more, unless it is on."""
    previous = _guards.pop(model, None)
    if previous is not None:
        previous.remove()
    if not blocks:
        return
    wrapped = [(block, type(block)) for block in map(model.get_submodule, blocks)]
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]

    def turn_off_again(module: nn.Module, args: Any) -> None:
        if any(m.gradient_checkpointing is True for m in flagged) and all(
            type(block) is cls for block, cls in wrapped
        ):
            _turned_off_again(model)

    _guards[model] = model.register_forward_pre_hook(turn_off_again)


@torch.compiler.disable  # a one-time change of module flags, outside any compiled graph
def _turned_off_again(model: nn.Module) -> None:
    if hf_checkpointing_off(model):
        logger.warning(
            "prime_ac: Hugging Face activation checkpointing was turned on after "
            "checkpoint_hf_model (a Trainer does so in train() for gradient_checkpointing=True, "
            "TRL's SFTConfig default), which checkpoints the blocks a second time; turned it off "
            "again. Set gradient_checkpointing=False in the training arguments to skip this."
        )


def _checked(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint_blocks``' keyword arguments, checked now: a misspelt name or a bad setting
    raises where the callback is built, not when training begins."""
    parameters = inspect.signature(checkpoint_blocks).parameters
    for name in kwargs:
        if name not in parameters or name == "model":
            close = difflib.get_close_matches(name, list(parameters), n=1)
            raise TypeError(
                f"PrimeACCallback({name}=...): checkpoint_blocks has no argument {name!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; it takes {sorted(set(parameters) - {'model'})}"
            )
    config = kwargs.get("config")
    settings = {
        f.name: kwargs[f.name]
        for f in fields(ACConfig)
        if f.name in parameters and kwargs.get(f.name) is not None
    }
    if config is None:
        ACConfig(**settings)  # raises, naming the bad value, as checkpoint_blocks would
    elif not isinstance(config, ACConfig):
        raise TypeError(f"PrimeACCallback(config=...) takes a prime_ac.ACConfig, got {config!r}")
    elif settings:
        raise ValueError(
            f"PrimeACCallback: pass {sorted(settings)} either as arguments or in config=, not both"
        )
    return kwargs


@functools.cache  # one class, built on first lookup: it subclasses transformers'
def _callback_class() -> type:
    from transformers import TrainerCallback

    class PrimeACCallback(TrainerCallback):
        """A ``transformers.TrainerCallback`` that checkpoints the trained model with prime_ac.

        At ``on_train_begin`` (after the trainer turned its own checkpointing on, before the
        first step) it turns Hugging Face checkpointing off and calls
        :func:`checkpoint_hf_model` with the keyword arguments given here. When the
        arguments asked for Hugging Face checkpointing (``gradient_checkpointing=True``,
        TRL's default) it says so once: set it to False in the config.

        Example::

            trainer = SFTTrainer(model=model, args=SFTConfig(gradient_checkpointing=False),
                                 train_dataset=data,
                                 callbacks=[PrimeACCallback(mode="selective")])
        """

        def __init__(self, **checkpoint_blocks_kwargs: Any) -> None:
            self.kwargs = _checked(checkpoint_blocks_kwargs)
            self.blocks: list[str] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is None:
                raise ValueError(
                    "PrimeACCallback.on_train_begin got no model= from the trainer: call "
                    "prime_ac.integrations.hf.checkpoint_hf_model(model) before training instead"
                )
            if hf_checkpointing_off(model):
                logger.warning(
                    "prime_ac: Hugging Face activation checkpointing was on (the trainer turns it "
                    "on for gradient_checkpointing=True, TRL's SFTConfig default); "
                    "PrimeACCallback turned it off and checkpoints with prime_ac instead. Set "
                    "gradient_checkpointing=False in the training arguments to skip this."
                )
            self.blocks = checkpoint_hf_model(model, **self.kwargs)
            return control

    return PrimeACCallback


def __getattr__(name: str) -> Any:
    if name == "PrimeACCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
