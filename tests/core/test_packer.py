"""The alignment-aware packer (packfn.data): the budgets it guarantees, order, splitting, streams, errors."""

from __future__ import annotations

import doctest
import itertools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import packfn
from packfn import pack_documents, pack_stream, safe_budget
from packfn.data import PackedBatch, Piece
from packfn.data import packer as packer_module

from tests.assertions_packer import assert_fits_the_static_ops, assert_rows_within_budgets
from tests.references_packer import next_fit
from tests.strategies_packer import Budgets, packing_inputs, round_up

HYPOTHESIS = settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])


def pieces_by_document(packed: PackedBatch) -> list[list[Piece]]:
    """Pieces grouped by document, in row order (raises if documents come out of order)."""
    grouped: list[list[Piece]] = []
    for piece in itertools.chain.from_iterable(packed.rows):
        if grouped and grouped[-1][0].document == piece.document:
            grouped[-1].append(piece)
        else:
            assert piece.document == len(grouped), "documents keep their order and none is skipped"
            grouped.append([piece])
    return grouped


def assert_next_fit(packed: PackedBatch, limits: Budgets) -> None:
    """A row is closed only when the piece that starts the next one would not fit it."""
    for pieces, following in itertools.pairwise(packed.rows):
        if not following:
            break
        first = following[0]
        span = sum(piece.span for piece in pieces) + round_up(first.length, limits.pad_to_multiple_of)
        aligned = sum(round_up(piece.length, limits.alignment) for piece in pieces)
        aligned += round_up(first.length, limits.alignment)
        if first.offset == 0:  # a whole document (or the first piece of a split one, which filled what it could)
            assert len(pieces) == limits.max_documents or span > limits.sequence or aligned > packed.budget
        else:  # a later piece: the row before it had no room for a single token
            room = min(
                packed.budget - sum(round_up(piece.length, limits.alignment) for piece in pieces),
                (limits.sequence - sum(piece.span for piece in pieces))
                // limits.pad_to_multiple_of
                * limits.pad_to_multiple_of,
            )
            assert len(pieces) == limits.max_documents or room < 1


# ------------------------------------------------------------- the guarantee


@HYPOTHESIS
@given(packing_inputs(split=False))
def test_unsplit_batches_fit_the_static_budgets_and_keep_every_document_whole_in_order(case):
    limits, lengths = case
    packed = pack_documents(lengths, **limits.kwargs(), strategy="next_fit")
    assert_rows_within_budgets(packed, limits)
    assert_fits_the_static_ops(packed, limits)
    assert_next_fit(packed, limits)
    grouped = pieces_by_document(packed)
    assert [group for group in grouped if len(group) != 1] == []
    assert [group[0].length for group in grouped] == lengths
    assert all(group[0].offset == 0 for group in grouped)
    assert packed.num_tokens == sum(lengths)
    assert packed.fill_ratio == sum(lengths) / (packed.batch * packed.budget)


@HYPOTHESIS
@given(packing_inputs(split=True))
def test_split_batches_fit_and_cut_only_documents_an_empty_row_cannot_hold(case):
    limits, lengths = case
    packed = pack_documents(lengths, **limits.kwargs(), split=True, strategy="next_fit")
    assert_rows_within_budgets(packed, limits)
    assert_fits_the_static_ops(packed, limits)
    assert_next_fit(packed, limits)
    grouped = pieces_by_document(packed)
    assert len(grouped) == len(lengths)
    for group, length in zip(grouped, lengths, strict=True):
        assert [piece.offset for piece in group] == list(itertools.accumulate([0] + [p.length for p in group[:-1]]))
        assert sum(piece.length for piece in group) == length
        if length <= limits.longest_unsplit:
            assert len(group) == 1, f"a document of {length} tokens fits an empty row but was split"
        else:
            assert len(group) >= 2
            assert len({piece.document for piece in group}) == 1
    assert packed.num_tokens == sum(lengths)


@HYPOTHESIS
@given(packing_inputs(split=True), st.integers(0, 3))
def test_gather_lays_out_each_documents_tokens_at_its_pieces(case, extra_rows):
    limits, lengths = case
    rows = len(pack_documents(lengths, **limits.kwargs(), split=True).rows)
    packed = pack_documents(lengths, **limits.kwargs(), split=True, batch=rows + extra_rows)
    assert packed.batch == rows + extra_rows and packed.rows[rows:] == ((),) * extra_rows
    assert_fits_the_static_ops(packed, limits)
    documents = [torch.arange(length) + 1000 * index for index, length in enumerate(lengths)]
    tokens = packed.gather(documents, padding=-1)
    assert tokens.shape == (packed.batch, limits.sequence) and tokens.dtype == torch.int64
    assert torch.equal(tokens == -1, packed.document_ids == 0)
    for row, pieces in enumerate(packed.rows):
        for piece in pieces:
            laid_out = tokens[row, piece.column : piece.column + piece.length]
            assert torch.equal(laid_out, documents[piece.document][piece.offset : piece.offset + piece.length])
    assert sorted(tokens[tokens >= 0].tolist()) == sorted(torch.cat(documents).tolist())


@HYPOTHESIS
@given(packing_inputs(split=True), st.integers(1, 4), st.booleans())
def test_a_stream_is_the_same_rows_cut_into_batches_of_one_shape(case, batch, drop_last):
    limits, lengths = case
    whole = pack_documents(lengths, **limits.kwargs(), split=True, strategy="next_fit")
    batches = list(
        pack_stream(
            iter(lengths),
            batch=batch,
            **limits.kwargs(),
            split=True,
            drop_last=drop_last,
            strategy="next_fit",
            window=5,
        )
    )
    full, rest = divmod(whole.batch, batch)
    assert len(batches) == full + (1 if rest and not drop_last else 0)
    rows = [row for packed in batches for row in packed.rows if row]
    expected = list(whole.rows) if not drop_last else list(whole.rows[: full * batch])
    assert rows == expected
    for packed in batches:
        assert packed.batch == batch
        assert packed.document_ids.shape == (batch, limits.sequence)
        assert_fits_the_static_ops(packed, limits)
    if batches:
        padded = pack_documents(
            lengths, **limits.kwargs(), split=True, batch=max(whole.batch, len(batches) * batch), strategy="next_fit"
        )
        streamed = torch.cat([packed.document_ids for packed in batches])
        assert torch.equal(streamed, padded.document_ids[: streamed.shape[0]])


def test_a_stream_is_read_lazily_and_indexes_documents_from_its_start():
    lengths = itertools.cycle([5, 3, 6, 2, 9])
    stream = pack_stream(lengths, batch=2, sequence=16, alignment=4, max_documents=3, strategy="next_fit")
    first, second = next(stream), next(stream)
    assert [[piece.document for piece in row] for row in first.rows] == [[0, 1], [2, 3]]
    assert [[piece.document for piece in row] for row in second.rows] == [[4], [5, 6]]
    assert second.document_lengths == {4: 9, 5: 5, 6: 3}
    tokens = {index: list(range(length)) for index, length in second.document_lengths.items()}
    assert second.gather(tokens)[1, :8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]


def test_the_default_budget_is_the_input_row_and_beats_the_worst_case():
    packed = pack_documents([100] * 20, sequence=512, alignment=16, max_documents=16)
    assert packed.budget == 512 < safe_budget(512, 16, 16) == 752
    assert pack_documents([3], sequence=10, alignment=4, max_documents=2).budget == 12
    # Five 100-token documents (112 aligned columns each) would need 560 columns: a row holds four.
    assert [len(row) for row in packed.rows] == [4] * 5


def test_physical_spans_pad_each_document_to_the_multiple():
    packed = pack_documents([3, 5], sequence=12, alignment=4, max_documents=2, pad_to_multiple_of=4)
    assert packed.seq_lens.tolist() == [[3, 5]] and packed.seq_lens_padded.tolist() == [[4, 8]]
    assert packed.document_ids.tolist() == [[1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0, 0]]
    assert packed.rows == ((Piece(0, 0, 3, 4, 0), Piece(1, 0, 5, 8, 4)),)


def test_splitting_fills_the_row_a_long_document_starts_in():
    packed = pack_documents([5, 40, 2], sequence=16, alignment=4, max_documents=4, split=True, strategy="next_fit")
    assert packed.rows == (
        (Piece(0, 0, 5, 5, 0), Piece(1, 0, 8, 8, 5)),  # 8 aligned columns left after the first document
        (Piece(1, 8, 16, 16, 0),),
        (Piece(1, 24, 16, 16, 0),),
        (Piece(2, 0, 2, 2, 0),),  # the last piece filled its row: the next document starts a new one
    )


def test_the_docstring_example():
    result = doctest.testmod(packer_module, raise_on_error=False, verbose=False)
    assert result.attempted >= 5 and result.failed == 0


def test_top_level_names():
    assert packfn.pack_documents is pack_documents and packfn.pack_stream is pack_stream
    assert packfn.PackedBatch is PackedBatch
    assert {"PackedBatch", "pack_documents", "pack_stream"} <= set(packfn.__all__)


# ------------------------------------------------------------------- errors

GOOD = {"sequence": 16, "alignment": 4, "max_documents": 3}


def test_a_document_longer_than_an_empty_row_raises_unless_split():
    with pytest.raises(ValueError, match=r"document 1 of 17 tokens does not fit an empty row.*split=True"):
        pack_documents([3, 17], **GOOD)
    # Its aligned size decides too: 13 tokens take 16 aligned columns of a 12-column budget.
    with pytest.raises(ValueError, match=r"16 aligned columns \(budget=12\)"):
        pack_documents([13], **GOOD, budget=12)
    with pytest.raises(ValueError, match="split=True"):
        list(pack_stream([3, 17], batch=1, **GOOD))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sequence": 0}, ValueError, "sequence must be positive"),
        ({"sequence": 16.0}, TypeError, "sequence must be an int"),
        ({"alignment": 0}, ValueError, "alignment must be positive"),
        ({"alignment": True}, TypeError, "alignment must be an int"),
        ({"max_documents": 0}, ValueError, "max_documents must be positive"),
        ({"budget": 10}, ValueError, "budget=10 must be a multiple of alignment=4"),
        ({"budget": 0}, ValueError, "budget must be positive"),
        ({"pad_to_multiple_of": 32}, ValueError, "pad_to_multiple_of=32 must not exceed sequence=16"),
        ({"batch": 0}, ValueError, "batch must be positive"),
        ({"split": 1}, TypeError, "split must be a bool"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        pack_documents([3], **{**GOOD, **kwargs})
    if "batch" not in kwargs:
        with pytest.raises(error, match=match):
            pack_stream([3], batch=1, **{**GOOD, **kwargs})  # at the call, before any next()


@pytest.mark.parametrize(
    ("lengths", "error", "match"),
    [
        ([3, 0], ValueError, "document 1: lengths must be positive, got 0"),
        ([-2], ValueError, "document 0: lengths must be positive, got -2"),
        ([3, 2.5], TypeError, "document 1: a length must be an int, got float"),
        ([True], TypeError, "a length must be an int, got a bool"),
        (torch.tensor([2.0]), TypeError, "document 0: a length must be an int, got Tensor"),
        ("abc", TypeError, "lengths must be an iterable of ints, got str"),
        (5, TypeError, "lengths must be an iterable of ints, got int"),
        (
            torch.tensor([[3, 2], [1, 1]]),
            ValueError,
            r"lengths must be 1-D .one length per document., got shape \(2, 2\)",
        ),
    ],
)
def test_bad_lengths_raise_clear_errors(lengths, error, match):
    with pytest.raises(error, match=match):
        pack_documents(lengths, **GOOD)


def test_integer_like_lengths_are_accepted():
    packed = pack_documents(torch.tensor([5, 3]), **GOOD)
    assert packed.seq_lens.tolist() == [[5, 3, 0]]


def test_too_few_rows_and_nothing_to_pack():
    with pytest.raises(ValueError, match="the documents need 3 rows, more than batch=2"):
        pack_documents([5, 3, 6, 2, 9], **GOOD, batch=2)
    with pytest.raises(ValueError, match="no document to pack"):
        pack_documents([], **GOOD)
    empty = pack_documents([], **GOOD, batch=2)
    assert empty.rows == ((), ()) and empty.num_tokens == 0
    assert not empty.document_ids.any() and not empty.seq_lens.any()
    assert list(pack_stream([], batch=2, **GOOD)) == []


def test_gather_checks_the_token_counts():
    packed = pack_documents([5, 3], **GOOD)
    with pytest.raises(ValueError, match=r"document 1 was packed with 3 tokens, got tokens of shape \(4,\)"):
        packed.gather([[1] * 5, [1] * 4])
    with pytest.raises(ValueError, match="document 0 was packed with 5 tokens"):
        packed.gather([torch.ones(5, 1), [1] * 3])


def test_gather_keeps_floating_values_and_refuses_to_truncate_them():
    packed = pack_documents([3, 2], sequence=8, alignment=1, max_documents=2)
    weights = packed.gather([[0.5, 1.5, 2.5], torch.tensor([4.0, 5.0])])
    assert weights.dtype == torch.float32
    assert weights[0, :5].tolist() == [0.5, 1.5, 2.5, 4.0, 5.0]
    assert packed.gather([[1, 2, 3], [4, 5]]).dtype == torch.int64
    int32 = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert packed.gather([int32, int32[:2]]).dtype == torch.int32
    assert packed.gather([int32, [4, 5]]).dtype == torch.int64  # promoted with the list's int64
    with pytest.raises(ValueError, match=r"document 0 holds torch.float32 values, which gather\(dtype=torch.int64\)"):
        packed.gather([[0.5, 1.5, 2.5], [4.0, 5.0]], dtype=torch.int64)


def test_gather_promotes_the_documents_dtypes_and_refuses_values_its_dtype_cannot_hold():
    packed = pack_documents([3, 2], sequence=8, alignment=1, max_documents=2)
    narrow_first = [torch.tensor([1, 2, 3], dtype=torch.int8), [300, -300]]
    assert packed.gather(narrow_first)[0, :5].tolist() == [1, 2, 3, 300, -300]  # int8 and int64: int64
    with pytest.raises(
        ValueError, match=r"document 1 holds values outside \[-128, 127\], which torch.int8 cannot hold"
    ):
        packed.gather(narrow_first, dtype=torch.int8)
    assert packed.gather([[1, 0, 1], [0, 1]], dtype=torch.bool).dtype == torch.bool
    with pytest.raises(ValueError, match=r"outside \[0, 1\], which torch.bool"):
        packed.gather([[1, 2, 1], [0, 1]], dtype=torch.bool)


@HYPOTHESIS
@given(packing_inputs(split=False))
@example((Budgets(16, 1, 4, None, 1), [8, 8, 16]))  # a document that exactly fills the rest of its row joins it
def test_next_fit_is_the_reference_next_fit_in_input_order(case):
    limits, lengths = case
    packed = pack_documents(lengths, **limits.kwargs(), strategy="next_fit")
    rows, closed = next_fit(
        lengths,
        sequence=limits.sequence,
        alignment=limits.alignment,
        budget=limits.resolved_budget,
        cap=limits.max_documents,
        multiple=limits.pad_to_multiple_of,
    )
    assert [[piece.document for piece in row] for row in packed.rows] == rows
    assert list(packed.closed_by) == closed


def test_pack_stream_drop_last_must_be_a_bool():
    with pytest.raises(TypeError, match="drop_last must be a bool, got str"):
        pack_stream([3], batch=1, drop_last="no", **GOOD)


def test_gather_names_a_document_the_mapping_lacks():
    packed = pack_documents([3, 2], sequence=8, alignment=1, max_documents=2)
    for documents in ({0: [1, 2, 3]}, [[1, 2, 3]]):
        with pytest.raises(ValueError, match="documents has no entry for document 1, which this batch packs"):
            packed.gather(documents)
