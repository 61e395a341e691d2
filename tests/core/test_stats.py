"""Packing statistics (packfn.data.stats): values against plain references, the tensor form, the loader's key."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from packfn import pack_documents, pack_stream
from packfn.data import BATCH_KEYS, CLOSED_BY, PackedDataset
from packfn.data.batch import CLOSED_BUDGET, CLOSED_DOCUMENTS, CLOSED_END, CLOSED_TOKENS
from packfn.data.fit import Budgets, Plan
from packfn.data.stats import (
    STATS_FIELDS,
    PackingStats,
    ThrownFill,
    fill_warning,
    packing_stats,
    stats_dict,
    stats_tensors,
    thrown_fill,
)

from tests.strategies_packer import packing_inputs

HYPOTHESIS = settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
SMALL = {"batch": 2, "sequence": 24, "max_documents": 4, "alignment": 4, "window": 7}


def reference_stats(rows, totals, closed_by, *, sequence: int, budget: int) -> dict:
    """The stats by their definitions, in plain Python over each row's pieces ``(document, offset, length)``."""
    filled = [pieces for pieces in rows if pieces]
    real = sum(length for pieces in rows for _, _, length in pieces)
    documents = sum(len(pieces) for pieces in rows)
    closed = Counter(reason for reason, pieces in zip(closed_by, rows, strict=True) if pieces)
    return {
        "fill": real / (len(rows) * sequence),
        "aligned_fill": real / (len(rows) * budget),
        "documents_mean": documents / len(filled) if filled else 0.0,
        "documents_max": max((len(pieces) for pieces in rows), default=0),
        "split_pieces": sum(1 for pieces in rows for document, _, length in pieces if length != totals[document]),
        **{f"closed_{reason}": closed[reason] for reason in CLOSED_BY},
        "real_tokens": real,
        "documents": documents,
        "rows": len(rows),
        "columns": len(rows) * sequence,
        "aligned_columns": len(rows) * budget,
    }


def batch_rows(packed) -> list[list[tuple[int, int, int]]]:
    return [[(piece.document, piece.offset, piece.length) for piece in pieces] for pieces in packed.rows]


def loader_rows(batch: dict) -> list[list[tuple[int, int, int]]]:
    """Each row's pieces read from a loader batch's own keys (``documents``, ``document_offsets``, ``seq_lens``)."""
    return [
        [
            (int(document), int(offset), int(length))
            for document, offset, length in zip(documents, offsets, lengths, strict=True)
            if document >= 0
        ]
        for documents, offsets, lengths in zip(
            batch["documents"], batch["document_offsets"], batch["seq_lens"], strict=True
        )
    ]


def assert_stats_equal(stats: dict, expected: dict) -> None:
    assert list(stats) == list(STATS_FIELDS)
    for name in STATS_FIELDS:
        assert stats[name] == pytest.approx(expected[name], rel=1e-12, abs=0), name


# ------------------------------------------------------------------ a PackedBatch


@HYPOTHESIS
@given(packing_inputs(split=True), st.integers(0, 2), st.sampled_from(["best_fit", "next_fit"]))
def test_packing_stats_match_the_rows_counted_by_hand(case, extra_rows, strategy):
    limits, lengths = case
    rows = len(pack_documents(lengths, **limits.kwargs(), split=True, strategy=strategy).rows)
    packed = pack_documents(lengths, **limits.kwargs(), split=True, strategy=strategy, batch=rows + extra_rows)
    stats = packing_stats(packed)
    expected = reference_stats(
        batch_rows(packed), lengths, packed.closed_by, sequence=limits.sequence, budget=packed.budget
    )
    assert_stats_equal(stats._asdict(), expected)
    assert stats.aligned_fill == pytest.approx(packed.fill_ratio)
    assert stats.limits() == packed.limits()
    assert stats.real_tokens == packed.num_tokens == sum(lengths)


def test_packing_stats_of_the_documented_example():
    packed = pack_documents([4, 3, 12, 2, 7], sequence=16, alignment=4, max_documents=3)
    stats = packing_stats(packed)
    assert (stats.rows, stats.real_tokens, stats.fill) == (2, 28, 0.875)
    assert (stats.documents_mean, stats.documents_max) == (2.5, 3)
    assert (stats.closed_tokens, stats.closed_documents, stats.split_pieces) == (1, 1, 0)


def test_split_pieces_count_every_piece_of_a_cut_document():
    # 20 tokens in rows of 8: pieces 8, 8, 4 (the last packed with the 3-token document).
    stats = packing_stats(pack_documents([20, 3], sequence=8, alignment=1, max_documents=4, split=True))
    assert (stats.split_pieces, stats.documents, stats.rows) == (3, 4, 3)


def test_packing_stats_rejects_what_is_not_a_packed_batch():
    with pytest.raises(TypeError, match="packed must be a PackedBatch, got dict"):
        packing_stats({"document_ids": torch.zeros(1, 4)})


# ------------------------------------------------------------------ the tensor form


def test_the_tensor_form_round_trips_in_the_order_of_stats_fields():
    stats = packing_stats(pack_documents([5, 9, 2, 7, 7], sequence=12, alignment=2, max_documents=2))
    values = stats.tensor()
    assert values.dtype == torch.float64 and values.shape == (len(STATS_FIELDS),)
    assert values.tolist() == [float(getattr(stats, name)) for name in STATS_FIELDS]
    assert PackingStats.from_tensor(values) == stats
    assert stats_dict(values) == stats_dict(stats) == stats._asdict()
    assert all(isinstance(stats_dict(values)[name], int) for name in ("documents_max", "rows", "closed_end"))


@HYPOTHESIS
@given(packing_inputs(split=True), st.integers(1, 3))
def test_a_stack_of_batches_combines_to_the_stats_of_all_their_rows(case, batch):
    limits, lengths = case
    batches = list(pack_stream(iter(lengths), batch=batch, **limits.kwargs(), split=True, window=4))
    stack = torch.stack([packing_stats(packed).tensor() for packed in batches])
    combined = stats_dict(stack)
    rows = [row for packed in batches for row in batch_rows(packed)]
    closed_by = [reason for packed in batches for reason in packed.closed_by]
    budget = batches[0].budget
    assert_stats_equal(combined, reference_stats(rows, lengths, closed_by, sequence=limits.sequence, budget=budget))
    # Any leading shape: a stack of stacks is the same batches.
    assert stats_dict(stack.view(1, len(batches), -1)) == combined


def test_from_tensor_names_what_is_wrong():
    with pytest.raises(TypeError, match=r"values must be a torch\.Tensor, got list"):
        stats_dict([0.0] * len(STATS_FIELDS))
    with pytest.raises(TypeError, match="values must be a floating tensor"):
        stats_dict(torch.zeros(len(STATS_FIELDS), dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"shape \[\.\.\., {len(STATS_FIELDS)}\].*got \(3,\)"):
        stats_dict(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="got \\(\\)"):
        stats_dict(torch.tensor(1.0))
    with pytest.raises(ValueError, match="holds no batch's stats"):
        stats_dict(torch.zeros(0, len(STATS_FIELDS), dtype=torch.float64))


def test_from_tensor_leaves_its_input_alone():
    values = torch.stack([packing_stats(pack_documents([3, 4], sequence=8, alignment=1, max_documents=2)).tensor()] * 2)
    before = values.clone()
    stats_dict(values)
    assert torch.equal(values, before)


# ------------------------------------------------------------------ the loader


@st.composite
def loader_cases(draw):
    limits, lengths = draw(packing_inputs(split=True, max_documents=30, max_sequence=48))
    kwargs = {
        **limits.kwargs(),
        "batch": draw(st.integers(1, 3)),
        "window": draw(st.integers(1, 12)),
        "split": True,
        "strategy": draw(st.sampled_from(["best_fit", "next_fit"])),
        "drop_last": draw(st.booleans()),
    }
    return kwargs, lengths


@HYPOTHESIS
@given(loader_cases())
@pytest.mark.filterwarnings("ignore::packfn.data.FillWarning")  # drawn caps as small as 1 throw fill away
def test_every_loader_batch_carries_its_stats(case):
    """The key against a reference read from the batch's own keys, with ``closed_by`` from ``pack_stream``."""
    kwargs, lengths = case
    documents = [[7] * length for length in lengths]
    batches = list(PackedDataset(documents, **kwargs))
    streamed = list(pack_stream(iter(lengths), **kwargs))  # one shard, in order: the loader's rows
    assert len(batches) == len(streamed)
    for batch, packed in zip(batches, streamed, strict=True):
        assert tuple(batch) == BATCH_KEYS
        values = batch["packing_stats"]
        assert values.dtype == torch.float64 and values.shape == (len(STATS_FIELDS),)
        rows = loader_rows(batch)
        assert rows == batch_rows(packed)
        expected = reference_stats(rows, lengths, packed.closed_by, sequence=kwargs["sequence"], budget=packed.budget)
        assert_stats_equal(stats_dict(values), expected)
        real = int((batch["document_ids"] > 0).sum())
        assert stats_dict(values)["fill"] == pytest.approx(real / batch["document_ids"].numel())


def test_stats_off_leaves_the_key_out_and_every_other_key_the_same():
    documents = [[index + 1] * (1 + index % 13) for index in range(80)]
    with_stats = list(PackedDataset(documents, **SMALL))
    without = list(PackedDataset(documents, **SMALL, packing_stats=False))
    assert len(with_stats) == len(without)
    for one, other in zip(with_stats, without, strict=True):
        assert tuple(other) == tuple(key for key in BATCH_KEYS if key != "packing_stats")
        assert all(torch.equal(one[key], other[key]) for key in other)
    with pytest.raises(TypeError, match="packing_stats must be a bool, got str"):
        PackedDataset(documents, **SMALL, packing_stats="yes")


def test_a_state_saved_with_stats_resumes_without_them_on_the_same_batches():
    documents = [[index + 1] * (1 + index % 9) for index in range(70)]
    uninterrupted = list(PackedDataset(documents, **SMALL, packing_stats=False))
    dataset = PackedDataset(documents, **SMALL)
    iterator = iter(dataset)
    head = [next(iterator) for _ in range(5)]
    restored = PackedDataset(documents, **SMALL, packing_stats=False)
    restored.load_state_dict(dataset.state_dict())
    rest = list(restored)
    assert len(head) + len(rest) == len(uninterrupted)
    for one, other in zip(head + rest, uninterrupted, strict=True):
        assert all(torch.equal(one[key], other[key]) for key in other)


def test_the_stats_of_a_resumed_run_are_those_of_the_uninterrupted_one():
    """A resume that starts inside a window builds the window's table again: the stats do not move."""
    documents = [[index + 1] * (1 + index % 11) for index in range(90)]
    kwargs = {**SMALL, "window": 30}
    uninterrupted = [batch["packing_stats"] for batch in PackedDataset(documents, **kwargs)]
    for stop in (1, 4, 7):
        dataset = PackedDataset(documents, **kwargs)
        iterator = iter(dataset)
        for _ in range(stop):
            next(iterator)
        restored = PackedDataset(documents, **kwargs)
        restored.load_state_dict(dataset.state_dict())
        assert all(
            torch.equal(one, batch["packing_stats"]) for one, batch in zip(uninterrupted[stop:], restored, strict=True)
        )


def test_stats_travel_through_a_dataloader_and_stack():
    documents = [[index + 1] * (1 + index % 13) for index in range(120)]
    direct = [batch["packing_stats"] for batch in PackedDataset(documents, **SMALL)]
    loaded = [batch["packing_stats"] for batch in DataLoader(PackedDataset(documents, **SMALL), batch_size=None)]
    assert all(torch.equal(one, other) for one, other in zip(direct, loaded, strict=True))
    combined = stats_dict(torch.stack(loaded))
    assert combined["real_tokens"] == sum(len(document) for document in documents)
    assert combined["documents"] == len(documents)  # no document is split here


def test_stats_tensors_give_each_batch_its_own_entries():
    stats = [
        packing_stats(pack_documents(lengths, sequence=8, alignment=1, max_documents=3))
        for lengths in ([3, 4, 5], [8, 1, 1, 1])
    ]
    first, second = stats_tensors(stats)
    assert torch.equal(first, stats[0].tensor()) and torch.equal(second, stats[1].tensor())
    first.zero_()  # no batch sees another's entries
    assert torch.equal(second, stats[1].tensor())


# ------------------------------------------------------------------ the fill a cap or a budget throws away


def hand_plan(rows: list[list[int]], closed: list[int], multiple: int) -> Plan:
    """A window's plan built by hand: each row's piece lengths, what closed it; spans rounded up to ``multiple``."""
    length = torch.tensor([value for pieces in rows for value in pieces])
    row = torch.tensor([index for index, pieces in enumerate(rows) for _ in pieces])
    span = (length + multiple - 1) // multiple * multiple
    count = torch.tensor([len(pieces) for pieces in rows])
    first = torch.cumsum(count, 0) - count
    slot = torch.arange(length.shape[0]) - first.index_select(0, row)
    before = torch.cumsum(span, 0) - span
    column = before - before.index_select(0, first).index_select(0, row)
    zeros = torch.zeros_like(length)
    fullness = torch.zeros(len(rows))
    return Plan(len(rows), row, slot, torch.arange(length.shape[0]), zeros, length, span, column, count, first,
                torch.tensor(closed), fullness)  # fmt: skip


@pytest.mark.parametrize(
    ("budgets", "rows", "closed", "sent", "expected"),
    [
        # A budget wider than the row: [3, 2, 1] spans 6 and takes 12 aligned columns, so 32 - 12 = 20 are left;
        # [9, 9, 9] takes 36 aligned columns, more than the row's 32, and leaves none (not -4). The last row is
        # not sent.
        (
            Budgets(32, 4, 3, 40, 1, False, "best_fit"),
            [[3, 2, 1], [9, 9, 9], [32], [5]],
            [CLOSED_DOCUMENTS, CLOSED_DOCUMENTS, CLOSED_TOKENS, CLOSED_END],
            [1, 0, 2],
            ThrownFill(rows=3, real_tokens=65, cap_rows=2, cap_columns=20, budget_rows=0, budget_columns=0),
        ),
        # A budget narrower than the row, spans in multiples of 2: [5, 5] spans 12 and fills the 16 aligned
        # columns of the budget, [3, 9] spans 14 and fills them too: 32 - 16 = 16 left in each.
        (
            Budgets(32, 4, 8, 16, 2, False, "best_fit"),
            [[5, 5], [3, 9], [1]],
            [CLOSED_BUDGET, CLOSED_BUDGET, CLOSED_END],
            [0, 1, 2],
            ThrownFill(rows=3, real_tokens=23, cap_rows=0, cap_columns=0, budget_rows=2, budget_columns=32),
        ),
    ],
)
def test_thrown_fill_counts_the_columns_beyond_the_spans_and_aligned_widths_of_the_rows_sent(
    budgets, rows, closed, sent, expected
):
    plan = hand_plan(rows, closed, budgets.multiple)
    assert thrown_fill(plan, torch.tensor(sent), budgets) == expected


def test_thrown_fill_adds_up_field_by_field():
    total = ThrownFill(1, 2, 3, 4, 5, 6).plus(ThrownFill(10, 20, 30, 40, 50, 60))
    assert total == ThrownFill(11, 22, 33, 44, 55, 66)
    assert ThrownFill().plus(total) == total


def test_fill_warning_names_each_limit_whose_rows_leave_more_than_a_tenth_of_the_columns_empty():
    """docs/packer.md: more than 10% of the sent rows' input columns; 10 rows of 100 columns here."""
    budgets = Budgets(100, 1, 4, 100, 1, False, "best_fit")
    at_the_share = ThrownFill(rows=10, real_tokens=500, cap_rows=3, cap_columns=100, budget_rows=2, budget_columns=100)
    assert fill_warning(at_the_share, budgets) is None
    assert fill_warning(ThrownFill(), budgets) is None  # no row sent
    cap = fill_warning(at_the_share._replace(cap_columns=101), budgets)
    assert cap.startswith("of the 10 rows packed (fill 0.500 of rows x sequence=100), max_documents=4 closed 3 of "
                          "them, leaving 10.1% of their input columns empty"), cap  # fmt: skip
    assert "budget=100" not in cap and "A larger max_documents fills them" in cap
    budget = fill_warning(at_the_share._replace(budget_columns=101), budgets)
    assert "budget=100 closed 2 of them, leaving 10.1%" in budget and "max_documents=4" not in budget
    both = fill_warning(at_the_share._replace(cap_columns=400, budget_columns=300), budgets)
    assert "max_documents=4 closed 3 of them, leaving 40.0% and budget=100 closed 2 of them, leaving 30.0%" in both
    assert "A larger max_documents or a wider budget fills them" in both
