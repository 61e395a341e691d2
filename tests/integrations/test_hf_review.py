"""apply_packfn_to_trainer where transformers' Trainer would silently train on something else.

- label smoothing where transformers' ``LabelSmoother`` does not shift the
  labels (``torch_compile=True``: the unwrapped model is an
  ``OptimizedModule``; a class of one's own);
- ``Trainer(model_init=...)``, whose model ``train()`` builds anew;
- TRL's ``SFTTrainer`` evaluating a ``PackedDataset`` with its default
  ``remove_unused_columns=True``;
- ``loss_mask_from_trl`` on a missing or a fractional mask value.

Each loss is held to every document run alone (random weights, learning
rate 0, nothing downloaded).
"""

from __future__ import annotations

import accelerate  # noqa: F401  (Trainer needs it)
import pytest
import torch
import transformers

from packfn.data import PackedDataset
from packfn.integrations.hf import apply_packfn
from packfn.integrations.trainer import apply_packfn_to_trainer

from tests.integrations.packed_training import documents, per_document_loss

SEQUENCE = 24


def tiny_llama(cls: type = transformers.LlamaForCausalLM):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return cls(config)


def packed(seed: int = 0) -> PackedDataset:
    return PackedDataset(documents(seed=seed), batch=2, sequence=SEQUENCE, max_documents=6)


def first_batches(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    batches = [batch for _, batch in zip(range(count), packed(seed), strict=False)]
    assert len(batches) == count
    return batches


def arguments(output_dir, **overrides) -> transformers.TrainingArguments:
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, report_to=[], save_strategy="no", ignore_data_skip=True,
        disable_tqdm=True, seed=0, learning_rate=0.0, logging_steps=1,
    )  # fmt: skip
    return transformers.TrainingArguments(**(settings | overrides))


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


class Scorer(transformers.LlamaForCausalLM):
    """A causal LM whose class name transformers does not know: its LabelSmoother does not shift the labels."""


@pytest.mark.parametrize("case", ["torch_compile", "own_class"])
def test_label_smoothing_scores_each_documents_next_tokens_where_transformers_does_not_shift(tmp_path, case):
    model = apply_packfn(tiny_llama(Scorer if case == "own_class" else transformers.LlamaForCausalLM))
    expected = [float(per_document_loss(model, batch, label_smoothing=0.1)) for batch in first_batches(2)]
    compiled = dict(torch_compile=True, torch_compile_backend="aot_eager") if case == "torch_compile" else {}
    trainer = transformers.Trainer(
        model=model, args=arguments(tmp_path, max_steps=2, label_smoothing_factor=0.1, **compiled),
        train_dataset=packed(),
    )  # fmt: skip
    apply_packfn_to_trainer(trainer)
    trainer.train()
    assert losses(trainer) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("takes_trial", [False, True])
def test_a_model_init_models_get_packfns_forward_when_train_builds_them_again(tmp_path, takes_trial):
    expected = [float(per_document_loss(tiny_llama(), batch)) for batch in first_batches(2)]
    calls = []

    def build(*trial):
        calls.append(trial)
        return tiny_llama()  # not patched: train() builds it after apply_packfn_to_trainer

    model_init = (lambda trial: build(trial)) if takes_trial else (lambda: build())
    trainer = transformers.Trainer(model_init=model_init, args=arguments(tmp_path, max_steps=2), train_dataset=packed())
    apply_packfn_to_trainer(trainer)
    trainer.train()
    assert calls == ([(None,)] * 2 if takes_trial else [()] * 2)  # Trainer.__init__'s call, then train()'s
    assert losses(trainer) == pytest.approx(expected, rel=1e-5)


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, 64)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", eos_token="</s>", unk_token="<pad>"
    )


def test_sft_trainer_evaluates_a_packed_dataset_per_document_with_remove_unused_columns(tmp_path):
    """TRL's column filter (remove_unused_columns=True, its default) would drop document_ids from the batches."""
    import datasets
    import trl

    model = tiny_llama()
    evaluation = packed(seed=5)
    expected = [float(per_document_loss(model, batch)) for batch in evaluation]
    examples = datasets.Dataset.from_list([{"input_ids": tokens} for tokens in documents()])
    arguments = trl.SFTConfig(
        str(tmp_path), max_steps=1, ignore_data_skip=True, dataset_kwargs={"skip_prepare_dataset": True}, bf16=False,
        use_cpu=True, report_to=[], per_device_eval_batch_size=1, disable_tqdm=True,
    )  # fmt: skip
    assert arguments.remove_unused_columns
    trainer = trl.SFTTrainer(
        model=model, args=arguments, train_dataset=examples, eval_dataset=evaluation,
        processing_class=word_tokenizer(), data_collator=lambda features: features[0],
    )  # fmt: skip
    apply_packfn_to_trainer(trainer, packed())
    assert trainer.evaluate()["eval_loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ([[0, 1, 1], None], r"completion_mask is None in example 1"),
        ([[0.0, 0.5, 1.0], [0.0, 1.0]], r"completion_mask holds 0.5: a float mask's values must be 0 or 1"),
    ],
)
def test_loss_mask_from_trl_refuses_a_missing_or_fractional_mask_naming_it(mask, message):
    import datasets

    from packfn.integrations.trainer import loss_mask_from_trl

    examples = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "completion_mask": mask})
    with pytest.raises(ValueError, match=message):
        loss_mask_from_trl(examples)


def test_predict_reads_a_packed_dataset_and_label_names_shift_labels_gives_the_targets(tmp_path):
    model = apply_packfn(tiny_llama())
    evaluation = packed(seed=5)
    batches = list(evaluation)
    expected = [float(per_document_loss(model, batch)) for batch in batches]
    trainer = transformers.Trainer(
        model=model, args=arguments(tmp_path, max_steps=1, label_names=["shift_labels"]), train_dataset=packed()
    )
    apply_packfn_to_trainer(trainer)
    output = trainer.predict(evaluation)
    assert output.metrics["test_loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert torch.equal(torch.as_tensor(output.label_ids), torch.cat([batch["shift_labels"] for batch in batches]))
