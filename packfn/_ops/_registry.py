"""The op machinery: one decorator turns vectorized math into a packfn op.

NOTE [One body, three roles]
Every packfn op is written once, as a plain function of tensors built from
vectorized aten calls (no Python loop over rows or documents, no host sync;
the one exception is ``packfn::_sizes`` of :mod:`packfn.nemo_automodel._trim`,
the drop-ins' trim step, whose whole job is to read values back).
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

NOTE [Eager kernels]
Where fewer, larger aten calls are faster in eager than the fusable body
(a running maximum, say, which Inductor does not lower on the CPU), an op
takes a second body, ``eager=``, as its custom-op kernel; the first body
stays the decomposition. Both compute the same outputs wherever the op's
data rules hold (on broken data, the same first broken rule); the tests hold
the two equal on generated inputs through ``<op>.math`` and ``<op>.eager``.

Data checks never read a value back to the host: see NOTE [One way to
report a broken rule] below.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._C import DispatchKey

from packfn._compat import current_dispatch_mode

NAMESPACE = "packfn"

__all__ = [
    "ASSERT_MESSAGE_BYTES",
    "NAMESPACE",
    "Rule",
    "assert_rules",
    "device_assert",
    "gpu_body",
    "gpu_kernels",
    "gpu_or",
    "named_value",
    "packfn_op",
]


def packfn_op(
    name: str,
    *,
    fake: Callable[..., Any],
    outputs: type[tuple] | None = None,
    eager: Callable[..., Any] | None = None,
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., None] | None = None,
    gpu: str | None = None,
) -> Callable[[Callable[..., Any]], Any]:
    """Register ``math`` as the op ``packfn::<name>`` (see NOTE [One body, three roles]).

    Args:
        name: Op name inside the ``packfn`` namespace.
        fake: Meta implementation; must compute output shapes from input
            shapes and static arguments only.
        outputs: A NamedTuple class naming the op's outputs. The decorated
            name then calls the op and returns that NamedTuple, so callers
            read ``parsed.num_tokens``, never ``outputs[4]``; the op itself
            stays ``torch.ops.packfn.<name>`` (plain tuples).
        eager: A faster eager kernel with ``math``'s signature (NOTE [Eager
            kernels]); ``math`` then serves as the decomposition only.
        backward: Optional ``register_autograd`` backward for differentiable
            outputs.
        setup_context: Saves what ``backward`` needs.
        gpu: The name of a function of :mod:`packfn._ops.triton_rows` with
            ``math``'s signature and outputs, launching Triton kernels: on
            CUDA tensors it replaces both bodies, in eager and in the
            decomposition Inductor compiles (NOTE [Two launches on a GPU]).

    Returns:
        A decorator that takes the typed math function and returns the
        ``torch.library.CustomOpDef`` (callable like the function), or with
        ``outputs`` a function returning the NamedTuple.
    """

    def register(math: Callable[..., Any]) -> Any:
        eager_body = math if eager is None else eager
        kernel, decomposition = eager_body, math
        if gpu is not None:
            kernel, decomposition = _on_gpu(gpu, eager_body), _on_gpu(gpu, math)
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(kernel)
        op.register_fake(fake)
        overload = getattr(torch.ops.packfn, name).default
        overload.py_impl(DispatchKey.CompositeImplicitAutograd)(decomposition)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        if outputs is None:
            op.math, op.eager = math, eager_body
            return op

        def named(function: Callable[..., Any]) -> Callable[..., Any]:
            return functools.wraps(math)(lambda *args: outputs(*function(*args)))

        @functools.wraps(math)
        def call(*args: Any) -> Any:
            # In plain eager the kernel runs directly: the custom-op dispatch
            # costs more than a small mask's whole parse, and an op with
            # named outputs has none that is differentiable. Traced (compile,
            # export, a dispatch mode such as FakeTensorMode), it stays the op.
            if torch.compiler.is_compiling() or current_dispatch_mode() is not None:
                return outputs(*op(*args))
            return outputs(*kernel(*args))

        # The bodies, callable on their own (the tests hold them equal).
        call.op, call.math, call.eager = op, named(math), named(eager_body)
        if gpu is not None:
            call.gpu = named(lambda *args: gpu_body(gpu)(*args))
        return call

    return register


@functools.cache
def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def gpu_kernels(tensor: torch.Tensor) -> bool:
    """Whether an op with Triton kernels runs them on ``tensor``: a non-empty CUDA tensor, with ``triton`` installed.

    An empty input takes the aten body, whose outputs need no kernel.
    """
    return tensor.device.type == "cuda" and tensor.numel() > 0 and _triton_importable()


def gpu_body(name: str) -> Callable[..., Any]:
    """The function ``name`` of :mod:`packfn._ops.triton_rows` (NOTE [Two launches on a GPU])."""
    # Imported on first use: importing triton costs time, and a CPU install may lack it.
    from packfn._ops import triton_rows

    return getattr(triton_rows, name)


def gpu_or(name: str, body: Callable[..., Any], *args: Any) -> Any:
    """``triton_rows.<name>(*args)`` where :func:`gpu_kernels` takes the first argument, else ``body(*args)``."""
    return gpu_body(name)(*args) if gpu_kernels(args[0]) else body(*args)


def _on_gpu(name: str, body: Callable[..., Any]) -> Callable[..., Any]:
    """``body``, or the Triton kernels of ``triton_rows.<name>`` where the first argument is on CUDA."""

    @functools.wraps(body)
    def choose(*args: Any) -> Any:
        return gpu_or(name, body, *args)

    return choose


def named_value(name: str, value: object) -> str:
    """``"name=value"`` for a message in eager; just ``name`` while tracing.

    Dynamo turns an int argument that changes between calls into a SymInt,
    and a SymInt cannot be formatted into a string inside a traced graph.
    """
    return name if torch.compiler.is_compiling() else f"{name}={value}"


# NOTE [One way to report a broken rule]
# An op never raises on data and never asserts inside its body. Its last
# output, ``broken``, is a bool vector with one flag per data rule of its
# family, computed in the same fused pass as the results. Each family keeps
# one table of :class:`Rule` s in flag order, and two helpers enforce the
# flags for every caller:
#
# - :func:`assert_rules`, the static path: one ``torch._assert_async`` per
#   rule, with the rule's message. No host sync: a ``RuntimeError`` in
#   eager on the CPU, an asynchronous device assert on a GPU and in
#   Inductor's generated code.
# - ``checked_ints`` (:mod:`packfn.nemo_automodel._trim`), the drop-ins: in eager one host sync reads the
#   flags together with the drop-in's data-dependent sizes and raises
#   ``ValueError`` with the first broken rule's message in upstream's words
#   (the drop-in layer keeps its own rules, aligned with the core's flags); under
#   torch.compile / torch.export the same message goes into a sync-free
#   assert and the sizes become unbacked SymInts.
#
# So an eager drop-in never hits a device-side assert (which would poison a
# CUDA context) and never validates twice, and a drop-in says the same
# thing compiled and eager.


class Rule(NamedTuple):
    """One data rule of an op family, as its ops flag it.

    Attributes:
        message: What a broken rule's assert (or error) says: the rule, named.
    """

    message: str


def assert_rules(broken: torch.Tensor, rules: tuple[Rule, ...]) -> None:
    """Sync-free check of an op's rule flags: bool ``[len(rules)]``, True where a rule is broken.

    On CUDA (with Triton) the flags are read as the bits of one integer, which every
    assert then tests: Inductor fuses asserts that read the same value into
    one Triton kernel, where asserts reading different elements of a flags
    tensor written by an earlier kernel are a kernel each. Elsewhere each
    assert reads its flag: Inductor's C++ backend would fuse the asserts
    reading one integer into an OpenMP parallel region, where a failed
    assert's exception aborts the process instead of raising.
    """
    if gpu_kernels(broken):  # a CUDA tensor, with Triton
        bits = torch.where(broken, 1 << torch.arange(len(rules), device=broken.device), 0).sum()
        flags = [(bits >> index) & 1 != 0 for index in range(len(rules))]
    else:
        flags = list(broken)
    for flag, rule in zip(flags, rules, strict=True):
        device_assert(~flag, rule.message)


# NOTE [Assert messages fit CUDA's buffer]
# CUDA's ``_assert_async`` copies its message into a 256-byte buffer and
# refuses one of 255 bytes or more ("Message length must be smaller than
# 255", aten/src/ATen/native/cuda/TensorCompare.cu) before it checks
# anything, so an op whose message is too long cannot run on a GPU at all;
# the CPU takes any length. Every sync-free assert of packfn goes through
# :func:`device_assert`, which holds its message to ``ASSERT_MESSAGE_BYTES``
# on every device, so a CPU run fails where a GPU would; the tests hold
# every message (its named values at int64's widest) to the limit, and
# ``tests/core/test_registry.py`` keeps ``torch._assert_async`` out of
# every other module.
ASSERT_MESSAGE_BYTES = 254


def device_assert(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async(condition, message)``: the one sync-free assert of packfn.

    Raises:
        AssertionError: ``message`` is longer than CUDA's assert takes
            (NOTE [Assert messages fit CUDA's buffer]): a bug in packfn, raised
            on every device.
    """
    size = len(message.encode())
    if size > ASSERT_MESSAGE_BYTES:
        raise AssertionError(
            f"packfn assert message of {size} bytes, past the {ASSERT_MESSAGE_BYTES} CUDA takes: {message[:80]}..."
        )
    torch._assert_async(condition, message)
