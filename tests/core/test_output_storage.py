"""Compiled static ops return tensors that own only their own storage.

A 0-d count returned as a view of a ``[batch * sequence]`` scan, or
boundaries that are a slice of a twice-as-long scatter buffer, would keep
megabytes alive for as long as the caller keeps a scalar. One compiled
function returns every static op's outputs (one graph, where Inductor has
the most room to hand out views of shared buffers), eager too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import packfn

DOCUMENT_IDS = torch.randint(0, 4, (4, 256), generator=torch.Generator().manual_seed(0)).sort(1).values
VALUES = torch.randn(4, 256, 8)
SEQ_LENS = torch.tensor([[100, 90, 0], [256, 0, 0], [5, 5, 5], [1, 0, 1]])


# Names taken outside the compiled function: torch 2.11 cannot trace vars() of a frozen dataclass.
LAYOUT_FIELDS = [field.name for field in dataclasses.fields(packfn.PackedSequenceLayout)]


def every_output(document_ids: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor) -> dict:
    varlen = packfn.varlen_metadata(document_ids, max_documents=8)
    batch = packfn.batch_metadata(document_ids, max_documents=8)
    layout = packfn.aligned_layout(seq_lens, sequence_length=256, alignment=16, budget=320)
    block_mask = packfn.document_block_mask(document_ids, block_size=64)
    outputs = {
        **{f"varlen_metadata.{k}": v for k, v in varlen._asdict().items()},
        **{f"varlen_metadata(D = sequence).{k}": v for k, v in packfn.varlen_metadata(document_ids)._asdict().items()},
        **{f"batch_metadata.{k}": v for k, v in batch._asdict().items()},
        **{
            f"flatten_metadata.{k}": v
            for k, v in packfn.flatten_metadata(batch.packed_token_indices, batch.cu_seqlens)._asdict().items()
        },
        **{
            f"physical_varlen_metadata.{k}": v
            for k, v in packfn.physical_varlen_metadata(document_ids)._asdict().items()
        },
        **{f"aligned_layout.{k}": getattr(layout, k) for k in LAYOUT_FIELDS},
        "packed_position_ids": packfn.packed_position_ids(document_ids),
        "block_causal_mask": packfn.block_causal_mask(document_ids),
        "unpad": packfn.unpad(values, varlen),
        "pad": packfn.pad(packfn.unpad(values, varlen), varlen),
        "pack": layout.pack(values),
        "restore": layout.restore(layout.pack(values)),
        **{f"BlockMask.{i}": t for i, t in enumerate(block_mask.as_tuple()[2:6])},
    }
    return {name: value for name, value in outputs.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_every_output_owns_only_its_storage(compiled):
    function = torch.compile(every_output, fullgraph=True) if compiled else every_output
    outputs = function(DOCUMENT_IDS, VALUES, SEQ_LENS)
    assert len(outputs) > 30
    larger = {
        name: (tensor.untyped_storage().nbytes(), tensor.numel() * tensor.element_size())
        for name, tensor in outputs.items()
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
    }
    assert not larger, f"outputs that keep more storage alive than their own (storage, own bytes): {larger}"
