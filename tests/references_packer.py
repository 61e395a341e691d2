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
