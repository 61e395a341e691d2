"""One rank's side of context parallelism, in one process: shards and local-query attention inputs.

Every property compares a rank's shard, for every ``balance``, with the whole
packed row built by the existing ops (``aligned_layout``, ``pack``,
``block_causal_mask``, ``create_block_mask``) read at the row columns that a
plain reference gives each rank (``tests.strategies_distributed.reference_columns``:
contiguous columns, or Megatron's head-tail partition rule by loops). The
multi-process runs are in ``tests/distributed/test_distributed.py``; the
balanced shards' own properties in ``tests/distributed/test_balanced.py``.
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
from tests.compiling import generated_code, no_packfn_fallback
from tests.references import varlen_dense_mask
from tests.strategies_distributed import ShardCase, reference_columns, reference_row, shard_cases

SETTINGS = settings(max_examples=30)


def shard_of(case: ShardCase) -> CPShard:
    return shard_packed_batch(case.seq_lens, case.seq_lens_padded, **case.kwargs())


def own_columns(case: ShardCase) -> slice:
    """This rank's gathered columns."""
    local = case.budget // case.world
    return slice(case.rank * local, (case.rank + 1) * local)


@SETTINGS
@given(shard_cases())
def test_shard_is_this_ranks_columns_of_the_packed_row(case):
    shard = shard_of(case)
    gathered = reference_row(case).at(reference_columns(case))
    columns = own_columns(case)
    assert_same(shard.input_ids, gathered.pack(case.input_ids)[:, columns])
    assert_same(shard.labels, gathered.pack(case.labels, fill=-100)[:, columns])
    assert_same(shard.loss_mask, gathered.pack(case.loss_mask)[:, columns])
    assert_same(shard.position_ids, gathered.position_ids[:, columns])
    assert_same(shard.sequence_ids, gathered.sequence_ids[:, columns])
    assert_same(shard.padding_mask, gathered.sequence_ids[:, columns] == 0)
    assert_same(shard.key_sequence_ids, gathered.sequence_ids)
    assert_same(shard.layout.position_ids, gathered.position_ids)
    assert_same(shard.layout.source_indices, gathered.source_indices)
    assert (shard.start, shard.local, shard.balance) == (columns.start, case.budget // case.world, case.balance)
    # The gathered layout restores gathered values to the input columns (pack's inverse on real tokens).
    real = gathered.real_inputs(case.input_ids.shape[1])
    restored = shard.layout.restore(shard.layout.pack(case.input_ids))
    assert torch.equal(restored[real], case.input_ids[real])
    assert not restored[~real].any()


def test_shards_of_every_rank_make_the_row_example():
    seq_lens = torch.tensor([[3, 2]])
    tokens = torch.arange(10, 15)[None]
    shards = [
        shard_packed_batch(
            seq_lens, input_ids=tokens, labels=tokens, rank=rank, world=2, budget=8, alignment=2, balance="contiguous"
        )
        for rank in range(2)
    ]
    assert shards[0].sequence_ids.tolist() == [[1, 1, 1, 0]]
    assert shards[1].sequence_ids.tolist() == [[2, 2, 0, 0]]
    assert shards[1].position_ids.tolist() == [[0, 1, 0, 0]]
    assert torch.cat([shard.input_ids for shard in shards], 1).tolist() == [[10, 11, 12, 0, 13, 14, 0, 0]]
    assert torch.cat([shard.labels for shard in shards], 1).tolist() == [[10, 11, 12, -100, 13, 14, -100, -100]]
    # cp_varlen_metadata's example: the runs holding each rank's queries, the keys before and after as one each.
    metadata = cp_varlen_metadata(shards[1])
    assert metadata.cu_seqlens_k.tolist() == [0, 4, 6, 8, 8, 8, 8]
    assert metadata.cu_seqlens_q.tolist() == [0, 0, 2, 4, 4, 4, 4]
    metadata = cp_varlen_metadata(shards[0])
    assert metadata.cu_seqlens_k.tolist() == [0, 3, 4, 8, 8, 8, 8]
    assert metadata.cu_seqlens_q.tolist() == [0, 3, 4, 4, 4, 4, 4]


@SETTINGS
@given(shard_cases())
def test_cp_block_causal_mask_is_this_ranks_rows_of_the_whole_mask(case):
    shard = shard_of(case)
    gathered = reference_columns(case)
    whole = packfn.block_causal_mask(reference_row(case).sequence_ids).squeeze(1)  # width order
    queries = gathered[:, own_columns(case)]
    rows = whole.gather(1, queries.unsqueeze(2).expand(-1, -1, case.budget))
    expected = rows.gather(2, gathered.unsqueeze(1).expand(-1, queries.shape[1], -1))
    assert_same(cp_block_causal_mask(shard), expected.unsqueeze(1))


def varlen_mask_on_gathered_keys(metadata, batch: int, local: int, budget: int) -> torch.Tensor:
    """Bool ``[batch * local, batch * budget]``: what the varlen kernel attends, each key buffer column mapped to
    the gathered column it copies."""
    attended = varlen_dense_mask(
        metadata.cu_seqlens_q, metadata.cu_seqlens_k, batch * local, batch * metadata.key_length
    )
    if metadata.key_tables is None:
        return attended
    tables = metadata.key_tables
    source = torch.where(tables.first_source >= 0, tables.first_source, tables.second_source).flatten()
    assert not attended[:, source < 0].any()  # the columns that copy no key (each row's last segment)
    flat = source + torch.arange(batch).repeat_interleave(metadata.key_length) * budget
    mapped = torch.zeros(batch * local, batch * budget, dtype=torch.bool)
    for column in range(flat.shape[0]):
        if source[column] >= 0:
            mapped[:, flat[column]] |= attended[:, column]
    return mapped


@SETTINGS
@given(shard_cases())
def test_cp_varlen_metadata_attends_exactly_the_earlier_keys_of_each_querys_document(case):
    shard = shard_of(case)
    metadata = cp_varlen_metadata(shard)
    batch, budget = shard.key_sequence_ids.shape
    local, key_length = shard.local, metadata.key_length
    documents = case.seq_lens.shape[-1]
    if case.balance == "contiguous":  # the runs that hold queries, and the keys before and after them
        segments = batch * (min(2 * documents, local - 1) + 3)
    else:  # four per slot (the documents' and the row's padding), one without queries a row
        segments = batch * (4 * (documents + 1) + 1)
    assert key_length == (budget if case.balance == "contiguous" else budget + budget // (2 * case.world))
    assert metadata.cu_seqlens_q.shape == metadata.cu_seqlens_k.shape == (segments + 1,)
    assert metadata.cu_seqlens_q.dtype == metadata.cu_seqlens_k.dtype == torch.int32
    assert (int(metadata.cu_seqlens_q[-1]), int(metadata.cu_seqlens_k[-1])) == (batch * local, batch * key_length)
    assert (metadata.max_seqlen_q_bound, metadata.max_seqlen_k_bound) == (local, budget)
    # Every real query attends exactly its row of the dense mask (padding queries attend what they like).
    dense = cp_block_causal_mask(shard).squeeze(1)
    expected = torch.block_diag(*dense) if batch > 1 else dense[0]
    actual = varlen_mask_on_gathered_keys(metadata, batch, local, budget)
    real = (shard.sequence_ids != 0).flatten()
    assert torch.equal(actual[real], expected[real])
    lengths_q = metadata.cu_seqlens_q[1:] - metadata.cu_seqlens_q[:-1]
    lengths_k = metadata.cu_seqlens_k[1:] - metadata.cu_seqlens_k[:-1]
    assert int(metadata.max_seqlen_q) == int(lengths_q.max())
    assert int(metadata.max_seqlen_k) == int(lengths_k.max())
    assert int(lengths_q.max()) <= local and int(lengths_k.max()) <= budget
    assert ((lengths_q == 0) | (lengths_q <= lengths_k)).all()  # bottom-right alignment never drops a query


@SETTINGS
@given(shard_cases(), st.data())
def test_cp_document_block_mask_equals_create_block_mask(case, data):
    shard = shard_of(case)
    block_size = data.draw(st.sampled_from([size for size in range(1, shard.local + 1) if shard.local % size == 0]))
    sequence_ids, positions = shard.key_sequence_ids, shard.layout.position_ids
    start = shard.start

    def mask_mod(b, h, q_idx, kv_idx):
        query = sequence_ids[b, q_idx + start]
        causal = positions[b, kv_idx] <= positions[b, q_idx + start]
        return (query == sequence_ids[b, kv_idx]) & (query != 0) & causal

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
    # The per-rank part of a sharded step (shard, masks, varlen boundaries and keys, the restore), contiguous
    # and balanced in one graph, under Inductor; tests/distributed/test_distributed.py compiles the whole
    # step, collectives included.
    torch._dynamo.reset()

    def local_step(seq_lens, tokens, keys):
        outputs = []
        for balance in ("contiguous", "rotated"):
            shard = shard_packed_batch(
                seq_lens, input_ids=tokens, labels=tokens, rank=1, world=2, budget=64, alignment=4, balance=balance
            )
            metadata = cp_varlen_metadata(shard)
            outputs += [shard.input_ids, shard.position_ids, cp_block_causal_mask(shard), metadata.cu_seqlens_q]
            outputs += [metadata.cu_seqlens_k, metadata.keys(keys), shard.layout.restore(keys)]
        return outputs

    compiled = torch.compile(local_step, fullgraph=True, dynamic=False)
    generator = torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            seq_lens = torch.randint(0, 5, (2, 3), generator=generator)
            tokens = torch.randint(1, 100, (2, 12), generator=generator)
            keys = torch.randn(2, 64, 3, generator=generator)
            with generated_code() as codes:
                assert_same(compiled(seq_lens, tokens, keys), local_step(seq_lens, tokens, keys))
            if step == 0:
                no_packfn_fallback("\n".join(codes))  # every op decomposed (pack / restore included)
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
    arguments["balance"] = "contiguous"
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
            balance="contiguous",
        )


def test_attention_builders_reject_other_inputs():
    shard = shard_packed_batch(
        SEQ_LENS, input_ids=TOKENS, labels=TOKENS, rank=0, world=2, budget=8, alignment=2, balance="contiguous"
    )
    for builder in (cp_block_causal_mask, cp_varlen_metadata, cp_document_block_mask):
        with pytest.raises(TypeError, match="shard must be a CPShard"):
            builder(shard.key_sequence_ids)
    with pytest.raises(ValueError, match="block_size=3 must divide the local shard length 4"):
        cp_document_block_mask(shard, block_size=3)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_contiguous_varlen_segments_cut_documents_that_cross_rank_boundaries(world):
    # Documents of 5, 7, 1 and 6 tokens in rows of 24 columns: boundaries between ranks (every 12, 8 or 6
    # columns) fall inside documents, so a query cut one column late (or early) sees a key it must not.
    seq_lens = torch.tensor([[5, 7, 1, 6], [3, 0, 9, 2]])
    budget = 24
    tokens = torch.arange(2 * 21).view(2, 21) + 1
    for rank in range(world):
        shard = shard_packed_batch(
            seq_lens, input_ids=tokens, labels=tokens, rank=rank, world=world, budget=budget, balance="contiguous"
        )
        metadata = cp_varlen_metadata(shard)
        batch, local = 2, shard.local
        assert metadata.cu_seqlens_k.shape == (batch * (min(2 * 4, local - 1) + 3) + 1,)
        dense = torch.block_diag(*cp_block_causal_mask(shard).squeeze(1))
        real = (shard.sequence_ids != 0).flatten()
        actual = varlen_mask_on_gathered_keys(metadata, batch, local, budget)
        assert torch.equal(actual[real], dense[real]), (world, rank)
