"""Megatron-core: THD ``PackedSeqParams`` a CUDA graph can capture, and the ltor masks / position ids drop-in.

Nothing here imports megatron. :func:`packed_seq_params` fills megatron's own
``PackedSeqParams`` when ``megatron.core.packed_seq_params`` has been imported
(or when given the class), and otherwise packfn's :class:`MegatronPackedSeqParams`, a
dataclass with the same fields. :func:`get_ltor_masks_and_position_ids` is
megatron-core's ``megatron.core.datasets.gpt_dataset._get_ltor_masks_and_position_ids``
(0.16 to 0.19; private there): same signature, outputs, dtypes and errors
(it finds the EOD tokens by upstream's own ``data == eod_token``), without
its loop over EOD tokens. (``megatron.training.utils`` has a batched function
of the same name with a ``pad_token``; its reset path ANDs the EOD and pad
index lists, so it only holds for ``pad_token == eod_token``: use
:func:`packfn.document_ids_from_eos` for batches.)
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from packfn._checks import check_tensor
from packfn._ops import formats as _format_ops
from packfn.formats import thd_metadata
from packfn.masks import causal_band_mask

__all__ = [
    "MegatronPackedSeqParams",
    "_get_ltor_masks_and_position_ids",
    "get_ltor_masks_and_position_ids",
    "packed_seq_params",
]


@dataclasses.dataclass
class MegatronPackedSeqParams:
    """megatron-core's ``PackedSeqParams`` fields (0.19), for building THD parameters where megatron is absent."""

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None
    total_tokens: int | None = None
    seq_idx: torch.Tensor | None = None
    tokens_per_sample: int | None = None
    pad_between_seqs: bool | None = None


def _params_class() -> type:
    """megatron's ``PackedSeqParams`` if its module is loaded, else packfn's."""
    module = sys.modules.get("megatron.core.packed_seq_params")
    return getattr(module, "PackedSeqParams", MegatronPackedSeqParams)


def packed_seq_params(
    document_ids: torch.Tensor, *, max_documents: int | None = None, params_class: type | None = None
) -> Any:
    """THD ``PackedSeqParams`` of a packed batch, every tensor of a fixed size and the bounds Python ints.

    For ``TEDotProductAttention`` over the batch flattened to ``[batch * sequence]``
    tokens (``qkv_format="thd"``): ``cu_seqlens_q`` / ``_kv`` are the
    documents' lengths summed (then the total repeated), ``cu_seqlens_q_padded``
    / ``_kv_padded`` where each starts in the flattened stream (the padding
    after a document is its own), ``max_seqlen_q`` / ``_kv`` the bound
    ``sequence``. Nothing depends on the data's values, so the step can be
    captured in a CUDA graph (Megatron-LM pads its ``cu_seqlens`` to a
    ``thd_max_num_seqs`` for the same reason); ``max_documents`` is that cap.
    ``total_tokens`` and ``seq_idx`` are left unset: megatron's
    ``__post_init__`` would size ``seq_idx`` by the data
    (:func:`packfn.seq_idx_from_document_ids` gives a static one).

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids,
            each document contiguous and the first row beginning with one
            (:func:`packfn.thd_metadata`).
        max_documents: The most documents of a row (default ``sequence``).
        params_class: The class to fill (default: megatron's
            ``PackedSeqParams`` if ``megatron.core.packed_seq_params`` is
            loaded, else :class:`MegatronPackedSeqParams`).

    Returns:
        An instance of ``params_class``.

    Raises:
        As :func:`packfn.thd_metadata`.
    """
    thd = thd_metadata(document_ids, max_documents=max_documents)
    cls = params_class if params_class is not None else _params_class()
    return cls(
        qkv_format="thd",
        cu_seqlens_q=thd.cu_seqlens,
        cu_seqlens_kv=thd.cu_seqlens,
        cu_seqlens_q_padded=thd.cu_seqlens_padded,
        cu_seqlens_kv_padded=thd.cu_seqlens_padded,
        max_seqlen_q=thd.max_seqlen_bound,
        max_seqlen_kv=thd.max_seqlen_bound,
    )


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int | torch.Tensor,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Build masks and position ids for a left-to-right model: megatron-core's, without its loop over EODs.

    An EOD token is the last token of its document. The EOD tokens are
    found as upstream finds them, by ``data == eod_token``: with torch's
    rules for that comparison, so an ``eod_token`` that ``data``'s dtype
    cannot hold wraps as it does upstream (int8 data and ``eod_token=128``
    match the tokens ``-128``), and a tensor ``eod_token`` (0-d, or any
    shape that broadcasts to ``data``'s) is compared as it is. (The core
    :func:`packfn.document_ids_from_eos` matches no token in that case
    instead.)

    Args:
        data: ``[sequence]`` token ids of one sample.
        eod_token: The EOD id (an int, or a tensor as upstream compares it).
        reset_position_ids: Position ids restart after each EOD.
        reset_attention_mask: Tokens after an EOD do not attend up to it.
        eod_mask_loss: The loss mask is 0 at EOD tokens.
        create_attention_mask: Build the dense mask (else ``None``).

    Returns:
        ``(attention_mask, loss_mask, position_ids)``: bool ``[1, sequence, sequence]``,
        True where a query may *not* attend a key (or None); float32
        ``[sequence]``; int64 ``[sequence]``. All on ``data.device``.

    Raises:
        TypeError: ``data`` is not a tensor.
        IndexError: ``data`` is not 1-d (or ``eod_token`` broadcasts it to
            more dimensions) while a switch needs its EOD positions
            (upstream's error, from the same indexing).
        OverflowError, RuntimeError, TypeError: ``data == eod_token`` fails
            (an ``eod_token`` past int64, a tensor that does not broadcast),
            while a switch needs it: upstream's error, from the same
            comparison.
    """
    check_tensor(data, "data")
    sequence = data.numel()
    columns = torch.arange(sequence, device=data.device)
    loss_mask, restarting = torch.ones(1, sequence, device=data.device), columns[None]
    if eod_mask_loss or reset_position_ids or reset_attention_mask:  # else upstream never compares eod_token
        eod = data == eod_token  # upstream's comparison, with its promotion and wrapping
        if not isinstance(eod, torch.Tensor):  # an eod_token torch does not compare (None, a str): no EOD, as upstream
            eod = torch.full((sequence,), bool(eod), device=data.device)
        if eod.shape != (sequence,):
            torch.ones(sequence, device=data.device)[eod]  # raises upstream's IndexError
            eod = eod.reshape(-1)
        # Positions restarting at every EOD give each token's document start (column minus position).
        _, restarting, loss_mask, _ = _format_ops.document_ids_from_eos_op(
            eod.to(torch.uint8).unsqueeze(0), None, [1], False, None, None, True, True, eod_mask_loss
        )
    attention_mask = None
    if create_attention_mask:
        first = columns - restarting if reset_attention_mask else torch.zeros_like(restarting)
        attention_mask = causal_band_mask(first, invert=True)
    position_ids = restarting[0] if reset_position_ids else columns
    return attention_mask, loss_mask[0].float(), position_ids


_get_ltor_masks_and_position_ids = get_ltor_masks_and_position_ids
"""megatron-core's own (private) name."""
