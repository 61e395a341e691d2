"""Load-balanced context parallelism in one process: the token order against the anchors, the varlen keys,
the packer's guarantee, the balance itself and the errors.

The properties that hold for every ``balance`` (shards, masks, varlen boundaries,
``BlockMask``) are in ``tests/distributed/test_distributed_local.py``; the
multi-process runs in ``tests/distributed/test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import packfn
from packfn.distributed import (
    CPShard,
    cp_attention_work,
    cp_block_causal_mask,
    cp_document_block_mask,
    cp_varlen_metadata,
    shard_packed_batch,
)

from tests.assertions import assert_same
from tests.strategies_distributed import (
    ShardCase,
    head_tail_columns,
    reference_columns,
    reference_row,
    shard_cases,
)

SETTINGS = settings(max_examples=40)
BALANCED = ("rotated", "head_tail")


def shards(case: ShardCase, **changes) -> list[CPShard]:
    """Every rank's shard of ``case``."""
    return [
        shard_packed_batch(case.seq_lens, case.seq_lens_padded, **case.kwargs(rank=rank, **changes))
        for rank in range(case.world)
    ]


# ------------------------------------------------------------ the token order


def test_the_module_example():
    seq_lens, tokens = torch.tensor([[8, 4]]), torch.arange(100, 112)[None]
    expected = {
        "head_tail": [[0, 1, 6, 7, 8, 11, 12, 15], [2, 3, 4, 5, 9, 10, 13, 14]],
        "rotated": [[0, 1, 6, 7, 9, 10, 12, 15], [2, 3, 4, 5, 8, 11, 13, 14]],
    }
    for balance, columns in expected.items():
        for rank in range(2):
            shard = shard_packed_batch(
                seq_lens, input_ids=tokens, labels=tokens, rank=rank, world=2, budget=16, balance=balance
            )
            assert shard.plan.key_columns[0].view(2, 8)[rank].tolist() == columns[rank]
            row = torch.tensor(columns[rank])
            assert shard.input_ids[0].tolist() == torch.where(row < 12, row + 100, 0).tolist()
            # Each rank attends half of the 36 + 10 pairs of the two documents.
            assert cp_attention_work(shard).tolist() == [23]


@SETTINGS
@given(shard_cases(balances=("head_tail",)))
def test_head_tail_order_is_megatrons_te_partition_rule(case):
    # Megatron-core documents Transformer Engine's THD partition (thd_get_partitioned_indices) as: each
    # sequence cut into 2 * cp_size chunks, rank r takes chunk r and chunk 2 * cp_size - 1 - r, in order.
    for rank, shard in enumerate(shards(case)):
        for row, lengths in enumerate(case.seq_lens.tolist()):
            widths = [-(-length // case.unit) * case.unit for length in lengths]
            widths.append(case.budget - sum(widths))
            local = shard.plan.key_columns[row].view(case.world, -1)[rank]
            assert local.tolist() == head_tail_columns(widths, case.world, rank)


def _torch_balancer():
    module = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    if not hasattr(module, "_PerDocumentHeadTailLoadBalancer"):
        pytest.skip("this torch has no _PerDocumentHeadTailLoadBalancer")
    return module._PerDocumentHeadTailLoadBalancer


def _document_major(columns: torch.Tensor, widths: list[int], world: int) -> list[int]:
    """The rank-major order of one row as torch releases before pytorch#189902 list it: per span, every rank's
    two chunks in rank order."""
    per_rank = columns.view(world, -1).tolist()
    order, offsets = [], [0] * world
    for width in widths:
        for rank in range(world):
            order += per_rank[rank][offsets[rank] : offsets[rank] + width // world]
            offsets[rank] += width // world
    return order


# Documents of 4 and 8 at world 2: rank 0 holds columns 0, 3 and 4, 5, 10, 11.
FIXED_PROBE = [0, 3, 4, 5, 10, 11, 1, 2, 6, 7, 8, 9]
DOCUMENT_MAJOR_PROBE = [0, 3, 1, 2, 4, 5, 10, 11, 6, 7, 8, 9]


@SETTINGS
@given(shard_cases(balances=("head_tail",)))
def test_head_tail_order_equals_torchs_per_document_load_balancer(case):
    # torch's _PerDocumentHeadTailLoadBalancer(seq_length_per_doc, world)._generate_indices(): the rearrange
    # indices of a row whose spans are each a multiple of 2 * world (the documents' widths, then the row's
    # padding). Until pytorch#189902 (July 2026) it listed them document-major (a contiguous cut then splits
    # documents unevenly); since, rank-major, which is the gathered order. Either way the same chunks.
    balancer = _torch_balancer()
    key_columns = shards(case)[0].plan.key_columns
    probe = balancer([[4, 8]], 2, "cpu")._generate_indices().tolist()[0]
    assert probe in (FIXED_PROBE, DOCUMENT_MAJOR_PROBE)
    fixed = probe == FIXED_PROBE
    for row, lengths in enumerate(case.seq_lens.tolist()):
        widths = [-(-length // case.unit) * case.unit for length in lengths]
        widths.append(case.budget - sum(widths))
        theirs = balancer([widths], case.world, "cpu")._generate_indices()[0]
        ours = key_columns[row]
        expected = ours.tolist() if fixed else _document_major(ours, widths, case.world)
        assert theirs.tolist() == expected
        restore = balancer([widths], case.world, "cpu")._generate_indices(restore=True)[0]
        assert torch.equal(theirs[restore], torch.arange(case.budget))


@SETTINGS
@given(shard_cases(balances=("rotated",)))
def test_rotated_order_turns_each_documents_pair(case):
    assert torch.equal(shards(case)[0].plan.key_columns, reference_columns(case))


@SETTINGS
@given(shard_cases(balances=BALANCED))
def test_every_rank_knows_every_ranks_columns(case):
    everyone = shards(case)
    for shard in everyone:
        assert torch.equal(shard.plan.key_columns, everyone[0].plan.key_columns)
        assert torch.equal(shard.layout.source_indices, everyone[0].layout.source_indices)
    # The shards one after the other are the gathered layout: a permutation of the row.
    key_columns = everyone[0].plan.key_columns
    assert torch.equal(key_columns.sort(1).values, torch.arange(case.budget).expand_as(key_columns))
    gathered = torch.cat([shard.input_ids for shard in everyone], 1)
    assert torch.equal(gathered, everyone[0].layout.pack(case.input_ids))


# ------------------------------------------------------------ the restore and the varlen keys


@SETTINGS
@given(shard_cases(balances=BALANCED))
def test_restore_is_the_inverse_of_the_gathered_order_and_its_backward(case):
    layout = shards(case)[0].layout
    row = reference_row(case)
    values = torch.randn(*case.input_ids.shape, 2, dtype=torch.float64, requires_grad=True)
    gathered = layout.pack(values)
    real = row.real_inputs(case.input_ids.shape[1])
    restored = layout.restore(gathered)
    assert torch.equal(restored[real], values.detach()[real])
    assert not restored[~real].any()
    weights = torch.randn_like(gathered)
    (gradient,) = torch.autograd.grad((gathered * weights).sum(), values)
    # The backward of pack is the restore: each real token gets its own column's weight, padding nothing.
    assert torch.equal(gradient, layout.restore(weights))


@SETTINGS
@given(shard_cases(balances=BALANCED))
def test_varlen_keys_copy_the_gathered_keys_and_sum_their_gradients(case):
    for shard in shards(case):
        metadata = cp_varlen_metadata(shard)
        tables = metadata.key_tables
        source = torch.where(tables.first_source >= 0, tables.first_source, tables.second_source)
        gathered = torch.randn(case.seq_lens.shape[0], case.budget, 3, dtype=torch.float64, requires_grad=True)
        keys = metadata.keys(gathered)
        assert keys.shape == (gathered.shape[0], metadata.key_length, 3)
        copied = (source >= 0).unsqueeze(2)  # each row's last segment copies no key: zeros
        expected = gathered.gather(1, source.clamp_min(0).unsqueeze(2).expand(-1, -1, 3)) * copied
        assert torch.equal(keys, expected)
        weights = torch.randn_like(keys)
        (ours,) = torch.autograd.grad((keys * weights).sum(), gathered)
        (reference,) = torch.autograd.grad((expected * weights).sum(), gathered)  # a scatter-add
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-15)
        # The inverse tables are inverses: each copy's position reads back its source.
        for sources, positions in (
            (tables.first_source, tables.first_positions),
            (tables.second_source, tables.second_positions),
        ):
            copied = positions >= 0
            assert torch.equal(sources.gather(1, positions.clamp_min(0))[copied], torch.nonzero(copied)[:, 1])
            assert int(copied.sum()) == int((sources >= 0).sum())


def test_contiguous_varlen_keys_are_the_gathered_keys():
    shard = shard_packed_batch(
        torch.tensor([[3, 2]]),
        input_ids=torch.ones(1, 5, dtype=torch.int64),
        labels=torch.ones(1, 5, dtype=torch.int64),
        rank=0,
        world=2,
        budget=8,
        alignment=2,
        balance="contiguous",
    )
    metadata = cp_varlen_metadata(shard)
    gathered = torch.randn(1, 8, 2)
    assert metadata.keys(gathered) is gathered
    assert metadata.key_length == 8 and metadata.key_tables is None
    with pytest.raises(ValueError, match=r"gathered must have shape \[batch=1, budget=8, ...\], got \(1, 4, 2\)"):
        metadata.keys(gathered[:, :4])


# ------------------------------------------------------------ edge inputs


@pytest.mark.parametrize("balance", BALANCED)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_edge_rows_one_token_short_and_all_padding(balance, world):
    # One-token documents, documents shorter than 2 * world, one longer, an all-padding row, absent slots.
    seq_lens = torch.tensor([[1, 1, 3, 0, 1], [0, 0, 0, 0, 0], [2 * world + 5, 1, 0, 0, 0]])
    sequence, alignment = 64, 2
    budget = 2 * world * alignment * 6
    tokens = torch.arange(3 * sequence).view(3, sequence) + 1
    every = [
        shard_packed_batch(
            seq_lens,
            input_ids=tokens,
            labels=tokens,
            rank=rank,
            world=world,
            budget=budget,
            alignment=alignment,
            balance=balance,
        )
        for rank in range(world)
    ]
    layout = every[0].layout
    # Every real token lands once, and comes back.
    gathered = torch.cat([shard.input_ids for shard in every], 1)
    assert sorted(gathered[gathered != 0].tolist()) == sorted(
        tokens[
            packfn.aligned_layout(seq_lens, sequence_length=sequence, alignment=1, budget=sequence).input_positions >= 0
        ].tolist()
    )
    assert not gathered[1].any()  # the all-padding row
    restored = layout.restore(gathered)
    real = layout.input_positions >= 0
    assert torch.equal(restored[real], tokens[real])
    work = torch.stack([cp_attention_work(shard) for shard in every])
    assert work.sum(0).tolist() == [1 + 1 + 6 + 1, 0, (2 * world + 5) * (2 * world + 6) // 2 + 1]
    for shard in every:
        cp_block_causal_mask(shard)
        cp_document_block_mask(shard, block_size=2)
        cp_varlen_metadata(shard)


# ------------------------------------------------------------ the packer's guarantee


@pytest.mark.parametrize("world", [2, 4])
def test_packer_pad_to_multiple_of_two_world_alignment_fits_a_balanced_shard(world):
    alignment, sequence = 2, 128
    unit = 2 * world * alignment
    generator = torch.Generator().manual_seed(world)
    lengths = torch.randint(1, 60, (60,), generator=generator).tolist()
    batches = list(
        packfn.pack_stream(
            lengths, batch=3, sequence=sequence, alignment=alignment, max_documents=12, pad_to_multiple_of=unit
        )
    )
    assert len(batches) > 2
    for packed in batches:
        tokens = torch.where(packed.document_ids > 0, 7, 0)
        for balance in BALANCED:
            every = [
                shard_packed_batch(
                    packed.seq_lens,
                    packed.seq_lens_padded,
                    input_ids=tokens,
                    labels=tokens,
                    rank=rank,
                    world=world,
                    budget=sequence,
                    alignment=alignment,
                    balance=balance,
                )
                for rank in range(world)
            ]
            # No assert tripped, and every real token is on some rank.
            assert sum(int((shard.input_ids == 7).sum()) for shard in every) == packed.num_tokens
    # Without the multiple, a row can need more than the budget: a sync-free assert that names the fix.
    packed = packfn.pack_documents(
        [unit + 1, unit + 1, unit - 2], sequence=3 * unit, alignment=alignment, max_documents=3
    )
    tokens = torch.ones_like(packed.document_ids)
    with pytest.raises(
        RuntimeError, match=rf"multiple of 2 \* world \* alignment \(unit={unit}\), do not fit budget={3 * unit}"
    ):
        shard_packed_batch(
            packed.seq_lens,
            input_ids=tokens,
            labels=tokens,
            rank=0,
            world=world,
            budget=3 * unit,
            alignment=alignment,
        )


def test_packed_dataset_with_the_multiple_feeds_balanced_shards():
    world, alignment, sequence = 2, 4, 64
    unit = 2 * world * alignment
    generator = torch.Generator().manual_seed(3)
    examples = [
        torch.randint(1, 50, (int(length),), generator=generator).tolist()
        for length in torch.randint(1, 40, (40,), generator=generator)
    ]
    for dp_rank in range(2):
        dataset = packfn.PackedDataset(
            examples,
            batch=2,
            sequence=sequence,
            max_documents=8,
            alignment=alignment,
            pad_to_multiple_of=unit,
            rank=dp_rank,
            world=2,
        )
        for batch in dataset:
            for rank in range(world):
                shard = shard_packed_batch(
                    batch["seq_lens"],
                    batch["seq_lens_padded"],
                    input_ids=batch["input_ids"],
                    labels=batch["shift_labels"],
                    rank=rank,
                    world=world,
                    budget=sequence,
                    alignment=alignment,
                )
                assert shard.input_ids.shape == (2, sequence // world)


# ------------------------------------------------------------ the balance


def _work(seq_lens: torch.Tensor, world: int, budget: int, balance: str) -> torch.Tensor:
    """int64 ``[world]``: every rank's attended pairs over the batch."""
    tokens = torch.ones(seq_lens.shape[0], budget, dtype=torch.int64)
    return torch.stack(
        [
            cp_attention_work(
                shard_packed_batch(
                    seq_lens, input_ids=tokens, labels=tokens, rank=rank, world=world, budget=budget, balance=balance
                )
            ).sum()
            for rank in range(world)
        ]
    )


def test_rotated_balances_short_documents_where_head_tail_cannot():
    # Best-fit batches of exponential lengths of mean 150 in rows of 4096 at world 8: pure head-tail leaves
    # the documents' work on the low ranks; the rotation evens it out.
    world, sequence = 8, 4096
    generator = torch.Generator().manual_seed(0)
    lengths = (torch.empty(600).exponential_(generator=generator) * 150).round().clamp_min(1).long().tolist()
    imbalance = {"rotated": [], "head_tail": [], "contiguous": []}
    for packed in packfn.pack_stream(
        lengths,
        batch=8,
        sequence=sequence,
        alignment=1,
        max_documents=128,
        pad_to_multiple_of=2 * world,
        drop_last=True,
    ):
        for balance in imbalance:
            work = _work(packed.seq_lens, world, sequence, balance).double()
            imbalance[balance].append(float(work.max() / work.mean()))
    assert len(imbalance["rotated"]) >= 2
    assert max(imbalance["rotated"]) <= 1.05
    assert max(imbalance["rotated"]) < max(imbalance["head_tail"]) < max(imbalance["contiguous"])


def test_long_documents_are_balanced_exactly():
    # A document of all real tokens whose width is 2 * world chunks gives every rank the same work.
    for world in (2, 4, 8):
        for balance in BALANCED:
            work = _work(torch.tensor([[16 * world, 4 * world]]), world, 32 * world, balance)
            assert (work == work[0]).all(), (world, balance, work)


# ------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"balance": "zigzag"}, r"balance must be one of 'rotated', 'head_tail', 'contiguous', got 'zigzag'"),
        (
            {"budget": 20},
            r"budget=20 must be a multiple of 2 \* world \* alignment = 2 \* 2 \* 2 = 8 for balance='rotated'",
        ),
        (
            {"budget": 12, "alignment": 1, "world": 4, "balance": "head_tail"},
            r"budget=12 must be a multiple of .* = 8 for balance='head_tail'",
        ),
    ],
)
def test_balanced_argument_errors(kwargs, message):
    tokens = torch.arange(5)[None]
    arguments = {"input_ids": tokens, "labels": tokens, "rank": 0, "world": 2, "budget": 16, "alignment": 2}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        shard_packed_batch(torch.tensor([[3, 2]]), **arguments)


def test_documents_that_do_not_fit_at_the_balanced_width_trip_the_assert():
    tokens = torch.ones(1, 10, dtype=torch.int64)
    # 5 and 5 tokens take 8 + 8 columns at world 2, alignment 2: not within budget 8, though 10 tokens fit 16.
    message = r"\(unit=8\), do not fit budget=8: pack them with pad_to_multiple_of=2 \* world \* alignment"
    with pytest.raises(RuntimeError, match=message):
        shard_packed_batch(
            torch.tensor([[5, 5]]), input_ids=tokens, labels=tokens, rank=0, world=2, budget=8, alignment=2
        )
    shard_packed_batch(torch.tensor([[5, 5]]), input_ids=tokens, labels=tokens, rank=0, world=2, budget=16, alignment=2)


@given(st.sampled_from(BALANCED))
@settings(max_examples=2)
def test_work_matches_the_dense_mask(balance):
    tokens = torch.ones(2, 40, dtype=torch.int64)
    for rank in range(2):
        shard = shard_packed_batch(
            torch.tensor([[9, 3, 1], [20, 0, 0]]),
            input_ids=tokens,
            labels=tokens,
            rank=rank,
            world=2,
            budget=48,
            balance=balance,
        )
        assert torch.equal(cp_attention_work(shard), cp_block_causal_mask(shard).sum((1, 2, 3)))


def test_a_budget_that_changes_between_compiled_calls_traces_without_a_graph_break():
    # Dynamo turns an int that changes between calls into a SymInt (automatic dynamic shapes): the balanced
    # path and its assert message must trace with it.
    torch._dynamo.reset()

    def step(seq_lens, tokens, budget):
        shard = shard_packed_batch(seq_lens, input_ids=tokens, labels=tokens, rank=1, world=2, budget=budget)
        return shard.input_ids, cp_varlen_metadata(shard).cu_seqlens_k

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    seq_lens, tokens = torch.tensor([[5, 3]]), torch.arange(1, 9)[None]
    for budget in (16, 24, 32):
        assert_same(compiled(seq_lens, tokens, budget), step(seq_lens, tokens, budget))
