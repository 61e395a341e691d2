"""attention_inputs and the registry of attention backends: each kind's inputs, static and compiled."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from torch.nn.attention.flex_attention import BlockMask

import packfn
from packfn.attention import ATTENTION_INPUT_KINDS, attention_backend

from tests.assertions import assert_same
from tests.compiling import Fn, export_dynamic
from tests.strategies import EXAMPLE, document_mask


def test_every_kind_names_a_backend_that_takes_it():
    for kind in ATTENTION_INPUT_KINDS:
        assert attention_backend(kind) == kind
    transformers_names = {"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"}
    assert transformers_names <= set(packfn.ATTENTION_BACKENDS)


def test_attention_inputs_of_each_kind():
    mask = packfn.block_causal_mask(EXAMPLE)
    assert set(packfn.attention_inputs(EXAMPLE)) == {"attention_mask"}
    assert_same(packfn.attention_inputs(EXAMPLE, "sdpa")["attention_mask"], mask)
    additive = packfn.attention_inputs(EXAMPLE, "eager", dtype=torch.float64)["attention_mask"]
    assert additive.dtype == torch.float64
    assert torch.equal(additive == 0, mask) and bool((additive[~mask] == torch.finfo(torch.float64).min).all())
    block = packfn.attention_inputs(EXAMPLE, "block_mask", block_size=16)["attention_mask"]
    assert isinstance(block, BlockMask)
    expected = packfn.document_block_mask(EXAMPLE, block_size=16)
    assert_same(block.to_dense(), expected.to_dense())
    assert packfn.attention_inputs(EXAMPLE, "document_ids")["attention_mask"] is EXAMPLE
    flash = packfn.attention_inputs(EXAMPLE, "flash_attention_2")
    assert set(flash) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert flash["cu_seq_lens_q"] is flash["cu_seq_lens_k"]
    assert_same(flash["cu_seq_lens_q"], packfn.physical_varlen_metadata(EXAMPLE).cu_seqlens)
    assert flash["max_length_q"] == flash["max_length_k"] == EXAMPLE.shape[1]


def test_a_new_entry_in_the_registry_is_a_new_backend(monkeypatch):
    monkeypatch.setitem(packfn.ATTENTION_BACKENDS, "my_varlen_kernel", "flash_varlen")
    assert_same(packfn.attention_inputs(EXAMPLE, "my_varlen_kernel"), packfn.attention_inputs(EXAMPLE, "flash_varlen"))
    monkeypatch.setitem(packfn.ATTENTION_BACKENDS, "broken", "dense")
    with pytest.raises(ValueError, match=r"ATTENTION_BACKENDS\['broken'\] must be one of"):
        packfn.attention_inputs(EXAMPLE, "broken")


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: packfn.attention_inputs(EXAMPLE, "paged|sdpa"), ValueError, "backend must be a registered"),
        (lambda: packfn.attention_inputs(EXAMPLE, None), TypeError, "backend must be the name"),
        (lambda: packfn.attention_inputs(EXAMPLE, "eager", dtype=torch.int64), TypeError, "floating"),
        (lambda: packfn.attention_inputs(EXAMPLE, "sdpa", dtype=torch.int64), TypeError, "floating"),  # any backend
        (lambda: packfn.attention_inputs(EXAMPLE, "flash_varlen", dtype="float32"), TypeError, "floating"),
        (lambda: packfn.attention_inputs(EXAMPLE, "eager", dtype=torch.float8_e4m3fn), TypeError, "16 bits or more"),
        (lambda: packfn.attention_inputs(EXAMPLE, "sdpa", build_mask=3), TypeError, "build_mask must be callable"),
        (
            lambda: packfn.attention_inputs(EXAMPLE.to(torch.uint16)),
            ValueError,
            r"integer or bool document ids \(bool, uint8, int8, int16, int32 or int64\), got dtype torch.uint16",
        ),
        (lambda: packfn.attention_inputs(EXAMPLE, "block_mask", block_size=0), ValueError, "block_size"),
        (lambda: packfn.attention_inputs(EXAMPLE[0]), ValueError, r"shape \[batch, sequence\]"),
    ],
)
def test_attention_inputs_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_masks_assert_the_mask_rules_and_varlen_takes_any_ids():
    decreasing = torch.tensor([[2, 2, 1, 0]])
    with pytest.raises(RuntimeError, match="decrease"):
        packfn.attention_inputs(decreasing, "sdpa")
    assert "cu_seq_lens_q" in packfn.attention_inputs(decreasing, "flash_varlen")


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flash_varlen", "document_ids"])
def test_attention_inputs_compile_fullgraph(backend):
    compiled = torch.compile(lambda ids: packfn.attention_inputs(ids, backend), fullgraph=True, backend="aot_eager")
    assert_same(compiled(EXAMPLE), packfn.attention_inputs(EXAMPLE, backend))


# Issue 8, case 3: attention inputs exported with a dynamic sequence.


def _attention_inputs(document_ids):
    # document_block_mask is left out: BlockMask.from_kv_blocks (torch) guards on the
    # number of blocks, so it does not export with a Dim on the sequence.
    flash = packfn.attention_inputs(document_ids, "flash_varlen")
    metadata = packfn.batch_metadata(document_ids, max_documents=16)
    return (
        packfn.attention_inputs(document_ids, "block_causal")["attention_mask"],
        flash["cu_seq_lens_q"],
        metadata.packed_token_indices,
        metadata.cu_seqlens,
    )


def test_export_attention_inputs_with_dynamic_sequence_runs_at_other_lengths():
    exported = export_dynamic(
        Fn(_attention_inputs), (document_mask(2, 64, seed=0),), ({1: Dim("S", min=16, max=4096)},)
    )
    for sequence in (40, 300):
        mask = document_mask(2, sequence, seed=sequence)
        assert_same(tuple(exported(mask)), _attention_inputs(mask))
