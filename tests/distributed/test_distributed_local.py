"""One rank's side of context parallelism, in one process: shards and local-query attention inputs.

Every property compares a rank's shard with the whole packed row built by the
existing ops (``aligned_layout``, ``pack``, ``block_causal_mask``,
``physical_varlen_metadata``, ``create_block_mask``). The multi-process runs
are in ``tests/distributed/test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import packfn
from packfn.distributed import (
    CPShard,
    cp_block_causal_mask,
    cp_document_block_mask,
    cp_varlen_metadata,
    shard_packed_batch,
)

from tests.assertions import assert_same
from tests.references import varlen_dense_mask
from tests.strategies_distributed import ShardCase, shard_cases

SETTINGS = settings(max_examples=30)


def whole_row(case: ShardCase) -> packfn.PackedSequenceLayout:
    return packfn.aligned_layout(
        case.seq_lens,
        case.seq_lens_padded,
        sequence_length=case.input_ids.shape[1],
        alignment=case.alignment,
        budget=case.budget,
    )


def shard_of(case: ShardCase) -> CPShard:
    return shard_packed_batch(case.seq_lens, case.seq_lens_padded, **case.kwargs())


def own_columns(case: ShardCase) -> slice:
    local = case.budget // case.world
    return slice(case.rank * local, (case.rank + 1) * local)


@SETTINGS
@given(shard_cases())
def test_shard_is_this_ranks_columns_of_the_packed_row(case):
    layout = whole_row(case)
    shard = shard_of(case)
    columns = own_columns(case)
    assert_same(shard.input_ids, layout.pack(case.input_ids)[:, columns])
    assert_same(shard.labels, layout.pack(case.labels, fill=-100)[:, columns])
    assert_same(shard.loss_mask, layout.pack(case.loss_mask)[:, columns])
    assert_same(shard.position_ids, layout.position_ids[:, columns])
    assert_same(shard.sequence_ids, layout.sequence_ids[:, columns])
    assert_same(shard.padding_mask, layout.sequence_ids[:, columns] == 0)
    assert_same(shard.key_sequence_ids, layout.sequence_ids)
    assert (shard.start, shard.local) == (columns.start, columns.stop - columns.start)


def test_shards_of_every_rank_make_the_row_example():
    seq_lens = torch.tensor([[3, 2]])
    tokens = torch.arange(10, 15)[None]
    shards = [
        shard_packed_batch(seq_lens, input_ids=tokens, labels=tokens, rank=rank, world=2, budget=8, alignment=2)
        for rank in range(2)
    ]
    assert shards[0].sequence_ids.tolist() == [[1, 1, 1, 0]]
    assert shards[1].sequence_ids.tolist() == [[2, 2, 0, 0]]
    assert shards[1].position_ids.tolist() == [[0, 1, 0, 0]]
    assert torch.cat([shard.input_ids for shard in shards], 1).tolist() == [[10, 11, 12, 0, 13, 14, 0, 0]]
    assert torch.cat([shard.labels for shard in shards], 1).tolist() == [[10, 11, 12, -100, 13, 14, -100, -100]]
    metadata = cp_varlen_metadata(shards[1])
    assert metadata.cu_seqlens_k[:6].tolist() == [0, 3, 4, 6, 8, 8]
    assert metadata.cu_seqlens_q[:6].tolist() == [0, 0, 0, 2, 4, 4]


@SETTINGS
@given(shard_cases())
def test_cp_block_causal_mask_is_this_ranks_rows_of_the_whole_mask(case):
    shard = shard_of(case)
    expected = packfn.block_causal_mask(whole_row(case).sequence_ids)[:, :, own_columns(case)]
    assert_same(cp_block_causal_mask(shard), expected)


@SETTINGS
@given(shard_cases())
def test_cp_varlen_metadata_attends_as_the_whole_rows_physical_segments(case):
    shard = shard_of(case)
    metadata = cp_varlen_metadata(shard)
    batch, budget = shard.key_sequence_ids.shape
    local = shard.local
    assert metadata.cu_seqlens_q.shape == metadata.cu_seqlens_k.shape == (batch * budget + 1,)
    assert metadata.cu_seqlens_q.dtype == metadata.cu_seqlens_k.dtype == torch.int32
    assert (int(metadata.cu_seqlens_q[-1]), int(metadata.cu_seqlens_k[-1])) == (batch * local, batch * budget)
    assert (metadata.max_seqlen_q_bound, metadata.max_seqlen_k_bound) == (local, budget)
    # The whole row's physical varlen mask, at this rank's query rows.
    whole = packfn.physical_varlen_metadata(whole_row(case).sequence_ids).cu_seqlens
    expected = varlen_dense_mask(whole, whole, batch * budget, batch * budget)
    rows = (torch.arange(batch)[:, None] * budget + torch.arange(shard.start, shard.start + local)).flatten()
    actual = varlen_dense_mask(metadata.cu_seqlens_q, metadata.cu_seqlens_k, batch * local, batch * budget)
    assert torch.equal(actual, expected[rows])
    lengths_q = metadata.cu_seqlens_q[1:] - metadata.cu_seqlens_q[:-1]
    lengths_k = metadata.cu_seqlens_k[1:] - metadata.cu_seqlens_k[:-1]
    assert int(metadata.max_seqlen_q) == int(lengths_q.max())
    assert int(metadata.max_seqlen_k) == int(lengths_k.max())


@SETTINGS
@given(shard_cases(), st.data())
def test_cp_document_block_mask_equals_create_block_mask(case, data):
    shard = shard_of(case)
    block_size = data.draw(st.sampled_from([size for size in range(1, shard.local + 1) if shard.local % size == 0]))
    sequence_ids = shard.key_sequence_ids
    start = shard.start

    def mask_mod(b, h, q_idx, kv_idx):
        query = sequence_ids[b, q_idx + start]
        return (query == sequence_ids[b, kv_idx]) & (query != 0) & (q_idx + start >= kv_idx)

    batch, budget = sequence_ids.shape
    expected = create_block_mask(mask_mod, batch, 1, shard.local, budget, device="cpu", BLOCK_SIZE=block_size)
    actual = cp_document_block_mask(shard, block_size=block_size)
    assert actual.shape == expected.shape
    assert actual.BLOCK_SIZE == expected.BLOCK_SIZE
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert_same(getattr(actual, name), getattr(expected, name))
    assert_same(actual.to_dense(), expected.to_dense())
    q = torch.arange(shard.local)[:, None]
    kv = torch.arange(budget)
    for b in range(batch):
        index = torch.tensor(b)
        assert torch.equal(actual.mask_mod(index, 0, q, kv), mask_mod(index, 0, q, kv))


def test_local_part_compiles_with_inductor_without_recompiles():
    # The per-rank part of a sharded step (shard, masks, varlen boundaries) under Inductor;
    # tests/distributed/test_distributed.py compiles the whole step, collectives included.
    torch._dynamo.reset()

    def local_step(seq_lens, tokens):
        shard = shard_packed_batch(seq_lens, input_ids=tokens, labels=tokens, rank=1, world=2, budget=32, alignment=4)
        metadata = cp_varlen_metadata(shard)
        return shard.input_ids, shard.position_ids, cp_block_causal_mask(shard), metadata.cu_seqlens_q

    compiled = torch.compile(local_step, fullgraph=True, dynamic=False)
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            seq_lens = torch.randint(0, 5, (2, 3), generator=generator)
            tokens = torch.randint(1, 100, (2, 12), generator=generator)
            assert_same(compiled(seq_lens, tokens), local_step(seq_lens, tokens))
            torch._dynamo.config.error_on_recompile = True
    finally:
        torch._dynamo.config.error_on_recompile = False


SEQ_LENS = torch.tensor([[3, 2]])
TOKENS = torch.arange(5)[None]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world": 3, "budget": 8, "alignment": 2}, ValueError, r"budget=8 must be a multiple of world \* alignment"),
        ({"world": 2, "budget": 12, "alignment": 4}, ValueError, r"= 2 \* 4 = 8"),
        ({"world": 2, "rank": 2}, ValueError, r"rank must be in \[0, world=2\), got 2"),
        ({"world": 0}, ValueError, "world must be positive"),
        ({"budget": 8.0}, TypeError, "budget must be an int"),
        ({"input_ids": TOKENS[0]}, ValueError, r"input_ids must be a \[batch, sequence\] tensor"),
        ({"labels": TOKENS[:, :4]}, ValueError, r"labels must have shape \[batch, sequence\] = \[1, 5\]"),
        ({"loss_mask": [1, 1]}, TypeError, "loss_mask must be a torch.Tensor"),
        ({"seq_lens": torch.tensor([[3, 2], [1, 1]])}, ValueError, r"batch = 1 rows .*got \(2, 2\)"),
        (
            {"seq_lens": torch.tensor([3, 2]), "input_ids": TOKENS.expand(2, 5), "labels": TOKENS.expand(2, 5)},
            ValueError,
            r"batch = 2 rows \(or \[documents\] for one row\), got \(2,\)",
        ),
        ({"seq_lens": [[3, 2]]}, TypeError, "seq_lens must be a torch.Tensor"),
        ({"input_ids": TOKENS[:, :0], "labels": TOKENS[:, :0]}, ValueError, "at least one column"),
        ({"padding_token_id": None}, TypeError, "padding_token_id must be an int"),
        ({"labels": TOKENS.to(torch.uint8)}, TypeError, "labels must be an int32 or int64"),
    ],
)
def test_shard_packed_batch_argument_errors(kwargs, error, message):
    arguments = {"input_ids": TOKENS, "labels": TOKENS, "rank": 0, "world": 2, "budget": 8, "alignment": 2}
    arguments.update(kwargs)
    seq_lens = arguments.pop("seq_lens", SEQ_LENS)
    with pytest.raises(error, match=message):
        shard_packed_batch(seq_lens, **arguments)


def test_documents_past_the_budget_trip_the_layout_assert():
    with pytest.raises(RuntimeError, match="fit"):
        shard_packed_batch(
            torch.tensor([[5, 5]]),
            input_ids=torch.ones(1, 10, dtype=torch.int64),
            labels=torch.ones(1, 10, dtype=torch.int64),
            rank=0,
            world=2,
            budget=8,
        )


def test_attention_builders_reject_other_inputs():
    shard = shard_packed_batch(SEQ_LENS, input_ids=TOKENS, labels=TOKENS, rank=0, world=2, budget=8, alignment=2)
    for builder in (cp_block_causal_mask, cp_varlen_metadata, cp_document_block_mask):
        with pytest.raises(TypeError, match="shard must be a CPShard"):
            builder(shard.key_sequence_ids)
    with pytest.raises(ValueError, match="block_size=3 must divide the local shard length 4"):
        cp_document_block_mask(shard, block_size=3)
