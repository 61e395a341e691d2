"""The main job's drivers and report: step times, memory, the trace's contents, the printed table and the plot.

``scripts/main_job.py`` runs the pipelines; each is a :class:`Driver` whose
steps' times, losses, real tokens and (on CUDA) peak memory land here, and
:class:`MainJobReport` prints them as the report's table, compares the
pipelines, and :func:`plot_summary` draws them. :func:`summarize_trace`
counts what ran inside packfn's compiled graph in a profiler trace.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from examples.packed_decoder import DecoderConfig
from scripts.attention_paths import ATTENTION_LINES, UPSTREAM_HELPERS
from scripts.batches import Batch

__all__ = [
    "PACKFN",
    "UPSTREAM_COMPILED",
    "UPSTREAM_EAGER",
    "Driver",
    "MainJobReport",
    "Pipelines",
    "TraceSummary",
    "plot_summary",
    "summarize_trace",
]

PLOT_INSTALL = "pip install -e '.[profile]'"
# The three pipelines' drivers, by the names the report gives them.
PACKFN = "packfn compiled"
UPSTREAM_EAGER = "upstream eager"
UPSTREAM_COMPILED = "upstream compiled"
_TITLES = {
    UPSTREAM_EAGER: "upstream eager",
    UPSTREAM_COMPILED: "upstream torch.compile",
    PACKFN: "packfn torch.compile(fullgraph=True)",
}


@dataclass
class Driver:
    """One way of training the model: its steps' times, losses and real-token counts."""

    name: str
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    warmup_steps: int = 0  # the first pass over the batches (compiles), left out of the medians
    graph_breaks: int | None = None  # compiled drivers only
    graph_break_reasons: dict[str, int] = field(default_factory=dict)
    recompiles: int | None = None
    frames: int | None = None
    graphs: int | None = None
    # CUDA only, a pair a step: (torch.cuda.max_memory_allocated over the step, its counter reset as the step
    # began; memory allocated as it began: the three models' weights and optimizer states, what the step keeps)
    memory: list[tuple[int, int]] = field(default_factory=list)

    @property
    def steady(self) -> list[float]:
        return self.seconds[self.warmup_steps :] or self.seconds[1:]

    @property
    def peak_bytes(self) -> int | None:
        """The highest ``max_memory_allocated`` over the steady steps (None off CUDA)."""
        start = len(self.seconds) - len(self.steady)
        return max((peak for peak, _ in self.memory[start:]), default=None)

    @property
    def step_peak_bytes(self) -> int | None:
        """The most a steady step allocated above what was allocated as it began (None off CUDA)."""
        start = len(self.seconds) - len(self.steady)
        return max((peak - resident for peak, resident in self.memory[start:]), default=None)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.steady)

    @property
    def tokens_per_s(self) -> float:
        """Median over the steady steps of real tokens over step time."""
        start = len(self.seconds) - len(self.steady)
        return statistics.median(t / s for t, s in zip(self.tokens[start:], self.steady, strict=True))

    @property
    def compile_s(self) -> float:
        """The first pass minus as many steady steps: the time spent compiling (and recompiling)."""
        warm = self.seconds[: self.warmup_steps]
        return max(0.0, sum(warm) - len(warm) * self.median_step_s)


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


@dataclass
class Pipelines:
    """The two pipelines' batches of the same tokens, and what packing them took."""

    documents: int  # documents the tokens came from
    document_tokens: list[int]  # their lengths
    source: str
    packfn: list[Batch]
    upstream: list[Batch]
    packfn_s: float  # packing and batch building, for all the batches
    upstream_s: float


@dataclass
class MainJobReport:
    """What :func:`run` measured (times in seconds)."""

    config: DecoderConfig
    batch: int
    pipelines: Pipelines
    worst_case_length: int
    drivers: dict[str, Driver]
    upstream: str
    trace_files: list[str]
    run_dir: str
    upstream_rows: str = "budget"
    upstream_helpers: str = "eager"
    upstream_helpers_s: float | None = None  # median eager time of the three upstream helpers on a batch
    trace_summary: TraceSummary | None = None
    parity: dict[str, float] = field(default_factory=dict)  # loss of packfn's first batch, initial weights
    summary_png: str | None = None  # the PNG beside the trace (None without matplotlib)
    attention: str = "dense"  # --attention
    device: str = "cpu"
    gpu: str | None = None  # the CUDA device's name
    cudagraph_skips: int | None = None  # CUDA: the times Inductor ran packfn's graphs without CUDA graphs

    @property
    def packfn(self) -> Driver:
        return self.drivers[PACKFN]

    @property
    def steps(self) -> int:
        return len(self.pipelines.packfn)

    @property
    def real_tokens(self) -> int:
        return sum(batch.num_tokens for batch in self.pipelines.packfn)

    @property
    def budget_fill(self) -> float:
        """Real tokens over the aligned area of packfn's batches (``steps * batch * budget``)."""
        return self.real_tokens / (self.steps * self.batch * self.config.length)

    def fill(self, name: str) -> float:
        """Real tokens over the input rows (``batches * batch * sequence``) of a driver's pipeline."""
        batches = self.pipelines.packfn if name == PACKFN else self.pipelines.upstream
        return sum(batch.num_tokens for batch in batches) / (len(batches) * self.batch * self.config.sequence)

    def upstream_lengths(self) -> list[int]:
        """The aligned row length ``packed_layout`` gives each upstream batch."""
        minimum = self.config.length if self.upstream_rows == "budget" else 0
        return [max(minimum, batch.aligned_length(self.config.alignment)) for batch in self.pipelines.upstream]

    def ratios(self) -> str:
        """packfn compiled's real tokens per second over each other pipeline's."""
        ours = self.packfn.tokens_per_s
        others = [driver for driver in self.drivers.values() if driver.name != PACKFN]
        if not others:
            return "only packfn compiled ran"
        return "packfn compiled " + ", ".join(
            f"{ours / driver.tokens_per_s:.2f}x {_TITLES[driver.name]}" for driver in others
        )

    def area_per_token(self) -> float:
        """Attended area per real token of packfn's rows over upstream's (``budget**2 / (fill * sequence)``)."""
        upstream = self.upstream_lengths()
        ours = self.config.length**2 / (self.fill(PACKFN) * self.config.sequence)
        theirs = statistics.mean(length * length for length in upstream) / (
            self.fill(UPSTREAM_EAGER) * self.config.sequence
        )
        return ours / theirs

    def memory_line(self) -> str:
        """Each driver's peak GPU memory over its timed steps, and the most one step added to what it began with."""
        mib = 2**20
        peaks = [
            f"{_TITLES[name]} {driver.peak_bytes / mib:,.0f} MiB (a step +{driver.step_peak_bytes / mib:,.0f} MiB)"
            for name in (UPSTREAM_EAGER, UPSTREAM_COMPILED, PACKFN)
            if (driver := self.drivers.get(name)) is not None and driver.peak_bytes is not None
        ]
        how = "torch.cuda.max_memory_allocated, reset at each step; the three models and AdamW states stay resident"
        return f"{'; '.join(peaks)} ({how})"

    def _helpers_ms(self) -> str:
        return "unmeasured" if self.upstream_helpers_s is None else f"{self.upstream_helpers_s * 1e3:.1f} ms"

    def lines(self) -> list[str]:
        """The printed report: what ran, real tokens per second and fill per pipeline, graphs, where the trace is."""
        config, pipelines = self.config, self.pipelines
        lengths = pipelines.document_tokens
        result = [
            "== packfn main job report ==",
            f"documents:    {pipelines.documents} from {pipelines.source}, {sum(lengths)} tokens (mean "
            f"{statistics.mean(lengths):.0f}, median {statistics.median(lengths):.0f}, longest {max(lengths)}); "
            f"each pipeline packs them and trains the same model (hidden {config.hidden}, {_layers(config.layers)}) "
            "from the same weights",
            f"packfn:       {self.steps} batches of {self.batch} x {config.sequence} tokens packed by "
            f"packfn.data.PackedDataset: max_documents={config.max_documents}, budget={config.length} aligned "
            f"columns (without the packer: safe_budget({config.sequence}, {config.max_documents}, "
            f"{config.alignment}) = {self.worst_case_length}); {pipelines.packfn_s / self.steps * 1e3:.1f} ms a "
            f"batch; real tokens fill {self.budget_fill:.1%} of the budget ({self.real_tokens} of {self.steps} x "
            f"{self.batch} x {config.length})",
        ]
        if self.attention != "dense" or self.device != "cpu":
            result.append(f"attention:    {self.attention}: {ATTENTION_LINES[self.attention]}")
        if self.gpu is not None:
            result.append(
                f"device:       {self.gpu} ({self.device}): bf16 autocast, TF32 for the matmuls left in float32; "
                "packfn's step in CUDA graphs (torch.compile mode=\"reduce-overhead\"'s triton.cudagraphs), which "
                f"Inductor skipped {self.cudagraph_skips} times"
            )
        if UPSTREAM_EAGER not in self.drivers:
            result.append(f"upstream:     {self.upstream}")
        else:
            upstream = self.upstream_lengths()
            over = sum(1 for length in upstream if length > config.length)
            rows = (
                f"packed_layout(minimum_length={config.length}), longer where its aligned documents need more"
                if self.upstream_rows == "budget"
                else "packed_layout's data-dependent length"
            )
            helpers = "eagerly (a graph break at each call)" if self.upstream_helpers == "eager" else "traced"
            per_batch = pipelines.upstream_s / max(1, len(pipelines.upstream))
            layout = (
                "its rows unpadded by get_unpad_data's indices (no row layout)"
                if self.attention == "varlen"
                else f"rows aligned afterwards by {rows}: {over} of {len(upstream)} batches need more than "
                f"{config.length} columns (mean {statistics.mean(upstream):.0f}, longest {max(upstream)})"
            )
            result += [
                f"upstream:     NeMo AutoModel 0.7.0: neat packing (greedy_knapsack, alignment 1, no cap) of the same "
                f"pieces, {len(pipelines.upstream)} batches, {per_batch * 1e3:.1f} ms a batch; {layout}",
                f"              its helpers ({UPSTREAM_HELPERS[self.attention]}) take "
                f"{self._helpers_ms()} a step eagerly; under torch.compile they run {helpers}",
            ]
        result.append(
            f"{'pipeline':<38}{'median step':>12}{'tokens/s':>11}{'fill':>8}{'graph breaks':>14}{'recompiles':>12}"
            f"{'compile':>10}"
        )
        for name in (UPSTREAM_EAGER, UPSTREAM_COMPILED, PACKFN):
            driver = self.drivers.get(name)
            if driver is None:
                continue
            compiled = driver.graph_breaks is not None
            result.append(
                f"{_TITLES[name]:<38}{driver.median_step_s * 1e3:>9.1f} ms{driver.tokens_per_s:>11,.0f}"
                f"{self.fill(name):>8.1%}"
                f"{driver.graph_breaks if compiled else '-':>14}{driver.recompiles if compiled else '-':>12}"
                f"{f'{driver.compile_s:.1f} s' if compiled else '-':>10}"
            )
        result.append(
            "              tokens/s: real tokens per second, median over the timed steps; fill: real tokens over "
            "the pipeline's rows x sequence"
        )
        result.append(f"real tokens/s: {self.ratios()}")
        if self.gpu is not None:
            result.append("peak memory:  " + self.memory_line())
        if UPSTREAM_EAGER in self.drivers and self.attention != "varlen":
            result.append(
                f"area:         packfn's rows attend over {self.area_per_token():.2f}x the area per real token of "
                "upstream's"
            )
        packfn = self.packfn
        result.append(
            f"packfn graph: {packfn.graph_breaks} graph breaks, {packfn.recompiles} recompiles "
            f"(frames compiled: {packfn.frames}, {len(packfn.seconds)} steps over batches of one shape, "
            "different contents)"
        )
        upstream_compiled = self.drivers.get(UPSTREAM_COMPILED)
        if upstream_compiled is not None:
            reasons = "; ".join(
                f"{_short_reason(reason)} x{count}"
                for reason, count in sorted(upstream_compiled.graph_break_reasons.items(), key=lambda kv: -kv[1])[:4]
            )
            result.append(
                f"upstream compiled: {upstream_compiled.graphs} graphs in {upstream_compiled.frames} frames over "
                f"{len(upstream_compiled.seconds)} steps; breaks on: {reasons or 'nothing'}"
            )
        if len(self.parity) > 1:
            difference = max(self.parity.values()) - min(self.parity.values())
            values = " / ".join(f"{self.parity[name]:.6f}" for name in (UPSTREAM_EAGER, UPSTREAM_COMPILED, PACKFN))
            result.append(
                f"loss parity:  packfn's first batch, initial weights: {values} (max |diff| {difference:.2e})"
            )
        result.append(f"trace:        {self.trace_files[0] if self.trace_files else 'none written'}")
        if self.trace_summary is not None:
            result.append(f"in the trace: {self.trace_summary.line()}")
        result.append(f"view:         tensorboard --logdir {Path(self.run_dir).parent}")
        result.append(f"summary:      {self.summary_png or f'no PNG (needs matplotlib: {PLOT_INSTALL})'}")
        return result


_COLORS = {UPSTREAM_EAGER: "#8c8c8c", UPSTREAM_COMPILED: "#dd8452", PACKFN: "#55a868"}
_LABELS = {
    UPSTREAM_EAGER: "upstream\neager",
    UPSTREAM_COMPILED: "upstream\ntorch.compile",
    PACKFN: "packfn\ntorch.compile\n(fullgraph)",
}


def plot_summary(report: MainJobReport, path: Path) -> bool:
    """A PNG beside the trace: step time, real tokens per second and fill per pipeline; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [name for name in (UPSTREAM_EAGER, UPSTREAM_COMPILED, PACKFN) if name in report.drivers]
    labels = [_LABELS[name] for name in names]
    colors = [_COLORS[name] for name in names]
    figure, (steps, speed, fills) = plt.subplots(1, 3, figsize=(13, 4.2))

    steps.boxplot([[seconds * 1e3 for seconds in report.drivers[name].steady] for name in names], showfliers=False)
    for position, name in enumerate(names, 1):
        values = [seconds * 1e3 for seconds in report.drivers[name].steady]
        steps.plot([position] * len(values), values, "o", color=_COLORS[name], alpha=0.5, markersize=4)
    steps.set_xticks(range(1, len(names) + 1), labels, fontsize=8)
    steps.set(ylabel="ms", title="step time (forward, backward, AdamW)")

    rates = [report.drivers[name].tokens_per_s for name in names]
    bars = speed.bar(range(len(names)), rates, color=colors)
    ours = report.packfn.tokens_per_s
    for bar, rate in zip(bars, rates, strict=True):
        note = f"{rate:,.0f}" if rate == ours else f"{rate:,.0f}\npackfn: {ours / rate:.2f}x this"
        speed.annotate(note, (bar.get_x() + bar.get_width() / 2, rate), ha="center", va="bottom", fontsize=8)
    speed.set_xticks(range(len(names)), labels, fontsize=8)
    speed.set(ylabel="real tokens per second (median)", title="training throughput", ylim=(0, max(rates) * 1.25))

    pipelines = [("packfn\n(PackedDataset)", report.pipelines.packfn, _COLORS[PACKFN])]
    if report.pipelines.upstream:
        pipelines.insert(0, ("upstream\n(neat packing)", report.pipelines.upstream, _COLORS[UPSTREAM_COMPILED]))
    area = report.batch * report.config.sequence
    for position, (_, batches, color) in enumerate(pipelines):
        per_batch = [batch.num_tokens / area for batch in batches]
        total = sum(batch.num_tokens for batch in batches) / (len(batches) * area)
        fills.bar(position, total, color=color, alpha=0.8)
        fills.plot([position] * len(per_batch), per_batch, "o", color="black", alpha=0.4, markersize=3)
        fills.annotate(f"{total:.1%}", (position, total / 2), ha="center", va="center", fontsize=9, color="white")
    fills.set_xticks(range(len(pipelines)), [label for label, _, _ in pipelines], fontsize=8)
    fills.set(
        ylabel="real tokens / (rows x sequence)",
        title="fill (dots: each batch)",
        ylim=(0, 1.1),
    )
    config = report.config
    figure.suptitle(
        f"main job: batch {report.batch} x {config.sequence}, hidden {config.hidden}, {_layers(config.layers)}, "
        f"{report.steps} batches; torch {torch.__version__}"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _layers(count: int) -> str:
    return f"{count} layer" if count == 1 else f"{count} layers"


def _short_reason(reason: str) -> str:
    """The first line of a graph-break reason, with the function it names (if any)."""
    import re

    first = reason.splitlines()[0][:60]
    function = re.search(r"<function (\S+) at 0x", reason)
    return f"{first} ({function.group(1)})" if function else first


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
