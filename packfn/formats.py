"""Conversions between the packing formats pipelines hand a model and packfn's document ids.

The packing format is described once, in :mod:`packfn.metadata`. Every
function here is static (shapes from input shapes and static arguments), reads
nothing back to the host, and checks data rules with sync-free asserts that
name the broken rule. For the example mask
``document_ids = [[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]``:

- position ids that restart at every document (:func:`packed_position_ids`):
  ``[[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]``, and back
  (:func:`document_ids_from_position_ids`, with the padding given);
- an EOS-delimited stream (:func:`document_ids_from_eos`): with EOS id 9,
  ``[[5, 9, 6, 7, 9, 0], [4, 4, 4, 9, 0, 0]]`` and ``pad_token_id=0`` give the mask;
- per-document lengths (:func:`document_ids_from_seq_lens`):
  ``seq_lens = [[2, 3], [4, 0]]``, ``sequence = 6``, and back
  (:func:`seq_lens_from_document_ids`);
- cumulative lengths (:func:`document_ids_from_cu_seqlens`): per row
  ``[[0, 2, 5], [0, 4, -1]]``, or over the flattened ``[batch * sequence]``
  stream ``[0, 2, 5, 6, 10]`` (then ``attention_mask`` marks the padding);
- 0-based sequence indices (:func:`document_ids_from_seq_idx`):
  ``[[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, -1, -1]]`` with ``pad_index=-1``, and back
  (:func:`seq_idx_from_document_ids`);
- THD boundaries for Transformer Engine (:func:`thd_metadata`):
  ``cu_seqlens = [0, 2, 5, 9, 9]``, ``cu_seqlens_padded = [0, 2, 6, 12, 12]``
  (``max_documents=2``);
- a causal LM's targets: :func:`shift_labels` (each token's target is the
  next valid token of its document, ``-100`` at a document's last token and
  at padding) and :func:`ignore_first_tokens` (``-100`` at each document's
  first token and at padding, the same targets before the shift).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from packfn._checks import (
    check_bool,
    check_int,
    check_int_or_none,
    check_mask,
    check_padding_mask,
    check_positive_int,
    check_same_device,
    check_table,
    check_token_ids,
)
from packfn._ops import formats as _ops
from packfn._ops import metadata as _metadata_ops
from packfn._ops._registry import Rule, assert_rules
from packfn._ops.metadata import mask_rules

__all__ = [
    "IGNORE_INDEX",
    "EosDocuments",
    "ThdMetadata",
    "document_ids_from_cu_seqlens",
    "document_ids_from_eos",
    "document_ids_from_position_ids",
    "document_ids_from_seq_idx",
    "document_ids_from_seq_lens",
    "ignore_first_tokens",
    "packed_position_ids",
    "seq_idx_from_document_ids",
    "seq_lens_from_document_ids",
    "shift_labels",
    "thd_metadata",
]

IGNORE_INDEX = -100
"""The label a loss ignores (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""


def packed_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at every document of a packed batch, with no host sync.

    A valid token's position is its rank among the valid tokens of its
    document, so every document sees the positions it would have alone
    (padding inside a document does not count). A padding token continues
    the count of the last valid token before it in its row; one with none
    before it counts from the row start. Trailing padding therefore continues
    the last document, which is what NeMo AutoModel's packed-sequence
    collater writes (``_pad_pack``); the tests hold the two equal.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.

    Returns:
        int64 ``[batch, sequence]``. For the example mask
        ``[[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]``.

    Raises:
        ValueError: the mask is not a non-empty ``[batch, sequence]`` integer
            or bool tensor.
        RuntimeError: (a sync-free assert, asynchronous on a GPU) negative or
            decreasing ids.
    """
    check_mask(document_ids)
    positions, broken = _ops.position_ids_op(document_ids)
    assert_rules(broken, mask_rules(document_ids.shape[1]))
    return positions


def shift_labels(labels: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """Each token's next-token target: the label of the token ``next_token`` points at, ``-100`` where none.

    Args:
        labels: ``[batch, sequence]`` labels, unshifted.
        next_token: int64 ``[batch, sequence]``: the flat index (into
            ``[batch * sequence]``) of the next valid token of each token's
            document, -1 at its last token and at padding (``packfn::document_positions``).

    Returns:
        ``[batch, sequence]`` in ``labels``' dtype: no document predicts the
        next one, and padding inside a document is skipped. For the example
        mask and ``labels = [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]``:
        ``[[2, -100, 4, 5, -100, -100], [7, 8, 9, -100, -100, -100]]``.
    """
    # One gather: index -1 wraps to the -100 appended after the labels.
    flat = torch.cat([labels.reshape(-1), labels.new_full((1,), IGNORE_INDEX)])
    return torch.take(flat, next_token)


def ignore_first_tokens(labels: torch.Tensor, document_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``labels`` with ``-100`` at each document's first token (position 0) and at padding.

    The targets :func:`shift_labels` gives, before the shift, where no
    padding sits inside a document: for a loss that shifts ``labels`` itself.

    Args:
        labels: ``[batch, sequence]`` labels.
        document_ids: ``[batch, sequence]`` document ids, 0 at padding.
        position_ids: ``[batch, sequence]`` position ids that restart at 0 on
            each document's first valid token (:func:`packed_position_ids`).
    """
    return torch.where((position_ids == 0) | (document_ids == 0), IGNORE_INDEX, labels)


def _checked(ids_and_flags: tuple[torch.Tensor, torch.Tensor], rules: tuple[Rule, ...]) -> torch.Tensor:
    document_ids, broken = ids_and_flags
    assert_rules(broken, rules)
    return document_ids


def document_ids_from_position_ids(
    position_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    pad_position: int | None = None,
    start: int | None = 0,
) -> torch.Tensor:
    """Document ids of position ids that restart per document (transformers / TRL flattening, torchtitan).

    A new document begins at every row start and wherever a valid token's
    position does not continue the previous valid token's by 1 (the rule of
    transformers' ``find_packed_sequence_indices``). The flattened ``[1, T]``
    batches of ``DataCollatorWithFlattening`` are a batch of one row.

    Args:
        position_ids: ``[batch, sequence]`` integer positions.
        attention_mask: Optional ``[batch, sequence]``: 0 marks padding.
        pad_position: Optional position value that marks padding (``-1``,
            say). Without either, every token is real: a padding tail that
            restarts its positions (torchtitan's) becomes documents.
        start: The position every document begins at (0; transformers'
            ``position_ids_start``, 2 for RoBERTa-style models); None accepts
            documents that begin anywhere (a row that starts inside a
            document, torchtune's split packs).

    Returns:
        int64 ``[batch, sequence]``: 1-based ids counting the documents of
        each row, 0 at padding. ``[[0, 1, 2, 0, 1, 0]]`` gives
        ``[[1, 1, 1, 2, 2, 3]]``.

    Raises:
        ValueError / TypeError: malformed arguments.
        RuntimeError: (a sync-free assert) negative positions, or a document
            that does not begin at ``start`` (positions that never restart).
    """
    check_table(position_ids, "position_ids")
    check_padding_mask(attention_mask, position_ids.shape)
    check_same_device(attention_mask, "attention_mask", position_ids, "position_ids")
    check_int_or_none(pad_position, "pad_position")
    check_int_or_none(start, "start", minimum=0)
    result = _ops.document_ids_from_position_ids_op(position_ids, attention_mask, pad_position, start)
    return _checked(result, _ops.position_id_rules(start))


class EosDocuments(NamedTuple):
    """Documents of an EOS- or BOS-delimited token stream, with Megatron-core's position and loss rules.

    Attributes:
        document_ids: int64 ``[batch, sequence]``: 1-based ids, 0 at padding
            (one document per row without ``reset_attention_mask``).
        position_ids: int64 ``[batch, sequence]``: restarting per document
            with ``reset_position_ids`` (as :func:`packed_position_ids`), else
            the column.
        loss_mask: bool ``[batch, sequence]``: False at padding, and at the
            marker tokens with ``eod_mask_loss``.
    """

    document_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor


def document_ids_from_eos(
    input_ids: torch.Tensor,
    eos_token_id: int | list[int],
    *,
    bos: bool = False,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    vocab_size: int | None = None,
    reset_position_ids: bool = True,
    reset_attention_mask: bool = True,
    eod_mask_loss: bool = False,
) -> EosDocuments:
    """Documents of token rows delimited by EOS (or EOD) tokens, the last token of their document.

    The convention of Megatron-core's GPT dataset and torchtitan 0.2: an EOS
    ends its document and the next token begins the next one; a row's tail
    without an EOS is a document too. With ``bos=True`` the marker begins its
    document instead (and a row's head before the first marker is one).
    Multi-turn chat templates that end every turn with the EOS id
    (Qwen3's ``<|im_end|>``) mark turns, not documents: pass a document
    separator there, or use the packer's own ``seq_lens``.

    Args:
        input_ids: ``[batch, sequence]`` integer token ids.
        eos_token_id: The marker id, or a list of them.
        bos: Markers begin their document (BOS) rather than end it.
        attention_mask: Optional ``[batch, sequence]``: 0 marks padding.
        pad_token_id: Optional id that marks padding (it must not be a marker).
        vocab_size: When given, marker ids must lie in ``[0, vocab_size)``
            (a ``ValueError``) and so must every token (a sync-free assert).
        reset_position_ids, reset_attention_mask, eod_mask_loss: Megatron's
            switches: position ids restart per document; documents are
            separate (else one per row); the loss skips the markers.

    Returns:
        :class:`EosDocuments`. ``[[5, 6, 0, 7, 8, 9, 0, 4]]`` with EOS 0
        gives ids ``[[1, 1, 1, 2, 2, 2, 2, 3]]`` and positions
        ``[[0, 1, 2, 0, 1, 2, 3, 0]]``.

    Raises:
        ValueError / TypeError: malformed arguments, a marker outside the
            vocabulary or equal to ``pad_token_id``.
        RuntimeError: (a sync-free assert) a token outside the vocabulary.
    """
    check_table(input_ids, "input_ids", uint64=True)
    vocab_size = check_int_or_none(vocab_size, "vocab_size", minimum=1)
    markers = check_token_ids(eos_token_id, "eos_token_id", vocab_size=vocab_size)
    check_padding_mask(attention_mask, input_ids.shape)
    check_same_device(attention_mask, "attention_mask", input_ids, "input_ids")
    check_int_or_none(pad_token_id, "pad_token_id")
    if pad_token_id is not None and pad_token_id in markers:
        raise ValueError(f"pad_token_id {pad_token_id} is also a marker in eos_token_id {markers}: pass attention_mask")
    switches = {"bos": bos, "reset_position_ids": reset_position_ids}
    switches |= {"reset_attention_mask": reset_attention_mask, "eod_mask_loss": eod_mask_loss}
    for name, value in switches.items():
        check_bool(value, name)
    *outputs, broken = _ops.document_ids_from_eos_op(
        input_ids, attention_mask, markers, bos, pad_token_id, vocab_size,
        reset_position_ids, reset_attention_mask, eod_mask_loss,
    )  # fmt: skip
    assert_rules(broken, _ops.eos_rules(vocab_size))
    return EosDocuments(*outputs)


def document_ids_from_cu_seqlens(
    cu_seqlens: torch.Tensor,
    sequence: int,
    *,
    batch: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Document ids of cumulative lengths: flash varlen / THD ``cu_seqlens``, flat or per row.

    Two layouts, told apart by rank:

    - ``[N]``: boundaries over the flattened ``[batch * sequence]`` stream
      (transformers' ``cu_seq_lens_q`` of a ``[1, T]`` batch, torchtitan's
      varlen metadata, NeMo AutoModel's ``flash_varlen``). Segments must not
      cross a row boundary.
    - ``[batch, N]``: one table per row, over its columns (packfn's
      :func:`packfn.batch_metadata` for contiguous documents).

    Either starts at 0 and never decreases; a fixed-size table may repeat its
    total (empty documents, which still take an id) or end in ``-1``
    entries. Tokens past the last boundary are padding; so are those where
    ``attention_mask`` is 0 (flat tables often hold padding runs as segments).

    Args:
        cu_seqlens: int ``[N]`` or ``[batch, N]``.
        sequence: Columns per row (``input_ids.shape[1]``).
        batch: Rows of a flat table (default: ``attention_mask``'s, else 1).
        attention_mask: Optional ``[batch, sequence]``: 0 marks padding.

    Returns:
        int64 ``[batch, sequence]``: the 1-based index of each token's
        segment in its row, 0 at padding. ``[0, 3, 5, 6]`` with
        ``sequence=6`` gives ``[[1, 1, 1, 2, 2, 3]]``.

    Raises:
        ValueError / TypeError: malformed arguments.
        RuntimeError: (a sync-free assert) boundaries that do not start at 0,
            decrease, hold a negative entry other than trailing ``-1``,
            overrun the row (or stream), or a segment across rows.
    """
    check_table(cu_seqlens, "cu_seqlens", ranks=(1, 2))
    sequence = check_positive_int(sequence, "sequence")
    if batch is not None:
        check_positive_int(batch, "batch")
    check_padding_mask(attention_mask, None)
    if cu_seqlens.ndim == 2:
        rows = cu_seqlens.shape[0]
        if batch is not None and batch != rows:
            raise ValueError(f"batch={batch} but cu_seqlens has {rows} rows (one table per row)")
    else:
        rows = batch if batch is not None else (attention_mask.shape[0] if attention_mask is not None else 1)
    check_padding_mask(attention_mask, (rows, sequence))
    check_same_device(attention_mask, "attention_mask", cu_seqlens, "cu_seqlens")
    result = _ops.document_ids_from_cu_seqlens_op(cu_seqlens, rows, sequence, attention_mask)
    return _checked(result, _ops.CU_SEQLENS_RULES)


def document_ids_from_seq_lens(seq_lens: torch.Tensor, sequence: int) -> torch.Tensor:
    """Document ids of per-document lengths (torchtune's ``seq_lens``, a packer's table).

    Document ``k`` of a row (its ``k``-th entry, 1-based id ``k``) takes the
    next ``seq_lens[row, k - 1]`` columns; a 0 entry is an absent document
    (its id goes unused); columns past the row's total are padding. A
    trailing entry for the padding (torchtune's ``PackedDataset`` appends one
    when a pack is not full) is a document of its own, as in torchtune
    (:mod:`packfn.integrations.torchtune` tells the two apart).

    Args:
        seq_lens: int ``[batch, D]``.
        sequence: Columns per row.

    Returns:
        int64 ``[batch, sequence]``. ``[[2, 3], [4, 0]]`` with ``sequence=6``
        gives the example mask.

    Raises:
        ValueError / TypeError: malformed arguments.
        RuntimeError: (a sync-free assert) a negative length, or lengths that
            exceed the row.
    """
    check_table(seq_lens, "seq_lens")
    sequence = check_positive_int(sequence, "sequence")
    return _checked(_ops.document_ids_from_seq_lens_op(seq_lens, sequence), _ops.SEQ_LENS_RULES)


def document_ids_from_seq_idx(
    seq_idx: torch.Tensor, *, attention_mask: torch.Tensor | None = None, pad_index: int | None = None
) -> torch.Tensor:
    """Document ids of 0-based sequence indices (transformers' ``seq_idx``, Mamba kernels').

    Args:
        seq_idx: ``[batch, sequence]`` integer indices, never decreasing along
            a row (gaps allowed).
        attention_mask: Optional ``[batch, sequence]``: 0 marks padding.
        pad_index: Optional index value that marks padding (``-1``, as
            :func:`seq_idx_from_document_ids` writes).

    Returns:
        int64 ``[batch, sequence]``: ``seq_idx + 1``, 0 at padding.

    Raises:
        ValueError / TypeError: malformed arguments.
        RuntimeError: (a sync-free assert) a negative or decreasing index, or
            an index of ``2**63 - 1``, whose id int64 cannot hold.
    """
    check_table(seq_idx, "seq_idx")
    check_padding_mask(attention_mask, seq_idx.shape)
    check_same_device(attention_mask, "attention_mask", seq_idx, "seq_idx")
    check_int_or_none(pad_index, "pad_index")
    result = _ops.document_ids_from_seq_idx_op(seq_idx, attention_mask, pad_index)
    return _checked(result, _ops.SEQ_IDX_RULES)


def seq_idx_from_document_ids(document_ids: torch.Tensor, *, pad_index: int = -1) -> torch.Tensor:
    """0-based sequence indices of a packed batch, for Mamba-style kernels and transformers' ``seq_idx``.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        pad_index: The index written at padding. The default, -1, is an
            index of its own, so a state-space kernel resets there.

    Returns:
        int32 ``[batch, sequence]``: the document id minus 1 (gaps kept, so
        :func:`document_ids_from_seq_idx` with ``pad_index`` gives the ids
        back), ``pad_index`` at padding.

    Raises:
        ValueError / TypeError: a malformed mask, or a ``pad_index`` that
            is not an int32.
        RuntimeError: (a sync-free assert) negative or decreasing ids, or
            an id above ``2**31``.
    """
    check_mask(document_ids)
    pad_index = check_int(pad_index, "pad_index")
    if not -(2**31) <= pad_index < 2**31:
        raise ValueError(f"pad_index must fit in int32 (seq_idx's dtype), got {pad_index}")
    seq_idx, broken = _ops.seq_idx_from_document_ids_op(document_ids, pad_index)
    assert_rules(broken, (*mask_rules(document_ids.shape[1]), _ops.SEQ_IDX_RANGE_RULE))
    return seq_idx


def seq_lens_from_document_ids(document_ids: torch.Tensor, *, max_documents: int | None = None) -> torch.Tensor:
    """Per-document lengths of a packed batch: the ``seq_lens`` table of :func:`packfn.aligned_layout` and torchtune.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        max_documents: ``D``, the most documents of a row (default ``sequence``).

    Returns:
        int64 ``[batch, D]``: each row's documents' valid-token counts in
        order, then zeros. For the example mask with ``D=2``: ``[[2, 3], [4, 0]]``.
        Ids with gaps are counted in order: ``[[1, 1, 3, 0]]`` gives
        ``[[2, 1, 0, 0]]``.

    Raises:
        ValueError: as :func:`packfn.batch_metadata`.
        RuntimeError: (a sync-free assert) negative or decreasing ids, or more
            than ``D`` documents in a row.
    """
    check_mask(document_ids)
    capacity = document_ids.shape[1] if max_documents is None else check_positive_int(max_documents, "max_documents")
    parsed = _metadata_ops.batch_metadata_op(document_ids, capacity)
    assert_rules(parsed.broken, mask_rules(capacity))
    bounds = parsed.cu_seqlens.long()
    return torch.where(bounds[:, 1:] >= 0, bounds[:, 1:] - bounds[:, :-1], 0)


class ThdMetadata(NamedTuple):
    """THD (``qkv_format="thd"``) boundaries of a packed batch over its flattened ``[batch * sequence]`` tokens.

    Fixed sizes, so a CUDA graph can capture the attention that reads them
    (the fix Megatron-LM pads its ``cu_seqlens`` to a ``thd_max_num_seqs``
    for). Transformer Engine reads document ``i`` from token
    ``cu_seqlens_padded[i]`` on, ``cu_seqlens[i + 1] - cu_seqlens[i]`` tokens
    long; the rest of its span is its padding.

    Attributes:
        cu_seqlens: int32 ``[batch * D + 1]``: running sums of the documents'
            lengths, then the total repeated (empty documents).
        cu_seqlens_padded: int32 ``[batch * D + 1]``: where each document
            starts in the flattened stream (its span runs to the next start,
            so the padding after it is its own), then ``batch * sequence``.
        max_seqlen_bound: Python int ``sequence``, a static bound of every
            document's length.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen_bound: int


def thd_metadata(document_ids: torch.Tensor, *, max_documents: int | None = None) -> ThdMetadata:
    """THD boundaries of a packed batch for Transformer Engine / Megatron-core (``PackedSeqParams``).

    Attention then runs on ``x.reshape(batch * sequence, ...)`` without
    unpadding. Each document's tokens must be contiguous (padding between
    documents and at row ends is fine), and the first row must begin with a
    document (its span starts at token 0).

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        max_documents: ``D``, the most documents of a row (default
            ``sequence``; pass your packer's cap: TE visits every slot).

    Returns:
        :class:`ThdMetadata`. For the example mask with ``D=2``:
        ``cu_seqlens = [0, 2, 5, 9, 9]``, ``cu_seqlens_padded = [0, 2, 6, 12, 12]``.

    Raises:
        ValueError: as :func:`packfn.varlen_metadata`.
        RuntimeError: (a sync-free assert) the mask rules, padding inside a
            document, or a first row that begins with padding.
    """
    check_mask(document_ids)
    capacity = document_ids.shape[1] if max_documents is None else check_positive_int(max_documents, "max_documents")
    cu_seqlens, cu_seqlens_padded, broken = _ops.thd_metadata_op(document_ids, capacity)
    assert_rules(broken, mask_rules(capacity) + _ops.THD_RULES)
    return ThdMetadata(cu_seqlens, cu_seqlens_padded, document_ids.shape[1])
