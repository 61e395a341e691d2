"""TRL's SFTTrainer (trl 1.16.0) on packfn's loader: an already tokenized dataset, its masks as packfn's loss_mask.

A tokenized prompt-completion dataset carries TRL's ``completion_mask``
and ``assistant_masks``; :func:`loss_mask_from_trl` turns them into the
``loss_mask`` column that ``PackedDataset`` reads. ``SFTTrainer`` (real
classes, a tiny Llama and a word-level tokenizer built offline) skips its
own preparation and trains on the packed batches; its fused LM head
(``add_fused_lm_head``) sits under packfn's forward, so every step's loss
is the loss of each document run alone over its completion tokens.
"""

from __future__ import annotations

import accelerate  # noqa: F401  (Trainer needs it)
import datasets
import pytest
import torch
import transformers
import trl
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from packfn.data import PackedDataset
from packfn.integrations.hf import PackedForward
from packfn.integrations.trainer import apply_packfn_to_trainer, loss_mask_from_trl

from tests.integrations import SIZES
from tests.integrations.packed_training import documents, per_document_loss, tiny_llama


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then ``t3`` ...)."""
    vocabulary = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, SIZES["vocab_size"])}
    backend = Tokenizer(WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tokenized() -> datasets.Dataset:
    """Prompt-completion examples as TRL tokenizes them: the prompt's first third masked out of the loss,
    and (as an assistant mask would) the last token of every third example."""
    examples = documents(count=30)
    completion = [[int(position >= len(tokens) // 3) for position in range(len(tokens))] for tokens in examples]
    assistant = [
        [int(index % 3 or position < len(tokens) - 1) for position in range(len(tokens))]
        for index, tokens in enumerate(examples)
    ]
    return datasets.Dataset.from_dict(
        {"input_ids": examples, "completion_mask": completion, "assistant_masks": assistant}
    )


def packed(examples: datasets.Dataset) -> PackedDataset:
    return PackedDataset(examples, batch=2, sequence=32, max_documents=6)


def test_loss_mask_is_the_product_of_trls_masks():
    examples = datasets.Dataset.from_dict(
        {"input_ids": [[5, 6, 7, 8], [9, 10, 11]], "completion_mask": [[0, 0, 1, 1], [0, 1, 1]],
         "assistant_masks": [[1, 1, 1, 0], [1, 1, 1]]}
    )  # fmt: skip
    assert loss_mask_from_trl(examples).to_dict() == {
        "input_ids": [[5, 6, 7, 8], [9, 10, 11]], "loss_mask": [[0, 0, 1, 0], [0, 1, 1]]
    }  # fmt: skip
    assert loss_mask_from_trl(examples, completion_only_loss=False)["loss_mask"] == [[1, 1, 1, 0], [1, 1, 1]]
    with_mask = examples.add_column("loss_mask", [[1, 0, 1, 1], [1, 1, 0]])
    assert loss_mask_from_trl(with_mask)["loss_mask"] == [[0, 0, 1, 0], [0, 1, 0]]
    plain = datasets.Dataset.from_dict({"input_ids": [[5, 6]]})
    assert loss_mask_from_trl(plain).to_dict() == {"input_ids": [[5, 6]]}
    wrong = examples.remove_columns("assistant_masks").map(lambda _: {"completion_mask": [1]})
    with pytest.raises(ValueError, match="completion_mask must have as many entries as input_ids"):
        loss_mask_from_trl(wrong)
    with pytest.raises(TypeError, match=r"dataset must be a datasets\.Dataset .*, got list"):
        loss_mask_from_trl([{"input_ids": [5, 6], "completion_mask": [0, 1]}])
    with pytest.raises(TypeError, match=r"or a datasets\.DatasetDict of them, got IterableDataset"):
        loss_mask_from_trl(examples.to_iterable_dataset())


def test_completion_only_loss_false_drops_the_completion_mask_it_leaves_out():
    """Only completion_mask, not applied: no loss_mask (every token takes a loss) and no TRL column left."""
    examples = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "completion_mask": [[0, 1, 1]]})
    assert loss_mask_from_trl(examples, completion_only_loss=False).to_dict() == {"input_ids": [[5, 6, 7]]}
    with_mask = examples.add_column("loss_mask", [[1, 1, 0]])
    assert loss_mask_from_trl(with_mask, completion_only_loss=False).to_dict() == {
        "input_ids": [[5, 6, 7]], "loss_mask": [[1, 1, 0]]
    }  # fmt: skip


def test_loss_mask_from_trl_converts_every_split_of_a_dataset_dict():
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "completion_mask": [[0, 1, 1]]}),
        test=datasets.Dataset.from_dict({"input_ids": [[8, 9]], "assistant_masks": [[1, 0]]}),
    )
    converted = loss_mask_from_trl(splits)
    assert isinstance(converted, datasets.DatasetDict)
    assert {name: split.to_dict() for name, split in converted.items()} == {
        "train": {"input_ids": [[5, 6, 7]], "loss_mask": [[0, 1, 1]]},
        "test": {"input_ids": [[8, 9]], "loss_mask": [[1, 0]]},
    }
    assert loss_mask_from_trl(splits, completion_only_loss=False)["train"].column_names == ["input_ids"]


@pytest.mark.parametrize("column", ["completion_mask", "assistant_masks", "loss_mask"])
def test_loss_mask_from_trl_reads_boolean_masks(column):
    """Each mask as booleans (False: no loss), beside an integer one."""
    other = "completion_mask" if column == "assistant_masks" else "assistant_masks"
    examples = datasets.Dataset.from_dict(
        {"input_ids": [[5, 6, 7], [8, 9]], column: [[False, True, True], [True, False]], other: [[1, 0, 1], [1, 1]]}
    )
    converted = loss_mask_from_trl(examples).to_dict()
    assert converted == {"input_ids": [[5, 6, 7], [8, 9]], "loss_mask": [[0, 0, 1], [1, 0]]}


def test_sft_trainer_label_smoothing_trains_on_each_documents_targets(tmp_path):
    """TRL's label smoothing (deprecated in SFTTrainer, still there) hands the LabelSmoother the batch's labels.

    The assistant masks alone: each document's first token takes a loss, so a shift of the batch's labels
    would ask the document before it to predict it.
    """
    examples = loss_mask_from_trl(tokenized(), completion_only_loss=False)
    model = tiny_llama()
    expected = [
        float(per_document_loss(model, batch, label_smoothing=0.1))
        for _, batch in zip(range(2), packed(examples), strict=False)
    ]
    arguments = trl.SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, logging_steps=1, learning_rate=0.0,
        save_strategy="no", bf16=False, gradient_checkpointing=False, ignore_data_skip=True, disable_tqdm=True,
        dataset_kwargs={"skip_prepare_dataset": True}, seed=0, label_smoothing_factor=0.1,
    )  # fmt: skip
    trainer = trl.SFTTrainer(model=model, args=arguments, train_dataset=examples, processing_class=tokenizer())
    apply_packfn_to_trainer(trainer, packed(examples))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses == pytest.approx(expected, rel=1e-5)


def test_sft_trainer_trains_on_packed_batches_with_the_per_document_completion_loss(tmp_path):
    examples = loss_mask_from_trl(tokenized())
    model = tiny_llama()
    batches = [batch for _, batch in zip(range(3), packed(examples), strict=False)]
    padding = sum(int((batch["document_ids"] == 0).sum()) for batch in batches)
    masked = sum(int((batch["labels"] == -100).sum()) for batch in batches)
    assert masked > padding  # the masks took tokens out of the loss
    expected = [float(per_document_loss(model, batch)) for batch in batches]
    arguments = trl.SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, logging_steps=1, learning_rate=0.0,
        save_strategy="no", bf16=False, gradient_checkpointing=False, ignore_data_skip=True, disable_tqdm=True,
        dataset_kwargs={"skip_prepare_dataset": True}, seed=0,
    )  # fmt: skip
    trainer = trl.SFTTrainer(model=model, args=arguments, train_dataset=examples, processing_class=tokenizer())
    apply_packfn_to_trainer(trainer, packed(examples))
    forward = trainer.model.forward
    assert isinstance(forward, PackedForward) and forward.inner is not None  # over TRL's fused LM head
    masks = []  # what the fused head's backbone call gets: packfn's block-causal masks
    trainer.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    trainer.train()
    assert len(masks) == 3 and all(mask.dtype == torch.bool and mask.shape == (2, 1, 32, 32) for mask in masks)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses == pytest.approx(expected, rel=1e-5)
    assert any("packing/fill" in entry for entry in trainer.state.log_history)
    assert all("mean_token_accuracy" in entry for entry in trainer.state.log_history if "loss" in entry)
