"""packfn.integrations.torchtune against torchtune 0.6.1: the packed collate function, its ids, the static batch."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# torchtune 0.6.1 needs torchao 0.15.0 (installed with --no-deps by the README's test command).
from torchtune.data import padded_collate_packed
from torchtune.datasets import PackedDataset
from torchtune.modules.attention_utils import _get_document_ids_from_seq_lens

from packfn.integrations import torchtune as ours

from tests.assertions import assert_same, outcome


def samples(lengths: list[int]) -> list[dict[str, list[int]]]:
    out, token = [], 1
    for n in lengths:
        out.append({"tokens": list(range(token, token + n)), "labels": list(range(token + 100, token + 100 + n))})
        token += n
    return out


@st.composite
def packs(draw):
    """torchtune's own packs (``PackedDataset``) of generated samples: empty ones, splits across packs, full packs."""
    max_seq_len = draw(st.integers(1, 12))
    split = draw(st.booleans())
    high = 3 * max_seq_len if split else max_seq_len
    lengths = draw(st.lists(st.integers(0, high), min_size=1, max_size=8))
    if not any(lengths):
        lengths[0] = 1
    dataset = PackedDataset(samples(lengths), max_seq_len=max_seq_len, split_across_pack=split)
    chosen = draw(st.lists(st.integers(0, len(dataset) - 1), min_size=1, max_size=4))
    return [dataset[i] for i in chosen], samples(lengths), max_seq_len


@settings(max_examples=40)
@given(batch=packs())
def test_padded_collate_packed_equals_torchtune(batch):
    packed, _, _ = batch
    assert_same(ours.padded_collate_packed(packed), padded_collate_packed(packed))
    seq_lens = [pack["seq_lens"] for pack in packed]
    table = ours._seq_lens_table(seq_lens)
    ids = ours._document_ids(table, ours._common_length(seq_lens))
    assert_same(ids - 1, _get_document_ids_from_seq_lens(seq_lens))


@settings(max_examples=40)
@given(batch=packs())
def test_collate_packed_gives_the_padding_entry_id_zero(batch):
    packed, _, max_seq_len = batch
    collated = ours.collate_packed(packed)
    upstream = padded_collate_packed(packed)
    for key in ("tokens", "labels", "input_pos"):
        assert_same(collated[key], upstream[key])
    ids = collated["document_ids"]
    assert ids.shape == (len(packed), max_seq_len) and ids.dtype == torch.int64
    # torchtune pads with padding_idx 0 and labels -100 past the documents: exactly where packfn says padding.
    for row, pack in enumerate(packed):
        real = int(pack["seq_lens"].sum()) - (int(pack["seq_lens"][-1]) if ours._is_padding_entry(pack) else 0)
        assert bool((ids[row, :real] > 0).all()) and bool((ids[row, real:] == 0).all())
        assert bool((pack["labels"][real:] == -100).all())


def test_packs_of_different_lengths_fail_as_torchtune_s():
    first = PackedDataset(samples([3, 2]), max_seq_len=6)[0]
    second = PackedDataset(samples([2, 2]), max_seq_len=5)[0]
    batch = [first, second]
    assert outcome(ours.padded_collate_packed, batch) == outcome(padded_collate_packed, batch)
    assert outcome(ours.padded_collate_packed, batch)[0] == "error"
