"""Every torch-version workaround and private torch API packfn relies on, in one place.

Each entry says which releases it is for and when it can go;
``tests/core/test_compat.py`` fails on a torch where a workaround is no
longer needed (so it gets removed) or no longer works (so it gets fixed).
packfn supports torch 2.11 and newer (``pyproject.toml``); CI runs 2.11, 2.13
and 2.15.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as _fc
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "AsyncCollectiveTensor",
    "all_gather",
    "all_gather_autograd",
    "current_dispatch_mode",
    "is_functorch_wrapper",
    "leading_columns",
    "sym_max",
    "sym_min",
]

# -- functional collectives: torch 2.13 renamed the all-gathers
# (``all_gather_tensor`` warns there; torch 2.11 and 2.12 have only that
# name). Remove the fallback once packfn requires torch >= 2.13.
all_gather = getattr(_fc, "all_gather_single", None) or _fc.all_gather_tensor
all_gather_autograd = getattr(_fc, "all_gather_single_autograd", None) or _fc.all_gather_tensor_autograd
AsyncCollectiveTensor = _fc.AsyncCollectiveTensor


def sym_min(a, b):
    """``min`` of ints or SymInts that installs no guard (so ``torch.export`` keeps a ``Dim`` free).

    Outside Dynamo (eager, non-strict export) the builtin ``min`` would guard
    on the comparison, so ``torch.sym_min`` is used there. Inside Dynamo the
    builtin is used, which Dynamo turns into ``torch.sym_min`` itself:
    torch 2.11's Dynamo graph-breaks on an explicit ``torch.sym_min`` of two
    ints ("torch.* op returned non-Tensor"). Use ``torch.sym_min``
    everywhere once packfn requires a torch whose Dynamo traces it.
    """
    return min(a, b) if torch.compiler.is_dynamo_compiling() else torch.sym_min(a, b)


def sym_max(a, b):
    """``max`` without a guard, as :func:`sym_min`."""
    return max(a, b) if torch.compiler.is_dynamo_compiling() else torch.sym_max(a, b)


def leading_columns(tensor: torch.Tensor, count) -> torch.Tensor:
    """The first ``count`` columns (axis 1) of ``tensor`` as a new contiguous tensor.

    By ``index_select`` rather than a slice: Inductor (torch 2.13 to 2.15) can
    save a slice of unbacked width for the backward with other strides than
    it planned for ("expected ... stride 4==8"). Use a slice once no supported
    torch does this.
    """
    return tensor.index_select(1, torch.arange(count, device=tensor.device))


def current_dispatch_mode():
    """The innermost ``TorchDispatchMode`` (``FakeTensorMode``, ...) or None: a private torch API."""
    return _get_current_dispatch_mode()


def is_functorch_wrapper(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` wraps another (``functionalize``, ``vmap``, ``grad``): private torch APIs.

    Such a tensor is a plain ``torch.Tensor`` by type, but its memory is not
    its values.
    """
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor) or torch._is_functional_tensor(tensor)
