"""The op machinery: one decorator turns vectorized math into a packfn op.

NOTE [One body, three roles]
Every packfn op is written once, as a plain function of tensors built from
vectorized aten calls (no Python loop over rows or documents, no host sync;
the one exception is ``_sizes`` below, the drop-ins' trim step, whose whole
job is to read values back).
:func:`packfn_op` registers that body in three roles:

1. the eager kernel of ``torch.library.custom_op("packfn::<name>")``, so
   ``torch.export`` keeps the op as one named ``packfn.<name>`` node;
2. a Python-dispatcher ``CompositeImplicitAutograd`` kernel, which is only
   consulted while tracing with the Python dispatcher on: AOTAutograd (the
   front end of Inductor) and ``ExportedProgram.run_decompositions()``.
   There the op decomposes into aten ops that Inductor fuses, and the
   compiled code holds no call back into ``torch.ops.packfn``;
3. nothing else: the fake (meta) function is written separately, by hand,
   so output shapes are visibly a function of input shapes and static
   arguments only.

Data checks never read a value back to the host. Mask ops return one bool
flag per rule, which callers enforce with :func:`assert_rules` (static API:
``torch._assert_async``, a plain exception in eager on the CPU, an
asynchronous device assert on a GPU and in Inductor's generated code) or
:func:`checked_ints` (drop-ins: read with their sizes, then ``ValueError``);
the layout op and ``pad`` assert inside their bodies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._C import DispatchKey

NAMESPACE = "packfn"

__all__ = [
    "NAMESPACE",
    "assert_async",
    "assert_rules",
    "cache_key_tag",
    "checked_ints",
    "named_value",
    "packfn_op",
    "python_ints",
]


def packfn_op(
    name: str,
    *,
    fake: Callable[..., Any],
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., None] | None = None,
) -> Callable[[Callable[..., Any]], Any]:
    """Register ``math`` as the op ``packfn::<name>`` (see NOTE [One body, three roles]).

    Args:
        name: Op name inside the ``packfn`` namespace.
        fake: Meta implementation; must compute output shapes from input
            shapes and static arguments only.
        backward: Optional ``register_autograd`` backward for differentiable
            outputs.
        setup_context: Saves what ``backward`` needs.

    Returns:
        A decorator that takes the typed math function and returns the
        ``torch.library.CustomOpDef`` (callable like the function).
    """

    def register(math: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(math)
        op.register_fake(fake)
        overload = getattr(torch.ops.packfn, name).default
        overload.py_impl(DispatchKey.CompositeImplicitAutograd)(math)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return register


def named_value(name: str, value: object) -> str:
    """``"name=value"`` for a message in eager; just ``name`` while tracing.

    Dynamo turns an int argument that changes between calls into a SymInt,
    and a SymInt cannot be formatted into a string inside a traced graph.
    """
    return name if torch.compiler.is_compiling() else f"{name}={value}"


def assert_async(condition: torch.Tensor, message: str) -> None:
    """Check a 0-d bool tensor without a host sync; ``message`` names the broken rule."""
    torch._assert_async(condition, message)


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


@packfn_op("_sizes", fake=_sizes_fake)
def _sizes(values: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    # One read for all values (eager: a single host sync; traced: one
    # unbacked size per value).
    return values.new_empty((*values.tolist(), 0))


def python_ints(values: list[torch.Tensor], bounds: list[int]) -> tuple[int, ...]:
    """Read 0-d integer tensors as Python ints (SymInts under compile), each in ``[0, bound]``.

    Eager: one host sync for all values. Under torch.compile or torch.export:
    unbacked SymInts, no graph break (NOTE [Data-dependent sizes without graph breaks]).
    """
    # Clamped into the declared range: values read alongside broken-rule
    # flags (``checked_ints``) may be meaningless, never out of range.
    stacked = torch.stack(
        [value.reshape(()).to(torch.int64).clamp(0, bound) for value, bound in zip(values, bounds, strict=True)]
    )
    return tuple(_sizes(stacked, list(bounds)).shape[:-1])


def assert_rules(broken: torch.Tensor, rules: tuple[str, ...]) -> None:
    """Sync-free check of an op's rule flags: bool ``[len(rules)]``, True where a rule is broken."""
    for index, rule in enumerate(rules):
        assert_async(~broken[index], rule)


def checked_ints(
    values: list[torch.Tensor],
    bounds: list[int],
    broken: torch.Tensor,
    rules: tuple[str, ...],
    *,
    message: str | None = None,
) -> tuple[int, ...]:
    """Read ``values`` as ints for a drop-in, enforcing the rule flags ``broken``.

    Eager: one host sync reads the values and the flags together, then a
    ``ValueError`` names the first broken rule (or says ``message``). Under
    torch.compile / torch.export: sync-free asserts and unbacked SymInts.
    """
    if torch.compiler.is_compiling():
        assert_rules(broken, rules)
        return python_ints(values, bounds)
    weights = 2 ** torch.arange(len(rules), device=broken.device)
    code_tensor = (broken.long() * weights).sum()
    *ints, code = python_ints([*values, code_tensor], [*bounds, 2 ** len(rules)])
    if code:
        first = (code & -code).bit_length() - 1
        raise ValueError(message or rules[first])
    return tuple(ints)


def cache_key_tag() -> str:
    """A tag for ``torch.compiler.config.cache_key_tag`` that changes whenever a packfn op changes.

    NOTE [Compile caches do not see decompositions]
    torch.compile's caches (FX graph and AOTAutograd) key on the graph that
    *calls* ``torch.ops.packfn.*``, not on the Python decomposition that
    Inductor inlines: after an upgrade of packfn, a warm cache can serve
    code compiled from the old decompositions. Tagging the cache with a
    digest of the op sources breaks it exactly when they change::

        torch.compiler.config.cache_key_tag = packfn.cache_key_tag()
    """
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return f"packfn-{digest.hexdigest()[:16]}"
