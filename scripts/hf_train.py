"""A tiny Hugging Face ``LlamaForCausalLM`` trained on packed batches three ways, each under ``torch.compile``.

Batches come from packfn's loader (:class:`packfn.data.PackedDataset`, best
fit, alignment 1) over real tokens: the Python standard library's sources,
tokenized by a BPE trained on the fly (``scripts/corpus.py``, nothing
downloaded; ``--data exponential`` for random ids of exponential lengths),
in rows of ``--sequence`` tokens, at most ``--max-documents`` per row. The model
is built from a ``LlamaConfig`` with random weights (nothing is downloaded)
and each way trains its own copy of the same initial model with AdamW, one
step per batch, on the same batches:

1. **packfn**: the model patched in place by
   ``packfn.integrations.hf.apply_packfn(model)`` (it stays a
   ``LlamaForCausalLM``: ``save_pretrained`` writes the plain model) and
   called on the packed batch, ``model(input_ids=tokens,
   document_ids=document_ids, labels=tokens)``; its forward builds, inside
   the compiled step (``hf_model_inputs``), restarting ``position_ids``,
   labels with -100 at padding and at each document's first token, and the
   attention input of the model's ``attn_implementation`` (a bool
   block-causal mask for SDPA, a ``BlockMask`` for FlexAttention);
2. **transformers packed**: transformers' own packed path: restarting
   ``position_ids`` (:func:`packfn.packed_position_ids`, inside the compiled
   step), no ``attention_mask``, ``use_cache=False`` (NOTE [transformers' own
   packed path needs use_cache=False] in :mod:`packfn.integrations.hf`), labels masked as
   in way 1. Transformers finds the documents from the restarts of the
   position ids; padding continues its row's last document's positions, so
   padding tokens attend like that document (their labels are -100, so the
   loss is over real tokens only);
3. **per-document padded**: no packing: every document is a row of its own,
   right-padded, labels -100 at padding, causal attention with a 2-D padding
   ``attention_mask``. Shapes are static over the run (rows: the most
   documents of any batch; columns: the longest document of the run), so the
   step compiles once; rows past a batch's documents are dummies (attention
   on, every label -100).

Every way is compiled once (``fullgraph=True``; a way that cannot be
compiled whole says why and falls back to plain ``torch.compile``, its
graph breaks counted). The ways take turns on each batch, their order
rotating; the report gives each way's graph breaks, recompiles (counted by
a counting Inductor backend: graphs compiled for a frame the way had
compiled before),
compile time, median step time (the first, compiling step left out) and
real (non-padding) tokens per second. The three first-step losses are the
mean over the same targets from the same weights: the script exits 1 when
they differ by more than ``--tolerance``.

FlexAttention has no backward on the CPU (torch 2.11, 2.13 and 2.14 raise
``NotImplementedError``): ``--attn flex_attention`` on the CPU runs
forward-only steps (no backward, no optimizer) and the report says so; on
cuda it trains. Flex blocks are 16 on the CPU (compiled CPU flex attention
is wrong for blocks under 16) and 128 on cuda.

    python scripts/hf_train.py                          # sdpa: 67-103 s on 2 shared CPU cores, cold compile cache
    python scripts/hf_train.py --attn flex_attention    # forward only on the CPU: 92-131 s there
    python scripts/hf_train.py --device cuda --sequence 4096 --mean 300 --hidden 512 --layers 4
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import copy
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers
from torch._dynamo.utils import counters

import packfn
from packfn.data import PackedDataset
from packfn.integrations.hf import apply_packfn

from scripts.batches import pieces
from scripts.corpus import add_data_argument, documents_source, training_documents
from scripts.measure import CountingInductor, graph_breaks, graph_breaks_since, synchronize

__all__ = ["HFTrainReport", "Way", "flex_backward_error", "main", "make_steps", "parse_args", "run"]

IGNORE_INDEX = -100
PACKFN = "1 packfn apply_packfn"
TRANSFORMERS = "2 transformers packed"
PADDED = "3 per-document padded"
WAYS = (PACKFN, TRANSFORMERS, PADDED)


@dataclass(frozen=True)
class Step:
    """One batch in the two forms the ways take.

    ``input_ids`` / ``document_ids`` are the packed ``[batch, sequence]``
    rows (0 at padding); ``row_*`` are the same documents one per row,
    ``[rows, columns]``, right-padded (``row_attention_mask`` 1 at real
    tokens and on dummy rows, ``row_labels`` -100 at padding and on dummy rows).
    """

    input_ids: torch.Tensor
    document_ids: torch.Tensor
    row_input_ids: torch.Tensor
    row_attention_mask: torch.Tensor
    row_labels: torch.Tensor
    num_tokens: int
    num_documents: int


def make_steps(arguments: argparse.Namespace) -> tuple[list[Step], int, int]:
    """``arguments.steps`` batches from :class:`packfn.data.PackedDataset`, and the static ``(rows, columns)`` of way 3.

    Documents are the standard library's sources, tokenized by a BPE of
    ``--vocab`` ids trained on them (``scripts/corpus.py``), or with
    ``--data exponential`` random ids of exponential lengths (mean
    ``--mean``, seed ``--seed``). The loader packs them at alignment 1, at
    most ``--max-documents`` per row; a document longer than a row is cut
    into pieces (``split=True``), each piece a document of its own for every way.
    """
    dataset = PackedDataset(
        training_documents(arguments, 2 * arguments.steps * arguments.batch * arguments.sequence),
        batch=arguments.batch,
        sequence=arguments.sequence,
        max_documents=arguments.max_documents,
        split=True,
        drop_last=True,
    )
    packed_batches = list(itertools.islice(dataset, arguments.steps))
    if len(packed_batches) < arguments.steps:
        raise SystemExit(f"the documents fill only {len(packed_batches)} batches; ask for fewer --steps")
    pieces_per_step = [pieces(item["input_ids"], item["seq_lens"]) for item in packed_batches]
    rows = max(len(step_pieces) for step_pieces in pieces_per_step)
    columns = max(len(piece) for step_pieces in pieces_per_step for piece in step_pieces)
    device = torch.device(arguments.device)
    steps = []
    for item, step_pieces in zip(packed_batches, pieces_per_step, strict=True):
        row_input_ids = torch.zeros(rows, columns, dtype=torch.int64)
        row_attention_mask = torch.ones(rows, columns, dtype=torch.int64)  # dummy rows: attention on
        row_labels = torch.full((rows, columns), IGNORE_INDEX, dtype=torch.int64)
        for row, piece in enumerate(step_pieces):
            length = len(piece)
            row_input_ids[row, :length] = torch.tensor(piece)
            row_attention_mask[row, length:] = 0
            row_labels[row, :length] = row_input_ids[row, :length]
        steps.append(
            Step(
                item["input_ids"].to(device),
                item["document_ids"].to(device),
                row_input_ids.to(device),
                row_attention_mask.to(device),
                row_labels.to(device),
                int(item["seq_lens"].sum()),
                len(step_pieces),
            )
        )
    return steps, rows, columns


# ------------------------------------------------------------ the three step functions (each compiled)


def packfn_loss(model, step: Step) -> torch.Tensor:
    """Way 1: the loss of the model patched by ``apply_packfn`` on the packed batch (its inputs built in the step)."""
    return model(input_ids=step.input_ids, document_ids=step.document_ids, labels=step.input_ids).loss


def transformers_packed_loss(model, step: Step) -> torch.Tensor:
    """Way 2: transformers' own packed path: restarting ``position_ids``, no ``attention_mask``, no cache."""
    positions = packfn.packed_position_ids(step.document_ids)
    labels = step.input_ids.masked_fill((positions == 0) | (step.document_ids == 0), IGNORE_INDEX)
    return model(input_ids=step.input_ids, position_ids=positions, labels=labels, use_cache=False).loss


def padded_loss(model, step: Step) -> torch.Tensor:
    """Way 3: one document per row, right-padded, a 2-D padding ``attention_mask``."""
    return model(
        input_ids=step.row_input_ids,
        attention_mask=step.row_attention_mask,
        labels=step.row_labels,
        use_cache=False,
    ).loss


# ------------------------------------------------------------ running and reporting


def _short(error: BaseException) -> str:
    """The exception's type and the first line of its message (and of Dynamo's debug context, when it has one)."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    text = f"{type(error).__name__}: {lines[0][:160] if lines else ''}"
    context = next((line for line in lines if line.startswith("Developer debug context:")), None)
    if context:
        text += f" [{context.removeprefix('Developer debug context:').strip()[:200]}]"
    return text


@dataclass
class Way:
    """One way of feeding the model: its compiled step, optimizer, and what its steps measured."""

    name: str
    model: torch.nn.Module
    loss_function: Callable[..., torch.Tensor]
    device: torch.device
    train: bool
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    graph_breaks: int = 0
    graph_break_reasons: dict[str, int] = field(default_factory=dict)
    fullgraph_error: str | None = None  # why fullgraph=True failed, when it did
    backend: CountingInductor = field(default_factory=CountingInductor)

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3) if self.train else None
        # Shapes are static by design. dynamic=False also keeps a way whose graph breaks out of automatic
        # dynamic shapes, which it would otherwise reach through code objects the ways share (transformers'
        # forwards), and whose symbolic sizes trip an Inductor bug in the CPU flex attention template (torch 2.13,
        # cpp_flex_attention_template.py renames size "ks1" inside "ks14": "cur_qSplitSize4" is not declared).
        self.compiled = torch.compile(self.loss_function, backend=self.backend, fullgraph=True, dynamic=False)

    def step(self, step: Step) -> None:
        """One step (forward, and backward and AdamW when training), timed, its graph breaks counted."""
        before = graph_breaks()
        synchronize(self.device)
        begin = time.perf_counter()
        try:
            loss = self._forward(step)
        except torch._dynamo.exc.Unsupported as error:
            if self.fullgraph_error is not None or self.seconds:
                raise
            # The way cannot be compiled whole: say why, then count its graph breaks under plain torch.compile.
            self.fullgraph_error = _short(error)
            print(f"{self.name}: fullgraph=True failed ({self.fullgraph_error}); plain torch.compile", flush=True)
            counters["graph_break"].clear()
            counters["graph_break"].update(before)
            self.backend = CountingInductor()
            self.compiled = torch.compile(self.loss_function, backend=self.backend, dynamic=False)
            begin = time.perf_counter()
            loss = self._forward(step)
        if self.optimizer is not None:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # the one host read of a step, after its work
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - begin)
        self.losses.append(value)
        self.tokens.append(step.num_tokens)
        for reason, count in graph_breaks_since(before).items():
            self.graph_break_reasons[reason] = self.graph_break_reasons.get(reason, 0) + count
            self.graph_breaks += count
        print(
            f"step {len(self.seconds) - 1:>3}  {self.name:<26} loss {value:.6f}  {self.seconds[-1] * 1e3:9.1f} ms",
            flush=True,
        )

    def _forward(self, step: Step) -> torch.Tensor:
        if self.train:
            return self.compiled(self.model, step)
        with torch.no_grad():
            return self.compiled(self.model, step)

    @property
    def recompiles(self) -> int:
        """Graphs compiled for a frame this way had compiled before (a guard failed on its steps)."""
        return self.backend.graphs - self.backend.frames

    @property
    def shared_frames(self) -> int:
        """Frames whose code an earlier way compiled first (transformers' functions, reached after a graph break)."""
        first: dict[int, int] = {}
        for frame, attempt in self.backend.compile_ids:
            first.setdefault(frame, attempt)
        return sum(1 for attempt in first.values() if attempt > 0)

    @property
    def median_step_s(self) -> float:
        """Median step time, the first (compiling) step left out."""
        return statistics.median(self.seconds[1:])

    @property
    def tokens_per_s(self) -> float:
        """Median over the steps after the first of real tokens over step time."""
        return statistics.median(t / s for t, s in zip(self.tokens[1:], self.seconds[1:], strict=True))

    @property
    def compile_s(self) -> float:
        """The first step minus a median step: the time spent compiling."""
        return max(0.0, self.seconds[0] - self.median_step_s)

    def compile_line(self) -> str:
        graphs = self.backend.graphs
        if self.fullgraph_error is None:
            how = "fullgraph=True"
        else:
            how = f"plain torch.compile after fullgraph=True failed ({self.fullgraph_error})"
        reasons = "; ".join(
            f"{reason.splitlines()[0][:80]} x{count}"
            for reason, count in sorted(self.graph_break_reasons.items(), key=lambda kv: -kv[1])[:3]
        )
        breaks = f"; breaks on: {reasons}" if reasons else ""
        if graphs == 1 and self.backend.frames == 1:
            reuse = f"compiled once, the other {len(self.seconds) - 1} steps (new contents, same shapes) reused it"
        else:
            reuse = f"{graphs} graphs in {self.backend.frames} frames over {len(self.seconds)} steps"
        shared = (
            f"; {self.shared_frames} of its frames run code an earlier way compiled too (not counted as recompiles)"
            if self.shared_frames
            else ""
        )
        return f"{self.name}: {how}: {reuse}{breaks}{shared}"


def flex_backward_error(device: torch.device) -> str | None:
    """Why FlexAttention cannot train on ``device`` (its error, eagerly, on tiny inputs), or None when it can."""
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.zeros(1, 1, 16, 16, device=device, requires_grad=True)
    try:
        flex_attention(query, query, query).sum().backward()
    except NotImplementedError as error:
        return _short(error)
    return None


@dataclass
class HFTrainReport:
    """What :func:`run` measured (times in seconds)."""

    arguments: argparse.Namespace
    ways: dict[str, Way]
    rows: int
    columns: int
    real_tokens: int
    documents: int
    forward_only: str | None  # why steps are forward only, or None when they train
    tolerance: float
    startup_s: float  # a trivial forward and backward compile before the ways: Inductor's one-time start-up

    @property
    def loss_difference(self) -> float:
        first = [way.losses[0] for way in self.ways.values()]
        difference = max(first) - min(first)
        return difference if difference == difference else float("inf")  # NaN: no agreement

    @property
    def losses_agree(self) -> bool:
        return self.loss_difference <= self.tolerance

    def lines(self) -> list[str]:
        """The printed report."""
        arguments = self.arguments
        steps = arguments.steps
        packed_area = steps * arguments.batch * arguments.sequence
        padded_area = steps * self.rows * self.columns
        steps_a_way = len(next(iter(self.ways.values())).seconds)
        source = documents_source(arguments)

        mode = (
            "training: forward, backward and AdamW (lr 1e-3) each step"
            if self.forward_only is None
            else f"FORWARD ONLY (no backward, no optimizer): FlexAttention cannot train on {arguments.device} "
            f"with torch {torch.__version__} ({self.forward_only}); on cuda it trains"
        )
        result = [
            "== packfn hf_train report ==",
            f"model:        LlamaForCausalLM from a LlamaConfig, random weights: hidden={arguments.hidden} "
            f"layers={arguments.layers} heads={arguments.heads} vocab={arguments.vocab}; "
            f"attn_implementation={arguments.attn}; device={arguments.device}; float32; "
            f"torch {torch.__version__}, transformers {transformers.__version__}",
            f"mode:         {mode}; each way on its own copy of the same initial model",
            f"batches:      {steps} of {arguments.batch} x {arguments.sequence} tokens packed by "
            f"packfn.data.PackedDataset (best fit, alignment 1, max_documents {arguments.max_documents}), "
            f"{self.documents} documents ({source}); {1 + arguments.rounds} passes "
            f"over them (1 + --rounds {arguments.rounds}): {steps_a_way} steps a way",
            f"real tokens:  {self.real_tokens / packed_area:.1%} of the packed budget ({self.real_tokens} of "
            f"{steps} x {arguments.batch} x {arguments.sequence}); "
            f"way 3's padded rows: {self.real_tokens / padded_area:.1%} of {steps} x {self.rows} x {self.columns}",
            f"way 3 shapes: static over the run: {self.rows} rows (the most documents of any step) x {self.columns} "
            "columns (the longest document of the run); rows past a step's documents are dummies (labels -100)",
            f"{'way':<28}{'graph breaks':>13}{'recompiles':>11}{'compile':>10}{'median step':>14}"
            f"{'real tokens/s':>15}{'first loss':>12}",
        ]
        for way in self.ways.values():
            result.append(
                f"{way.name:<28}{way.graph_breaks:>13}{way.recompiles:>11}{way.compile_s:>8.1f} s"
                f"{way.median_step_s * 1e3:>11.1f} ms{way.tokens_per_s:>15,.0f}{way.losses[0]:>12.6f}"
            )
        verdict = "OK" if self.losses_agree else "MISMATCH"
        result.append(
            f"loss agreement: first-step losses {' / '.join(f'{way.losses[0]:.6f}' for way in self.ways.values())}: "
            f"max |diff| {self.loss_difference:.2e} (tolerance {self.tolerance:.0e}): {verdict}"
        )
        result.append("compiles:")
        result.extend(f"  {way.compile_line()}" for way in self.ways.values())
        result.append(
            f"notes:        compile = the first step minus a median step; Inductor's one-time start-up "
            f"({self.startup_s:.1f} s, a trivial forward and backward compile) is paid before the ways, which "
            f"compile in the order {', '.join(name.split()[0] for name in self.ways)} and share Inductor's kernel "
            "cache: a way compiled later reuses the kernels (norms, MLPs, ...) that an earlier one built. "
            "Median step and tokens/s leave out the first step; real tokens exclude padding. "
            "Way 2: padding continues the positions of its row's last document, so transformers' packed detection "
            "lets padding tokens attend like that document; their labels are -100, so every loss is over real tokens "
            "only (the same targets in the three ways)."
        )
        return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", choices=("sdpa", "flex_attention"), default="sdpa", help="attn_implementation")
    parser.add_argument("--batch", type=int, default=4, help="packed rows per batch")
    parser.add_argument("--sequence", type=int, default=256, help="tokens per packed row")
    add_data_argument(parser)
    parser.add_argument("--mean", type=int, default=64, help="mean document length of --data exponential")
    parser.add_argument("--max-documents", type=int, default=16, help="the packer's cap of documents per row")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="batches (same shape, new documents), one step each")
    parser.add_argument(
        "--rounds", type=int, default=2, help="more passes over the same batches after the first, for the medians"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the document lengths, tokens and weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest allowed difference of the first-step losses"
    )
    arguments = parser.parse_args(argv)
    for name in ("batch", "sequence", "mean", "max_documents", "hidden", "layers", "heads", "vocab"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if arguments.steps < 2:
        parser.error("--steps must be at least 2 (the first step compiles)")
    if arguments.rounds < 0:
        parser.error("--rounds must be at least 0")
    if arguments.hidden % arguments.heads:
        parser.error("--hidden must be a multiple of --heads")
    return arguments


def build_model(arguments: argparse.Namespace) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` from a ``LlamaConfig`` with random (seeded) weights, in train mode."""
    config = transformers.LlamaConfig(
        vocab_size=arguments.vocab,
        hidden_size=arguments.hidden,
        intermediate_size=4 * arguments.hidden,
        num_hidden_layers=arguments.layers,
        num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.heads,
        max_position_embeddings=max(arguments.sequence, 128),
        attn_implementation=arguments.attn,
        # A training run keeps no KV cache. With the default (True) the model builds a DynamicCache inside the
        # step even in train mode; under flex_attention (torch 2.13, 2 layers) Dynamo then stops on
        # AttributeError("'DynamicLayer' object has no attribute 'dtype'") in transformers' code.
        use_cache=False,
    )
    torch.manual_seed(arguments.seed)
    return transformers.LlamaForCausalLM(config).to(arguments.device).train()


def run(arguments: argparse.Namespace) -> HFTrainReport:
    """Train (or, for flex on a device without its backward, run forward) the three ways on the same batches."""
    device = torch.device(arguments.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    forward_only = flex_backward_error(device) if arguments.attn == "flex_attention" else None
    # Compiled CPU flex attention is wrong for blocks under 16 (hf_model_inputs' docstring).
    block_size = 16 if device.type == "cpu" else 128
    steps, rows, columns = make_steps(arguments)
    model = build_model(arguments)
    print(
        f"hf_train: attn={arguments.attn} device={device} batch={arguments.batch} sequence={arguments.sequence} "
        f"hidden={arguments.hidden} layers={arguments.layers} steps={arguments.steps}; way 3 rows {rows} x {columns}"
        + (f"; forward only ({forward_only})" if forward_only else ""),
        flush=True,
    )

    torch._dynamo.reset()
    # Inductor's one-time start-up (C++ compiler checks, imports) would land in whichever way compiles first.
    begin = time.perf_counter()
    warm = torch.ones(4, device=device, requires_grad=True)
    torch.compile(lambda x: (x * x).sum(), fullgraph=True)(warm).backward()
    startup_s = time.perf_counter() - begin
    counters.clear()
    functions = {PACKFN: packfn_loss, TRANSFORMERS: transformers_packed_loss, PADDED: padded_loss}
    models = {name: copy.deepcopy(model) for name in WAYS}
    apply_packfn(models[PACKFN], block_size=block_size)  # in place: still a LlamaForCausalLM
    ways = {name: Way(name, models[name], functions[name], device, train=forward_only is None) for name in WAYS}
    # Each way's step is one frame, compiled once; a recompile would show in the counts (not fall back to
    # eager unseen) up to a limit above the steps of the run.
    with torch._dynamo.config.patch(cache_size_limit=max(8, arguments.steps + 1)):
        # The first pass compiles (step 0) and checks that new contents of the same shapes hit the cache; the
        # --rounds passes after it are timed too (a shared machine's noise needs more than a few steps).
        for index, step in enumerate(steps * (1 + arguments.rounds)):
            shift = index % len(WAYS)
            for name in WAYS[shift:] + WAYS[:shift]:
                ways[name].step(step)
    return HFTrainReport(
        arguments=arguments,
        ways=ways,
        rows=rows,
        columns=columns,
        real_tokens=sum(step.num_tokens for step in steps),
        documents=sum(step.num_documents for step in steps),
        forward_only=forward_only,
        tolerance=arguments.tolerance,
        startup_s=startup_s,
    )


def main(argv: list[str] | None = None) -> int:
    report = run(parse_args(argv))
    print("\n".join(report.lines()), flush=True)
    if not report.losses_agree:
        print(
            f"hf_train: the first-step losses differ by {report.loss_difference:.2e} > {report.tolerance:.0e}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
