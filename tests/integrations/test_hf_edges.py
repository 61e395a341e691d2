"""hf_model_inputs off the main path: int32 labels, the registry of backends, export of the flash inputs."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from transformers import LlamaConfig, LlamaForCausalLM

import packfn
from packfn.integrations.hf import PackedCollator, hf_model_inputs

DOCUMENT_IDS = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])


def _config(implementation: str) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        attn_implementation=implementation,
        use_cache=False,
    )


def test_int32_labels_come_back_int64_and_train():
    config = _config("sdpa")
    tokens = torch.randint(1, 32, DOCUMENT_IDS.shape)
    inputs = hf_model_inputs(DOCUMENT_IDS, config, input_ids=tokens, labels=tokens.int())
    assert inputs["labels"].dtype == inputs["shift_labels"].dtype == torch.int64
    wide = hf_model_inputs(DOCUMENT_IDS, config, input_ids=tokens, labels=tokens)
    assert torch.equal(inputs["labels"], wide["labels"]) and torch.equal(inputs["shift_labels"], wide["shift_labels"])
    loss = LlamaForCausalLM(config)(**inputs).loss  # transformers' loss rejects int32 targets
    assert torch.isfinite(loss)


class FlashInputs(torch.nn.Module):
    def forward(self, document_ids):
        inputs = hf_model_inputs(document_ids, _config("flash_attention_2"))
        return inputs["position_ids"], inputs["cu_seq_lens_q"]


def test_flash_inputs_export_with_the_default_sequence_dim():
    module = FlashInputs()
    exported = torch.export.export(module, (DOCUMENT_IDS,), dynamic_shapes=({1: Dim("S")},))
    for sequence in (2, 3, 9):
        ids = torch.randint(0, 3, (2, sequence)).sort(1).values
        for got, want in zip(exported.module()(ids), module(ids), strict=True):
            assert torch.equal(got, want)


# One registry: a backend registered in packfn.ATTENTION_BACKENDS is what both paths dispatch on.


@pytest.mark.parametrize("kind", ["flash_varlen", "document_ids", "block_causal", "additive_mask"])
def test_a_registered_backend_is_what_both_paths_dispatch_on(monkeypatch, kind):
    monkeypatch.setitem(packfn.ATTENTION_BACKENDS, "my_kernel", kind)
    core = packfn.attention_inputs(DOCUMENT_IDS, "my_kernel", dtype=torch.float32)
    hf = hf_model_inputs(DOCUMENT_IDS, _config("sdpa"), attn_implementation="my_kernel", dtype=torch.float32)
    assert set(core) <= set(hf) and set(hf) - set(core) == {"position_ids"}
    for key, value in core.items():
        assert torch.equal(hf[key], value) if isinstance(value, torch.Tensor) else hf[key] == value
    # Remapping a transformers name moves both paths with it.
    monkeypatch.setitem(packfn.ATTENTION_BACKENDS, "sdpa", kind)
    assert set(hf_model_inputs(DOCUMENT_IDS, _config("sdpa"))) == set(hf)


def test_an_unregistered_backend_is_refused_by_both_paths():
    with pytest.raises(ValueError, match="attn_implementation must be a registered attention backend"):
        hf_model_inputs(DOCUMENT_IDS, _config("sdpa"), attn_implementation="my_kernel")
    with pytest.raises(ValueError, match="backend must be a registered attention backend"):
        packfn.attention_inputs(DOCUMENT_IDS, "my_kernel")


def test_a_document_id_backend_cannot_serve_chunks_shorter_than_the_row(monkeypatch):
    monkeypatch.setitem(packfn.ATTENTION_BACKENDS, "my_kernel", "document_ids")
    config = _config("sdpa")
    config.layer_types, config.attention_chunk_size = ["chunked_attention"], 4
    with pytest.raises(ValueError, match="one document-id mask serves every layer"):
        hf_model_inputs(DOCUMENT_IDS, config, attn_implementation="my_kernel")


# The first-token rule, written once: the collator and hf_model_inputs agree on it.


def test_collator_and_model_inputs_ignore_the_same_first_tokens():
    features = [{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [2, 3]}, {"input_ids": [4, 4, 4, 4], "seq_lens": [4]}]
    batch = PackedCollator(6)(features)
    assert batch["labels"].tolist() == [[-100, 6, -100, 8, 9, -100], [-100, 4, 4, 4, -100, -100]]
    inputs = hf_model_inputs(batch["document_ids"], _config("sdpa"), labels=batch["input_ids"])
    assert torch.equal(inputs["labels"], batch["labels"])


def test_collator_refuses_a_feature_whose_attention_mask_marks_padding():
    """A tokenizer's padded row would put its pad tokens into a document, as tokens and as targets."""
    collator = PackedCollator(6)
    with pytest.raises(ValueError, match="feature 0: its attention_mask marks padding"):
        collator([{"input_ids": [5, 6, 0, 0], "attention_mask": [1, 1, 0, 0]}])
    with pytest.raises(ValueError, match="does not match its 2 tokens"):
        collator([{"input_ids": [5, 6], "attention_mask": [1, 1, 1]}])
    batch = collator([{"input_ids": [5, 6], "attention_mask": [1, 1]}])  # an all-ones mask is no padding
    assert batch["document_ids"].tolist() == [[1, 1, 0, 0, 0, 0]]
    for mask in ([True, True], torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.int64)):
        assert collator([{"input_ids": [5, 6], "attention_mask": mask}])["document_ids"].tolist() == [
            [1, 1, 0, 0, 0, 0]
        ]
    with pytest.raises(ValueError, match="marks padding"):
        collator([{"input_ids": [5, 6], "attention_mask": torch.tensor([True, False])}])
