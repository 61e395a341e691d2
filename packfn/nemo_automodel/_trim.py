"""The drop-ins' trim step: the static op's outputs cut to upstream's data-dependent sizes.

The only place in packfn that reads values back to the host on purpose:
in eager one read (a host sync on an accelerator), under ``torch.compile``
and ``torch.export`` an unbacked size, never a graph break.
"""

from __future__ import annotations

import torch

from packfn._ops._registry import Rule, assert_rules, packfn_op

__all__ = ["checked_ints", "python_ints", "refuse_jit_trace"]


# NOTE [Data-dependent sizes without graph breaks]
# The drop-in API returns Python ints (``max_seqlen``) and tensors whose
# length depends on data (``indices[:tokens]``). ``Tensor.item()`` graph-breaks
# under torch.compile unless ``capture_scalar_outputs`` is set globally, so
# instead ``_sizes`` returns an empty tensor of shape ``[*values, 0]``: in
# eager its shape holds the values (one host sync for all of them); under
# torch.compile / torch.export its fake carries fresh unbacked SymInts, and
# its decomposition reads each value with ``.item()``, which AOTAutograd
# turns into an unbacked size. Nothing is allocated: the tensor has no
# elements.


def _sizes_fake(values: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """``[*values, 0]`` with one unbacked size in ``[0, bound]`` per value."""
    ctx = torch.library.get_ctx()
    sizes = [ctx.new_dynamic_size(min=0, max=bound) for bound in bounds]
    return values.new_empty((*sizes, 0))


def _sizes_eager(values: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    # One read for all values: a single host sync.
    return values.new_empty((*values.tolist(), 0))


@packfn_op("_sizes", fake=_sizes_fake, eager=_sizes_eager)
def _sizes(values: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    # Traced: one unbacked size per value, with its declared range (the
    # fake's range never reaches a trace: FakeTensorMode runs this body).
    sizes = []
    for index, bound in enumerate(bounds):
        size = values[index].item()
        torch._check(size >= 0, lambda: "a packfn size read back is negative")
        torch._check(size <= bound, lambda: "a packfn size read back exceeds its bound")
        sizes.append(size)
    return values.new_empty((*sizes, 0))


def python_ints(values: list[torch.Tensor], bounds: list[int]) -> tuple[int, ...]:
    """Read 0-d integer tensors as Python ints (SymInts under compile), each in ``[0, bound]``.

    Eager: one host sync for all values. Under torch.compile or torch.export:
    unbacked SymInts, no graph break (NOTE [Data-dependent sizes without graph breaks]).
    """
    if not values:
        return ()
    if not torch.compiler.is_compiling():
        read = torch.stack([value.reshape(()).to(torch.int64) for value in values]).tolist()
        return _clamped(read, bounds)
    # Clamped into the declared range: values read alongside broken-rule
    # flags (``checked_ints``) may be meaningless, never out of range. A
    # bound of 2**62 at most leaves room for ``size + 1`` in int64 (an int64
    # mask's largest id is bounded by 2**63 - 1).
    capped = [min(bound, 2**62) for bound in bounds]
    stacked = torch.stack(
        [value.reshape(()).to(torch.int64).clamp(0, bound) for value, bound in zip(values, capped, strict=True)]
    )
    sizes = tuple(_sizes(stacked, capped).shape[:-1])
    for size, bound in zip(sizes, bounds, strict=True):
        # Known from the cap when the bound is a number; a symbolic one (dynamic shapes) needs saying, or
        # torch 2.11 gives a slice by ``size`` of a tensor a Triton kernel wrote a fresh size of its own, which
        # AOTAutograd then fails to place (PendingUnbackedSymbolNotFound: get_unpad_data on CUDA).
        torch._check(size <= bound)
    return sizes


def _clamped(read: list[int], bounds: list[int]) -> tuple[int, ...]:
    return tuple(min(max(value, 0), bound) for value, bound in zip(read, bounds, strict=True))


def refuse_jit_trace() -> None:
    """Raise under ``torch.jit.trace``, which would keep what a drop-in reads from the data as constants."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            "packfn's drop-ins size their outputs and check their inputs by the data, which torch.jit.trace "
            "records as constants; use torch.export or torch.compile (or the static API) instead"
        )


def checked_ints(
    values: list[torch.Tensor], bounds: list[int], broken: torch.Tensor, rules: tuple[Rule, ...]
) -> tuple[int, ...]:
    """Read ``values`` as ints for a drop-in, enforcing the rule flags ``broken``.

    See NOTE [One way to report a broken rule].

    ``rules`` are the drop-in's: one per flag of ``broken``, in the core
    op's order, each with the message upstream raises for it.

    Eager: one host sync reads the values and the flags together, then a
    ``ValueError`` carries the first broken rule's message. Under
    torch.compile / torch.export: sync-free asserts with the same messages,
    and unbacked SymInts. Under ``torch.jit.trace``: a ``RuntimeError``,
    since the trace would keep the values read as constants.
    """
    if torch.compiler.is_compiling():
        assert_rules(broken, rules)
        return python_ints(values, bounds)
    refuse_jit_trace()
    # One read of the flags and the values together.
    read = torch.cat([broken.to(torch.int64), *(value.reshape(1).to(torch.int64) for value in values)]).tolist()
    for flag, rule in zip(read[: len(rules)], rules, strict=True):
        if flag:
            raise ValueError(rule.message)
    return _clamped(read[len(rules) :], bounds)
