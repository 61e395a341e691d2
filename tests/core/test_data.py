"""The loader (packfn.data.PackedDataset): static budgets, conservation, determinism, sharding, resume, bad input."""

from __future__ import annotations

import contextlib
import itertools
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from packfn import aligned_layout, packed_position_ids, suggest_budgets, varlen_metadata
from packfn.data import BATCH_KEYS, IGNORE_INDEX, FillWarning, PackedDataset
from packfn.data import loader as data_module
from packfn.data.stats import FILL_WARNING_SHARE

from tests.strategies_packer import budgets, token_documents

with contextlib.suppress(ImportError):  # imported at collection, before a test can take modules out of sys.modules
    import datasets  # noqa: F401

HYPOTHESIS = settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
# The strategies draw caps and budgets as small as 1, where the loader's FillWarning is right; the tests of the
# warning record it themselves.
pytestmark = pytest.mark.filterwarnings("ignore::packfn.data.FillWarning")
SMALL = {"batch": 2, "sequence": 24, "max_documents": 4, "alignment": 4, "window": 7}


def documents_for(draw, limits, split: bool, max_documents: int = 30) -> list[list[int]]:
    longest = 3 * limits.sequence if split else limits.longest_unsplit
    return draw(token_documents(longest=longest, max_documents=max_documents))


@st.composite
def loader_cases(draw) -> tuple[dict, list[list[int]]]:
    """Keyword arguments of a PackedDataset and documents it can pack (split where one does not fit a row)."""
    limits = draw(budgets(max_sequence=48))
    split = draw(st.booleans())
    documents = documents_for(draw, limits, split)
    kwargs = {
        **limits.kwargs(),
        "batch": draw(st.integers(1, 3)),
        "window": draw(st.integers(1, 12)),
        "split": split,
        "strategy": draw(st.sampled_from(["best_fit", "best_fit", "next_fit"])),
    }
    return kwargs, documents


def pieces_of(batches: list[dict]) -> list[tuple[int, int, list[int]]]:
    """``(document, offset, tokens)`` of every slot of every batch, in order."""
    pieces = []
    for batch in batches:
        for row in range(batch["input_ids"].shape[0]):
            column = 0
            for slot in range(batch["seq_lens"].shape[1]):
                document = int(batch["documents"][row, slot])
                length, span = int(batch["seq_lens"][row, slot]), int(batch["seq_lens_padded"][row, slot])
                if document >= 0:
                    tokens = batch["input_ids"][row, column : column + length].tolist()
                    pieces.append((document, int(batch["document_offsets"][row, slot]), tokens))
                column += span
    return pieces


def assert_same_batches(first: list[dict], second: list[dict]) -> None:
    assert len(first) == len(second)
    for one, other in zip(first, second, strict=True):
        assert one.keys() == other.keys()
        for key in one:
            assert torch.equal(one[key], other[key]), key


def assert_conserved(batches: list[dict], documents: list[list[int]], shard: list[int] | None = None) -> None:
    """Every document (of the shard) is there once, its pieces tiling it in order; nothing else is."""
    pieces = sorted(pieces_of(batches))
    wanted = range(len(documents)) if shard is None else shard
    assert sorted({document for document, _, _ in pieces}) == sorted(wanted)
    for document, group in itertools.groupby(pieces, key=lambda piece: piece[0]):
        tokens = [token for _, _, piece in group for token in piece]  # sorted by offset within the document
        assert tokens == documents[document]


# ------------------------------------------------------------------ batches


@HYPOTHESIS
@given(loader_cases())
def test_every_batch_fits_the_static_ops_and_carries_every_token_once(case):
    kwargs, documents = case
    dataset = PackedDataset(documents, **kwargs)
    batches = list(dataset)
    assert_conserved(batches, documents)
    shape = (kwargs["batch"], kwargs["sequence"])
    for batch in batches:
        assert tuple(batch) == BATCH_KEYS
        assert all(batch[key].dtype == torch.int64 for key in BATCH_KEYS if key != "packing_stats")
        assert batch["packing_stats"].dtype == torch.float64  # tests/core/test_stats.py checks its values
        assert batch["input_ids"].shape == batch["labels"].shape == batch["document_ids"].shape == shape
        assert batch["seq_lens"].shape == (kwargs["batch"], kwargs["max_documents"])
        varlen_metadata(batch["document_ids"], max_documents=kwargs["max_documents"])
        aligned_layout(
            batch["seq_lens"],
            batch["seq_lens_padded"],
            sequence_length=kwargs["sequence"],
            alignment=kwargs["alignment"],
            budget=dataset.budget,
        )
        padding = batch["document_ids"] == 0
        assert (batch["input_ids"][padding] == 0).all() and (batch["input_ids"][~padding] > 0).all()
        assert torch.equal(batch["labels"], batch["input_ids"].masked_fill(padding, IGNORE_INDEX))
        assert torch.equal(batch["position_ids"], packed_position_ids(batch["document_ids"]))
        # shift_labels: the next token of the same document piece.
        same = (batch["document_ids"][:, 1:] == batch["document_ids"][:, :-1]) & ~padding[:, 1:]
        assert torch.equal(batch["shift_labels"][:, :-1], torch.where(same, batch["labels"][:, 1:], IGNORE_INDEX))
        assert (batch["shift_labels"][:, -1] == IGNORE_INDEX).all()


def test_labels_and_loss_masks_follow_their_tokens():
    examples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [8, 9], "labels": [1, 2]},
        {"input_ids": [3, 4], "labels": [11, 12], "loss_mask": [True, False]},
    ]
    batch = next(iter(PackedDataset(examples, batch=1, sequence=8, max_documents=4, strategy="next_fit")))
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 4, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, 1, 2, 11, -100, -100]]
    assert batch["shift_labels"].tolist() == [[6, 7, -100, 2, -100, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["documents"].tolist() == [[0, 1, 2, -1]]


# ------------------------------------------------------------------ determinism and sharding


def rank_batches(documents: list[list[int]], kwargs: dict, rank: int, workers: int) -> list[dict]:
    """A rank's batches in the order a ``DataLoader`` with ``workers`` workers yields them (its j-th: worker j % W)."""
    shards = []
    for worker in range(workers):
        info = mock.Mock(id=worker, num_workers=workers)
        with mock.patch.object(data_module, "get_worker_info", return_value=info):
            shards.append(list(PackedDataset(documents, **kwargs, rank=rank)))
            if worker == 0:  # deterministic for a seed
                assert_same_batches(shards[-1], list(PackedDataset(documents, **kwargs, rank=rank)))
    total = sum(len(batches) for batches in shards)
    assert [len(batches) for batches in shards] == [len(range(worker, total, workers)) for worker in range(workers)]
    return [shards[turn % workers][turn // workers] for turn in range(total)]


@HYPOTHESIS
@given(loader_cases(), st.integers(0, 3), st.integers(1, 4), st.integers(1, 2), st.booleans())
def test_ranks_and_workers_take_the_single_process_batches_in_turn_and_as_many_each(
    case, seed, world, workers, drop_last
):
    kwargs, documents = case
    kwargs = {**kwargs, "shuffle": len(documents) > 1, "seed": seed, "drop_last": drop_last}
    plan = list(PackedDataset(documents, **kwargs))  # one process: the epoch's plan (drop_last: its full batches)
    ranks = [rank_batches(documents, {**kwargs, "world": world}, rank, workers) for rank in range(world)]
    # Every rank the same count: ceil(N / world), the last round completed by the plan's first batches again;
    # with drop_last, N // world of its full batches.
    each = len(plan) // world if drop_last else -(-len(plan) // world)
    assert [len(batches) for batches in ranks] == [each] * world
    assert PackedDataset(documents, **kwargs, world=world).batches_per_rank() == each
    dealt = [ranks[number % world][number // world] for number in range(each * world)]
    assert_same_batches(dealt, [plan[number % len(plan)] for number in range(each * world)])
    if not drop_last:
        assert_conserved(dealt[: len(plan)], documents)  # the union is the dataset, with no overlap


def test_a_seed_and_an_epoch_set_the_order():
    documents = [[index + 1] * (1 + index % 5) for index in range(40)]
    kwargs = {"batch": 2, "sequence": 8, "max_documents": 4, "shuffle": True}
    first = list(PackedDataset(documents, **kwargs, seed=1))
    assert_same_batches(first, list(PackedDataset(documents, **kwargs, seed=1)))
    other = PackedDataset(documents, **kwargs, seed=1)
    other.set_epoch(1)
    assert pieces_of(list(other)) != pieces_of(first)
    assert pieces_of(list(PackedDataset(documents, **kwargs, seed=2))) != pieces_of(first)


def test_two_dataloader_workers_split_the_documents_and_a_plain_dataloader_resumes():
    documents = [[index + 1] * (1 + index % 13) for index in range(120)]
    uninterrupted = list(DataLoader(PackedDataset(documents, **SMALL), batch_size=None, num_workers=2))
    assert_conserved(uninterrupted, documents)
    for consumed in (3, 8):
        state = PackedDataset(documents, **SMALL).state_after(consumed, num_workers=2)
        restored = PackedDataset(documents, **SMALL)
        restored.load_state_dict(state)
        rest = list(DataLoader(restored, batch_size=None, num_workers=2))
        assert_same_batches(uninterrupted[consumed:], rest)


def test_a_rank_yields_the_same_batches_with_two_dataloader_workers_and_resumes_in_the_last_round():
    # 120 documents pack into 22 batches: at world 3 rank 2 takes 8, the last one (number 23) batch 1 again.
    documents = [[index + 1] * (1 + index % 13) for index in range(120)]
    kwargs = {**SMALL, "rank": 2, "world": 3, "shuffle": True}
    plan = list(PackedDataset(documents, **{**kwargs, "rank": 0, "world": 1}))
    assert len(plan) == 22
    uninterrupted = list(DataLoader(PackedDataset(documents, **kwargs), batch_size=None, num_workers=2))
    assert_same_batches(uninterrupted, [plan[number % 22] for number in range(2, 24, 3)])
    for consumed in (3, 7):
        state = PackedDataset(documents, **kwargs).state_after(consumed, num_workers=2)
        restored = PackedDataset(documents, **kwargs)
        restored.load_state_dict(state)
        assert_same_batches(uninterrupted[consumed:], list(DataLoader(restored, batch_size=None, num_workers=2)))
    restored = PackedDataset(documents, **kwargs)
    restored.load_state_dict(PackedDataset(documents, **kwargs).state_after(8, num_workers=2))  # the epoch's end
    assert list(DataLoader(restored, batch_size=None, num_workers=2)) == []
    for workers in (0, 2):  # a count past the rank's 8 batches (a global step, say) would skip the epoch
        with pytest.raises(ValueError, match=r"batches must be at most the 8 batches this rank's .* got 9"):
            PackedDataset(documents, **kwargs).state_after(9, num_workers=workers)


def test_a_persistent_worker_iterating_again_raises_instead_of_repeating_the_last_epoch():
    documents = [[index + 1] * (1 + index % 13) for index in range(60)]
    dataset = PackedDataset(documents, **SMALL, shuffle=True)
    loader = DataLoader(dataset, batch_size=None, num_workers=1, persistent_workers=True)
    first = list(loader)
    assert_conserved(first, documents)
    dataset.set_epoch(1)  # never reaches the persistent worker's copy
    with pytest.raises(RuntimeError, match=r"iterated again in the same DataLoader worker .* persistent_workers=False"):
        list(loader)
    again = DataLoader(dataset, batch_size=None, num_workers=1)  # workers made anew each epoch: set_epoch holds
    expected = PackedDataset(documents, **SMALL, shuffle=True)
    expected.set_epoch(1)
    assert_same_batches(list(again), list(expected))


def test_statefuldataloader_resumes_inside_two_workers():
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    documents = [[index + 1] * (1 + index % 11) for index in range(100)]
    uninterrupted = list(DataLoader(PackedDataset(documents, **SMALL), batch_size=None, num_workers=2))
    loader = stateful.StatefulDataLoader(PackedDataset(documents, **SMALL), batch_size=None, num_workers=2)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    state = loader.state_dict()
    del iterator
    restored = stateful.StatefulDataLoader(PackedDataset(documents, **SMALL), batch_size=None, num_workers=2)
    restored.load_state_dict(state)
    assert_same_batches(uninterrupted, head + list(restored))


# ------------------------------------------------------------------ resume


@HYPOTHESIS
@given(loader_cases(), st.data())
def test_a_restored_dataset_continues_exactly_where_the_state_was_taken(case, data):
    kwargs, documents = case
    world = data.draw(st.integers(1, 3))  # a rank's cuts include those inside the last round's repeated batches
    kwargs = {
        **kwargs,
        "world": world,
        "rank": data.draw(st.integers(0, world - 1)),
        "drop_last": data.draw(st.booleans()),
    }
    uninterrupted = list(PackedDataset(documents, **kwargs))
    stop = data.draw(st.integers(0, len(uninterrupted)))
    dataset = PackedDataset(documents, **kwargs)
    iterator = iter(dataset)
    head = [next(iterator) for _ in range(stop)]
    state = dataset.state_dict()
    restored = PackedDataset(documents, **kwargs)
    restored.load_state_dict(state)
    assert_same_batches(uninterrupted, head + list(restored))
    # The replayed state of a plain DataLoader is the same state.
    replayed = PackedDataset(documents, **kwargs).state_after(stop)
    again = PackedDataset(documents, **kwargs)
    again.load_state_dict(replayed)
    assert_same_batches(uninterrupted[stop:], list(again))


def test_a_re_iterable_that_is_not_a_sequence_resumes_by_skipping():
    documents = [[index + 1] * (1 + index % 7) for index in range(60)]

    class Examples:
        def __iter__(self):
            return iter(documents)

    uninterrupted = list(PackedDataset(Examples(), **SMALL))
    assert_same_batches(uninterrupted, list(PackedDataset(documents, **SMALL)))
    dataset = PackedDataset(Examples(), **SMALL)
    iterator = iter(dataset)
    head = [next(iterator) for _ in range(4)]
    restored = PackedDataset(Examples(), **SMALL)
    restored.load_state_dict(dataset.state_dict())
    assert_same_batches(uninterrupted, head + list(restored))


def test_a_stream_without_a_length_gives_every_rank_as_many_batches_and_resumes_in_the_last_round():
    # 39 documents pack into 9 batches: at world 4 ranks 1, 2 and 3 take batches 0, 1 and 2 again.
    documents = [[index + 1] * (1 + index * 5 % 17) for index in range(39)]

    class Examples:
        def __iter__(self):
            return iter(documents)

    plan = list(PackedDataset(documents, **SMALL))
    assert len(plan) == 9
    for rank in range(4):
        from_stream = list(PackedDataset(Examples(), **SMALL, rank=rank, world=4))
        assert_same_batches(from_stream, [plan[number % 9] for number in range(rank, 12, 4)])
        for stop in range(len(from_stream) + 1):
            dataset = PackedDataset(Examples(), **SMALL, rank=rank, world=4)
            iterator = iter(dataset)
            head = [next(iterator) for _ in range(stop)]
            restored = PackedDataset(Examples(), **SMALL, rank=rank, world=4)
            restored.load_state_dict(dataset.state_dict())
            assert_same_batches(from_stream, head + list(restored))
    assert PackedDataset(Examples(), **SMALL, world=4).batches_per_rank() == 3


# ------------------------------------------------------------------ a cap or a budget that throws fill away


def _exponential(count: int, mean: int) -> list[list[int]]:
    lengths = torch.empty(count).exponential_(1 / mean, generator=torch.Generator().manual_seed(0)).ceil()
    return [[7] * int(length) for length in lengths]


def _fill_warnings(dataset: PackedDataset, iterations: int = 1) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(iterations):
            batches = list(dataset)
            assert len(batches) > 1
    return [warning for warning in caught if issubclass(warning.category, FillWarning)]


def test_a_cap_too_small_for_the_lengths_warns_once_naming_it():
    # 200 documents of mean 16 in rows of 256 under a cap of 1: 4 windows of 50, 25 batches, twice.
    dataset = PackedDataset(_exponential(200, 16), batch=8, sequence=256, max_documents=1, window=50)
    (warning,) = _fill_warnings(dataset, iterations=2)
    message = str(warning.message)
    assert message.startswith("PackedDataset: of the "), message
    assert "max_documents=1 closed " in message and "A larger max_documents fills them" in message
    assert "budget=" not in message.split(". ")[0]
    fill = float(message.split("(fill ")[1].split()[0])
    assert 0 < fill < 1 - FILL_WARNING_SHARE
    assert warning.filename == __file__  # it points at the loop that iterates


def test_a_budget_narrower_than_the_row_warns_once_naming_it():
    dataset = PackedDataset(
        _exponential(400, 16), batch=4, sequence=256, max_documents=64, budget=64, split=True, window=50
    )
    (warning,) = _fill_warnings(dataset)
    message = str(warning.message)
    assert "budget=64 closed " in message and "A wider budget fills them" in message
    assert "max_documents=" not in message


def test_a_cap_and_a_budget_that_suit_the_lengths_do_not_warn():
    documents = _exponential(400, 16)
    suggestion = suggest_budgets([len(document) for document in documents], sequence=256, alignment=16)
    dataset = PackedDataset(
        documents,
        batch=4,
        sequence=256,
        alignment=16,
        max_documents=suggestion.max_documents,
        budget=suggestion.budget,
        window=200,
    )
    assert _fill_warnings(dataset) == []


# ------------------------------------------------------------------ an HF dataset


@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow])
@given(token_documents(longest=20, max_documents=25), st.booleans())
def test_an_hf_dataset_packs_as_the_same_examples_in_a_list(documents, with_labels):
    datasets = pytest.importorskip("datasets")
    columns = {"input_ids": documents}
    if with_labels:
        columns["labels"] = [[token % 7 for token in document] for document in documents]
        columns["loss_mask"] = [[position % 2 for position in range(len(document))] for document in documents]
    examples = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    kwargs = {"batch": 2, "sequence": 20, "max_documents": 5, "window": 6, "shuffle": True, "seed": 3}
    from_hf = list(PackedDataset(datasets.Dataset.from_dict(columns), **kwargs))
    assert_same_batches(list(PackedDataset(examples, **kwargs)), from_hf)


def test_a_streaming_hf_dataset_and_a_fixed_length_column_pack_as_the_same_examples_in_a_list():
    datasets = pytest.importorskip("datasets")
    documents = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    examples = [{"input_ids": document} for document in documents]
    kwargs = {"batch": 1, "sequence": 8, "max_documents": 3, "window": 4}
    streaming = datasets.Dataset.from_dict({"input_ids": documents}).to_iterable_dataset()  # no length: one pass
    assert_same_batches(list(PackedDataset(streaming, **kwargs)), list(PackedDataset(examples, **kwargs)))
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"), length=3)})
    fixed = datasets.Dataset.from_dict({"input_ids": documents}, features=features)
    shuffled = {**kwargs, "shuffle": True, "seed": 1}
    assert_same_batches(list(PackedDataset(fixed, **shuffled)), list(PackedDataset(examples, **shuffled)))


# ------------------------------------------------------------------ bad input


def _first(examples, **kwargs) -> dict:
    return next(iter(PackedDataset(examples, **{"batch": 1, "sequence": 8, "max_documents": 4, **kwargs})))


def test_an_example_without_input_ids_raises():
    with pytest.raises(ValueError, match=r"example 1 has no 'input_ids' \(keys: \['text'\]\)"):
        _first([{"input_ids": [1]}, {"text": "a"}])
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match=r"the dataset has no 'input_ids' column \(columns: \['text'\]\)"):
        PackedDataset(datasets.Dataset.from_dict({"text": ["a"]}), batch=1, sequence=8, max_documents=4)
    with pytest.raises(ValueError, match=r"example 1 has no 'input_ids' \(null\)"):
        _first(datasets.Dataset.from_dict({"input_ids": [[1], None]}))
    with pytest.raises(ValueError, match=r"example 1 has no 'input_ids' \(null\)"):  # the same row as a dict
        _first([{"input_ids": [1]}, {"input_ids": None}])


def test_a_negative_token_id_raises_naming_the_example():
    import datasets
    import pyarrow as pa

    with pytest.raises(ValueError, match=r"example 2: input_ids holds a negative token id \(-1\)"):
        _first([[1, 2], [3], [4, -1, 5]])
    table = pa.table({"input_ids": pa.array([[1, 2, 3], [-4, 5]], pa.list_(pa.int32()))})
    with pytest.raises(ValueError, match=r"example 1: input_ids holds a negative token id \(-4\)"):
        _first(datasets.Dataset(table))  # read from the Arrow column in place


def test_non_integer_tokens_raise():
    with pytest.raises(TypeError, match=r"example 0: input_ids must hold integer token ids, got dtype torch.float32"):
        _first([[1.5, 2.0]])
    with pytest.raises(TypeError, match=r"example 0: input_ids must hold integer token ids, got dtype torch.bool"):
        _first([[True, False]])
    with pytest.raises(TypeError, match="example 0: input_ids must be a sequence of integer token ids"):
        _first([["a", "b"]])
    with pytest.raises(TypeError, match="example 0 must be a mapping with 'input_ids' or a sequence of token ids"):
        _first(["text"])
    datasets = pytest.importorskip("datasets")
    with pytest.raises(TypeError, match="column 'input_ids' must hold integer token ids, got double"):
        _first(datasets.Dataset.from_dict({"input_ids": [[1.0]]}))


def test_an_empty_example_raises():
    with pytest.raises(ValueError, match="example 1 is empty: a document needs at least one token"):
        _first([[1], []])
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match="example 0 is empty"):
        _first(datasets.Dataset.from_dict({"input_ids": [[], [1]]}))


def test_a_document_longer_than_a_row_raises_without_split():
    with pytest.raises(ValueError, match=r"document 1 of 9 tokens does not fit an empty row.*split=True"):
        _first([[1], [2] * 9])
    assert _first([[2] * 9], split=True)["seq_lens"].tolist() == [[8, 0, 0, 0]]


def test_labels_of_another_length_raise():
    with pytest.raises(ValueError, match="example 0: labels must have as many entries as input_ids"):
        _first([{"input_ids": [1, 2], "labels": [1]}])
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match="example 1: labels must have as many entries as input_ids \\(it is null"):
        _first(datasets.Dataset.from_dict({"input_ids": [[1], [2, 3]], "labels": [[1], None]}))


def test_a_loss_mask_that_is_not_a_mask_raises_naming_the_example():
    with pytest.raises(TypeError, match="example 1: loss_mask must be a sequence of 0 / 1"):
        _first([{"input_ids": [1]}, {"input_ids": [2, 3], "loss_mask": "yes"}])


def test_unsigned_ids_beyond_int64_raise_instead_of_turning_negative():
    import numpy

    huge = numpy.array([2**63 + 5, 1], dtype=numpy.uint64)
    with pytest.raises(ValueError, match=r"example 0: input_ids holds token ids of 2\*\*63 or more"):
        _first([huge])
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match=r"column 'input_ids' holds token ids of 2\*\*63 or more"):
        import pyarrow

        column = pyarrow.array([huge.tolist()], type=pyarrow.list_(pyarrow.uint64()))
        _first(datasets.Dataset(pyarrow.table({"input_ids": column})))
    with pytest.raises(ValueError, match=r"example 0: input_ids holds token ids of 2\*\*63 or more"):
        _first([numpy.array([1, 2**64 - 1], dtype=numpy.uint64)])  # -1 by its bits as int64
    assert _first([huge[1:]])["input_ids"][0, 0] == 1  # uint64 ids that fit are taken
    with pytest.raises(ValueError, match="example 0: input_ids holds token ids outside int64"):
        _first([[2**63, 1]])


def test_an_empty_dataset_yields_nothing_as_an_empty_list_does():
    datasets = pytest.importorskip("datasets")
    assert list(PackedDataset([], batch=1, sequence=8, max_documents=4)) == []
    assert (
        list(PackedDataset(datasets.Dataset.from_dict({"input_ids": []}), batch=1, sequence=8, max_documents=4)) == []
    )


def test_a_state_dict_from_a_loader_with_other_settings_raises():
    documents = [[1, 2]] * 10
    state = PackedDataset(documents, **SMALL).state_dict()
    with pytest.raises(ValueError, match="other settings: batch=2 there, 3 here; max_documents=4 there, 5 here"):
        PackedDataset(documents, **{**SMALL, "batch": 3, "max_documents": 5}).load_state_dict(state)
    with pytest.raises(ValueError, match="examples=10 there, 11 here"):
        PackedDataset([*documents, [3]], **SMALL).load_state_dict(state)
    with pytest.raises(ValueError, match="not a PackedDataset state_dict"):
        PackedDataset(documents, **SMALL).load_state_dict({"epoch": 0})
    # A state saved with two workers does not load into a process without them.
    two = PackedDataset(documents, **SMALL).state_after(1, num_workers=2)
    dataset = PackedDataset(documents, **SMALL)
    dataset.load_state_dict(two)
    with pytest.raises(ValueError, match="resume with the number of DataLoader workers it was saved with"):
        iter(dataset)


def test_a_state_dict_of_the_per_shard_packing_or_without_its_batch_count_raises():
    documents = [[1, 2]] * 10
    dataset = PackedDataset(documents, **SMALL)
    next(iter(dataset))
    state = dataset.state_dict()
    with pytest.raises(ValueError, match=r"not a PackedDataset state_dict \(version 2\)"):
        PackedDataset(documents, **SMALL).load_state_dict({**state, "version": 1})
    shards = {key: {**progress, "batches": -1} for key, progress in state["shards"].items()}
    with pytest.raises(ValueError, match="shard '0/1' of the state_dict has no count 'batches' of at least 0: -1"):
        PackedDataset(documents, **SMALL).load_state_dict({**state, "shards": shards})


def test_bad_arguments_raise_at_construction():
    with pytest.raises(TypeError, match="a one-shot iterator cannot be split across workers"):
        PackedDataset(iter([[1]]), batch=1, sequence=8, max_documents=4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world=2\), got 2"):
        PackedDataset([[1]], batch=1, sequence=8, max_documents=4, rank=2, world=2)
    with pytest.raises(ValueError, match="shuffle=True needs indexable examples"):
        PackedDataset(
            type("Examples", (), {"__iter__": lambda self: iter([[1]])})(),
            batch=1,
            sequence=8,
            max_documents=4,
            shuffle=True,
        )
    with pytest.raises(ValueError, match="batch must be positive"):
        PackedDataset([[1]], batch=0, sequence=8, max_documents=4)
    with pytest.raises(ValueError, match="epoch must not be negative, got -1"):
        PackedDataset([[1]], batch=1, sequence=8, max_documents=4).batches_per_rank(-1)
