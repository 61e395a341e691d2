"""Running sums that Inductor compiles on every GPU at every length.

NOTE [Scans that never split]
Inductor's Triton backend turns a scan whose axis is longer than 8192 and
that has fewer than 2 x (number of SMs) rows into a *split scan*: one
kernel without an x axis, in which the rows are spread over program ids.
torch 2.11 (and 2.12) cannot write a load indexed by the row alone into
such a kernel (``TypeError: list indices must be integers or slices, not
NoneType`` in ``TritonSymbols.get_block_shape``, pytorch/pytorch#180221,
fixed from 2.13 on), and the decompositions fuse exactly such loads (a
row's total, a row's first column) into their scans. So packed batches of
16k to 128k columns, the long-context runs packfn exists for, did not
compile on those releases, while 4096 columns did.

packfn therefore never scans a row of a 2-D tensor: every running sum over
a long axis is one 1-D scan over the flattened tensor (:func:`running_sum`),
from which each row's own sums are recovered by subtracting the total of
the rows before it, outside the scan. A 1-D scan has no row axis to lose,
so it compiles (split or not) on every release, and it is the form a GPU
scans fastest (one pass over all rows at once). ``cummax`` / ``cummin``
(a value and an index: two dtypes) never split; Inductor falls back to
aten for them past 8192 columns instead.

``tests/core/test_fakes.py`` holds every ``cumsum`` in the ops'
decompositions to a 1-D input, and ``tests/core/test_triton_codegen.py``
writes every public function's Triton code for an H200, on the CPU, at
8193 columns (one past where Inductor splits), so a 2-D long scan fails
in CI on torch 2.11 before it reaches a GPU; ``scripts/gpu_check.py``
runs every function on a GPU at 8192, 8193, 32768 and 131072.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["running_sum"]


def running_sum(values: torch.Tensor) -> torch.Tensor:
    """``values.cumsum(-1)`` as one 1-D scan (NOTE [Scans that never split]).

    Args:
        values: bool or integer ``[..., length]``, with a total over all
            rows that int64 holds.

    Returns:
        int64, ``values``' shape: each row's running sums, from its own
        first entry.
    """
    if values.dim() <= 1:
        return values.cumsum(0)
    shape = values.shape
    rows = math.prod(shape[:-1])  # not view(-1, length): ambiguous for an empty tensor
    flat = values.reshape(-1).cumsum(0).view(rows, shape[-1])
    # The running sum at each row's last column (0 for an empty row), shifted down one row: the rows before.
    last = F.pad(flat, (1, 0))[:, -1]
    before = F.pad(last, (1, 0))[:rows]
    return (flat - before.unsqueeze(1)).view(shape)
