"""The format conversions against the pipelines' own: transformers, TRL and torchtitan, on generated inputs.

Each anchor's conversion is the oracle (the test extra and the README's test
command install every one; a missing one fails the import, never skips).
"""

from __future__ import annotations

import torch

# Imported while collecting: a module that puts sys.modules back after a test (mock.patch.dict) must find
# datasets there already, or the next import registers its pyarrow types twice.
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import masking_utils
from trl.trainer import sft_trainer as trl_sft

import packfn
from packfn.integrations.hf import PackedCollator

from scripts.benchmarks.formats import titan  # torchtitan's attention module, imported without triton
from tests.assertions import assert_same
from tests.strategies_formats import PackedRows, packed_rows

SETTINGS = settings(max_examples=40)


@st.composite
def position_rows(draw, max_batch: int = 3, max_sequence: int = 32) -> torch.Tensor:
    """Non-negative position ids of any shape of restarts: continuing by 1, jumping, repeating, restarting at 0."""
    batch, sequence = draw(st.integers(1, max_batch)), draw(st.integers(1, max_sequence))
    rows = []
    for _ in range(batch):
        row = [draw(st.integers(0, 3))]
        for _ in range(sequence - 1):
            step = draw(st.sampled_from(["next", "next", "next", "zero", "jump", "same"]))
            row.append(
                {"next": row[-1] + 1, "zero": 0, "same": row[-1]}.get(step)
                if step != "jump"
                else draw(st.integers(0, 9))
            )
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


# ------------------------------------------------------------------ transformers


@SETTINGS
@given(positions=position_rows())
def test_equal_to_transformers_find_packed_sequence_indices(positions):
    expected = masking_utils.find_packed_sequence_indices(positions)
    ids = packfn.document_ids_from_position_ids(positions, start=None)
    if expected is None:  # transformers' answer when every row is one sequence
        assert bool((ids == 1).all())
    else:
        assert_same(ids - 1, expected)


@SETTINGS
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), start=st.sampled_from([0, 2]))
def test_data_collator_with_flattening_outputs_convert_alike(lengths, start):
    features = [{"input_ids": list(range(10 * k, 10 * k + n))} for k, n in enumerate(lengths)]
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_seq_idx=True, position_ids_start=start
    )
    batch = collator(features)
    truth = torch.tensor([[k for k, n in enumerate(lengths, start=1) for _ in range(n)]])
    total = truth.shape[1]
    assert_same(packfn.document_ids_from_position_ids(batch["position_ids"], start=start), truth)
    assert_same(packfn.document_ids_from_cu_seqlens(batch["cu_seq_lens_q"], total), truth)
    assert_same(packfn.document_ids_from_seq_idx(batch["seq_idx"]), truth)
    assert_same(packfn.seq_idx_from_document_ids(truth), batch["seq_idx"])
    physical = packfn.physical_varlen_metadata(truth)
    assert_same(physical.cu_seqlens[: len(lengths) + 1], batch["cu_seq_lens_q"])
    assert int(physical.max_seqlen) == batch["max_length_q"]


# -------------------------------------------------------------------------- TRL


@SETTINGS
@given(rows=packed_rows(max_batch=3, allow_empty_rows=False), multiple=st.sampled_from([None, 8]))
def test_trl_padding_free_collator_outputs_convert_alike(rows: PackedRows, multiple):
    features = [
        {"input_ids": list(range(1, sum(lengths) + 1)), "seq_lengths": list(lengths)} for lengths in rows.lengths
    ]
    collator = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=multiple)
    batch = collator(features)
    total = batch["input_ids"].shape[1]
    from_positions = packfn.document_ids_from_position_ids(batch["position_ids"])
    assert_same(packfn.document_ids_from_cu_seqlens(batch["cu_seq_lens_q"], total), from_positions)
    assert_same(packfn.document_ids_from_seq_idx(batch["seq_idx"]), from_positions)
    # packfn's own collator keeps the rows: the same documents, in the same order.
    ours = PackedCollator(rows.sequence)(features)["document_ids"]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ours.amax(1).cumsum(0)[:-1]]).unsqueeze(1)
    flat = (ours + offsets)[ours > 0]
    assert_same(flat.unsqueeze(0), from_positions[:, : flat.numel()])


# -------------------------------------------------------------------- torchtitan


@SETTINGS
@given(rows=packed_rows(max_batch=3, padding=False))
def test_equal_to_torchtitan_varlen_metadata_and_document_ids(rows: PackedRows):
    """torchtitan 0.3's ``positions`` (restarting at 0; a padding tail is a document of its own)."""
    assert titan is not None, "torchtitan is a test dependency (see the README's test command)"
    attention = titan
    positions = packfn.packed_position_ids(rows.document_ids)
    ids = packfn.document_ids_from_position_ids(positions)
    assert_same(ids - 1, torch.cumsum((positions == 0).int(), dim=1) - 1)  # get_document_mask_mod's ids
    expected = attention.create_varlen_metadata_for_document(positions)
    physical = packfn.physical_varlen_metadata(ids)
    assert_same(physical.cu_seqlens[: expected.cu_seq_q.numel()], expected.cu_seq_q)
    assert bool((physical.cu_seqlens[expected.cu_seq_q.numel() :] == ids.numel()).all())
    assert int(physical.max_seqlen) == expected.max_q
