"""PrimeACCallback inside TRL's SFTTrainer: two steps on an in-memory dataset.

TRL 1.16's SFTConfig turns Hugging Face checkpointing on by default and the Trainer applies it
before ``on_train_begin``, so the callback sees it on and must turn it off. The trained weights
(two AdamW steps) must be bitwise those of training without AC; memory is measured on the
trained models, whose weights are then the same, against TRL's own checkpointing.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("trl")

import hf_models  # noqa: E402
from ac_compare import replayed, step  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from prime_ac.integrations.hf import PrimeACCallback, checkpoint_hf_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

SDPA = [
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(hf_models.VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        pad_token="t0",
        eos_token="t1",
        unk_token="t0",
    )


def _data() -> Dataset:
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(2, hf_models.VOCAB, (48,), generator=g).tolist() for _ in range(4)]
    return Dataset.from_dict({"input_ids": rows})


def train(tmp_path, callbacks=(), prepare=None, **config) -> torch.nn.Module:
    """Two steps of SFTTrainer on a fresh model; ``prepare(model)`` runs before the trainer is
    built (the order docs recommend for FSDP and compile)."""
    model = hf_models.llama()
    if prepare is not None:
        prepare(model)
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        **config,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=_data(),
        processing_class=_tokenizer(),
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer.model


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    assert [n for n in pa if not torch.equal(pa[n], pb[n])] == []


def test_sft_config_still_turns_hf_checkpointing_on(tmp_path):
    assert SFTConfig(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing is True


def test_callback_turns_trl_checkpointing_off_and_trains_bitwise(tmp_path, caplog):
    none = train(tmp_path / "none", gradient_checkpointing=False)
    own = train(tmp_path / "trl")  # SFTConfig's default: HF checkpointing on
    callback = PrimeACCallback(mode="full")
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        ours = train(tmp_path / "prime_ac", [callback])
    assert "Set gradient_checkpointing=False" in caplog.text
    assert callback.blocks == ["model.layers.0", "model.layers.1"]
    assert own.is_activation_checkpointing and not ours.is_activation_checkpointing
    assert_same_weights(ours, none)
    assert_same_weights(own, none)
    # the same weights now: one step of each model measures its checkpointing alone
    none_step, own_step, our_step = (step(m, hf_models.loss) for m in (none, own, ours))
    assert our_step.held == own_step.held < none_step.held
    assert 0 < replayed(our_step, none_step) <= replayed(own_step, none_step)


def test_callback_with_checkpointing_off_in_the_config_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        model = train(tmp_path, [PrimeACCallback(mode="full")], gradient_checkpointing=False)
    assert "prime_ac" not in caplog.text
    assert not model.is_activation_checkpointing


def test_attention_kept_holds_what_trls_selective_holds(tmp_path):
    """TRL's own selective checkpointing keeps the attention kernels: prime_ac with them as
    targets keeps the same bytes."""
    none = train(tmp_path / "none", gradient_checkpointing=False)
    own = train(tmp_path / "trl", gradient_checkpointing_kwargs={"selective": True})
    ours = train(
        tmp_path / "prime_ac",
        [PrimeACCallback(mode="selective", targets=SDPA)],
        gradient_checkpointing=False,
    )
    assert_same_weights(ours, none)
    assert_same_weights(own, none)
    none_step, own_step, our_step = (step(m, hf_models.loss) for m in (none, own, ours))
    assert our_step.held == own_step.held < none_step.held
    assert replayed(our_step, none_step) <= replayed(own_step, none_step)


def test_checkpoint_hf_model_before_the_trainer_ends_with_one_layer(tmp_path, caplog):
    """prime_ac applied first, then SFTConfig's default gradient_checkpointing=True turns Hugging
    Face checkpointing on in train(): the first forward turns it off again and says so."""
    none = train(tmp_path / "none", gradient_checkpointing=False)
    alone = train(
        tmp_path / "alone",
        prepare=lambda m: checkpoint_hf_model(m, mode="full"),
        gradient_checkpointing=False,
    )
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        ours = train(tmp_path / "prime_ac", prepare=lambda m: checkpoint_hf_model(m, mode="full"))
    assert "Set gradient_checkpointing=False" in caplog.text
    assert not ours.is_activation_checkpointing
    assert_same_weights(ours, none)
    none_step, alone_step, our_step = (step(m, hf_models.loss) for m in (none, alone, ours))
    assert (our_step.held, our_step.backward_flops) == (alone_step.held, alone_step.backward_flops)
    assert our_step.held < none_step.held
