"""Shared benchmark inputs (SPEC section 5) and the ``Case`` record every family returns."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

__all__ = ["FLOOR", "Case", "Inputs", "floor_variant", "make_inputs"]


@dataclass
class Case:
    """One measured job: several variants of the same work, timed side by side.

    ``variants`` maps a label (``"upstream"``, ``"packfn eager"``,
    ``"packfn compiled"``, ``"clone"``, ...) to a zero-argument callable.
    Ratios are reported as ``time(baseline) / time(variant)`` (above 1 means
    the variant is faster).
    """

    family: str
    name: str
    sequence: int
    variants: dict[str, Callable[[], object]]
    baseline: str = "upstream"
    notes: dict[str, str] = field(default_factory=dict)
    floor: str | None = None
    """A variant whose time is the floor of the job (one pass over the mask); rows report time over it."""


FLOOR = "floor: (mask > 0).sum()"


def floor_variant(mask: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The floor of a mask op: one pass over the mask (SPEC section 6)."""
    return {FLOOR: lambda: (mask > 0).sum()}


@dataclass
class Inputs:
    """SPEC section 5 inputs: ``batch`` rows of exponential-length documents.

    Attributes:
        batch, sequence, mean: the shape and mean document length.
        lengths: per row, the document lengths (rows filled until the next
            document would not fit, the rest padding).
        device: where tensors live.
    """

    batch: int
    sequence: int
    mean: int
    lengths: list[list[int]]
    device: torch.device
    hidden: int = 1024

    @cached_property
    def max_documents(self) -> int:
        """The most documents in any row (a packer's real cap)."""
        return max(1, max(len(row) for row in self.lengths))

    @cached_property
    def document_ids(self) -> torch.Tensor:
        """int64 ``[batch, sequence]``: 1-based document ids, 0 at padding."""
        mask = torch.zeros(self.batch, self.sequence, dtype=torch.int64)
        for row, lengths in enumerate(self.lengths):
            start = 0
            for document, length in enumerate(lengths, start=1):
                mask[row, start : start + length] = document
                start += length
        return mask.to(self.device)

    @cached_property
    def seq_lens(self) -> torch.Tensor:
        """int64 ``[batch, max_documents]``: document lengths, 0 for absent slots."""
        table = torch.zeros(self.batch, self.max_documents, dtype=torch.int64)
        for row, lengths in enumerate(self.lengths):
            table[row, : len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
        return table.to(self.device)

    @cached_property
    def values(self) -> torch.Tensor:
        """float32 ``[batch, sequence, hidden]`` activations."""
        generator = torch.Generator().manual_seed(1)
        return torch.randn(self.batch, self.sequence, self.hidden, generator=generator).to(self.device)


def make_inputs(
    sequence: int, mean: int, *, batch: int = 8, seed: int = 0, device: str | torch.device = "cpu", hidden: int = 1024
) -> Inputs:
    """Draw document lengths from an exponential distribution (at least 1 token)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths, used = [], 0
        while True:
            uniform = torch.rand((), generator=generator).item()
            length = max(1, math.ceil(-mean * math.log1p(-uniform)))
            if used + length > sequence:
                break
            lengths.append(length)
            used += length
        rows.append(lengths)
    return Inputs(batch, sequence, mean, rows, torch.device(device), hidden)
