"""Plain reference packers the packer tests compare with (written for clarity, not speed)."""

from __future__ import annotations


def best_fit_decreasing(lengths: list[int], *, alignment: int, capacity: int, cap: int) -> list[list[int]]:
    """Best-fit decreasing at aligned sizes: the documents' indices in each bin of ``capacity`` aligned columns.

    Each document takes ``round_up(length, alignment)`` columns. Documents
    go longest first (ties in input order), each into the open bin with the
    least room that still holds it (ties: the bin opened first), or a new
    bin; a bin holds at most ``cap`` documents.
    """
    sizes = [-(-length // alignment) * alignment for length in lengths]
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    bins: list[list[int]] = []
    rooms: list[int] = []
    for index in order:
        fitting = [number for number, room in enumerate(rooms) if sizes[index] <= room and len(bins[number]) < cap]
        if fitting:
            number = min(fitting, key=lambda number: (rooms[number], number))
        else:
            number = len(bins)
            bins.append([])
            rooms.append(capacity)
        bins[number].append(index)
        rooms[number] -= sizes[index]
    return bins


def next_fit(
    lengths: list[int], *, sequence: int, alignment: int, budget: int, cap: int, multiple: int
) -> tuple[list[list[int]], list[str]]:
    """Next fit in input order: the documents' indices in each row, and what closed each row.

    A document takes ``round_up(length, multiple)`` input columns (its span)
    and ``round_up(length, alignment)`` aligned ones. It joins the last row
    when both fit that row's room and the row holds fewer than ``cap``
    documents; else it opens a row. A row it could not join was closed by
    the tokens (its span did not fit), else by the cap, else by the aligned
    budget; the last row by the end of the documents.
    """
    rows: list[list[int]] = []
    closed: list[str] = []
    span_used = aligned_used = 0
    for index, length in enumerate(lengths):
        span, aligned = -(-length // multiple) * multiple, -(-length // alignment) * alignment
        if rows and len(rows[-1]) < cap and span_used + span <= sequence and aligned_used + aligned <= budget:
            rows[-1].append(index)
            span_used, aligned_used = span_used + span, aligned_used + aligned
            continue
        if rows:
            closed[-1] = "tokens" if span_used + span > sequence else "documents" if len(rows[-1]) == cap else "budget"
        rows.append([index])
        closed.append("end")
        span_used, aligned_used = span, aligned
    return rows, closed
