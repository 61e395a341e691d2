"""Inputs at the edges of the data side and of ``pack``: nulls, scalars a dtype cannot hold, ids past int64, states.

Each bad input gets an error that names the argument, the example or the
column; none is written wrapped, truncated or as a sentinel.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy
import pytest
import torch

import packfn
from packfn.data import PackedDataset
from packfn.data.fit import Items, checked_budgets, split_items

with contextlib.suppress(ImportError):  # imported at collection, before a test can take modules out of sys.modules
    import datasets  # noqa: F401

LOADER = {"batch": 1, "sequence": 8, "max_documents": 4}

# ------------------------------------------------------------------ a null inside a list


def _first(examples, **kwargs) -> dict:
    return next(iter(PackedDataset(examples, **{**LOADER, **kwargs})))


NULLS = {
    "input_ids": [{"input_ids": [4, 5]}, {"input_ids": [1, None, 3]}],
    "labels": [{"input_ids": [4, 5], "labels": [4, 5]}, {"input_ids": [1, 2, 3], "labels": [1, None, 3]}],
    "loss_mask": [{"input_ids": [4, 5], "loss_mask": [1, 1]}, {"input_ids": [1, 2, 3], "loss_mask": [1, None, 0]}],
}


@pytest.mark.parametrize("column", list(NULLS))
def test_a_null_inside_an_hf_dataset_list_raises_naming_the_example_and_column(column):
    datasets = pytest.importorskip("datasets")
    rows = NULLS[column]
    message = rf"example 1: {column} holds a null \(None\) at token 1"
    with pytest.raises(TypeError, match=message):  # the Arrow path
        _first(datasets.Dataset.from_list(rows))
    with pytest.raises(TypeError, match=message):  # the same rows as Python lists
        _first(rows)


def test_a_null_at_the_first_token_of_a_later_example_names_that_example():
    """The null is the first value of example 1, right where example 0's tokens end in the flattened column."""
    datasets = pytest.importorskip("datasets")
    rows = [{"input_ids": [4, 5]}, {"input_ids": [None, 2]}]
    for examples in (datasets.Dataset.from_list(rows), rows):
        with pytest.raises(TypeError, match=r"example 1: input_ids holds a null \(None\) at token 0"):
            _first(examples)


def test_a_null_is_named_by_its_example_in_a_shuffled_window_of_several_arrow_chunks():
    datasets = pytest.importorskip("datasets")
    clean = datasets.Dataset.from_list([{"input_ids": [index + 1] * (1 + index % 3)} for index in range(5)])
    dirty = datasets.Dataset.from_list([{"input_ids": [7, 7, 7, None]}])
    examples = datasets.concatenate_datasets([clean, dirty, clean])  # example 5 holds the null
    with pytest.raises(TypeError, match=r"example 5: input_ids holds a null \(None\) at token 3"):
        list(PackedDataset(examples, **LOADER, shuffle=True, seed=1, window=20))
    assert len(list(PackedDataset(datasets.concatenate_datasets([clean, clean]), **LOADER, shuffle=True))) > 0


# ------------------------------------------------------------------ gather's padding


def _packed() -> packfn.PackedBatch:
    return packfn.pack_documents([3, 2], sequence=4, alignment=1, max_documents=2)


UINT8 = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4, 5], dtype=torch.uint8)]


@pytest.mark.parametrize(
    ("padding", "dtype", "message"),
    [
        (-100, None, r"padding=-100 is outside \[0, 255\], which torch.uint8 cannot hold"),
        (-1, None, r"padding=-1 is outside \[0, 255\]"),
        (256, None, r"padding=256 is outside \[0, 255\]"),
        (0.5, torch.int64, "padding=0.5 is not an integer, which torch.int64 would truncate"),
        (float("nan"), torch.int64, "padding=nan is not an integer"),
        (2, torch.bool, r"padding=2 is outside \[0, 1\], which torch.bool cannot hold"),
        (2**63, torch.int64, "padding=9223372036854775808 is outside"),
        (1e6, torch.float16, "padding=1000000.0 is outside .* the finite values of torch.float16"),
        pytest.param(10**400, torch.float32, "the finite values of torch.float32", id="10**400-float32"),
    ],
)
def test_gather_padding_the_dtype_cannot_hold_raises_instead_of_wrapping(padding, dtype, message):
    with pytest.raises(ValueError, match=message):
        _packed().gather(UINT8, padding=padding, dtype=dtype)


def test_gather_padding_the_dtype_holds_is_written_as_it_is():
    packed = _packed()
    assert packed.gather(UINT8, padding=255)[1].tolist() == [4, 5, 255, 255]
    assert packed.gather(UINT8, padding=1.0, dtype=torch.int64)[1].tolist() == [4, 5, 1, 1]
    assert packed.gather(UINT8, padding=-(2**63), dtype=torch.int64)[1, 2] == -(2**63)
    assert packed.gather(UINT8, padding=float("-inf"), dtype=torch.float16)[1, 3] == float("-inf")
    assert packed.gather(UINT8, padding=2**70, dtype=torch.float32)[1, 3] == float(2**70)
    assert packed.gather(UINT8, padding=numpy.int64(7))[1, 3] == 7
    # float16's largest finite value, as an int and as a float, is held (one past it is not, above).
    assert packed.gather(UINT8, padding=65504, dtype=torch.float16)[1, 3] == 65504
    assert packed.gather(UINT8, padding=-65504.0, dtype=torch.float16)[1, 3] == -65504
    with pytest.raises(TypeError, match="padding must be an int or a float, got str"):
        packed.gather(UINT8, padding="0")
    with pytest.raises(TypeError, match="padding must be an int or a float, got Tensor"):
        packed.gather(UINT8, padding=torch.tensor(0))


@pytest.mark.parametrize(
    ("tokens", "dtype", "message"),
    [
        ([70000, 1, 2], torch.float16, r"document 0 holds values outside \[-65504.0, 65504.0\], which torch.float16"),
        ([2**40 + 1, 1, 2], torch.float32, "document 0 holds integers torch.float32 cannot hold exactly"),
        ([2**24 + 1, 1, 2], torch.float32, "document 0 holds integers torch.float32 cannot hold exactly"),
        ([2**63 - 1, 1, 2], torch.float64, "document 0 holds integers torch.float64 cannot hold exactly"),
        (torch.tensor([1e6, 1.0, 2.0], dtype=torch.float64), torch.float16, "document 0 holds values outside"),
        (torch.tensor([1e39, 1.0, 2.0], dtype=torch.float64), torch.float32, "document 0 holds values outside"),
        ([2**64 - 1, 1, 2], None, "document 0's tokens are not a tensor of numbers torch holds"),
        ([2**24 + 1, 0.5, 2], None, "document 0 holds integers torch.float32 cannot hold exactly"),  # among floats
        ([2**53 + 1, 0.5, 2], torch.float64, "document 0 holds integers torch.float64 cannot hold exactly"),
    ],
)
def test_gather_into_a_floating_dtype_refuses_values_it_would_overflow_or_round(tokens, dtype, message):
    with pytest.raises(ValueError, match=message):
        _packed().gather([tokens, [4, 5]], dtype=dtype)


@pytest.mark.parametrize(
    ("documents", "dtype", "error", "message"),
    [
        ([[1e300, 1.0], [1.0, 2.0, 3.0]], None, ValueError, r"document 0 holds values outside .* torch.float32"),
        ([torch.tensor([1 + 1j, 2]), [3.0, 4.0, 5.0]], torch.float32, ValueError, "imaginary parts torch.float32"),
        ([[1, 2], [3, 4, 5]], torch.uint16, ValueError, "dtype must be bool, an integer dtype up to int64"),
        ([[1, 2], [3, 4, 5]], torch.float8_e4m3fn, ValueError, "dtype must be bool, an integer dtype up to int64"),
        ([[1, 2], [3, 4, 5]], "int64", TypeError, "dtype must be a torch.dtype or None, got str"),
        ([torch.tensor([2**63, 1], dtype=torch.uint64), [3, 4, 5]], torch.int64, ValueError, r"2\*\*63 or more"),
        ([torch.tensor([1, 2**64 - 1], dtype=torch.uint64), [3, 4, 5]], torch.int64, ValueError, r"2\*\*63 or more"),
        ([numpy.array([2**64 - 1, 1], dtype=numpy.uint64), [3, 4, 5]], None, ValueError, "have no common dtype"),
    ],
)
def test_gather_refuses_documents_and_dtypes_it_cannot_write_exactly(documents, dtype, error, message):
    with pytest.raises(error, match=message):
        packfn.pack_documents([2, 3], sequence=6, alignment=1, max_documents=2).gather(documents, dtype=dtype)


def test_gather_of_an_empty_batch_is_int64_unless_told():
    packed = packfn.pack_documents([], sequence=4, batch=1, alignment=1, max_documents=2)
    assert packed.gather([]).dtype == torch.int64 and packed.gather([]).tolist() == [[0, 0, 0, 0]]
    assert packed.gather([], dtype=torch.float16, padding=-1).tolist() == [[-1, -1, -1, -1]]


def test_gather_writes_the_ints_of_a_list_of_floats_that_the_dtype_holds():
    packed = _packed()
    assert packed.gather([[2**24, 0.5, 3], [4, 5]])[0, :3].tolist() == [2**24, 0.5, 3]
    assert packed.gather([[2**70, 0.5, 3], [4, 5]], dtype=torch.float64)[0, 0].item() == 2**70  # past int64, held
    first, second = packfn.pack_stream([3], batch=1, sequence=2, split=True, alignment=1, max_documents=1)
    assert first.gather([[0.5, 1, 2**24 + 1]]).tolist() == [[0.5, 1.0]]  # only this batch's piece is written
    with pytest.raises(ValueError, match=r"document 0 holds integers torch\.float32 cannot hold exactly"):
        second.gather([[0.5, 1, 2**24 + 1]])


def test_gather_of_complex_and_integer_documents_warns_of_nothing():
    packed = _packed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert packed.gather([[1 + 1j, 2, 3], [4, 5]])[1, :2].tolist() == [4, 5]


def test_gather_reads_a_list_of_floats_in_double_precision():
    packed = packfn.pack_documents([2, 3], sequence=6, alignment=1, max_documents=2)
    wide = packed.gather([[1e300, 0.1], [1.0, 2.0, 3.0]], dtype=torch.float64)
    assert wide[0, :2].tolist() == [1e300, 0.1]
    assert packed.gather([[0.1, 1.0], [1.0, 2.0, 3.0]]).dtype == torch.float32  # the default stays float32
    unsigned = [torch.tensor([1, 2], dtype=torch.uint32), torch.tensor([3, 4, 5], dtype=torch.uint32)]
    assert packed.gather(unsigned, dtype=torch.int64)[0].tolist() == [1, 2, 3, 4, 5, 0]
    zero = [torch.tensor([0, 1], dtype=torch.uint64), [3, 4, 5]]  # 0 is no value past int64
    assert packed.gather(zero, dtype=torch.int64)[0].tolist() == [0, 1, 3, 4, 5, 0]


def test_gather_into_a_floating_dtype_writes_what_it_holds():
    packed = _packed()
    assert packed.gather([[65504, 2**11, 3], [4, 5]], dtype=torch.float16)[0, :3].tolist() == [65504, 2048, 3]
    assert packed.gather([[2**24, -(2**24), 1], [4, 5]], dtype=torch.float32)[0, :3].tolist() == [2**24, -(2**24), 1]
    rounded = packed.gather([torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64), torch.tensor([4.0, 5.0])])
    assert rounded.dtype == torch.float64  # promoted, nothing rounds
    halves = packed.gather(
        [torch.tensor([0.1, float("inf"), float("nan")]), torch.tensor([4.0, 5.0])], dtype=torch.bfloat16
    )
    assert (
        halves[0, 0] == torch.tensor(0.1, dtype=torch.bfloat16)
        and halves[0, 1] == float("inf")
        and halves[0, 2].isnan()
    )


@pytest.mark.parametrize(
    ("padding", "dtype", "message"),
    [
        (2**24 + 1, torch.float32, r"padding=16777217 is not exactly a value of torch.float32, which would round it"),
        (2049, torch.float16, r"padding=2049 is not exactly a value of torch.float16"),
        (2**63 - 1, torch.float64, r"padding=9223372036854775807 is not exactly a value of torch.float64"),
    ],
)
def test_an_integer_padding_a_floating_dtype_would_round_raises(padding, dtype, message):
    with pytest.raises(ValueError, match=message):
        _packed().gather(UINT8, padding=padding, dtype=dtype)


# ------------------------------------------------------------------ positions that wrap int64


@pytest.mark.parametrize("start", [None, 0])
@pytest.mark.parametrize("attention_mask", [None, torch.ones(1, 6, dtype=torch.int64)], ids=["runs", "masked"])
def test_a_negative_position_after_int64_s_maximum_is_refused_not_read_as_continuing(start, attention_mask):
    """2**63 - 1 then -2**63 differ by 1 in int64: the CPU kernel's runs read them as one document."""
    positions = torch.tensor([[0, 1, 2, 3, 2**63 - 1, -(2**63)]])
    with pytest.raises(RuntimeError, match="position_ids must not be negative"):
        packfn.document_ids_from_position_ids(positions, attention_mask=attention_mask, start=start)


# ------------------------------------------------------------------ tensors on two devices

META = {"device": "meta"}
IDS = torch.tensor([[1, 1, 2, 0]])


def _layout_of_ids() -> packfn.PackedSequenceLayout:
    lengths = packfn.seq_lens_from_document_ids(IDS, max_documents=2)
    return packfn.aligned_layout(lengths, sequence_length=4, alignment=2, budget=8)


MASK = torch.ones(1, 4, dtype=torch.int64, **META)
TWO_DEVICES = {
    "eos": (
        lambda: packfn.document_ids_from_eos(IDS, 2, attention_mask=MASK),
        "attention_mask is on meta but input_ids",
    ),
    "position_ids": (
        lambda: packfn.document_ids_from_position_ids(IDS, attention_mask=MASK),
        "attention_mask is on meta but position_ids",
    ),
    "seq_idx": (lambda: packfn.document_ids_from_seq_idx(IDS, attention_mask=MASK), "attention_mask is on meta"),
    "cu_seqlens": (
        lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 2, 4]), sequence=4, attention_mask=MASK),
        "attention_mask is on meta but cu_seqlens on cpu",
    ),
    "unpad": (lambda: packfn.unpad(torch.zeros(1, 4, **META), packfn.varlen_metadata(IDS)), "values is on meta"),
    "pad": (lambda: packfn.pad(torch.zeros(4, 2, **META), packfn.varlen_metadata(IDS)), "values is on meta"),
    "pack": (lambda: _layout_of_ids().pack(torch.zeros(1, 4, **META)), "values is on meta but the layout on cpu"),
    "restore": (lambda: _layout_of_ids().restore(torch.zeros(1, 8, **META)), "values is on meta but the layout"),
    "aligned_layout": (
        lambda: packfn.aligned_layout(
            torch.tensor([[3, 1]]), torch.tensor([[3, 1]], **META), sequence_length=4, alignment=1, budget=4
        ),
        "seq_lens_padded is on meta but seq_lens on cpu",
    ),
    "flatten_metadata": (
        lambda: packfn.flatten_metadata(torch.tensor([[0, 1, 2, -1]]), torch.tensor([[0, 2, 3]], **META)),
        "cu_seqlens is on meta but packed_token_indices on cpu",
    ),
    "document_block_mask": (
        lambda: packfn.document_block_mask(IDS, window=2, positions=packfn.packed_position_ids(IDS).to("meta")),
        "positions is on meta but document_ids on cpu",
    ),
    "shard_packed_batch labels": (
        lambda: _shard(labels=torch.zeros(1, 4, dtype=torch.int64, **META)),
        "labels is on meta but input_ids on cpu",
    ),
    "shard_packed_batch seq_lens": (
        lambda: _shard(seq_lens=torch.tensor([[3, 1]], **META)),
        "seq_lens is on meta but input_ids on cpu",
    ),
}


def _shard(**tensors) -> packfn.CPShard:
    inputs = {"seq_lens": torch.tensor([[3, 1]]), "input_ids": IDS, "labels": IDS, **tensors}
    seq_lens = inputs.pop("seq_lens")
    return packfn.shard_packed_batch(seq_lens, None, **inputs, rank=0, world=1, budget=4, balance="contiguous")


@pytest.mark.parametrize("case", list(TWO_DEVICES))
def test_tensors_on_two_devices_raise_naming_both(case):
    call, message = TWO_DEVICES[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("padding_token_id", "message"),
    [(-1, r"padding_token_id=-1 is outside \[0, 255\]"), (256, r"padding_token_id=256 is outside \[0, 255\]")],
)
def test_a_shard_padding_token_id_the_tokens_cannot_hold_raises_naming_it(padding_token_id, message):
    with pytest.raises(ValueError, match=message):
        _shard(input_ids=IDS.to(torch.uint8), padding_token_id=padding_token_id)
    shard = _shard(seq_lens=torch.tensor([[2, 1]]), input_ids=IDS.to(torch.uint8), padding_token_id=255)
    assert shard.input_ids.tolist() == [[1, 1, 2, 255]]


# ------------------------------------------------------------------ int arguments past int64

PAST = 2**63
PAST_INT64 = {  # a case: (the argument named, the call)
    "varlen_metadata": ("max_documents", lambda: packfn.varlen_metadata(IDS, max_documents=PAST)),
    "aligned_layout": (
        "alignment",
        lambda: packfn.aligned_layout(torch.tensor([[3]]), sequence_length=4, alignment=PAST, budget=8),
    ),
    "cu_seqlens": ("sequence", lambda: packfn.document_ids_from_cu_seqlens(torch.tensor([0, 2]), PAST)),
    "document_block_mask": ("block_size", lambda: packfn.document_block_mask(IDS, block_size=PAST)),
    "pack_documents": ("sequence", lambda: packfn.pack_documents([3], sequence=PAST, alignment=1, max_documents=1)),
    "seq_lens": ("sequence", lambda: packfn.document_ids_from_seq_lens(torch.tensor([[2]]), PAST)),
}


@pytest.mark.parametrize("case", list(PAST_INT64))
def test_an_int_argument_past_int64_raises_naming_it(case):
    name, call = PAST_INT64[case]
    with pytest.raises(ValueError, match=f"^{name}=9223372036854775808 is outside .*, which torch.int64 cannot"):
        call()


def test_a_safe_budget_past_int64_raises_and_one_within_is_returned():
    with pytest.raises(ValueError, match="the safe budget of these arguments, 9223372036854775808, is past int64"):
        packfn.safe_budget(4, 2, 2**62)
    assert packfn.safe_budget(4, 1, 2**62) == 2**62


# ------------------------------------------------------------------ the loader's padding id


@pytest.mark.parametrize("padding_token_id", [2**70, 2**63, -(2**63) - 1])
def test_a_padding_token_id_past_int64_raises_at_construction(padding_token_id):
    with pytest.raises(ValueError, match=rf"padding_token_id={padding_token_id} is outside .* torch.int64 cannot hold"):
        PackedDataset([[1, 2]], **LOADER, padding_token_id=padding_token_id)


@pytest.mark.parametrize("padding_token_id", [2**63 - 1, -(2**63)])
def test_a_padding_token_id_at_int64_s_limits_is_written(padding_token_id):
    assert _first([[1, 2]], padding_token_id=padding_token_id)["input_ids"][0].tolist()[2:] == [padding_token_id] * 6


@pytest.mark.parametrize("pad_token_id", [2**70, 2**63, -(2**63) - 1])
def test_a_collator_pad_token_id_past_int64_raises_at_construction(pad_token_id):
    from packfn.integrations.hf import PackedCollator

    with pytest.raises(ValueError, match=rf"pad_token_id={pad_token_id} is outside .* torch.int64 cannot hold"):
        PackedCollator(6, pad_token_id=pad_token_id)
    assert PackedCollator(6, pad_token_id=2**63 - 1).pad_token_id == 2**63 - 1


# ------------------------------------------------------------------ a state over other examples

RESUME = {"batch": 1, "sequence": 8, "max_documents": 3, "window": 4, "split": True}
LENGTHS = (5, 3, 7, 2, 6, 4, 3, 5)


class Reiterable:
    """A re-iterable that is not a sequence (the loader reads it in one pass, skipping on resume)."""

    def __init__(self, documents):
        self.documents = documents

    def __iter__(self):
        return iter(self.documents)


def _documents(lengths) -> list[list[int]]:
    return [[index + 1] * length for index, length in enumerate(lengths)]


def _state_after(examples, batches: int) -> dict:
    dataset = PackedDataset(examples, **RESUME)
    iterator = iter(dataset)
    for _ in range(batches):
        next(iterator)
    return dataset.state_dict()


def _edited(state: dict, change) -> dict:
    state = {**state, "shards": {key: dict(progress) for key, progress in state["shards"].items()}}
    change(state)
    return state


EDITS = {
    "no epoch": (lambda state: state.pop("epoch"), "the state_dict's 'epoch' is missing or not an int"),
    "negative epoch": (lambda state: state.update(epoch=-1), "the state_dict's 'epoch' is negative: -1"),
    "bool epoch": (lambda state: state.update(epoch=True), "the state_dict's 'epoch' is missing or not an int"),
    "bool emitted": (
        lambda state: next(iter(state["shards"].values())).update(emitted=True),
        "has no count 'emitted' of at least 0: True",
    ),
    "negative emitted": (
        lambda state: next(iter(state["shards"].values())).update(emitted=-3),
        "has no count 'emitted' of at least 0: -3",
    ),
    "no position": (lambda state: next(iter(state["shards"].values())).pop("position"), "no count 'position'"),
    "shards a list": (lambda state: state.update(shards=[]), "the state_dict's 'shards' is missing or not a mapping"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_state_dict_raises_naming_the_entry(edit):
    change, message = EDITS[edit]
    state = _edited(_state_after(_documents(LENGTHS), 2), change)
    with pytest.raises(ValueError, match=message):
        PackedDataset(_documents(LENGTHS), **RESUME).load_state_dict(state)


KINDS = {
    "list": lambda documents: documents,
    "datasets": lambda documents: pytest.importorskip("datasets").Dataset.from_dict({"input_ids": documents}),
    "re-iterable": Reiterable,
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_state_dict_over_other_examples_of_the_same_count_raises(kind):
    make = KINDS[kind]
    state = _state_after(make(_documents(LENGTHS)), 2)
    other = PackedDataset(make(_documents((2, 3, 1, 2, 1, 1, 3, 1))), **RESUME)
    other.load_state_dict(state)  # the settings (and the count) match
    with pytest.raises(ValueError, match="the state_dict does not match these examples: the documents of shard 0"):
        next(iter(other))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_state_dict_whose_carried_piece_has_another_length_here_raises(kind):
    make = KINDS[kind]
    state = _state_after(make(_documents(LENGTHS)), 4)
    (carried,) = state["shards"]["0/1"]["carry"]["document"].tolist()  # a piece of document 3 waits in a row
    assert carried == 3 and state["shards"]["0/1"]["position"] == 4
    lengths = list(LENGTHS)
    lengths[carried] += 2  # the window it resumes in (documents 4 to 7) is the same
    other = PackedDataset(make(_documents(lengths)), **RESUME)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="carries a piece of example 3 of 2 tokens, which has 4 here"):
        next(iter(other))


def test_a_state_dict_past_the_end_of_a_shorter_re_iterable_raises():
    state = _state_after(Reiterable(_documents(LENGTHS)), 4)
    other = PackedDataset(Reiterable(_documents(LENGTHS[:3])), **RESUME)
    other.load_state_dict(state)  # a re-iterable has no count to compare
    with pytest.raises(ValueError, match="resumes shard 0 after 4 of its examples, and they hold 3"):
        next(iter(other))


def test_a_state_dict_over_examples_of_the_same_lengths_resumes():
    documents = _documents(LENGTHS)
    state = _state_after(documents, 2)
    same_lengths = [[token + 100 for token in document] for document in documents]
    restored = PackedDataset(same_lengths, **RESUME)
    restored.load_state_dict(state)
    assert [batch["seq_lens"].tolist() for batch in restored] == [
        batch["seq_lens"].tolist() for batch in list(PackedDataset(documents, **RESUME))[2:]
    ]


# ------------------------------------------------------------------ lengths past int64


@pytest.mark.parametrize(
    ("lengths", "past"),
    [
        ([2**70], 2**70),
        ([3, 2**63], 2**63),
        (numpy.array([2, 2**64 - 1], dtype=numpy.uint64), 2**64 - 1),
        (torch.tensor([2, 2**63 + 1], dtype=torch.uint64), 2**63 + 1),
    ],
    ids=["2**70", "2**63", "numpy uint64", "torch uint64"],
)
@pytest.mark.parametrize("split", [True, False])
def test_pack_documents_a_length_past_int64_raises_naming_it(lengths, past, split):
    index = len(lengths) - 1
    with pytest.raises(ValueError, match=rf"document {index}: a length must fit in int64, got {past}"):
        packfn.pack_documents(lengths, sequence=8, alignment=1, max_documents=2, split=split)


def test_pack_stream_a_length_past_int64_raises_naming_it():
    stream = packfn.pack_stream(iter([3, 2, 2**64]), batch=1, sequence=8, alignment=1, max_documents=2, window=2)
    with pytest.raises(ValueError, match="document 2: a length must fit in int64, got 18446744073709551616"):
        list(stream)


def test_a_split_length_near_int64_s_limit_is_cut_without_wrapping_its_piece_count():
    # 2**63 - 1 + longest - 1 is past int64: the piece count must not be computed through it.
    budgets = checked_budgets(2**62, 1, 2, None, 1, True)
    lengths = torch.tensor([2**63 - 1, 5])
    item, offset, length = split_items(
        Items(torch.arange(2), torch.zeros(2, dtype=torch.int64), lengths, lengths), budgets
    )
    assert item.tolist() == [0, 0, 1]
    assert offset.tolist() == [0, 2**62, 0] and length.tolist() == [2**62, 2**62 - 1, 5]


# ------------------------------------------------------------------ pack's fill


def _layout() -> packfn.PackedSequenceLayout:
    return packfn.aligned_layout(torch.tensor([[3, 5]]), sequence_length=9, alignment=4, budget=12)


@pytest.mark.parametrize(
    ("dtype", "fill", "message"),
    [
        (torch.int64, 0.5, "fill=0.5 is not an integer, which torch.int64 would truncate"),
        (torch.int64, float("inf"), "fill=inf is not an integer"),
        (torch.uint8, -1, r"fill=-1 is outside \[0, 255\], which torch.uint8 cannot hold"),
        (torch.uint8, 256, r"fill=256 is outside \[0, 255\]"),
        (torch.bool, 2, r"fill=2 is outside \[0, 1\]"),
        (torch.int64, 2**53 + 1, "fill=9007199254740993 does not pass exactly as the op's float64 scalar"),
        (torch.int64, 2**63 - 1, "does not pass exactly"),  # as a float64 it is 2**63, which wraps
        (torch.float16, 1e6, "fill=1000000.0 is outside .* the finite values of torch.float16"),
        (torch.float16, -1e6, r"fill=-1000000.0 is outside \[-65504.0, 65504.0\], the finite values of torch.float16"),
        (torch.float16, -65520.0, r"fill=-65520.0 is outside \[-65504.0, 65504.0\]"),  # would round to -inf
        (torch.bfloat16, 1e39, r"fill=1e\+39 is outside .* the finite values of torch.bfloat16"),
        (torch.bfloat16, -1e39, r"fill=-1e\+39 is outside .* the finite values of torch.bfloat16"),
        (torch.float32, 2**24 + 1, "fill=16777217 is not exactly a value of torch.float32"),
    ],
)
def test_pack_fill_the_values_dtype_cannot_hold_raises_naming_fill(dtype, fill, message):
    with pytest.raises(ValueError, match=message):
        _layout().pack(torch.ones(1, 9, dtype=dtype), fill=fill)


def test_pack_fill_the_values_dtype_holds_is_written_as_it_is():
    layout = _layout()
    padding = [3, 9, 10, 11]
    for dtype, fill in [
        (torch.uint8, 255),
        (torch.int64, 1.0),
        (torch.int64, -(2**53)),
        (torch.bool, True),
        (torch.float16, float("-inf")),
        (torch.float32, 2**70),
    ]:
        packed = layout.pack(torch.zeros(1, 9, dtype=dtype), fill=fill)
        assert packed.dtype == dtype and packed[0, padding].tolist() == [fill] * 4, (dtype, fill)
    nan = layout.pack(torch.zeros(1, 9), fill=float("nan"))
    assert nan[0, padding].isnan().all()


def test_a_fill_passed_into_a_compiled_function_compiles_fullgraph_and_is_still_checked():
    """A float argument may be traced (torch.compile need not specialize floats): its checks are guards, no break."""
    layout = _layout()
    pack = torch.compile(lambda values, fill: layout.pack(values, fill=fill), backend="aot_eager", fullgraph=True)
    for fill in (0.25, -3.5):
        assert pack(torch.ones(1, 9), fill)[0, 3] == fill
    with pytest.raises(Exception, match="is outside"):  # the raise, or torch's report that quotes its line
        pack(torch.ones(1, 9), 1e39)
    integral = torch.compile(lambda values, fill: layout.pack(values, fill=fill), backend="aot_eager", fullgraph=True)
    assert integral(torch.ones(1, 9, dtype=torch.int64), 2.0)[0, 3] == 2
    with pytest.raises(Exception, match="would truncate"):  # never truncated to 2
        integral(torch.ones(1, 9, dtype=torch.int64), 2.5)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_pack_and_restore_of_a_dtype_torch_cannot_gather_raise_naming_values(dtype):
    layout = _layout()
    message = rf"values must be bool, an integer dtype up to int64 .* got {dtype}"
    with pytest.raises(ValueError, match=message):
        layout.pack(torch.zeros(1, 9).to(dtype))
    with pytest.raises(ValueError, match=message):
        layout.restore(torch.zeros(1, 12).to(dtype))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
    ],
)
def test_pack_and_restore_take_every_dtype_they_accept(dtype):
    layout = _layout()
    values = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 0, 0]]).to(dtype)  # column 8 is padding: restore writes 0 there
    assert torch.equal(layout.restore(layout.pack(values)), values)
