"""Profile a packed-sequence decoder whose forward uses packfn, compiled with ``fullgraph=True``.

The model (``scripts/packed_decoder.py``, re-exported here) parses a
document-id mask with :func:`packfn.batch_metadata`, builds a fixed-length
aligned layout with :func:`packfn.layout.aligned_layout`, packs the
embeddings, runs RoPE from the layout's ``position_ids`` and SDPA with
:func:`packfn.attention.block_causal_mask`, and restores the tokens for the
LM head. Training steps (forward, backward, AdamW) run under
``torch.profiler`` with a TensorBoard trace handler writing one run folder
under ``--out``; every step gets a different batch of the same shape.

Attention is SDPA with the dense bool block-causal mask: on the CPU,
FlexAttention has no backward (torch 2.13 raises NotImplementedError), and
SDPA's fused CPU kernel takes the bool mask directly. ``--attention flex``
builds :func:`packfn.attention.document_block_mask` instead (GPU training).

The report: graph breaks, recompiles (frames compiled beyond the first),
compile time, median step time, against the same weights driven eagerly by
NeMo AutoModel's helpers (``build_packed_sequence_metadata``,
``packed_layout`` / ``pack`` / ``restore``, a dense block-causal mask,
``get_unpad_data``), with the first-step loss of both as a parity check.

    python scripts/profile.py                   # defaults: under two minutes on 2 CPU cores
    python scripts/profile.py --steps 12 --sequence 1024 --out profiles
    tensorboard --logdir profiles               # pip install -e '.[profile]'
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def _become_stdlib_profile() -> None:
    """Load the standard library's ``profile`` module in place of this file.

    NOTE [This file shadows the stdlib profile module]
    A script run as ``python scripts/<name>.py`` has ``scripts/`` first on
    ``sys.path``, and ``torch._dynamo`` imports ``cProfile``, which imports
    ``profile``: without this, that import would execute this file and
    cProfile would fail (``module 'profile' has no attribute 'run'``). The
    import system returns ``sys.modules["profile"]`` after executing a module,
    so replacing the entry here hands cProfile the real module.
    """
    import importlib.util
    import sysconfig

    spec = importlib.util.spec_from_file_location("profile", Path(sysconfig.get_path("stdlib")) / "profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile"] = module
    spec.loader.exec_module(module)


if __name__ == "profile":
    _become_stdlib_profile()
else:
    _REPO = Path(__file__).resolve().parents[1]
    if sys.path and Path(sys.path[0] or ".").resolve() == _REPO / "scripts":
        sys.path.pop(0)  # run as a script: keep the stdlib `profile` importable (see the NOTE above)
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))

    import torch
    from torch._dynamo.utils import counters

    from scripts.benchmarks.common import use_packfn_cache_key
    from scripts.packed_decoder import (
        DecoderConfig,
        PackedDecoder,
        add_model_arguments,
        batches_and_config,
        packed_loss,
        upstream_available,
        upstream_loss,
    )

__all__ = [
    "DecoderConfig",
    "PackedDecoder",
    "ProfileReport",
    "TraceSummary",
    "main",
    "parse_args",
    "run",
    "summarize_trace",
]


class CountingInductor:
    """A ``torch.compile`` backend: Inductor, counting the frames (graphs) it is handed."""

    def __init__(self) -> None:
        self.frames = 0

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.frames += 1
        return compile_fx(graph_module, example_inputs)


@dataclass
class ProfileReport:
    """What :func:`run` measured (times in seconds)."""

    graph_breaks: int
    graph_break_reasons: dict[str, int]
    frames_compiled: int
    recompiles: int
    compile_s: float
    step_s: list[float]
    median_step_s: float
    trace_files: list[str]
    run_dir: str
    losses: list[float]
    trace_summary: TraceSummary | None = None
    upstream: str = "not run"
    upstream_step_s: list[float] = field(default_factory=list)
    upstream_median_step_s: float | None = None
    upstream_losses: list[float] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The printed report."""
        result = [
            "== packfn profile report ==",
            f"graph breaks:      {self.graph_breaks}"
            + (f"  {self.graph_break_reasons}" if self.graph_break_reasons else ""),
            f"recompiles:        {self.recompiles}  (frames compiled: {self.frames_compiled}, "
            f"{len(self.step_s)} steps over batches of one shape, different contents)",
            f"compile time:      {self.compile_s:.1f} s  (first step minus the median step)",
            f"median step:       packfn compiled {self.median_step_s * 1e3:.1f} ms",
        ]
        if self.upstream_median_step_s is not None:
            ratio = self.upstream_median_step_s / self.median_step_s
            result.append(
                f"                   upstream eager  {self.upstream_median_step_s * 1e3:.1f} ms  "
                f"(upstream / packfn = {ratio:.2f}; above 1: packfn compiled is faster)"
            )
            difference = abs(self.losses[0] - self.upstream_losses[0])
            result.append(
                f"loss parity:       first step {self.losses[0]:.6f} vs {self.upstream_losses[0]:.6f} "
                f"(|diff| {difference:.2e})"
            )
        else:
            result.append(f"upstream:          {self.upstream}")
        result.append(f"trace:             {self.trace_files[0] if self.trace_files else 'none written'}")
        if self.trace_summary is not None:
            result.append(f"in the trace:      {self.trace_summary.line()}")
        result.append(f"view:              tensorboard --logdir {Path(self.run_dir).parent}")
        return result


@dataclass
class TraceSummary:
    """What ran inside the compiled graphs of one trace (events nested in ``CompiledFxGraph`` calls)."""

    graph_calls: int
    fused_kernels: dict[str, int]
    aten_calls: dict[str, int]
    packfn_calls: dict[str, int]

    def line(self) -> str:
        aten = ", ".join(f"{name.removeprefix('aten::')} x{count}" for name, count in sorted(self.aten_calls.items()))
        return (
            f"{self.graph_calls} compiled-graph calls: {sum(self.fused_kernels.values())} fused Inductor kernel calls "
            f"({len(self.fused_kernels)} kernels), {sum(self.packfn_calls.values())} packfn:: calls, "
            f"aten fallbacks: {aten or 'none'}"
        )


# Allocation and view calls of Inductor's wrapper code (no compute), left out of the summary.
_BOOKKEEPING = frozenset(
    f"aten::{name}"
    for name in (
        "as_strided",
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "resolve_conj",
        "to",
        "transpose",
        "view",
        "zero_",
        "zeros",
        "reshape",
        "t",
        "alias",
        "_reshape_alias",
        "lift_fresh",
    )
)


def summarize_trace(path: str | Path) -> TraceSummary:
    """Count the events nested inside compiled-graph calls of a ``*.pt.trace.json`` (gzip or not)."""
    import gzip
    import json
    from collections import Counter

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as handle:
        events = [event for event in json.load(handle)["traceEvents"] if event.get("ph") == "X"]
    spans = [
        (event["tid"], event["ts"], event["ts"] + event["dur"])
        for event in events
        if event["name"].startswith("## Call CompiledFxGraph")
    ]
    fused, aten, packfn = Counter(), Counter(), Counter()
    for event in events:
        name = event["name"]
        inside = any(
            tid == event["tid"] and begin <= event["ts"] and event["ts"] + event["dur"] <= end
            for tid, begin, end in spans
        )
        if not inside or name.startswith("## Call"):
            continue
        if "packfn" in name:
            packfn[name] += 1
        elif "cpp_fused" in name or name.startswith("triton_"):
            fused[name] += 1
        elif name.startswith("aten::") and name not in _BOOKKEEPING:
            aten[name] += 1
    return TraceSummary(len(spans), dict(fused), dict(aten), dict(packfn))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=4, sequence=512, mean=96, hidden=128, layers=2, vocab=256)
    parser.add_argument("--steps", type=int, default=8, help="training steps per driver (the first compiles)")
    parser.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa")
    parser.add_argument("--out", type=Path, default=Path("profiles"))
    parser.add_argument("--run-name", default=None, help="run folder under --out (default: decoder_<sizes>_<time>)")
    parser.add_argument("--no-upstream", action="store_true", help="skip the upstream eager comparison")
    arguments = parser.parse_args(argv)
    if arguments.steps < 2:
        parser.error("--steps must be at least 2 (the first step compiles)")
    return arguments


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One optimizer (AdamW) step per call of :meth:`step`, timed, with a printed line."""

    def __init__(self, model, loss_function, device: torch.device, label: str) -> None:
        self.model, self.loss_function, self.device, self.label = model, loss_function, device, label
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def step(self, batch) -> None:
        _synchronize(self.device)
        begin = time.perf_counter()
        loss = self.loss_function(self.model, batch.input_ids, batch.document_ids, batch.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # the one host read of a step, after its work
        _synchronize(self.device)
        self.seconds.append(time.perf_counter() - begin)
        self.losses.append(value)
        print(
            f"step {len(self.seconds) - 1:>3}  {self.label:<16} loss {value:.4f}  {self.seconds[-1] * 1e3:9.1f} ms",
            flush=True,
        )


def run(arguments: argparse.Namespace) -> ProfileReport:
    """Train the packfn-driven model compiled under the profiler, then the upstream-driven one eagerly."""
    device = torch.device(arguments.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    if arguments.attention == "flex" and device.type == "cpu":
        raise SystemExit("--attention flex needs a GPU for training: FlexAttention has no CPU backward in torch 2.13")
    batches, config = batches_and_config(arguments, arguments.steps)
    cap = config.max_documents
    torch.manual_seed(0)
    model = PackedDecoder(config).to(device)
    reference = copy.deepcopy(model)
    print(
        f"model: batch={arguments.batch} sequence={arguments.sequence} aligned length={config.length} "
        f"(alignment {config.alignment}, D={cap}) hidden={config.hidden} layers={config.layers} "
        f"attention={config.attention} device={device}",
        flush=True,
    )

    torch._dynamo.reset()
    counters.clear()
    backend = CountingInductor()
    compiled_loss = torch.compile(packed_loss, backend=backend, fullgraph=True)

    run_name = arguments.run_name or (
        f"decoder_b{arguments.batch}_s{arguments.sequence}_h{arguments.hidden}_l{arguments.layers}_"
        f"{time.strftime('%Y%m%d-%H%M%S')}"
    )
    run_dir = arguments.out / run_name
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Step 0 compiles (skipped), then one step of warm-up and up to three recorded steps.
    active = max(1, min(3, arguments.steps - 2))
    schedule = torch.profiler.schedule(
        skip_first=1, wait=0, warmup=1 if arguments.steps > 2 else 0, active=active, repeat=1
    )
    packfn = Trainer(model, compiled_loss, device, "packfn compiled")
    # Kernel profiling makes each Inductor C++ kernel a named event in the trace.
    with (
        torch._inductor.config.patch({"cpp.enable_kernel_profile": True}),
        torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(run_dir)),
            record_shapes=True,
        ) as profiler,
    ):
        for batch in batches:
            packfn.step(batch)
            profiler.step()
    compile_s = packfn.seconds[0] - statistics.median(packfn.seconds[1:])

    upstream = None
    if arguments.no_upstream:
        upstream_status = "skipped (--no-upstream)"
    elif not upstream_available():
        upstream_status = "not importable: pip install --no-deps nemo-automodel==0.7.0"
    else:
        # Interleaved rounds, so that load on a shared machine hits both alike.
        print("-- interleaved: upstream eager and packfn compiled, same batches --", flush=True)
        upstream_status = "run"
        upstream = Trainer(reference, upstream_loss, device, "upstream eager")
        for batch in batches:
            upstream.step(batch)
            packfn.step(batch)

    graph_breaks = dict(counters["graph_break"])
    # With the upstream run, packfn's median is taken over the interleaved rounds.
    steady = packfn.seconds[len(batches) :] if upstream else packfn.seconds[1:]
    report = ProfileReport(
        graph_breaks=sum(graph_breaks.values()),
        graph_break_reasons=graph_breaks,
        frames_compiled=backend.frames,
        recompiles=max(0, backend.frames - 1),
        compile_s=max(0.0, compile_s),
        step_s=packfn.seconds,
        median_step_s=statistics.median(steady),
        trace_files=sorted(str(path) for path in run_dir.glob("*.pt.trace.json*")),
        run_dir=str(run_dir),
        losses=packfn.losses,
        upstream=upstream_status,
    )
    if report.trace_files:
        report.trace_summary = summarize_trace(report.trace_files[0])
    if upstream is not None:
        report.upstream_step_s = upstream.seconds
        report.upstream_median_step_s = statistics.median(upstream.seconds[1:])
        report.upstream_losses = upstream.losses
    return report


def main(argv: list[str] | None = None) -> int:
    use_packfn_cache_key()  # NOTE [Compile caches do not see decompositions]
    report = run(parse_args(argv))
    print("\n".join(report.lines()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
