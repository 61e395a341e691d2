"""The main job: a packed decoder trained by whole pipelines on real tokens, packfn's and NeMo AutoModel's.

The documents are real: the Python standard library's own sources, cut at
their top-level statements and tokenized by a BPE trained on the fly
(``scripts/corpus.py``; nothing is downloaded). ``--data exponential``
takes random tokens with exponential lengths (mean ``--mean``) instead.
Each pipeline packs the same tokens with its own packer and trains the
model (``examples/packed_decoder.py``) from the same initial weights:

1. **packfn compiled**: :class:`packfn.data.PackedDataset` packs the
   documents (best fit under the static budgets: at most ``--max-documents``
   per row, each counted at its aligned size against ``--budget``, by default
   the input row length; ``split=True``), and packfn's static path trains
   under ``torch.compile(fullgraph=True)``: one graph, no recompiles;
2. **upstream eager**: NeMo AutoModel 0.7.0's neat packing packs the same
   tokens (``greedy_knapsack`` over the pieces, rows laid out by its
   ``_build_packed_sample``, alignment 1, no cap), and its helpers
   (``build_packed_sequence_metadata``, ``packed_layout`` / ``pack`` /
   ``restore``, a dense block-causal mask, ``get_unpad_data`` for the loss;
   or the inputs of the ``--attention`` path below) train eagerly;
3. **upstream compiled**: the same, under plain ``torch.compile`` (graph
   breaks allowed); its graph breaks and recompiles are counted.

packfn's batches come first: the first ``--steps`` full batches its loader
packs; upstream packs exactly the pieces those batches hold, and trains
on every full batch it makes of them. Upstream's rows are aligned only by
``packed_layout``, after packing: with ``--upstream-rows budget`` (the
default) they get packfn's budget as ``minimum_length`` and grow past it
when their aligned documents need more; ``--upstream-rows data`` keeps
upstream's data-dependent length. Under ``torch.compile`` the upstream
helpers run eagerly (``torch.compiler.disable``: a graph break at each
call, ``--upstream-helpers eager``), which keeps that driver's compile time
near packfn's: traced (``--upstream-helpers traced``), ``packed_layout``'s
per-document loop specializes the graph on every batch's lengths.

Each compiled driver first runs over its batches (compiling and, for
upstream, recompiling), then the three take turns, ``--rounds`` passes over
their batches, their order rotating (so load on a shared machine hits them
alike); the report takes each driver's median over those turns: step time
(forward, backward, AdamW) and real tokens per second, the headline, with
the fill of each pipeline's rows beside it. The three also compute the loss
of packfn's first batch from the initial weights (loss parity). packfn's
first pass runs under ``torch.profiler`` with a TensorBoard trace handler
writing one run folder under ``--out``; beside the trace, ``main_job.png``
(with matplotlib) draws each pipeline's step times, real tokens per second
and fill.

Attention (``--attention``) runs the same kernel in every pipeline, each
feeding it from its own helpers:

- ``dense``, the CPU default: SDPA over the bool block-causal mask
  ``[batch, 1, rows, rows]`` (packfn: :func:`packfn.block_causal_mask` of
  its layout; upstream: the mask ``_indexed_mask_to_4d_block_causal`` builds).
- ``varlen``, the CUDA default: ``torch.nn.attention.varlen.varlen_attn``
  (torch 2.11 or later, CUDA only) over the batch's tokens as one unpadded
  stream. packfn: :func:`packfn.varlen_metadata` at the packer's cap ``D``
  (``batch * D + 1`` boundaries), :func:`packfn.unpad` / :func:`packfn.pad`,
  the kernel's maximum length the static bound ``sequence``: all inside the
  one compiled graph, nothing read on the host. Upstream: ``get_unpad_data``
  (a ``nonzero`` and a host read of ``max_seqlen``, as upstream does).
- ``flex``: FlexAttention over the aligned rows. packfn:
  :func:`packfn.document_block_mask` inside the compiled step; upstream:
  ``create_block_mask`` over a document ``mask_mod``, as torchtitan does.
  NOTE [FlexAttention in the main job] (``scripts/attention_paths.py``)
  gives its block size, BlockMask reuse and compile options. Training needs
  CUDA (torch 2.13 has no FlexAttention backward on the CPU).

varlen is the GPU default because it does no work on padding, on alignment
gaps or across documents (FlashAttention's cost is each document's length
squared, halved), builds no mask per step, and runs torch's FlashAttention
kernel, which in bf16 on an H100 / H200 is faster for a plain causal mask
than FlexAttention's Triton template, itself computing whole 128 x 128
blocks where documents meet. flex stays for masks varlen cannot express.
That is reasoning, not a measurement: the H200 figures of these paths are
still to be taken (docs/benchmarks.md).

On CUDA (``--device cuda``) the job runs as GPU users run it: the forward
under bf16 autocast, TF32 for the matmuls left in float32; packfn's step in
CUDA graphs (the Inductor option of ``torch.compile(mode="reduce-overhead")``;
upstream compiled keeps the default mode, as its graph breaks and new row
lengths leave little to capture); and the report adds each pipeline's peak
GPU memory (``torch.cuda.max_memory_allocated``, reset at each step). The
CPU keeps float32 and ``dense``. ``--device cuda`` without CUDA, or an
attention path the device cannot train, exits with the reason.

    python scripts/main_job.py                   # defaults: under 4 minutes on 2 quiet CPU cores, more under load
    python scripts/main_job.py --steps 12 --sequence 1024 --out profiles
    python scripts/main_job.py --device cuda --batch 8 --sequence 4096 --hidden 1024 --heads 8 --layers 4
    # the same with --attention flex (or dense): every pipeline on FlexAttention (on the dense mask)
    tensorboard --logdir profiles                # pip install -e '.[profile]'
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from packfn import safe_budget

from examples.packed_decoder import (
    DecoderConfig,
    PackedDecoder,
    lengths_from_boundaries,
)
from scripts.attention_paths import (
    ATTENTIONS,
    CUDA_GRAPHS,
    GPU_ATTENTION,
    attention_error,
    compiled_flex_functions,
    packfn_loss_function,
    precision,
    upstream_block_mask,
    upstream_loss_for,
)
from scripts.batches import Batch, add_model_arguments, decoder_config, loader_batches, pieces
from scripts.corpus import add_data_argument, documents_source, training_documents
from scripts.main_job_report import (
    PACKFN,
    UPSTREAM_COMPILED,
    UPSTREAM_EAGER,
    Driver,
    MainJobReport,
    Pipelines,
    plot_summary,
    summarize_trace,
)
from scripts.measure import CountingInductor, graph_breaks, graph_breaks_since, synchronize
from scripts.upstream import neat_packing, neat_packing_batches, upstream_available

__all__ = ["Progress", "Trainer", "main", "make_pipelines", "parse_args", "run", "time_upstream_helpers"]

# Each Inductor C++ kernel a named event in the trace (both compiled drivers are compiled with it).
KERNEL_PROFILE = {"cpp.enable_kernel_profile": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=4, sequence=512, mean=96, hidden=128, layers=2, vocab=256)
    parser.add_argument("--steps", type=int, default=8, help="batches (each a new one: the same shape, new documents)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved passes of the three drivers over the batches (timed)"
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=None,
        help=f"dense: SDPA over a bool block-causal mask; varlen: torch's varlen_attn over the unpadded tokens (CUDA); "
        f"flex: FlexAttention with a document BlockMask (its backward needs CUDA on torch 2.13). Default: dense on "
        f"the CPU, {GPU_ATTENTION} on CUDA",
    )
    add_data_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("profiles"))
    parser.add_argument("--run-name", default=None, help="run folder under --out (default: decoder_<sizes>_<time>)")
    parser.add_argument("--no-upstream", action="store_true", help="skip both upstream drivers")
    parser.add_argument(
        "--upstream-rows",
        choices=("budget", "data"),
        default="budget",
        help="upstream's aligned row length: the packer's budget (packed_layout(minimum_length=budget), the "
        "same area as packfn) or its data-dependent longest row (a new length recompiles the compiled driver)",
    )
    parser.add_argument(
        "--upstream-helpers",
        choices=("eager", "traced"),
        default="eager",
        help="under the upstream torch.compile driver, run upstream's helpers eagerly (torch.compiler.disable: "
        "a graph break at each call) or let Dynamo trace them (packed_layout's per-document loop then "
        "recompiles for every batch: minutes each on 2 CPU cores)",
    )
    arguments = parser.parse_args(argv)
    if arguments.attention is None:
        arguments.attention = GPU_ATTENTION if arguments.device.split(":")[0] == "cuda" else "dense"
    if arguments.steps < 2:
        parser.error("--steps must be at least 2 (the first step compiles)")
    if arguments.rounds < 1:
        parser.error("--rounds must be at least 1")
    return arguments


class Progress:
    """What the job is doing, on stderr, each line flushed at once: a compile of minutes is never silent.

    :meth:`say` prints a line stamped with the time since the job began.
    :meth:`start` begins a pass over batches, drawn as a bar of its steps
    that :meth:`step` advances after each timed step (never inside one): on
    a terminal the bar is redrawn in place and the step lines on stdout are
    written above it; elsewhere (a log file, a pipe) each advance is a line.
    """

    WIDTH = 24

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.label, self.total, self.done = "", 0, 0
        self.pass_began = self.began
        self.remaining = False  # show an estimate of the time left (steps of one cost: the timed rounds)
        self.drawn = False  # a bar is on the terminal's last line

    @staticmethod
    def _stream():
        return sys.stderr  # looked up at each write: redirect_stderr (a test) catches it

    def _live(self) -> bool:
        isatty = getattr(self._stream(), "isatty", None)
        return bool(isatty and isatty())

    def _stamp(self) -> str:
        minutes, seconds = divmod(int(time.perf_counter() - self.began), 60)
        return f"[{minutes:>3}:{seconds:02}]"

    def _clear(self) -> None:
        if self.drawn:
            self._stream().write("\r\x1b[K")
            self._stream().flush()
            self.drawn = False

    def say(self, message: str) -> None:
        """A line on stderr: what the job does now."""
        self._clear()
        print(f"{self._stamp()} {message}", file=self._stream(), flush=True)

    def start(self, label: str, total: int, *, remaining: bool = False) -> None:
        """Begin a pass of ``total`` steps, drawn as a bar at 0."""
        self.label, self.total, self.done, self.remaining = label, total, 0, remaining
        self.pass_began = time.perf_counter()
        self._draw()

    def step(self) -> None:
        """One step of the pass done: advance the bar (the pass ends at ``total``)."""
        if not self.total:  # no pass begun
            return
        self.done += 1
        self._draw()
        if self.done >= self.total and self.drawn:  # keep the finished bar as a line
            self._stream().write("\n")
            self._stream().flush()
            self.drawn = False

    def write(self, line: str) -> None:
        """A line on stdout (a step's result), above the bar on a terminal."""
        self._clear()
        print(line, flush=True)

    def _draw(self) -> None:
        filled = self.WIDTH * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        text = f"{self._stamp()} {self.label} [{bar}] {self.done}/{self.total} steps"
        if self.remaining and 0 < self.done < self.total:
            left = (time.perf_counter() - self.pass_began) / self.done * (self.total - self.done)
            text += f", about {left:.0f} s left"
        if self._live():
            self._clear()
            self._stream().write(text)
            self._stream().flush()
            self.drawn = True
        else:
            print(text, file=self._stream(), flush=True)


class Trainer:
    """One optimizer (AdamW) step per call of :meth:`step`, timed, with a printed line.

    The forward runs under :func:`precision` (bf16 autocast on CUDA).
    ``inductor_options`` patch Inductor's config around forward and
    backward (whose graph compiles at its first call): :data:`CUDA_GRAPHS`
    for packfn's step on CUDA, which then marks each step's beginning for
    the CUDA-graph trees. On CUDA each step records its peak memory.
    """

    def __init__(
        self,
        model,
        loss_function,
        device: torch.device,
        driver: Driver,
        progress: Progress | None = None,
        *,
        inductor_options: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.loss_function, self.device, self.driver = model, loss_function, device, driver
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.progress = progress or Progress()
        self.inductor_options = inductor_options or {}

    def step(self, batch: Batch) -> None:
        cuda = self.device.type == "cuda"
        synchronize(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            resident = torch.cuda.memory_allocated(self.device)
        if self.inductor_options.get("triton.cudagraphs"):
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last step's graph outputs may be reused
        options = (
            torch._inductor.config.patch(self.inductor_options) if self.inductor_options else contextlib.nullcontext()
        )
        begin = time.perf_counter()
        with options:
            with precision(self.device):
                loss = self.loss_function(self.model, batch.input_ids, batch.document_ids, batch.labels)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # the one host read of a step, after its work
        synchronize(self.device)
        driver = self.driver
        driver.seconds.append(time.perf_counter() - begin)
        driver.losses.append(value)
        driver.tokens.append(batch.num_tokens)
        if cuda:
            driver.memory.append((torch.cuda.max_memory_allocated(self.device), resident))
        self.progress.write(
            f"step {len(driver.seconds) - 1:>3}  {driver.name:<18} loss {value:.4f}  {driver.seconds[-1] * 1e3:9.1f} ms"
        )
        self.progress.step()


def _record_compiles(driver: Driver, backend: CountingInductor, before: dict[str, int]) -> None:
    driver.graph_break_reasons = graph_breaks_since(before)
    driver.graph_breaks = sum(driver.graph_break_reasons.values())
    driver.recompiles, driver.frames, driver.graphs = backend.recompiles, backend.frames, backend.graphs


def time_upstream_helpers(
    batches: list[Batch],
    alignment: int,
    minimum_length: int,
    attention: str = "dense",
    build_block_mask: Callable[..., BlockMask] = create_block_mask,
) -> float:
    """Median seconds, on one batch, of the upstream helpers ``--attention``'s drivers call outside their graphs.

    ``dense``: ``build_packed_sequence_metadata``, ``packed_layout`` and
    ``get_unpad_data``; ``flex`` adds the BlockMask (``build_block_mask``,
    the builder the drivers use); ``varlen``: ``get_unpad_data`` alone.
    """
    from nemo_automodel.components.datasets.packing import build_packed_sequence_metadata, get_unpad_data
    from nemo_automodel.components.models.deepseek_v41.packing import packed_layout

    seconds = []
    for batch in batches * 2:
        document_ids = batch.document_ids
        synchronize(document_ids.device)
        begin = time.perf_counter()
        if attention != "varlen":
            metadata = build_packed_sequence_metadata(document_ids)
            layout = packed_layout(
                lengths_from_boundaries(metadata["cu_seqlens"]),
                seq_lens_padded=None,
                input_shape=tuple(document_ids.shape),
                alignment=alignment,
                minimum_length=minimum_length,
            )
            if attention == "flex":
                upstream_block_mask(layout.sequence_ids, build_block_mask)
        get_unpad_data(document_ids)
        synchronize(document_ids.device)
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds[len(batches) :])


def make_pipelines(
    arguments: argparse.Namespace, config: DecoderConfig, upstream: bool, progress: Progress | None = None
) -> Pipelines:
    """packfn's first ``--steps`` full batches of the documents, and upstream's neat-packing batches of their pieces."""
    progress = progress or Progress()
    steps, batch, sequence = arguments.steps, arguments.batch, config.sequence
    wanted = steps * batch * sequence
    progress.say(f"documents: at least {2 * wanted:,} tokens of {documents_source(arguments)} ...")
    documents = training_documents(arguments, 2 * wanted)
    progress.say(
        f"packing: {steps} batches of {batch} x {sequence} with packfn.data.PackedDataset "
        f"(max_documents={config.max_documents}, budget={config.length}) ..."
    )
    kept = sum(1 for _ in itertools.takewhile(lambda total: total < wanted, itertools.accumulate(map(len, documents))))
    while True:  # the shortest prefix of the documents that fills --steps batches
        begin = time.perf_counter()
        batches = loader_batches(
            documents[: kept + 1],
            batch=batch,
            sequence=sequence,
            alignment=config.alignment,
            max_documents=config.max_documents,
            budget=arguments.budget,
            device=arguments.device,
        )
        packfn_s = time.perf_counter() - begin
        if len(batches) >= steps or kept + 1 >= len(documents):
            break
        kept += max(1, (kept + 1) // 20)
    if len(batches) < steps:
        raise SystemExit(f"the documents fill only {len(batches)} batches; ask for fewer --steps")
    used = documents[: kept + 1]
    packfn_batches = batches[:steps]
    upstream_batches, upstream_s = [], 0.0
    if upstream:
        progress.say("packing: the same pieces with NeMo AutoModel's neat packing ...")
        # The same tokens: every piece of packfn's batches (back to back in their rows: no span padding here).
        same = [piece for packed in packfn_batches for piece in pieces(packed.input_ids, packed.seq_lens)]
        neat_packing()  # imported before the clock starts (it imports HF datasets)
        begin = time.perf_counter()
        upstream_batches = neat_packing_batches(same, batch=batch, sequence=sequence, device=arguments.device)
        upstream_s = time.perf_counter() - begin
    return Pipelines(
        documents=len(used),
        document_tokens=[len(document) for document in used],
        source=documents_source(arguments),
        packfn=packfn_batches,
        upstream=upstream_batches,
        packfn_s=packfn_s * steps / max(1, len(batches)),
        upstream_s=upstream_s,
    )


def _profile_packfn(trainer: Trainer, batches: list[Batch], run_dir: Path, device: torch.device) -> None:
    """packfn's first pass over its batches (it compiles), under the profiler."""
    trainer.progress.start("packfn compiled, first pass (compiling, profiled)", len(batches))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Step 0 compiles (skipped), then one step of warm-up and up to three recorded steps.
    active = max(1, min(3, len(batches) - 2))
    schedule = torch.profiler.schedule(
        skip_first=1, wait=0, warmup=1 if len(batches) > 2 else 0, active=active, repeat=1
    )
    # Kernel profiling makes each Inductor C++ kernel a named event in the trace.
    with (
        torch._inductor.config.patch(KERNEL_PROFILE),
        torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(run_dir)),
            record_shapes=True,
        ) as profiler,
    ):
        for batch in batches:
            trainer.step(batch)
            profiler.step()


def _device(name: str) -> torch.device:
    """``--device`` as a device of this machine; ``SystemExit`` with the reason (no traceback) when it is not one."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise SystemExit(f"--device {name}: not a torch device ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise SystemExit(
            f"--device {name}: CUDA is not available (torch {torch.__version__}, {build}); leave --device out to "
            "run on the CPU"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SystemExit(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def run(arguments: argparse.Namespace) -> MainJobReport:
    """Train the three drivers, each on its own pipeline's batches of the same tokens (packfn's first pass profiled)."""
    device = _device(arguments.device)
    error = attention_error(arguments.attention, device)
    if error is not None:
        raise SystemExit(f"{error}; --attention dense runs everywhere")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the matmuls autocast leaves in float32 (GPU default)
    budget = arguments.budget
    if budget is None:  # the packer's default: the row length rounded up to the alignment
        budget = -(-arguments.sequence // arguments.alignment) * arguments.alignment
    # The model's own forward (packed_loss, --attention dense) is its SDPA path; flex and varlen run its layers
    # through decode_with.
    config = dataclasses.replace(decoder_config(arguments, budget), attention="sdpa")
    if arguments.no_upstream:
        upstream_status = "skipped (--no-upstream)"
    elif not upstream_available() or importlib.util.find_spec("datasets") is None:
        upstream_status = (
            "not importable: pip install --no-deps nemo-automodel==0.7.0 and pip install 'datasets>=4.7,<4.8'"
        )
    else:
        upstream_status = "run"
    progress = Progress()
    pipelines = make_pipelines(arguments, config, upstream_status == "run", progress)
    torch.manual_seed(0)
    model = PackedDecoder(config).to(device)
    worst = safe_budget(config.sequence, config.max_documents, config.alignment)
    print(
        f"model: batch={arguments.batch} sequence={config.sequence} aligned budget={config.length} "
        f"(packer: alignment {config.alignment}, D={config.max_documents}; worst case {worst}) "
        f"hidden={config.hidden} layers={config.layers} attention={arguments.attention} device={device}",
        flush=True,
    )

    torch._dynamo.reset()
    counters.clear()
    drivers: dict[str, Driver] = {}
    trainers: dict[str, Trainer] = {}
    batches: dict[str, list[Batch]] = {PACKFN: pipelines.packfn}

    # 1. packfn compiled, fullgraph, its first pass under the profiler.
    backend = CountingInductor()
    drivers[PACKFN] = Driver(PACKFN, warmup_steps=len(pipelines.packfn))
    packfn_loss = torch.compile(packfn_loss_function(arguments.attention), backend=backend, fullgraph=True)
    cuda_graphs = CUDA_GRAPHS if device.type == "cuda" else None
    trainers[PACKFN] = Trainer(
        copy.deepcopy(model), packfn_loss, device, drivers[PACKFN], progress, inductor_options=cuda_graphs
    )
    run_name = arguments.run_name or (
        f"decoder_b{arguments.batch}_s{arguments.sequence}_h{arguments.hidden}_l{arguments.layers}_"
        f"{time.strftime('%Y%m%d-%H%M%S')}"
    )
    run_dir = arguments.out / run_name
    before = graph_breaks()
    progress.say(
        f"packfn compiled: a first pass over its {len(pipelines.packfn)} batches, profiled; its first step compiles "
        "the training step with torch.compile(fullgraph=True) (minutes on 2 CPU cores, longer under load) ..."
    )
    _profile_packfn(trainers[PACKFN], pipelines.packfn, run_dir, device)
    _record_compiles(drivers[PACKFN], backend, before)

    minimum_length = config.length if arguments.upstream_rows == "budget" else 0
    if upstream_status == "run":
        eager_helpers = arguments.upstream_helpers == "eager"
        # 2. upstream under plain torch.compile: a first pass compiles and recompiles.
        progress.say(
            f"upstream compiled: a first pass over its {len(pipelines.upstream)} batches under plain torch.compile; "
            "its first step compiles, and a batch of a new row length recompiles (minutes each on 2 CPU cores) ..."
        )
        upstream_backend = CountingInductor()
        drivers[UPSTREAM_COMPILED] = Driver(UPSTREAM_COMPILED, warmup_steps=len(pipelines.upstream))
        upstream_compiled = torch.compile(
            upstream_loss_for(arguments.attention, minimum_length=minimum_length, eager_helpers=eager_helpers),
            backend=upstream_backend,
        )
        trainers[UPSTREAM_COMPILED] = Trainer(
            copy.deepcopy(model), upstream_compiled, device, drivers[UPSTREAM_COMPILED], progress
        )
        before = graph_breaks()
        progress.start("upstream compiled, first pass (compiling)", len(pipelines.upstream))
        # Compiled with the same Inductor settings as packfn's graph (kernel profiling hooks included).
        with torch._inductor.config.patch(KERNEL_PROFILE):
            for batch in pipelines.upstream:
                trainers[UPSTREAM_COMPILED].step(batch)
        drivers[UPSTREAM_EAGER] = Driver(UPSTREAM_EAGER, warmup_steps=1)
        upstream_eager = upstream_loss_for(arguments.attention, minimum_length=minimum_length)
        trainers[UPSTREAM_EAGER] = Trainer(
            copy.deepcopy(model), upstream_eager, device, drivers[UPSTREAM_EAGER], progress
        )
        batches[UPSTREAM_COMPILED] = batches[UPSTREAM_EAGER] = pipelines.upstream

    # 3. Interleaved rounds, each driver on its own batches, the drivers' order rotating.
    order = [name for name in (UPSTREAM_EAGER, UPSTREAM_COMPILED, PACKFN) if name in trainers]
    turns = max(len(values) for values in batches.values())
    progress.say(
        f"timed rounds: {arguments.rounds} x {turns} turns of {', '.join(order)}, each on its pipeline's batches, "
        "their order rotating ..."
    )
    for turn in range(turns * arguments.rounds):
        if turn % turns == 0:
            label = f"timed rounds, round {turn // turns + 1} of {arguments.rounds}"
            progress.start(label, turns * len(order), remaining=True)
        shift = turn % len(order)
        for name in order[shift:] + order[:shift]:
            trainers[name].step(batches[name][turn % len(batches[name])])
    if UPSTREAM_COMPILED in drivers:
        _record_compiles(drivers[UPSTREAM_COMPILED], upstream_backend, before)
    drivers[PACKFN].recompiles = backend.recompiles
    drivers[PACKFN].frames = backend.frames

    # Loss parity: every driver's loss of packfn's first batch, from the initial weights (no step).
    progress.say("report: loss parity, the upstream helpers' eager time, the trace's summary, the PNG ...")
    first = pipelines.packfn[0]
    losses = {PACKFN: packfn_loss}
    if upstream_status == "run":
        losses |= {UPSTREAM_EAGER: upstream_eager, UPSTREAM_COMPILED: upstream_compiled}
    parity = {}
    for name, function in losses.items():
        options = trainers[name].inductor_options
        if options.get("triton.cudagraphs"):
            torch.compiler.cudagraph_mark_step_begin()
        with torch._inductor.config.patch(options), precision(device):
            parity[name] = function(model, first.input_ids, first.document_ids, first.labels).item()

    trace_files = sorted(str(path) for path in run_dir.glob("*.pt.trace.json*"))
    report = MainJobReport(
        config=config,
        batch=arguments.batch,
        pipelines=pipelines,
        worst_case_length=worst,
        drivers=drivers,
        upstream=upstream_status,
        trace_files=trace_files,
        run_dir=str(run_dir),
        upstream_rows=arguments.upstream_rows,
        upstream_helpers=arguments.upstream_helpers,
        parity=parity,
        attention=arguments.attention,
        device=str(device),
    )
    if device.type == "cuda":
        report.gpu = torch.cuda.get_device_name(device)
        report.cudagraph_skips = counters["inductor"]["cudagraph_skips"]
    if upstream_status == "run":
        build = compiled_flex_functions()[1] if device.type == "cuda" else create_block_mask
        report.upstream_helpers_s = time_upstream_helpers(
            pipelines.upstream, config.alignment, minimum_length, arguments.attention, build
        )
    if trace_files:
        report.trace_summary = summarize_trace(trace_files[0])
    summary = run_dir / "main_job.png"
    if plot_summary(report, summary):
        report.summary_png = str(summary)
    progress.say("done")
    return report


def main(argv: list[str] | None = None) -> int:
    report = run(parse_args(argv))
    print("\n".join(report.lines()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
