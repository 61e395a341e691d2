"""Plain-Python references that the format tests compare packfn against: loops over rows and documents."""

from __future__ import annotations

import torch


def ids_from_lengths(sequence: int, rows: list[list[int]]) -> torch.Tensor:
    """int64 ``[batch, sequence]``: each row's documents (1-based, in order) over its first columns, then 0."""
    out = []
    for lengths in rows:
        row = [k for k, n in enumerate(lengths, start=1) for _ in range(n)]
        out.append(row + [0] * (sequence - len(row)))
    return torch.tensor(out, dtype=torch.int64).view(len(rows), sequence)


def position_ids_reference(mask: torch.Tensor) -> torch.Tensor:
    """By loops: rank among the document's valid tokens; padding continues the last valid token's count."""
    out = []
    for row in mask.to(torch.int64).tolist():
        seen: dict[int, int] = {}
        positions, last = [], None  # last: (column, position) of the last valid token
        for column, document in enumerate(row):
            if document:
                seen[document] = seen.get(document, -1) + 1
                last = (column, seen[document])
                positions.append(seen[document])
            else:
                positions.append(column if last is None else last[1] + column - last[0])
        out.append(positions)
    return torch.tensor(out, dtype=torch.int64).view(mask.shape)


def next_token_reference(mask: torch.Tensor) -> torch.Tensor:
    """By loops: the flat index of the next valid token of each valid token's document in its row, else -1."""
    batch, sequence = mask.shape
    rows = mask.to(torch.int64).tolist()
    out = []
    for r, row in enumerate(rows):
        for column, document in enumerate(row):
            following = [c for c in range(column + 1, sequence) if row[c]]
            same = document and following and row[following[0]] == document
            out.append(r * sequence + following[0] if same else -1)
    return torch.tensor(out, dtype=torch.int64).view(batch, sequence)


def canonical_ids(mask: torch.Tensor) -> torch.Tensor:
    """The documents of a mask renumbered 1, 2, ... in each row (gaps dropped), 0 at padding."""
    out = []
    for row in mask.to(torch.int64).tolist():
        rank, previous, renumbered = 0, None, []
        for document in row:
            if document and document != previous:
                rank, previous = rank + 1, document
            renumbered.append(rank if document else 0)
        out.append(renumbered)
    return torch.tensor(out, dtype=torch.int64).view(mask.shape)


def eos_stream(sequence: int, rows: list[list[int]], eos: int, pad: int, tail: list[bool]) -> torch.Tensor:
    """Token rows: each document's tokens are ``eos + 1 + its index``, its last an EOS unless ``tail[row]``
    leaves the row's last document open; ``pad`` fills the rest."""
    out = []
    for lengths, open_tail in zip(rows, tail, strict=True):
        row = []
        for k, n in enumerate(lengths):
            tokens = [eos + 2 + (k + j) % 5 for j in range(n)]
            if not (open_tail and k == len(lengths) - 1):
                tokens[-1] = eos
            row.extend(tokens)
        out.append(row + [pad] * (sequence - len(row)))
    return torch.tensor(out, dtype=torch.int64).view(len(rows), sequence)


def physical_segments(mask: torch.Tensor) -> list[int]:
    """Flat boundaries of the runs of equal ids over ``[batch * sequence]``, each row start a boundary."""
    batch, sequence = mask.shape
    rows = mask.tolist()
    bounds = []
    for r, row in enumerate(rows):
        for column, value in enumerate(row):
            if column == 0 or value != row[column - 1]:
                bounds.append(r * sequence + column)
    return [*bounds, batch * sequence]


def thd_reference(mask: torch.Tensor, max_documents: int) -> tuple[list[int], list[int]]:
    """THD ``cu_seqlens`` (valid lengths) and ``cu_seqlens_padded`` (flat starts) of contiguous documents."""
    batch, sequence = mask.shape
    starts, lengths = [], []
    for r, row in enumerate(mask.tolist()):
        for column, value in enumerate(row):
            if value and (column == 0 or row[column - 1] != value):
                starts.append(r * sequence + column)
                lengths.append(0)
            if value:
                lengths[-1] += 1
    slots = batch * max_documents
    total, running = batch * sequence, [0]
    for n in lengths:
        running.append(running[-1] + n)
    cu = running + [running[-1]] * (slots + 1 - len(running))
    padded = ([0, *starts[1:]] if starts else [0]) + [total] * (slots + 1 - max(1, len(starts)))
    return cu, padded


def megatron_ltor(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask):
    """megatron-core's ``_get_ltor_masks_and_position_ids`` as documented (0.16 to 0.19), for when it is absent."""
    seq_length = data.numel()
    attention_mask = (
        torch.tril(torch.ones((seq_length, seq_length), device=data.device)).unsqueeze(0)
        if create_attention_mask
        else None
    )
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    if reset_position_ids or reset_attention_mask:
        previous = 0
        for i in position_ids[data == eod_token].tolist():  # the EOD positions, indexed as documented (1-d data)
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, (i + 1) :, : (i + 1)] = 0
            if reset_position_ids:
                position_ids[(i + 1) :] -= i + 1 - previous
                previous = i + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids
