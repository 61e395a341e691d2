"""Named cases that pin single rules against upstream, each a behaviour a user would see change.

Every case here once let a one-line change of packfn's source pass the
suite: a rule applied batch-wide instead of per row, a clamp one column
tighter, a comparison off by one, a mask dtype dropped, a 4-D mask read
inverted.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from nemo_automodel.components.datasets import packing as upstream
from nemo_automodel.components.datasets.packing import _DefaultPackedSequenceContract
from nemo_automodel.components.datasets.utils import neat_packed_collater
from nemo_automodel.components.models.deepseek_v41 import cp as upstream_cp
from nemo_automodel.components.models.deepseek_v41 import packing as upstream_layout

import packfn
import packfn.nemo_automodel as drop_ins

from tests.assertions import assert_same, assert_same_outcome, outcome
from tests.strategies import packing_masks


def test_narrow_dtype_overflow_is_decided_per_row():
    # Row 0: one document of 290 tokens with id 1 (counted in int64 upstream,
    # its row's ids are at most 1); row 1: a document of 3 tokens with id 2.
    mask = torch.zeros(2, 290, dtype=torch.uint8)
    mask[0] = 1
    mask[1, :3] = 2
    expected = upstream.build_packed_sequence_metadata(mask)
    assert expected["cu_seqlens"].tolist() == [[0, 290, -1], [0, 3, -1]]
    assert_same(drop_ins.build_packed_sequence_metadata(mask), expected)


@pytest.mark.parametrize(("dtype", "limit"), [(torch.int8, 127), (torch.int16, 32767)])
def test_narrow_signed_masks_count_up_to_their_maximum_and_refuse_past_it(dtype, limit):
    fits = torch.cat([torch.ones(1, limit), torch.full((1, 3), 2)], dim=1).to(dtype)
    for function in ("get_unpad_data", "get_seqlens_in_batch", "build_packed_sequence_metadata"):
        assert_same(getattr(drop_ins, function)(fits), getattr(upstream, function)(fits))
    wraps = torch.cat([torch.ones(1, limit + 1), torch.full((1, 3), 2)], dim=1).to(dtype)
    for function in ("get_unpad_data", "get_seqlens_in_batch", "build_packed_sequence_metadata"):
        with pytest.raises(ValueError, match=f"does not fit attention_mask's dtype {dtype}"):
            getattr(drop_ins, function)(wraps)


@settings(max_examples=40)
@given(packing_masks(max_batch=4, max_sequence=64, dtypes=(torch.int8, torch.int16)))
def test_int8_and_int16_masks_match_upstream(mask):
    for function in ("get_unpad_data", "get_seqlens_in_batch", "build_packed_sequence_metadata"):
        assert_same_outcome(outcome(getattr(drop_ins, function), mask), outcome(getattr(upstream, function), mask))
    # The static op takes them too, with the same token order.
    if mask.any():
        indices, _, _ = upstream.get_unpad_data(mask)
        metadata = packfn.varlen_metadata(mask)
        assert torch.equal(metadata.indices[: indices.numel()], indices)


@pytest.mark.parametrize("exact_cpu_path", [True, False], ids=["exact_cpu_path", "static_path"])
def test_a_span_longer_than_the_row_is_refused(exact_cpu_path, monkeypatch):
    seq_lens, spans = torch.tensor([[5]]), torch.tensor([[12]])
    arguments = {"seq_lens_padded": spans, "input_shape": (1, 8), "alignment": 4}
    with pytest.raises(ValueError, match="Packed document lengths exceed") as theirs:
        upstream_layout.packed_layout(seq_lens, **arguments)
    if not exact_cpu_path:
        monkeypatch.setattr("packfn.nemo_automodel.layout.exact_on_cpu", lambda *tensors: False)
    with pytest.raises(ValueError, match=str(theirs.value)):
        drop_ins.packed_layout(seq_lens, **arguments)
    with pytest.raises(RuntimeError, match="must not run past the input row"):
        packfn.aligned_layout(seq_lens, spans, sequence_length=8, alignment=4, budget=16)


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([[1, 1, 0], [1, 0, 0]]),
        torch.tensor([[True, True, False], [True, False, False]]),
        torch.tensor([[0, 0, 0], [1, 1, 1]], dtype=torch.int32),
        torch.tensor([[1, 2, 0], [1, 0, 0]]),
    ],
    ids=["ids at most 1", "bool", "int32 at most 1", "an id of 2"],
)
def test_collater_adds_packed_seq_ids_exactly_when_an_id_exceeds_one(mask):
    contract = _DefaultPackedSequenceContract("block_causal", False)
    tensors = {"input_ids": mask.long() * 7, "labels": mask.long() * 5, "position_ids": torch.arange(3).expand(2, 3)}
    batch = [{**{name: t[row] for name, t in tensors.items()}, "attention_mask": mask[row]} for row in range(2)]
    expected = neat_packed_collater(batch, packing=contract)
    ours = drop_ins.packed_attention_inputs(mask, contract, **tensors)
    assert list(ours) == list(expected)
    assert ("_packed_seq_ids" in ours) == ("_packed_seq_ids" in expected) == bool(mask.long().max() > 1)


class FakeMesh:
    """The three calls shard_cp_batch makes of a device mesh, without a process group."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def size(self) -> int:
        return self.world

    def get_local_rank(self) -> int:
        return self.rank

    def get_group(self):
        return None


def _four_dimensional_masks():
    real = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    visible = real[:, None, :, None] & real[:, None, None, :] & torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    return {"bool": visible, "additive float": additive, "2-D": real.long()}


@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "packed"])
def test_shard_cp_batch_padding_token_id_the_dtype_holds_matches_upstream_and_others_are_named(packed):
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.uint8), "labels": torch.tensor([[1, 2, 3, 4, 5]])}
    if packed:
        batch["seq_lens"] = torch.tensor([[2, 3]])
    alignment = 4 if packed else 1
    theirs = upstream_cp.shard_cp_batch(
        FakeMesh(1, 2), None, dict(batch), padding_token_id=255, packed_alignment=alignment
    )
    ours = drop_ins.shard_cp_batch(FakeMesh(1, 2), None, dict(batch), padding_token_id=255, packed_alignment=alignment)
    assert_same(ours[1], theirs[1])
    assert ours[1]["input_ids"][0, -1] == 255
    # Upstream writes -1 as 255 and 0.5 as 0; packfn names the argument.
    for padding, message in ((-1, r"padding_token_id=-1 is outside \[0, 255\]"), (0.5, "padding_token_id=0.5 is not")):
        with pytest.raises(ValueError, match=message):
            drop_ins.shard_cp_batch(FakeMesh(1, 2), None, dict(batch), padding_token_id=padding)


@pytest.mark.parametrize("kind", list(_four_dimensional_masks()))
@pytest.mark.parametrize("rank", [0, 1])
def test_shard_cp_batch_reads_padding_off_a_4d_mask_like_upstream(kind, rank):
    mask = _four_dimensional_masks()[kind]
    tokens = torch.arange(12).view(2, 6) + 1
    batch = {"input_ids": tokens, "labels": tokens * 2, "attention_mask": mask}
    theirs = upstream_cp.shard_cp_batch(FakeMesh(rank, 2), None, dict(batch))
    ours = drop_ins.shard_cp_batch(FakeMesh(rank, 2), None, dict(batch))
    assert_same(ours[1], theirs[1])
    assert not ours[1]["attention_mask"].all()  # the padding is found, not lost
