"""Which sequence lengths each static path exports for under ``torch.export`` with a ``Dim``, and runs at after.

Every op below exports with the default ``Dim("S")`` (whose range holds 2,
where a guard on ``sequence - 1 != 1`` used to break the export) and its
exported program equals eager at other sizes. Two paths export for a
stated range only, pinned here so that the docs say what the tests walk:
FlexAttention's ``BlockMask`` for sequences of whole blocks, at least two
(``sequence = block_size * Dim("blocks", min=2)``), and an aligned layout
whose budget is computed from the traced sequence (``safe_budget``) for
sequences of at least ``documents`` columns.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim

import packfn

SEQ_LENS = torch.tensor([[3, 5, 0], [7, 2, 1]])  # 8 and 10 real tokens, back to back


def _ids(sequence: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (2, sequence), generator=generator).sort(1).values


class Wrapped(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, document_ids, values):
        return self.function(document_ids, values)


def _flat(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


CASES = {
    "varlen_metadata": lambda ids, x: tuple(packfn.varlen_metadata(ids, max_documents=4))[:6],
    "varlen_metadata at D = sequence": lambda ids, x: tuple(packfn.varlen_metadata(ids))[:6],
    "batch_metadata": lambda ids, x: tuple(packfn.batch_metadata(ids))[:4],
    "flatten_metadata": lambda ids, x: tuple(packfn.flatten_metadata(*tuple(packfn.batch_metadata(ids))[:2]))[:6],
    "physical_varlen_metadata": lambda ids, x: tuple(packfn.physical_varlen_metadata(ids))[:3],
    "block_causal_mask": lambda ids, x: packfn.block_causal_mask(ids),
    "packed_position_ids": lambda ids, x: packfn.packed_position_ids(ids),
    "unpad and pad": lambda ids, x: packfn.pad(
        packfn.unpad(x, packfn.varlen_metadata(ids)), packfn.varlen_metadata(ids)
    ),
}


# Values with no, one and two trailing axes for the functions that move them.
PARAMETERS = [(name, ()) for name in CASES] + [("unpad and pad", (3,)), ("unpad and pad", (2, 3))]


@pytest.mark.parametrize(("name", "trailing"), PARAMETERS, ids=[f"{n}-{len(t)} trailing" for n, t in PARAMETERS])
def test_static_path_exports_with_the_default_sequence_dim(name, trailing):
    module = Wrapped(CASES[name])
    exported = torch.export.export(
        module, (_ids(8, 0), torch.randn(2, 8, *trailing)), dynamic_shapes=({1: Dim("S")}, {1: Dim("S")})
    )
    for sequence in (2, 3, 5, 17):
        args = (_ids(sequence, sequence), torch.randn(2, sequence, *trailing))
        for got, want in zip(_flat(exported.module()(*args)), _flat(module(*args)), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class Layout(torch.nn.Module):
    """An aligned layout, then pack and restore of values with trailing axes."""

    def __init__(self, budget: int | None) -> None:
        super().__init__()
        self.budget = budget

    def forward(self, seq_lens, values):
        sequence = values.shape[1]
        budget = self.budget or packfn.safe_budget(sequence, seq_lens.shape[1], 4)
        layout = packfn.aligned_layout(seq_lens, sequence_length=sequence, alignment=4, budget=budget)
        packed = layout.pack(values, fill=-1)
        return packed, layout.restore(packed * 2), layout.sequence_ids


@pytest.mark.parametrize("trailing", [(), (3,), (2, 3)])
@pytest.mark.parametrize("batch_dim", [False, True], ids=["static batch", "dynamic batch"])
def test_layout_with_a_fixed_budget_exports_with_the_default_dims(trailing, batch_dim):
    module = Layout(budget=32)
    dims = {1: Dim("S"), **({0: Dim("B")} if batch_dim else {})}
    exported = torch.export.export(
        module, (SEQ_LENS, torch.randn(2, 16, *trailing)), dynamic_shapes=({0: dims[0]} if batch_dim else None, dims)
    )
    for sequence in (10, 11, 40):
        args = (SEQ_LENS, torch.randn(2, sequence, *trailing))
        for got, want in zip(exported.module()(*args), module(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("trailing", [(), (3,), (3, 5)])
def test_layout_with_a_budget_from_the_traced_sequence_exports_from_documents_columns(trailing):
    module = Layout(budget=None)
    documents = SEQ_LENS.shape[1]
    values = torch.randn(2, 16, *trailing)
    with pytest.raises(Exception, match="Constraints violated"):  # the solver cannot bound min(documents, S) below
        torch.export.export(module, (SEQ_LENS, values), dynamic_shapes=(None, {1: Dim("S")}))
    for dim in (Dim("S", min=documents), Dim("S", min=8, max=512)):
        exported = torch.export.export(module, (SEQ_LENS, values), dynamic_shapes=(None, {1: dim}))
        for sequence in (10, 13, 40):
            args = (SEQ_LENS, torch.randn(2, sequence, *trailing))
            for got, want in zip(exported.module()(*args), module(*args), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


class BlockMaskTensors(torch.nn.Module):
    def forward(self, document_ids):
        block_mask = packfn.document_block_mask(document_ids, block_size=4)
        return (
            block_mask.kv_num_blocks,
            block_mask.kv_indices,
            block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices,
        )


def test_document_block_mask_exports_for_whole_blocks_from_two():
    module = BlockMaskTensors()
    # Any length: torch's solver cannot prove ceil(S / 4) ** 2 != ceil(S / 4), even above one block.
    for dim in (Dim("S"), Dim("S", min=5)):
        with pytest.raises(Exception, match="Constraints violated"):
            torch.export.export(module, (_ids(8, 0),), dynamic_shapes=({1: dim},))
    blocks = Dim("blocks", min=2)
    exported = torch.export.export(module, (_ids(8, 0),), dynamic_shapes=({1: 4 * blocks},))
    for sequence in (8, 12, 24):
        ids = _ids(sequence, sequence)
        for got, want in zip(exported.module()(ids), module(ids), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_physical_varlen_metadata_compiles_once_across_sequences_from_two():
    """Through AOTAutograd and Inductor (a guard there recompiles too): compiled at 5, then 7, then 2 columns."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(
        lambda ids: tuple(packfn.physical_varlen_metadata(ids))[:3], backend=counter, dynamic=True, fullgraph=True
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        for sequence in (5, 7, 2, 3):
            ids = _ids(sequence, sequence)
            for got, want in zip(compiled(ids), tuple(packfn.physical_varlen_metadata(ids))[:3], strict=True):
                assert torch.equal(got, want)
    assert counter.frame_count == 1
