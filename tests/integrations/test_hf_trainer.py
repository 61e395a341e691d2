"""A transformers model patched by apply_packfn, and transformers.Trainer on packed batches: compiled, saved, loaded.

A tiny Llama built from a config (random weights, nothing downloaded) is
patched in place: it keeps its class, state dict keys and config, takes a
``PackedDataset`` batch (``document_ids`` and the rest), pickles and
deep-copies with its weights, and ``save_pretrained`` / the Trainer's
``save_model`` write what ``AutoModelForCausalLM.from_pretrained`` loads.
Under ``Trainer(torch_compile=True)`` it trains a few steps with the
learning rate at 0, so that every step's loss can be held to the loss of
each document run alone. The compiles use AOTAutograd without Inductor
(``aot_eager``): graph breaks and recompiles are Dynamo's, and the C++
compile would take most of the time. Checkpoints, resume and the packing
stats: ``tests/integrations/test_hf_resume.py``; TRL: ``test_hf_trl.py``.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import accelerate  # noqa: F401  (Trainer needs it)
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from packfn.data import PackedDataset
from packfn.integrations.hf import PackedCollator, PackedForward, apply_packfn, causal_lm_labels
from packfn.integrations.trainer import apply_packfn_to_trainer

from tests.assertions import assert_same
from tests.integrations.packed_training import documents, per_document_loss

SEQUENCE = 24
ROWS = [[5, 9, 3], [24], [2, 2, 2, 7], [11, 6]]  # documents per row; the last rows leave padding


def features(seed: int = 0) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, 64, (sum(lengths),), generator=generator).tolist(), "seq_lengths": lengths}
        for lengths in ROWS
    ]


def tiny_llama(implementation: str = "sdpa", layers: int = 2):
    """Random weights (seeded); the compiled tests take one layer (Dynamo's tracing is most of their time)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=implementation,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def packed_dataset(**kwargs) -> PackedDataset:
    """The shared documents packed 2 rows of SEQUENCE a batch (about a dozen batches an epoch)."""
    return PackedDataset(documents(), batch=2, sequence=SEQUENCE, max_documents=6, **kwargs)


def loader_batches(count: int = 3, **kwargs) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` batches of a PackedDataset over the shared documents (packing_stats included)."""
    batches = [batch for _, batch in zip(range(count), packed_dataset(**kwargs), strict=False)]
    assert len(batches) == count
    return batches


def arguments(output_dir, **overrides) -> transformers.TrainingArguments:
    """TrainingArguments of a short CPU run on packfn's loader: no save, no report, no progress bar."""
    settings = dict(
        output_dir=str(output_dir), use_cpu=True, report_to=[], save_strategy="no", ignore_data_skip=True,
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    return transformers.TrainingArguments(**(settings | overrides))


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry]


def test_collator_builds_static_rows_with_document_ids():
    batch = PackedCollator(SEQUENCE, pad_token_id=0)(features())
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "input_ids": (4, SEQUENCE), "labels": (4, SEQUENCE), "document_ids": (4, SEQUENCE)
    }  # fmt: skip
    assert batch["document_ids"][2].tolist() == [1, 1, 2, 2, 3, 3] + [4] * 7 + [0] * 11
    tokens = batch["input_ids"][2].tolist()
    assert batch["labels"][2].tolist()[:7] == [-100, tokens[1], -100, tokens[3], -100, tokens[5], -100]
    assert bool((batch["labels"][batch["document_ids"] == 0] == -100).all())


@settings(max_examples=25)
@given(rows=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=3))
def test_collator_documents_are_the_lengths(rows):
    sequence = max(sum(row) for row in rows) + 2
    batch = PackedCollator(sequence)([{"input_ids": [1] * sum(row), "seq_lengths": row} for row in rows])
    for ids, lengths in zip(batch["document_ids"].tolist(), rows, strict=True):
        assert ids == [k for k, n in enumerate(lengths, start=1) for _ in range(n)] + [0] * (sequence - sum(lengths))


def test_collator_rejects_rows_it_cannot_hold():
    with pytest.raises(ValueError, match="more than sequence=4"):
        PackedCollator(4)([{"input_ids": [1] * 5}])
    with pytest.raises(ValueError, match="do not add up"):
        PackedCollator(8)([{"input_ids": [1] * 5, "seq_lengths": [2, 2]}])


@pytest.mark.parametrize(
    ("features", "error", "match"),
    [
        ([], ValueError, "PackedCollator got no features"),
        ([{"labels": [1]}], ValueError, "feature 0 has no 'input_ids'"),
        ([{"input_ids": [1, 2]}, {"input_ids": [1.7, 2.2]}], TypeError, "feature 1: input_ids must hold integer"),
        ([{"input_ids": [[1, 2], [3, 4]]}], ValueError, r"feature 0: input_ids must be 1-D, got shape \(2, 2\)"),
        ([{"input_ids": [1, 2, 3, 4], "labels": [9]}], ValueError, "feature 0: its 1 labels do not match its 4 tokens"),
        ([{"input_ids": [1, 2], "labels": [0.5, 1.0]}], TypeError, "feature 0: labels must hold integer"),
        ([{"input_ids": [1, 2, 3], "seq_lengths": [4, -1]}], ValueError, r"lengths \[4, -1\] hold a negative"),
    ],
)
def test_collator_names_the_feature_it_cannot_read(features, error, match):
    with pytest.raises(error, match=match):
        PackedCollator(6)(features)
    with pytest.raises(TypeError, match="pad_token_id must be an int, got float"):
        PackedCollator(6, pad_token_id=1.5)


def test_collator_takes_missing_or_null_labels_as_the_tokens():
    for feature in ({"input_ids": [4, 5, 6]}, {"input_ids": [4, 5, 6], "labels": None}):
        assert PackedCollator(4)([feature])["labels"].tolist() == [[-100, 5, 6, -100]]


# ------------------------------------------------------------------ the patched model


def test_patched_model_keeps_its_class_state_dict_keys_and_config():
    model = tiny_llama()
    keys, config = list(model.state_dict()), model.config
    assert apply_packfn(model, block_size=16) is model
    assert type(model) is transformers.LlamaForCausalLM
    assert list(model.state_dict()) == keys
    assert model.config is config
    assert isinstance(model.forward, PackedForward) and model.forward.options == {"block_size": 16}
    parameters = inspect.signature(model.forward).parameters
    assert {"input_ids", "labels", "document_ids", "documents", "packing_stats", "kwargs"} <= set(parameters)
    # Applied again: still one packfn layer, with the new options.
    apply_packfn(model)
    assert model.forward.inner is None and model.forward.options == {}


def test_apply_packfn_refuses_what_it_cannot_patch():
    with pytest.raises(TypeError, match="a module with a config"):
        apply_packfn(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"options of hf_model_inputs .*got \['window'\]"):
        apply_packfn(tiny_llama(), window=4)


def test_patched_forward_takes_a_loader_batch_with_the_per_document_loss():
    model = apply_packfn(tiny_llama()).eval()
    batch = loader_batches(1)[0]
    assert "packing_stats" in batch and "documents" in batch  # every key of the loader's batch is taken
    with torch.no_grad():
        loss = model(**batch).loss
        assert float(loss) == pytest.approx(float(per_document_loss(model, batch)), rel=1e-5)
        # Without document_ids the forward is the class's own.
        tokens = batch["input_ids"]
        plain = transformers.LlamaForCausalLM.forward
        assert_same(model(input_ids=tokens).logits, plain(model, input_ids=tokens).logits)
        assert_same(model(tokens).logits, plain(model, tokens).logits)
    with pytest.raises(ValueError, match=r"document_ids build \['attention_mask'\]"):
        model(**batch, attention_mask=torch.ones_like(tokens))


def test_patched_forward_takes_input_ids_positionally_and_names_any_other_positional():
    model = apply_packfn(tiny_llama()).eval()
    batch = loader_batches(1)[0]
    tokens, ids, labels = batch["input_ids"], batch["document_ids"], batch["labels"]
    with torch.no_grad():
        positional = model(tokens, document_ids=ids, labels=labels)
        keyword = model(input_ids=tokens, document_ids=ids, labels=labels)
    assert_same(positional.logits, keyword.logits)
    assert float(positional.loss) == pytest.approx(float(per_document_loss(model, batch)), rel=1e-5)
    with pytest.raises(TypeError, match="only positional argument, got 2: pass attention_mask by keyword"):
        model(tokens, torch.ones_like(tokens), document_ids=ids)
    with pytest.raises(TypeError, match="got 3: pass attention_mask, position_ids by keyword"):
        model(tokens, None, None, document_ids=ids)
    with pytest.raises(TypeError, match="input_ids was given twice"):
        model(tokens, input_ids=tokens, document_ids=ids)


def test_positionals_past_the_forwards_parameters_are_named_by_their_place():
    """LlamaForCausalLM.forward has 8 positional parameters: a 9th is named by its place, not an IndexError."""
    model = apply_packfn(tiny_llama(layers=1)).eval()
    batch = loader_batches(1)[0]
    tokens, ids = batch["input_ids"], batch["document_ids"]
    keywords = "attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache, logits_to_keep"
    with pytest.raises(TypeError, match=f"got 9: pass {keywords}, positional argument 9 by keyword"):
        model(tokens, *[None] * 8, document_ids=ids)


def test_a_none_for_an_input_the_ids_build_is_not_a_clash():
    """PEFT's forward passes attention_mask=None (and others) on to the model: None is no input given."""
    model = apply_packfn(tiny_llama()).eval()
    batch = loader_batches(1)[0]
    with torch.no_grad():
        assert_same(model(**batch, attention_mask=None).logits, model(**batch).logits)


def test_causal_lm_labels_shift_into_each_documents_targets():
    """The docstring's example; one-column shifted, they are the batch's shift_labels (none cross a boundary)."""
    ids = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    labels = torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]])
    assert causal_lm_labels(ids, labels).tolist() == [[-100, 2, -100, 4, 5, -100], [-100, 7, 8, 9, -100, -100]]
    batch = loader_batches(1)[0]
    shifted = causal_lm_labels(batch["document_ids"], batch["labels"].int())
    assert shifted.dtype == torch.int64
    assert_same(shifted[:, 1:], batch["shift_labels"][:, :-1])
    assert bool((batch["shift_labels"][:, -1] == -100).all())
    with pytest.raises(TypeError, match=r"labels must be a torch\.Tensor, got NoneType"):
        causal_lm_labels(ids, None)
    with pytest.raises(ValueError, match=r"labels must have the shape of document_ids \(2, 6\), got \(2, 5\)"):
        causal_lm_labels(ids, labels[:, :5])


def test_causal_lm_labels_refuse_labels_that_are_not_integers():
    """Float labels would come back truncated to int64 targets: they are refused as hf_model_inputs refuses them."""
    ids = torch.tensor([[1, 1, 2, 2]])
    with pytest.raises(TypeError, match=r"labels must be an int32 or int64 tensor .*, got torch\.float32"):
        causal_lm_labels(ids, torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


def test_patched_model_compiles_to_one_graph_across_batches_of_new_contents():
    """fullgraph through AOTAutograd, forward and backward, the loader's whole batch (stats included) as input."""
    model = apply_packfn(tiny_llama(layers=1))
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        for batch in loader_batches(3, shuffle=True):
            loss = compiled(**batch).loss
            loss.backward()
            torch.testing.assert_close(loss, model(**batch).loss, rtol=1e-6, atol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


def test_patched_model_deep_copies_and_pickles_with_its_own_weights():
    model = apply_packfn(tiny_llama()).eval()
    batch = loader_batches(1)[0]
    with torch.no_grad():
        expected = model(**batch).logits
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert isinstance(twin.forward, PackedForward) and twin.forward.model is twin
            assert_same(twin(**batch).logits, expected)
            twin.lm_head.weight.mul_(2)  # the twin's forward runs the twin's weights, not the original's
            assert not torch.equal(twin(**batch).logits, expected)
            assert_same(model(**batch).logits, expected)


def test_save_pretrained_writes_the_plain_model_that_from_pretrained_loads(tmp_path):
    model = apply_packfn(tiny_llama()).eval()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is transformers.LlamaForCausalLM and "forward" not in loaded.__dict__  # unpatched
    batch = loader_batches(1)[0]
    with torch.no_grad():
        assert_same(loaded(input_ids=batch["input_ids"]).logits, model(input_ids=batch["input_ids"]).logits)
        assert_same(apply_packfn(loaded)(**batch).logits, model(**batch).logits)


def test_patched_model_takes_collated_rows_with_the_eager_backend():
    """Eager attention takes an additive mask (the other backends: tests/integrations/test_hf.py)."""
    model = apply_packfn(tiny_llama("eager")).eval()
    batch = PackedCollator(SEQUENCE)(features(1))
    with torch.no_grad():
        output = model(**batch)
    assert float(output.loss) == pytest.approx(float(per_document_loss(model, batch)), rel=1e-5)
    assert_same(output.logits.shape, torch.Size([4, SEQUENCE, 64]))


# ------------------------------------------------------------------ Trainer


def test_trainer_trains_compiled_with_one_graph_and_the_per_document_loss(tmp_path):
    """Trainer(torch_compile=True) on a PackedDataset: one graph for new contents, every step's loss per document."""
    model = tiny_llama(layers=1)
    batches = loader_batches(3)
    expected = [per_document_loss(model, batch) for batch in batches]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=3, logging_steps=1,
        learning_rate=0.0, ignore_data_skip=True, disable_tqdm=True, torch_compile=True,
        torch_compile_backend="aot_eager", seed=0,
    )  # fmt: skip
    dataset = PackedDataset(documents(), batch=2, sequence=SEQUENCE, max_documents=6)
    trainer = transformers.Trainer(model=apply_packfn(model), args=arguments, train_dataset=dataset)
    apply_packfn_to_trainer(trainer)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses == pytest.approx([float(loss) for loss in expected], rel=1e-5, abs=1e-6)
    assert all(entry["grad_norm"] > 0 for entry in trainer.state.log_history if "grad_norm" in entry)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert (tmp_path / "final" / "config.json").is_file()
    with torch.no_grad():
        tokens = batches[0]["input_ids"]
        assert_same(loaded.eval()(input_ids=tokens).logits, model.eval()(input_ids=tokens).logits)


def test_apply_packfn_to_trainer_refuses_a_setup_that_cannot_resume(tmp_path):
    dataset = PackedDataset(documents(), batch=2, sequence=SEQUENCE, max_documents=6)

    def trainer(**overrides):
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, **overrides
        )
        return transformers.Trainer(model=tiny_llama(), args=arguments, train_dataset=dataset)

    with pytest.raises(ValueError, match="ignore_data_skip=True"):
        apply_packfn_to_trainer(trainer())
    with pytest.raises(TypeError, match=r"trains on a packfn\.data\.PackedDataset"):
        apply_packfn_to_trainer(trainer(ignore_data_skip=True), dataset=[[1, 2, 3]])
    other_rank = PackedDataset(documents(), batch=2, sequence=SEQUENCE, max_documents=6, rank=1, world=2)
    with pytest.raises(ValueError, match=r"rank=args\.process_index"):
        apply_packfn_to_trainer(trainer(ignore_data_skip=True), dataset=other_rank)
    with pytest.raises(ValueError, match=r"auto_find_batch_size=False"):
        apply_packfn_to_trainer(trainer(ignore_data_skip=True, auto_find_batch_size=True))
    patched = apply_packfn_to_trainer(trainer(ignore_data_skip=True), block_size=16)  # an unpatched model is patched
    assert patched.model.forward.options == {"block_size": 16}


def test_trainer_evaluates_a_packed_dataset_one_batch_at_a_time(tmp_path):
    """Evaluation goes through the Trainer's own loader: per_device_eval_batch_size=1, a collator that unwraps."""
    model = apply_packfn(tiny_llama())
    evaluation = PackedDataset(documents(seed=3), batch=2, sequence=SEQUENCE, max_documents=6)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, ignore_data_skip=True,
        per_device_eval_batch_size=1, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=arguments, eval_dataset=evaluation, data_collator=lambda features: features[0]
    )
    metrics = trainer.evaluate()
    expected = [float(per_document_loss(model, batch)) for batch in evaluation]
    assert metrics["eval_loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_apply_packfn_to_trainer_gives_its_options_to_a_model_already_patched(tmp_path):
    model = apply_packfn(tiny_llama(), block_size=32)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path, max_steps=1), train_dataset=packed_dataset())
    apply_packfn_to_trainer(trainer, block_size=16)
    assert model.forward.options == {"block_size": 16} and model.forward.inner is None  # one packfn layer
    apply_packfn_to_trainer(trainer)  # no options: the patch keeps its own
    assert model.forward.options == {"block_size": 16}


def test_training_without_apply_packfn_to_trainer_names_the_missing_call(tmp_path):
    """The Trainer's own DataLoader stacks per_device_train_batch_size (8) packed batches into one."""
    trainer = transformers.Trainer(
        model=apply_packfn(tiny_llama(layers=1)), args=arguments(tmp_path, max_steps=1), train_dataset=packed_dataset()
    )
    with pytest.raises(ValueError, match=rf"got \(8, 2, {SEQUENCE}\).*call apply_packfn_to_trainer\(trainer\)"):
        trainer.train()


def shifted_cross_entropy(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func as one is written for a causal LM: it shifts the labels itself."""
    logits = outputs.logits[:, :-1].flatten(0, 1).float()
    total = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


@pytest.mark.parametrize("loss", ["label_smoothing_factor", "compute_loss_func"])
def test_losses_that_shift_the_labels_themselves_train_on_each_documents_targets(tmp_path, loss):
    """The Trainer pops labels before the forward and shifts the batch's own: no target may cross a document."""
    model = tiny_llama(layers=1)
    smoothing = 0.1 if loss == "label_smoothing_factor" else 0.0
    expected = [float(per_document_loss(model, batch, label_smoothing=smoothing)) for batch in loader_batches(2)]
    trainer = transformers.Trainer(
        model=apply_packfn(model),
        args=arguments(tmp_path, max_steps=2, logging_steps=1, learning_rate=0.0, label_smoothing_factor=smoothing),
        train_dataset=packed_dataset(),
        compute_loss_func=shifted_cross_entropy if loss == "compute_loss_func" else None,
    )
    apply_packfn_to_trainer(trainer)
    trainer.train()
    assert logged(trainer, "loss") == pytest.approx(expected, rel=1e-5)


def test_the_trainer_logs_the_datasets_epoch_and_counts_its_rows_as_samples(tmp_path):
    """Without a length, the Trainer would log step / max_steps as the epoch and count per_device_train_batch_size."""
    per_epoch = sum(1 for _ in packed_dataset())
    assert per_epoch > 3
    trainer = transformers.Trainer(
        model=apply_packfn(tiny_llama(layers=1)), args=arguments(tmp_path, max_steps=3, logging_steps=1),
        train_dataset=packed_dataset(),
    )  # fmt: skip
    apply_packfn_to_trainer(trainer)
    metrics = trainer.train().metrics
    assert logged(trainer, "epoch") == pytest.approx([1 / per_epoch, 2 / per_epoch, 3 / per_epoch])
    assert trainer.state.epoch == pytest.approx(3 / per_epoch)
    assert trainer.get_total_train_batch_size(trainer.args) == 2  # the dataset's rows, not the default 8
    # 3 steps of 2 rows; the metrics are rounded (runtime to 4 decimals, samples per second to 3), so their
    # product is 6 within what the two roundings can move it (8 rows per step would give 24).
    speed, runtime = metrics["train_samples_per_second"], metrics["train_runtime"]
    assert speed * runtime == pytest.approx(6, abs=speed * 5e-5 + runtime * 5e-4 + 1e-9)
