"""The dense packer (best fit, the default): the static budgets it guarantees, conservation, density, what closed
each row, windows over a stream, and the budgets it proposes."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import packfn
from packfn import pack_documents, pack_stream, suggest_budgets
from packfn.data import PackedBatch

from tests.assertions_packer import assert_fits_the_static_ops, assert_rows_within_budgets
from tests.references_packer import best_fit_decreasing
from tests.strategies_packer import Budgets, packing_inputs, round_up

with contextlib.suppress(ImportError):  # imported at collection, before a test can take modules out of sys.modules
    import datasets  # noqa: F401

HYPOTHESIS = settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])


def assert_conserved(packed: PackedBatch, lengths: list[int], limits: Budgets) -> None:
    """Every document is there once: whole if an empty row holds it, else in pieces that tile it."""
    pieces = sorted((piece.document, piece.offset, piece.length) for row in packed.rows for piece in row)
    grouped = {document: list(group) for document, group in itertools.groupby(pieces, key=lambda piece: piece[0])}
    assert sorted(grouped) == list(range(len(lengths)))
    longest = limits.longest_unsplit
    for document, group in grouped.items():
        offsets = [offset for _, offset, _ in group]
        assert offsets == list(itertools.accumulate([0] + [length for *_, length in group[:-1]]))
        assert sum(length for *_, length in group) == lengths[document]
        if lengths[document] <= longest:
            assert len(group) == 1, f"document {document} fits an empty row but was split"
        else:  # full rows, then the rest
            assert [length for *_, length in group[:-1]] == [longest] * (len(group) - 1)
    assert packed.num_tokens == sum(lengths)


# ------------------------------------------------------------- the guarantee and conservation


@HYPOTHESIS
@given(packing_inputs(split=False) | packing_inputs(split=True), st.data())
def test_best_fit_batches_fit_the_static_budgets_and_hold_every_document_once(case, data):
    limits, lengths = case
    split = max(lengths) > limits.longest_unsplit
    packed = pack_documents(lengths, **limits.kwargs(), split=split)
    assert_rows_within_budgets(packed, limits)
    assert_fits_the_static_ops(packed, limits)
    assert_conserved(packed, lengths, limits)
    # Rows come out ordered by their first document.
    firsts = [min(piece.document for piece in row) for row in packed.rows]
    assert firsts == sorted(firsts)
    # Deterministic: the same lengths pack the same way, as a list, a tensor or a tuple.
    again = pack_documents(
        data.draw(st.sampled_from([torch.tensor, tuple, list]))(lengths), **limits.kwargs(), split=split
    )
    assert again.rows == packed.rows and torch.equal(again.document_ids, packed.document_ids)


@HYPOTHESIS
@given(packing_inputs(split=False, max_documents=40))
def test_best_fit_needs_no_more_rows_than_best_fit_decreasing_on_the_aligned_sizes(case):
    limits, lengths = case
    packed = pack_documents(lengths, **limits.kwargs())
    if limits.one_budget:  # the aligned budget implies the input one: the reference's problem exactly
        reference = best_fit_decreasing(
            lengths, alignment=limits.alignment, capacity=limits.resolved_budget, cap=limits.max_documents
        )
        assert packed.batch <= len(reference)
    lower_bound = max(
        math.ceil(sum(round_up(n, limits.alignment) for n in lengths) / limits.resolved_budget),
        math.ceil(len(lengths) / limits.max_documents),
    )
    assert lower_bound <= packed.batch


def test_best_fit_packs_densely_where_next_fit_does_not():
    lengths = [4, 3, 12, 2, 7]
    packed = pack_documents(lengths, sequence=16, alignment=4, max_documents=3)
    assert [[piece.document for piece in row] for row in packed.rows] == [[0, 2], [1, 3, 4]]
    assert pack_documents(lengths, sequence=16, alignment=4, max_documents=3, strategy="next_fit").batch == 3


def test_a_split_document_fills_whole_rows_and_its_rest_is_packed_like_any_document():
    packed = pack_documents([5, 40, 2], sequence=16, alignment=4, max_documents=4, split=True)
    pieces = {(piece.document, piece.offset): piece.length for row in packed.rows for piece in row}
    assert pieces == {(0, 0): 5, (1, 0): 16, (1, 16): 16, (1, 32): 8, (2, 0): 2}
    # The rest (8 aligned columns) fills document 0's row; 2 takes a row of its own: 52 aligned columns, 4 rows.
    assert [[(piece.document, piece.offset) for piece in row] for row in packed.rows] == [
        [(0, 0), (1, 32)],
        [(1, 0)],
        [(1, 16)],
        [(2, 0)],
    ]


def test_a_binding_cap_takes_the_balanced_pass_when_it_needs_fewer_rows():
    # Longest first: 30 and 2 fill a row by tokens, 3, 1, 1 the next by the cap, the last 1 needs a third row.
    lengths = [3, 1, 30, 1, 2, 1]
    reference = best_fit_decreasing(lengths, alignment=1, capacity=32, cap=3)
    assert len(reference) == 3
    packed = pack_documents(lengths, sequence=32, alignment=1, max_documents=3)
    assert packed.batch == 2 and sorted(len(row) for row in packed.rows) == [3, 3]  # dealt long and short alike
    assert_fits_the_static_ops(packed, Budgets(32, 1, 3, None, 1))


# ------------------------------------------------------------- what closed each row


def test_closed_by_names_the_constraint_that_closed_each_row():
    # Row 0 is full of tokens, row 1 holds max_documents (the example of pack_documents).
    packed = pack_documents([4, 3, 12, 2, 7], sequence=16, alignment=4, max_documents=3)
    assert packed.closed_by == ("tokens", "documents")
    assert packed.limits() == {"tokens": 1, "documents": 1}
    # Alignment 8: two 5-token documents take 16 aligned columns of 16; their 10 tokens leave input room.
    assert pack_documents([5, 5], sequence=16, alignment=8, max_documents=4).closed_by == ("budget",)
    # Exactly the smallest document's room left, and the cap reached: the cap closed the row, not the tokens.
    assert pack_documents([8, 4, 4], sequence=16, alignment=1, max_documents=2).closed_by == ("documents", "end")
    # Room left and nothing to fill it: the documents ran out. Padding rows are "end" too.
    assert pack_documents([3], sequence=16, alignment=1, max_documents=4, batch=2).closed_by == ("end", "end")
    assert pack_documents([3], sequence=16, alignment=1, max_documents=4, batch=2).limits() == {"end": 1}


def test_a_small_cap_shows_in_closed_by_and_suggest_budgets_proposes_one_that_does_not_bind():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.empty(4000).exponential_(1 / 24, generator=generator).ceil().long()
    capped = pack_documents(lengths, sequence=1024, alignment=1, max_documents=8)
    assert capped.limits()["documents"] > 0.9 * capped.batch  # the cap, not the tokens, closes the rows
    suggestion = suggest_budgets(lengths, sequence=1024, tolerance=0.01)
    assert suggestion.budget == 1024 and suggestion.unlimited_rows == suggestion.lower_bound_rows
    assert suggestion.rows <= suggestion.unlimited_rows / 0.99
    smaller = pack_documents(lengths, sequence=1024, alignment=1, max_documents=suggestion.max_documents - 1)
    assert smaller.batch > suggestion.unlimited_rows / 0.99  # the smallest cap within tolerance
    packed = pack_documents(lengths, sequence=1024, alignment=1, max_documents=suggestion.max_documents)
    assert packed.batch == suggestion.rows and abs(suggestion.fill - packed.fill_ratio) < 1e-12


def test_suggest_budgets_widens_the_budget_only_when_its_rows_carry_more_tokens_per_column():
    # 33-token documents take 64 aligned columns: a 96-column budget holds one per row (fill ratio 33 / 96), 128
    # columns hold two (66 / 128); wider holds no third (its spans would pass the 96-column row).
    suggestion = suggest_budgets([33] * 100, sequence=96, alignment=32)
    assert (suggestion.budget, suggestion.rows, suggestion.max_documents) == (128, 50, 2)
    # 20-token documents at alignment 16 in rows of 512: 16 a row at budget 512 (fill ratio 0.625); wider budgets
    # hold more a row but carry fewer tokens per column (25 a row at 800: 0.61).
    wide = suggest_budgets([20] * 512, sequence=512, alignment=16)
    assert wide.budget == 512 and wide.rows == 32 and wide.unlimited_rows == 21
    # At tolerance 0 a cap whose rows equal the uncapped ones qualifies: cap 2 needs 3 rows, cap 3 gets the
    # uncapped 2 (8 + 4 + 4 twice, by the cap-balanced pass), so 3 is the smallest, below the 4 a row can hold.
    exact = suggest_budgets([8, 8, 4, 4, 4, 4], sequence=16, tolerance=0)
    assert (exact.max_documents, exact.rows, exact.unlimited_rows, exact.most_documents) == (3, 2, 2, 4)
    with pytest.raises(ValueError, match="tolerance must be a number in"):
        suggest_budgets([20], sequence=512, tolerance=1.0)
    with pytest.raises(ValueError, match="at least one length"):
        suggest_budgets([], sequence=512)


# ------------------------------------------------------------- streams


@HYPOTHESIS
@given(packing_inputs(split=True, max_documents=40), st.integers(1, 3), st.integers(1, 12))
# Rows carried into the next window hold pieces already: the cap-balanced pass must count them (found by a mutant).
@example((Budgets(64, 1, 4, None, 1), [24, 14, 1, 18, 8, 32, 4, 10, 4, 16, 9, 1]), 2, 6)
def test_a_best_fit_stream_fits_every_batch_and_sends_every_document_once(case, batch, window):
    limits, lengths = case
    batches = list(pack_stream(iter(lengths), batch=batch, **limits.kwargs(), split=True, window=window))
    for packed in batches:
        assert packed.batch == batch
        assert_rows_within_budgets(packed, limits)
        assert_fits_the_static_ops(packed, limits)
    pieces = sorted((p.document, p.offset, p.length) for packed in batches for row in packed.rows for p in row)
    whole = pack_documents(lengths, **limits.kwargs(), split=True)
    assert pieces == sorted((p.document, p.offset, p.length) for row in whole.rows for p in row)
    dropped = list(pack_stream(lengths, batch=batch, **limits.kwargs(), split=True, window=window, drop_last=True))
    assert len(dropped) == sum(1 for packed in batches if all(packed.rows))


def test_carried_rows_fill_up_in_the_next_window():
    # Windows of three 6-token documents in rows of 12: packed alone, each window leaves a half row (8 rows in
    # all); the half row is carried into the next window and filled there (6 rows, all full).
    batches = list(pack_stream([6] * 12, batch=1, sequence=12, alignment=1, max_documents=4, window=3))
    assert [packed.num_tokens for packed in batches] == [12] * 6


def test_top_level_names_and_strategy_errors():
    assert packfn.suggest_budgets is suggest_budgets and packfn.PackedDataset.__module__ == "packfn.data.loader"
    with pytest.raises(ValueError, match="strategy must be one of 'best_fit', 'next_fit', got 'first_fit'"):
        pack_documents([3], sequence=8, alignment=1, max_documents=2, strategy="first_fit")
    with pytest.raises(ValueError, match="window must be positive"):
        pack_stream([3], batch=1, sequence=8, alignment=1, max_documents=2, window=0)


# ------------------------------------------------------------- against TRL's bfd


@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(16, 256), st.lists(st.integers(1, 256), min_size=1, max_size=120))
def test_alignment_one_with_no_cap_packs_no_more_rows_than_trl_bfd(sequence, lengths):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    lengths = [min(length, sequence) for length in lengths]  # TRL's bfd truncates longer documents
    dataset = datasets.Dataset.from_dict({"input_ids": [[1] * length for length in lengths]})
    rows = len(trl.pack_dataset(dataset, sequence, "bfd", {"batch_size": None}))  # one window: the whole list
    packed = pack_documents(lengths, sequence=sequence, alignment=1, max_documents=sequence)
    assert packed.batch <= rows
