"""Ops that convert between packing formats: document ids to per-document position ids.

The packing format is the one of :mod:`packfn._ops.metadata`. Every op here
never raises on its data: its last output is ``broken``, the rule flags of
:func:`packfn._ops.metadata.mask_rules`.

Shapes: ``B`` batch, ``S`` sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from packfn._ops._registry import packfn_op
from packfn._ops.metadata import _compact, _parse_mask, broken_fake

__all__ = ["DocumentPositions", "PositionOutputs", "document_positions_op", "position_ids_op"]


# ------------------------------------------------------------ position ids


def _position_ids_fake(document_ids: torch.Tensor):
    """int64 ``[batch, sequence]`` and the rule flags."""
    return document_ids.new_empty(document_ids.shape, dtype=torch.int64), broken_fake(document_ids)


class PositionOutputs(NamedTuple):
    """Outputs of ``packfn::position_ids``."""

    position_ids: torch.Tensor  # int64 [batch, sequence]
    broken: torch.Tensor  # bool [3]: mask_rules


def _positions(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position ids ``[B, S]``, the next valid token of each token's document (flat, -1 if none), rule flags.

    A valid token's position is its rank among its document's valid tokens.
    A padding token continues the count of the last valid token before it
    in its row (its position plus the distance), and one with no valid
    token before it in its row counts from the row start.
    """
    batch, sequence = document_ids.shape
    parsed = _parse_mask(document_ids, sequence)
    starts, seen = parsed.starts.reshape(-1), parsed.valid_seen
    flat = torch.arange(starts.numel(), device=starts.device)
    documents = starts.cumsum(0)  # documents begun at or before each position
    # The valid rank (in the flat stream) of each document's first token.
    first = _compact(starts, seen - 1, starts.numel(), search=False)
    last_valid = parsed.indices.index_select(0, (seen - 1).clamp_min(0))
    rank = seen - 1 - first.index_select(0, (documents - 1).clamp_min(0))
    row = flat // sequence
    in_row = (seen > 0) & (torch.div(last_valid, sequence, rounding_mode="floor") == row)
    positions = torch.where(in_row, rank + flat - last_valid, flat % sequence)
    # The next valid token of the stream is the one ranked just after the
    # valid tokens seen so far; it continues this token's document when it is
    # in this row and carries this token's id.
    ids = document_ids.reshape(-1)
    valid = parsed.valid.reshape(-1)
    after = parsed.indices.gather(0, seen.clamp_max(ids.numel() - 1))
    continues = valid & (seen < seen[-1]) & (torch.div(after, sequence, rounding_mode="floor") == row)
    next_token = torch.where(continues & (ids.gather(0, after) == ids), after, -1)
    return positions.view(batch, sequence), next_token.view(batch, sequence), parsed.broken


@packfn_op("position_ids", fake=_position_ids_fake, outputs=PositionOutputs)
def position_ids_op(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions, _, broken = _positions(document_ids)
    return positions, broken


def _document_positions_fake(document_ids: torch.Tensor):
    """int64 ``[batch, sequence]`` twice and the rule flags."""
    shape = document_ids.shape
    new = document_ids.new_empty
    return new(shape, dtype=torch.int64), new(shape, dtype=torch.int64), broken_fake(document_ids)


class DocumentPositions(NamedTuple):
    """Outputs of ``packfn::document_positions``: what a causal LM needs of a mask besides its attention mask."""

    position_ids: torch.Tensor  # int64 [batch, sequence]
    next_token: torch.Tensor  # int64 [batch, sequence]: flat index of the next valid token of the document, or -1
    broken: torch.Tensor  # bool [3]: mask_rules


@packfn_op("document_positions", fake=_document_positions_fake, outputs=DocumentPositions)
def document_positions_op(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _positions(document_ids)
