"""Conversions between packing formats and packfn's document-id mask.

The packing format is described once, in :mod:`packfn._ops.metadata`. For
the example mask ``[[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]``, the position
ids that restart at every document are ``[[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]``
(:func:`packed_position_ids`).
"""

from __future__ import annotations

import torch

from packfn._checks import check_mask
from packfn._ops import formats as _ops
from packfn._ops._registry import assert_rules
from packfn._ops.metadata import mask_rules

__all__ = ["packed_position_ids"]


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
