"""Boundaries the other tests step over: each test fails when the comparison at its boundary moves by one.

- the dtype's own maximum (and minimum) as a marker or pad id of
  :func:`packfn.document_ids_from_eos` (the other tests try ids the dtype
  cannot hold: 256, -256, 2**40);
- the largest document id :func:`packfn.seq_idx_from_document_ids` takes,
  ``2**31`` (seq_idx is int32: the id minus 1), and its neighbours;
- the default ``max_documents`` of :func:`packfn.seq_lens_from_document_ids`
  (``sequence``: a row of one-token documents fills it);
- rows exactly ``floor_scale`` long under Llama 4's ``attn_temperature_tuning``
  in :func:`packfn.integrations.hf.hf_model_inputs` (the first column it
  scales is ``floor_scale - 1``).
"""

from __future__ import annotations

import pytest
import torch

import packfn

from tests.assertions import assert_same
from tests.references import document_spans

# ------------------------------------------------------------------ EOS and pad ids at the dtype's limits


def test_eos_at_the_dtype_s_maximum_marks_its_tokens():
    tokens = [[5, 255, 7, 9, 255, 3]]
    narrow = packfn.document_ids_from_eos(torch.tensor(tokens, dtype=torch.uint8), 255, eod_mask_loss=True)
    assert narrow.document_ids.tolist() == [[1, 1, 2, 2, 2, 3]]
    assert narrow.loss_mask.tolist() == [[True, False, True, True, False, True]]
    wide = packfn.document_ids_from_eos(torch.tensor(tokens), 255, eod_mask_loss=True)
    for ours, theirs in zip(narrow, wide, strict=True):
        assert_same(ours, theirs)
    int8 = torch.tensor([[5, 127, 7, 9, 127, 3]], dtype=torch.int8)
    assert packfn.document_ids_from_eos(int8, 127).document_ids.tolist() == [[1, 1, 2, 2, 2, 3]]


def test_pad_at_the_dtype_s_maximum_and_minimum_marks_padding():
    uint8 = torch.tensor([[5, 6, 9, 7, 255, 255]], dtype=torch.uint8)
    assert packfn.document_ids_from_eos(uint8, 9, pad_token_id=255).document_ids.tolist() == [[1, 1, 1, 2, 0, 0]]
    int8 = torch.tensor([[5, 6, 9, 7, -128, -128]], dtype=torch.int8)
    assert packfn.document_ids_from_eos(int8, 9, pad_token_id=-128).document_ids.tolist() == [[1, 1, 1, 2, 0, 0]]
    int8 = torch.tensor([[5, 6, 9, 7, 127, 127]], dtype=torch.int8)
    assert packfn.document_ids_from_eos(int8, 9, pad_token_id=127).document_ids.tolist() == [[1, 1, 1, 2, 0, 0]]


@pytest.mark.parametrize("pad_token_id", [None, 0], ids=["runs", "with padding"])  # the two CPU eager paths
def test_a_vocabulary_of_the_dtype_s_maximum_refuses_that_token_and_one_past_it_takes_it(pad_token_id):
    tokens = torch.tensor([[5, 255, 7]], dtype=torch.uint8)
    ids = packfn.document_ids_from_eos(tokens, 7, vocab_size=256, pad_token_id=pad_token_id).document_ids
    assert ids.tolist() == [[1, 1, 1]]
    with pytest.raises(RuntimeError, match=r"input_ids must lie in \[0, vocab_size=255\)"):
        packfn.document_ids_from_eos(tokens, 7, vocab_size=255, pad_token_id=pad_token_id)


# ------------------------------------------------------------------ position ids: the first token and start


@pytest.mark.parametrize("attention_mask", [None, torch.ones(1, 5, dtype=torch.bool)], ids=["runs", "masked"])
def test_a_document_that_opens_below_start_is_refused(attention_mask):
    """start=1: a document opening at 1 is fine, one opening at 0 is not (the rule is !=, not >)."""
    positions = torch.tensor([[1, 2, 3, 1, 2]])
    assert packfn.document_ids_from_position_ids(positions, attention_mask=attention_mask, start=1).tolist() == [
        [1, 1, 1, 2, 2]
    ]
    with pytest.raises(RuntimeError, match="every document of position_ids must begin at start=1"):
        packfn.document_ids_from_position_ids(positions - 1, attention_mask=attention_mask, start=1)


def test_the_first_real_token_after_left_padding_opens_a_document_even_where_the_pad_value_runs_into_it():
    """-1 then 0 counts up by one, and so does a masked 5 before 6: the first real token still opens a document."""
    ids = packfn.document_ids_from_position_ids(torch.tensor([[-1, 0, 1, 2]]), pad_position=-1)
    assert ids.tolist() == [[0, 1, 1, 1]]
    masked = torch.tensor([[0, 1, 1]])
    ids = packfn.document_ids_from_position_ids(torch.tensor([[5, 6, 7]]), attention_mask=masked, start=None)
    assert ids.tolist() == [[0, 1, 1]]


# ------------------------------------------------------------------ seq_idx at int32's limit


def test_seq_idx_takes_document_ids_up_to_exactly_2_to_the_31():
    ids = torch.tensor([[2**31 - 1, 2**31 - 1, 2**31, 0]])
    seq_idx = packfn.seq_idx_from_document_ids(ids)
    assert seq_idx.dtype == torch.int32
    assert seq_idx.tolist() == [[2**31 - 2, 2**31 - 2, 2**31 - 1, -1]]
    assert packfn.seq_idx_from_document_ids(torch.tensor([[2**31]])).tolist() == [[2**31 - 1]]


def test_seq_idx_refuses_a_document_id_of_2_to_the_31_plus_one():
    with pytest.raises(RuntimeError, match=r"document ids must be at most 2\*\*31"):
        packfn.seq_idx_from_document_ids(torch.tensor([[2**31, 2**31 + 1]]))


def test_seq_idx_writes_int32_s_minimum_as_the_pad_index():
    seq_idx = packfn.seq_idx_from_document_ids(torch.tensor([[1, 0]]), pad_index=-(2**31))
    assert seq_idx.dtype == torch.int32 and seq_idx.tolist() == [[0, -(2**31)]]
    with pytest.raises(ValueError, match="pad_index"):
        packfn.seq_idx_from_document_ids(torch.tensor([[1, 0]]), pad_index=-(2**31) - 1)


# ------------------------------------------------------------------ seq_lens' default cap


def test_seq_lens_without_max_documents_hold_a_row_of_one_token_documents():
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 1, 0, 2, 0]])
    seq_lens = packfn.seq_lens_from_document_ids(ids)
    assert seq_lens.shape == (2, 5)  # [batch, sequence]
    assert seq_lens.tolist() == [[1, 1, 1, 1, 1], [2, 1, 0, 0, 0]]
    assert_same(seq_lens, packfn.seq_lens_from_document_ids(ids, max_documents=5))


def test_seq_lens_count_ids_with_gaps_in_order():
    """A row's documents take the slots 1, 2, ... in order, whatever their ids (the glossary's slot)."""
    assert packfn.seq_lens_from_document_ids(torch.tensor([[1, 1, 3, 0], [2, 5, 5, 5]])).tolist() == [
        [2, 1, 0, 0],
        [1, 3, 0, 0],
    ]


# ------------------------------------------------------------------ Llama 4's attention temperature tuning

FLOOR_SCALE = 8


def _llama4(tuning: bool):
    transformers = pytest.importorskip("transformers")
    from tests.integrations import SIZES

    config = transformers.Llama4TextConfig(
        **SIZES,
        head_dim=8,
        intermediate_size_mlp=64,
        num_local_experts=2,
        num_experts_per_tok=1,
        no_rope_layers=[0, 0],  # both layers NoPE: the layers that tune the temperature
        attn_temperature_tuning=tuning,
        floor_scale=FLOOR_SCALE,
        attn_scale=1.0,  # ten times the default: a scaled query moves the logits well past float noise
    )
    torch.manual_seed(0)
    return config, transformers.Llama4ForCausalLM(config).eval()


def _packed_minus_alone(net, inputs: dict, document_ids: torch.Tensor, tokens: torch.Tensor) -> float:
    """The largest difference between a packed batch's logits and each document's run alone."""
    with torch.no_grad():
        packed = net(**inputs, use_cache=False).logits
        worst = 0.0
        for row, positions in document_spans(document_ids):
            alone = net(input_ids=tokens[row, positions][None], use_cache=False).logits[0]
            worst = max(worst, (packed[row, positions] - alone).abs().max().item())
    return worst


def _rows(sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ``sequence`` columns whose second document ends on the last column."""
    first = [1] * 3 + [2] * (sequence - 3)
    second = [1] * (sequence - 4) + [0] + [2] * 3
    document_ids = torch.tensor([first, second])
    tokens = torch.randint(1, 64, document_ids.shape, generator=torch.Generator().manual_seed(1))
    return document_ids, tokens


def test_temperature_tuning_rows_one_shorter_than_floor_scale_equal_each_document_alone():
    from packfn.integrations.hf import hf_model_inputs

    config, net = _llama4(True)
    document_ids, tokens = _rows(FLOOR_SCALE - 1)
    inputs = hf_model_inputs(document_ids, config, input_ids=tokens, attn_implementation="sdpa")
    assert _packed_minus_alone(net, inputs, document_ids, tokens) < 1e-5


def test_temperature_tuning_rows_exactly_floor_scale_long_are_refused_as_they_differ():
    from packfn.integrations.hf import hf_model_inputs

    config, net = _llama4(True)
    document_ids, tokens = _rows(FLOOR_SCALE)
    with pytest.raises(ValueError, match=f"attn_temperature_tuning .* floor_scale={FLOOR_SCALE}"):
        hf_model_inputs(document_ids, config, input_ids=tokens, attn_implementation="sdpa")
    # Why: masks built as if tuning were off leave the last column's query scaled by its column, not its position.
    untuned, _ = _llama4(False)
    inputs = hf_model_inputs(document_ids, untuned, input_ids=tokens, attn_implementation="sdpa")
    assert _packed_minus_alone(net, inputs, document_ids, tokens) > 1e-4  # ten times the tolerance of equal
