"""transformers.Trainer on static packed batches: PackedCollator and PackedCausalLM, compiled, loss per document.

A tiny Llama built from a config (random weights, nothing downloaded) trains
a few steps under ``torch_compile`` with the learning rate at 0, so that every
step's loss can be held to the loss of each document run alone through the
same weights. The compile uses AOTAutograd without Inductor: graph breaks and
recompiles are Dynamo's, and the C++ compile would take most of the time.
"""

from __future__ import annotations

import accelerate  # noqa: F401  (Trainer needs it)
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from packfn.integrations.hf import PackedCausalLM, PackedCollator

from tests.assertions import assert_same

SEQUENCE = 24
ROWS = [[5, 9, 3], [24], [2, 2, 2, 7], [11, 6]]  # documents per row; the last rows leave padding


def features(seed: int = 0) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, 64, (sum(lengths),), generator=generator).tolist(), "seq_lengths": lengths}
        for lengths in ROWS
    ]


def tiny_llama(implementation: str = "sdpa"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=implementation,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def per_document_loss(model, rows: list[dict[str, list[int]]]) -> torch.Tensor:
    """Every document alone through the model: the summed token losses over the number of targets."""
    total, targets = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for row in rows:
            start = 0
            for length in row["seq_lengths"]:
                tokens = torch.tensor([row["input_ids"][start : start + length]])
                start += length
                if length < 2:
                    continue
                logits = model(input_ids=tokens).logits[0, :-1].double()
                total += torch.nn.functional.cross_entropy(logits, tokens[0, 1:], reduction="sum")
                targets += length - 1
    return total / targets


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


def test_trainer_trains_compiled_with_one_graph_and_the_per_document_loss(tmp_path):
    model = tiny_llama()
    rows = features()
    expected = per_document_loss(model, rows)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=3, logging_steps=1,
        per_device_train_batch_size=len(rows), learning_rate=0.0, remove_unused_columns=False, disable_tqdm=True,
        torch_compile=True, torch_compile_backend="aot_eager", seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=PackedCausalLM(model), args=arguments, train_dataset=rows, data_collator=PackedCollator(SEQUENCE)
    )
    counters.clear()
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3
    for loss in losses:
        assert loss == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    assert all(entry["grad_norm"] > 0 for entry in trainer.state.log_history if "grad_norm" in entry)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_wrapper_loss_is_the_per_document_loss_for_the_eager_backend():
    """Eager attention takes an additive mask (the others: tests/integrations/test_hf.py, through hf_model_inputs)."""
    model = tiny_llama("eager")
    batch = PackedCollator(SEQUENCE)(features(1))
    with torch.no_grad():
        wrapped = PackedCausalLM(model)(**batch)
    assert float(wrapped.loss) == pytest.approx(float(per_document_loss(model, features(1))), rel=1e-5)
    assert_same(wrapped.logits.shape, torch.Size([4, SEQUENCE, 64]))
