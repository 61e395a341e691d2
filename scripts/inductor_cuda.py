"""Inductor's Triton code for a CUDA GPU, generated on a machine without one.

CI has no GPU, yet the failures that matter most for GPU users happen in
Inductor's Triton code generation: a split scan that torch 2.11 cannot
generate (pytorch/pytorch#180221, NOTE [Scans that never split] in
``packfn/_ops/scan.py``), the kernels an op launches. Both are decided
while the code is *written*, before any kernel is compiled or run, so they
can be checked on a CPU.

:func:`triton_code` compiles a function with the real pipeline (Dynamo,
AOTAutograd with Inductor's decompositions, Inductor's graph passes) on
CPU tensors and, at the last step, hands Inductor's ``GraphLowering`` the
same graph on a CUDA device with an H200's properties. It returns the
Python wrapper and the Triton kernels Inductor writes; nothing is compiled
by Triton and nothing runs. It needs the ``triton`` package (CUDA builds
of torch bring it; the test command installs it beside the CPU build) and
patches private torch APIs, so it is a test and measurement tool, never
library code.

    from scripts.inductor_cuda import launches, triton_code
    code = triton_code(packfn.packed_position_ids, torch.ones(8, 32768, dtype=torch.int64))
    print(launches(code))
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable
from unittest import mock

import torch

__all__ = ["H200", "TritonCodegenUnavailable", "kernel_names", "launches", "triton_code"]

CUDA = torch.device("cuda", 0)


class TritonCodegenUnavailable(RuntimeError):
    """The ``triton`` package is not importable, so Inductor cannot write Triton code."""


class _Written(Exception):
    def __init__(self, code: str) -> None:
        super().__init__("triton code written")
        self.code = code


def _h200():
    from torch._inductor.runtime.hints import DeviceProperties

    fields = {
        "type": "cuda",
        "index": 0,
        "multi_processor_count": 132,
        "cc": 90,
        "major": 9,
        "regs_per_multiprocessor": 65536,
        "max_threads_per_multi_processor": 2048,
        "warp_size": 32,
    }
    known = {name for name in DeviceProperties._fields} if hasattr(DeviceProperties, "_fields") else None
    if known is None:
        import dataclasses

        known = {field.name for field in dataclasses.fields(DeviceProperties)}
    return DeviceProperties(**{name: value for name, value in fields.items() if name in known})


# What torch.cuda.get_device_properties reports on an H200 (the fields Inductor reads).
H200 = types.SimpleNamespace(
    name="NVIDIA H200",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=140 * 2**30,
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    warp_size=32,
    shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472,
    L2_cache_size=60 * 2**20,
    gcnArchName="",
    is_integrated=False,
)


def _on_cuda(value):
    """``value`` with every CPU device (a device argument, a fake tensor's device) moved to CUDA."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, torch.device):
        return CUDA if value.type == "cpu" else value
    if isinstance(value, FakeTensor):
        if value.fake_device.type == "cpu" and value.dim() > 0:
            value.fake_device = CUDA
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cuda(item) for item in value)
    if isinstance(value, dict):
        return {key: _on_cuda(item) for key, item in value.items()}
    return value


def _graph_on_cuda(gm: torch.fx.GraphModule) -> list:
    """Move ``gm``'s nodes (arguments and their fake values) to CUDA; returns its placeholders' values."""
    for node in gm.graph.nodes:
        node.args = _on_cuda(node.args)
        node.kwargs = _on_cuda(node.kwargs)
        if "val" in node.meta:
            node.meta["val"] = _on_cuda(node.meta["val"])
    gm.recompile()
    return [node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"]


def _lowering_class():
    from torch._inductor.graph import GraphLowering

    class CudaGraphLowering(GraphLowering):
        """Lowers the graph as on CUDA; writes the code and stops there."""

        def __init__(self, gm, example_inputs=None, *args, **kwargs):
            self._cuda_inputs = _graph_on_cuda(gm)
            with _believe_h200():
                super().__init__(gm, self._cuda_inputs, *args, **kwargs)

        def run(self, *args):
            with _believe_h200():
                return super().run(*self._cuda_inputs)

        def compile_to_module(self):
            with _believe_h200():
                wrapper, _ = self.codegen()
            raise _Written(wrapper.value if hasattr(wrapper, "value") else str(wrapper))

    return CudaGraphLowering


@contextlib.contextmanager
def _believe_h200():
    """Patches under which Inductor's lowering and code generation believe a CUDA H200 is present."""
    from torch._inductor.runtime.hints import DeviceProperties

    props = _h200()
    patches = [
        mock.patch("torch._subclasses.fake_tensor.init_gpu_context", lambda device: None),
        mock.patch.object(DeviceProperties, "create", classmethod(lambda cls, device: props)),
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.get_device_capability", lambda *args: (9, 0)),
        mock.patch("torch.cuda.get_device_properties", lambda *args: H200),
        mock.patch("torch.cuda.current_device", lambda: 0),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch._inductor.scheduler.has_triton", lambda: True),
        mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "cpu-written"),
        mock.patch("torch.utils._triton.triton_backend", lambda: None),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


class _H200Driver:
    """What Triton's active driver tells torch while it reads a user-defined kernel (Hopper, warps of 32)."""

    @staticmethod
    def get_current_target():
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def _lowering_on_cuda():
    """Inductor's compile with the graph lowered for CUDA, and no cache that could serve CPU code instead.

    packfn's ops take their Triton kernels, as on a CUDA tensor (NOTE [Two
    launches on a GPU] in ``packfn/_ops/triton_rows.py``), and torch reads
    those kernels' Triton IR for an H200 to learn which arguments they write.
    """
    from torch._dynamo.device_interface import CudaInterface
    from triton.runtime import driver

    patches = [
        mock.patch("packfn._ops._registry.gpu_kernels", lambda tensor: True),
        # Bound when torch imports, and asked before Inductor lowers a graph with a bf16 input or output.
        mock.patch.object(CudaInterface, "is_bf16_supported", staticmethod(lambda including_emulation=False: True)),
        mock.patch.object(type(driver), "active", property(lambda self: _H200Driver)),
        mock.patch("torch._inductor.compile_fx.GraphLowering", _lowering_class()),
        mock.patch("torch._inductor.config.fx_graph_cache", False),
        mock.patch("torch._inductor.config.fx_graph_remote_cache", False),
        mock.patch("torch._functorch.config.enable_autograd_cache", False),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise TritonCodegenUnavailable(
            "Inductor writes Triton code only with the triton package installed (pip install triton)"
        ) from error


def triton_code(function: Callable[..., object], *args, dynamic: bool = False) -> str:
    """Inductor's output code (wrapper and Triton kernels) for ``function(*args)`` on an H200.

    Args:
        function: What to compile, with ``torch.compile(fullgraph=True)``.
        *args: CPU tensors (and other arguments) of the shapes to compile for.
        dynamic: ``torch.compile``'s ``dynamic``.

    Raises:
        TritonCodegenUnavailable: without the ``triton`` package.
        Whatever Inductor raises while writing the Triton code (the class of
        failure this tool exists to catch), unwrapped from Dynamo's
        ``BackendCompilerFailed``.
    """
    _require_triton()
    torch._dynamo.reset()
    compiled = torch.compile(function, fullgraph=True, dynamic=dynamic, backend="inductor")
    try:
        with _lowering_on_cuda(), torch.no_grad():
            compiled(*args)
    except _Written as written:
        return written.code
    except torch._dynamo.exc.BackendCompilerFailed as error:
        cause = error.inner_exception if hasattr(error, "inner_exception") else error.__cause__
        if isinstance(cause, _Written):
            return cause.code
        while cause is not None and not isinstance(cause, _Written) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, _Written):
            return cause.code
        raise (cause or error) from error
    finally:
        torch._dynamo.reset()
    return ""  # no graph: the function computes nothing (it returns its inputs)


# Inductor's own kernels (triton_*) and user-defined ones (packfn's, under their function's name).
_TRITON = re.compile(r"\b(\w+)\.run\(")
# Kernels the wrapper launches besides its own: aten fallbacks (a scan Inductor does not split, a sort), extern
# kernels (matmuls) and the memset of a split scan's workspace.
_OTHER = re.compile(r"\b(torch\.ops\.aten\.\w+(?:\.\w+)?|extern_kernels\.\w+)\(|(\w+)\.zero_\(\)")


def kernel_names(code: str) -> list[str]:
    """Every kernel Inductor's wrapper ``code`` launches, in order: Triton kernels, fallbacks, memsets."""
    call = code[code.index("def call(") :] if "def call(" in code else code
    found = []
    for line in call.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        found += _TRITON.findall(stripped)
        found += [fallback or f"memset {buffer}" for fallback, buffer in _OTHER.findall(stripped)]
    return found


def launches(code: str) -> int:
    """Kernel launches of one call of Inductor's wrapper ``code`` (:func:`kernel_names`)."""
    return len(kernel_names(code))
