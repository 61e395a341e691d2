"""hf_model_inputs off the main path: int32 labels, and export of the flash inputs with the default Dim."""

from __future__ import annotations

import torch
from torch.export import Dim
from transformers import LlamaConfig, LlamaForCausalLM

from packfn.integrations.hf import hf_model_inputs

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
