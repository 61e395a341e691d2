"""When the drop-ins may work at exact sizes from the start (NOTE [Exact sizes on the CPU] in :mod:`.metadata`)."""

from __future__ import annotations

import torch

from packfn._compat import current_dispatch_mode
from packfn._ops._cpu import cpu_nonzero

__all__ = ["exact_on_cpu", "nonzero"]


def exact_on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether a drop-in may work at exact sizes: plain CPU tensors in eager, under no dispatch mode, no subclass."""
    return (
        not torch.compiler.is_compiling()
        and current_dispatch_mode() is None
        and all(type(tensor) is torch.Tensor and tensor.device.type == "cpu" for tensor in tensors)
    )


def nonzero(flags: torch.Tensor) -> torch.Tensor:
    """The positions of the True entries of a 1-d bool CPU tensor: NumPy's where installed, else aten's."""
    positions = cpu_nonzero(flags)
    return flags.nonzero().squeeze(1) if positions is None else positions
