"""GPU checks of SPEC section 6, prepared for a lent CUDA GPU: one run, every failure recorded.

Sections, in the order ``--sections`` names them. Each section and each
function inside it is independent: a failure (an error, a result that
differs from the CPU's, a host sync) is recorded and the run goes on. The
run ends with the list of failures and exits 1 when there is one.

1. ``correctness``: every public function (``scripts/catalog.py``: the
   core, the format conversions, the distributed shards and their attention
   inputs, the integrations and the NeMo AutoModel drop-ins) at every batch
   of ``--batches`` and sequence of ``--sequences`` (the sizes where
   Inductor changes path: 8192 / 8193 columns, then 32768 and 131072):
   eagerly on the device, compiled with dynamic shapes (one compile per
   function and batch, called at every sequence) and, at the
   ``--static`` sizes, compiled with static shapes; each result equal to
   the function's eager result on the CPU.
2. ``codegen``: each function compiled at ``--batches``' largest and
   ``--codegen-sequence``: the kernels Inductor's code launches (Triton
   kernels, aten fallbacks, memsets), no call back into ``packfn``, and the
   median time against one pass over the mask (``(mask > 0).sum()``,
   compiled). SPEC section 6: at most 4 launches per metadata function and
   5 times the pass. On ``--device cpu`` the launches are those of the
   Triton code Inductor writes for an H200 (``scripts/inductor_cuda.py``).
3. ``sync``: ``torch.cuda.set_sync_debug_mode("error")`` around every
   function of the static path, eager and compiled: a host sync is a failure.
4. ``bandwidth``: compiled ``pack`` / ``restore`` against ``values.clone()``
   (``[batch, sequence, --hidden]`` float32). Target: pack at 80% of copy bandwidth.
5. ``upstream``: compiled static functions against NeMo AutoModel's eager
   helpers on the same inputs.
6. ``model``: the example model (``examples/packed_decoder.py``) trained a few
   steps under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), with
   graph breaks and CUDA-graph skips counted, against upstream eagerly.

A section that would start past ``--budget`` seconds is skipped, and a
section that runs past it skips its remaining functions; each skip is named
in the JSON (``--json``). Uses no API newer than torch 2.11. Without CUDA it
parses its arguments and exits with a message (status 2). ``--device cpu``
walks every section on the CPU at whatever sizes are given (C++ kernels,
wall-clock timings, no sync check): the tests use it so that the script
cannot rot between the sessions that are lent a GPU.

    python scripts/gpu_check.py --json gpu_check.json
    python scripts/gpu_check.py --sequences 8193 --batches 8 --sections correctness codegen
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import functools
import json
import platform
import statistics
import time
import traceback
from collections.abc import Callable

import torch

from scripts.measure import synchronize

SECTIONS = ("correctness", "codegen", "sync", "bandwidth", "upstream", "model")
# SPEC section 6: the metadata functions compiled launch at most this many kernels, within FLOOR_TARGET of a pass.
LAUNCH_TARGET = 4
FLOOR_TARGET = 5.0
METADATA_FUNCTIONS = (
    "varlen_metadata",
    "batch_metadata",
    "flatten_metadata",
    "thd_metadata",
    "physical_varlen_metadata",
    "unpad",
    "pad",
    "aligned_layout",
    "block_causal_mask",
    "document_block_mask",
    "packed_position_ids",
    "seq_idx_from_document_ids",
    "seq_lens_from_document_ids",
)
BANDWIDTH_TARGET = 0.8
MODEL_MAX_DOCUMENTS = 16
CORRECTNESS_HIDDEN = 16
STATIC_PATH_LAYERS = ("core", "formats", "distributed", "integrations")
RANKS = (1,)  # of 2 context-parallel ranks: the one whose queries start inside the row


def _size(text: str) -> tuple[int, int]:
    batch, _, sequence = text.partition("x")
    return int(batch), int(sequence)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sequences", type=int, nargs="+", default=[8192, 8193, 32768, 131072])
    parser.add_argument(
        "--static",
        type=_size,
        nargs="*",
        default=[(8, 8193), (1, 131072), (8, 131072)],
        metavar="BATCHxSEQUENCE",
        help="sizes at which every function is also compiled with static shapes",
    )
    parser.add_argument("--codegen-sequence", type=int, default=32768, help="SPEC section 6's size for the launches")
    parser.add_argument("--mean", type=int, default=300, help="mean document length")
    parser.add_argument("--hidden", type=int, default=1024, help="activation width for pack / restore bandwidth")
    parser.add_argument("--alignment", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant")
    parser.add_argument("--only", nargs="*", default=None, help="run only the functions of these names (catalog.py)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--model-sequence", type=int, default=2048)
    parser.add_argument("--model-batch", type=int, default=4)
    parser.add_argument("--model-hidden", type=int, default=256)
    parser.add_argument("--model-layers", type=int, default=2)
    parser.add_argument("--model-steps", type=int, default=6)
    parser.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa", help="attention of the model")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds; work past it is skipped and named")
    parser.add_argument("--json", type=Path, default=Path("bench_results/gpu_check.json"))
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a walk of the script itself")
    arguments = parser.parse_args(argv)
    for name in ("hidden", "alignment", "repeats", "mean", "model_steps", "codegen_sequence"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if min(arguments.batches) < 1 or min(arguments.sequences) < 1:
        parser.error("--batches and --sequences must be positive")
    return arguments


# ------------------------------------------------------------------ the run


class Run:
    """The clock, the failures and the skips of one run."""

    def __init__(self, arguments: argparse.Namespace) -> None:
        self.arguments = arguments
        self.started = time.perf_counter()
        self.failures: list[str] = []
        self.skipped: list[str] = []

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_budget(self, what: str) -> bool:
        """Whether the budget is spent; if so ``what`` is recorded as skipped."""
        if self.elapsed <= self.arguments.budget:
            return False
        self.skipped.append(what)
        return True

    def check(self, label: str, function: Callable[[], object]) -> str:
        """``"ok"`` where ``function`` returns True, else a failure (recorded under ``label``)."""
        try:
            outcome = "ok" if function() else "MISMATCH"
        except Exception as error:  # record and go on: one failure must not hide the others
            outcome = f"ERROR {type(error).__name__}: {_first_line(error)}"
        if outcome != "ok":
            self.failures.append(f"{label}: {outcome}")
        return outcome


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines() or [""])[0][:400]


def _median_ms(function: Callable[[], object], repeats: int, device: str) -> float:
    """Median milliseconds of ``function`` after three warm-up calls: CUDA events on CUDA, else wall clock."""
    for _ in range(3):
        function()
    if device != "cuda":
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            function()
            times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _compiled(function: Callable[..., object], *, dynamic: bool) -> Callable[..., object]:
    return torch.compile(function, fullgraph=True, dynamic=dynamic)


def _inputs(arguments, batch: int, sequence: int, hidden: int = CORRECTNESS_HIDDEN):
    from scripts.benchmarks.common import make_inputs

    return make_inputs(sequence, arguments.mean, batch=batch, hidden=hidden)


def _selected(entries: dict, arguments) -> dict:
    if not arguments.only:
        return entries
    return {name: entry for name, entry in entries.items() if name in arguments.only}


# ----------------------------------------------------------------- sections


def section_correctness(run: Run) -> dict:
    """Every function at every size: eager on the device, compiled dynamic and (at ``--static``) static, vs the CPU."""
    from scripts.catalog import catalog, same

    arguments = run.arguments
    device = arguments.device
    result: dict[str, dict[str, dict[str, str]]] = {}
    for batch in arguments.batches:
        sizes = {sequence: _inputs(arguments, batch, sequence) for sequence in arguments.sequences}
        cap = max(inputs.max_documents for inputs in sizes.values())  # one cap: the dynamic compile serves all
        catalogs = {
            sequence: _selected(catalog(inputs, max_documents=cap, ranks=RANKS), arguments)
            for sequence, inputs in sizes.items()
        }
        names = list(dict.fromkeys(name for entries in catalogs.values() for name in entries))
        for name in names:
            if run.over_budget(f"correctness {name} at batch {batch}"):
                continue
            torch._dynamo.reset()
            for sequence, entries in catalogs.items():
                if name not in entries:
                    continue
                entry, size = entries[name], f"{batch}x{sequence}"
                label = f"correctness {name} {size}"
                outcomes = result.setdefault(name, {}).setdefault(size, {})
                try:
                    reference = entry.function(*entry.args)
                except Exception as error:
                    outcomes["cpu"] = f"ERROR {type(error).__name__}: {_first_line(error)}"
                    run.failures.append(f"{label} cpu: {outcomes['cpu']}")
                    continue
                on_device = entry.to(device)

                def matches(function, on_device=on_device, reference=reference) -> bool:
                    return same(function(*on_device.args), reference)

                outcomes["eager"] = run.check(f"{label} eager", functools.partial(matches, on_device.function))
                if not entry.compiles:
                    continue
                dynamic = _compiled(on_device.function, dynamic=True)
                outcomes["dynamic"] = run.check(f"{label} dynamic", functools.partial(matches, dynamic))
                if (batch, sequence) in arguments.static:
                    torch._dynamo.reset()
                    static = _compiled(on_device.function, dynamic=False)
                    outcomes["static"] = run.check(f"{label} static", functools.partial(matches, static))
                    torch._dynamo.reset()
                print(f"correctness {name:<48} {size:<9} {outcomes}", flush=True)
    backward = _backward(run)
    return {"functions": result, "backward": backward}


def _backward(run: Run) -> dict:
    """The compiled backward of the differentiable functions at batch > 1, against eager on the device."""
    import packfn

    arguments = run.arguments
    batch = max(arguments.batches)
    sequence = min(arguments.sequences)
    inputs = _inputs(arguments, batch, sequence)
    mask, values = inputs.document_ids.to(arguments.device), inputs.values.to(arguments.device)
    seq_lens = inputs.seq_lens.to(arguments.device)
    budget = packfn.safe_budget(sequence, seq_lens.shape[1], arguments.alignment)
    layout = packfn.aligned_layout(seq_lens, sequence_length=sequence, alignment=arguments.alignment, budget=budget)
    metadata = packfn.varlen_metadata(mask, max_documents=inputs.max_documents)
    functions = {
        "pack": (layout.pack, values),
        "restore": (layout.restore, layout.pack(values)),
        "unpad": (lambda values: packfn.unpad(values, metadata), values),
        "pad": (lambda values: packfn.pad(values, metadata), packfn.unpad(values, metadata)),
    }
    result = {}
    for name, (function, values) in functions.items():

        def gradients(function, values=values):
            values = values.detach().requires_grad_(True)
            out = function(values)
            weights = torch.arange(out.numel(), device=out.device, dtype=out.dtype).reshape(out.shape).sin()
            (out * weights).sum().backward()
            return values.grad

        result[f"{name}@{batch}x{sequence}"] = run.check(
            f"backward {name}",
            lambda f=function, g=gradients: torch.equal(g(_compiled(f, dynamic=False)), g(f)),
        )
    return result


def section_codegen(run: Run) -> dict:
    """Launches per function in Inductor's code (for an H200 when the device is the CPU), and time over a pass."""
    from scripts.catalog import catalog
    from scripts.inductor_cuda import kernel_names, triton_code

    arguments = run.arguments
    batch, sequence = max(arguments.batches), arguments.codegen_sequence
    inputs = _inputs(arguments, batch, sequence)
    entries = _selected(catalog(inputs, ranks=RANKS), arguments)
    mask = inputs.document_ids.to(arguments.device)
    floor = _compiled(lambda mask: (mask > 0).sum(), dynamic=False)
    floor_ms = _median_ms(lambda: floor(mask), arguments.repeats, arguments.device)
    result: dict[str, object] = {"size": f"{batch}x{sequence}", "floor_ms": floor_ms, "functions": {}}
    for name, entry in entries.items():
        if not entry.compiles or run.over_budget(f"codegen {name}"):
            continue
        on_device = entry.to(arguments.device)
        row: dict[str, object] = {}
        try:
            if arguments.device == "cuda":
                from torch._inductor.utils import run_and_get_code

                torch._dynamo.reset()
                compiled = _compiled(on_device.function, dynamic=False)
                _, codes = run_and_get_code(compiled, *on_device.args)
                code = "\n".join(codes)
            else:
                code = triton_code(entry.function, *entry.args)
                compiled = _compiled(on_device.function, dynamic=False)
            kernels = kernel_names(code)
            row["launches"] = len(kernels)
            row["kernels"] = kernels
            row["packfn_calls"] = code.count("torch.ops.packfn") + code.count("packfn::")
            row["ms"] = _median_ms(lambda c=compiled, a=on_device.args: c(*a), arguments.repeats, arguments.device)
            row["over_floor"] = row["ms"] / floor_ms
            if row["packfn_calls"]:
                run.failures.append(f"codegen {name}: {row['packfn_calls']} calls back into packfn")
            if name in METADATA_FUNCTIONS:
                row["meets_launch_target"] = row["launches"] <= LAUNCH_TARGET
                row["meets_floor_target"] = row["over_floor"] <= FLOOR_TARGET
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {_first_line(error)}"
            run.failures.append(f"codegen {name}: {row['error']}")
        result["functions"][name] = row
        print(f"codegen  {name:<48} { ({k: v for k, v in row.items() if k != 'kernels'}) }", flush=True)
    return result


def section_sync(run: Run) -> dict:
    from scripts.catalog import catalog

    arguments = run.arguments
    if arguments.device != "cuda":
        return {"skipped": "torch.cuda.set_sync_debug_mode needs CUDA"}
    inputs = _inputs(arguments, max(arguments.batches), arguments.codegen_sequence)
    entries = {
        name: entry.to("cuda")
        for name, entry in _selected(catalog(inputs, ranks=RANKS), arguments).items()
        if entry.layer in STATIC_PATH_LAYERS and entry.compiles
    }
    result = {}
    for mode in ("eager", "compiled"):
        for name, entry in entries.items():
            if run.over_budget(f"sync {mode} {name}"):
                continue
            runner = _compiled(entry.function, dynamic=False) if mode == "compiled" else entry.function

            def synced(runner=runner, entry=entry) -> bool:
                runner(*entry.args)  # compile (or warm) outside the checked region
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    runner(*entry.args)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                return True

            result[f"{mode}:{name}"] = run.check(f"sync {mode} {name}", synced)
            print(f"sync     {mode:<9} {name:<48} {result[f'{mode}:{name}']}", flush=True)
    return result


def section_bandwidth(run: Run) -> dict:
    from packfn import aligned_layout, safe_budget

    arguments = run.arguments
    sequence = arguments.codegen_sequence
    inputs = _inputs(arguments, max(arguments.batches), sequence, hidden=arguments.hidden)
    values, seq_lens = inputs.values.to(arguments.device), inputs.seq_lens.to(arguments.device)
    budget = safe_budget(sequence, seq_lens.shape[1], arguments.alignment)
    layout = aligned_layout(seq_lens, sequence_length=sequence, alignment=arguments.alignment, budget=budget)
    packed = layout.pack(values)
    pack = _compiled(lambda values: layout.pack(values), dynamic=False)
    restore = _compiled(lambda values: layout.restore(values), dynamic=False)
    row_bytes = values.shape[-1] * values.element_size()
    real = int((layout.source_indices >= 0).sum())  # bytes moved: every output row written, every real token read
    measured = {
        "clone": (_median_ms(values.clone, arguments.repeats, arguments.device), 2 * values.numel() * 4),
        "pack": (
            _median_ms(lambda: pack(values), arguments.repeats, arguments.device),
            (values.shape[0] * budget + real) * row_bytes,
        ),
        "restore": (
            _median_ms(lambda: restore(packed), arguments.repeats, arguments.device),
            (values.shape[0] * sequence + real) * row_bytes,
        ),
    }
    rates = {name: moved / (ms * 1e-3) / 1e9 for name, (ms, moved) in measured.items()}
    entry = {name: {"ms": ms, "GB/s": rates[name]} for name, (ms, _) in measured.items()}
    for name in ("pack", "restore"):
        entry[name]["fraction_of_clone_bandwidth"] = rates[name] / rates["clone"]
    entry["meets_target"] = entry["pack"]["fraction_of_clone_bandwidth"] >= BANDWIDTH_TARGET
    print(f"bandwidth S={sequence:<6} {entry}", flush=True)
    return {str(sequence): entry}


def _upstream_pairs(arguments, inputs) -> dict[str, tuple[str, Callable[[], object]]]:
    """Label to (catalog name, upstream eager call) on the same inputs."""
    from nemo_automodel.components.datasets import packed_seq
    from nemo_automodel.components.datasets import packing as upstream
    from nemo_automodel.components.models.deepseek_v41.packing import packed_layout

    mask, seq_lens = inputs.document_ids.to(arguments.device), inputs.seq_lens.to(arguments.device)
    values = inputs.values.to(arguments.device)
    shape = tuple(mask.shape)

    def layout():
        return packed_layout(seq_lens, seq_lens_padded=None, input_shape=shape, alignment=arguments.alignment)

    upstream_layout = layout()
    return {
        "varlen_metadata vs get_unpad_data": ("varlen_metadata", lambda: upstream.get_unpad_data(mask)),
        "batch_metadata vs build_packed_sequence_metadata": (
            "batch_metadata",
            lambda: upstream.build_packed_sequence_metadata(mask),
        ),
        "aligned_layout vs packed_layout": ("aligned_layout", layout),
        "pack vs upstream pack": ("pack", lambda: upstream_layout.pack(values)),
        "physical_varlen_metadata vs packed_seq_params_from_doc_ids": (
            "physical_varlen_metadata",
            lambda: packed_seq.packed_seq_params_from_doc_ids(mask),
        ),
    }


def section_upstream(run: Run) -> dict:
    from scripts.catalog import catalog

    try:
        import nemo_automodel.components.datasets.packed_seq
        import nemo_automodel.components.datasets.packing
        import nemo_automodel.components.models.deepseek_v41.packing  # noqa: F401
    except ImportError as error:
        return {"skipped": f"upstream not importable ({error}): pip install --no-deps nemo-automodel==0.7.0"}
    arguments = run.arguments
    sequence = arguments.codegen_sequence
    inputs = _inputs(arguments, max(arguments.batches), sequence, hidden=arguments.hidden)
    entries = catalog(inputs, alignment=arguments.alignment)
    result = {}
    for label, (name, reference) in _upstream_pairs(arguments, inputs).items():
        if run.over_budget(f"upstream {label}"):
            continue
        entry = entries[name].to(arguments.device)
        compiled = _compiled(entry.function, dynamic=False)
        ours = _median_ms(lambda c=compiled, a=entry.args: c(*a), arguments.repeats, arguments.device)
        theirs = _median_ms(reference, arguments.repeats, arguments.device)
        result[f"{label}@{sequence}"] = {
            "packfn_compiled_ms": ours,
            "upstream_eager_ms": theirs,
            "speedup": theirs / ours,
        }
        print(f"upstream S={sequence:<6} {label:<58} x{theirs / ours:8.1f}", flush=True)
    return result


def section_model(run: Run) -> dict:
    import copy

    from torch._dynamo.utils import counters

    from examples.packed_decoder import DecoderConfig, PackedDecoder, packed_loss
    from scripts.batches import make_batches
    from scripts.upstream import upstream_available, upstream_loss

    arguments = run.arguments
    # Batches from packfn's packer: the model's static budgets are the packer's (no worst-case padding).
    batches = make_batches(
        arguments.model_steps,
        batch=arguments.model_batch,
        sequence=arguments.model_sequence,
        mean=arguments.mean,
        vocab=256,
        alignment=16,
        max_documents=MODEL_MAX_DOCUMENTS,
        device=arguments.device,
    )
    config = DecoderConfig(
        sequence=arguments.model_sequence,
        max_documents=MODEL_MAX_DOCUMENTS,
        budget=batches[0].packed.budget,
        hidden=arguments.model_hidden,
        layers=arguments.model_layers,
        heads=max(1, arguments.model_hidden // 64),
        alignment=16,
        attention=arguments.attention,
    )
    torch.manual_seed(0)
    model = PackedDecoder(config).to(arguments.device)
    reference = copy.deepcopy(model)
    counters.clear()
    compiled = torch.compile(packed_loss, mode="reduce-overhead", fullgraph=True)

    def train(model, loss_function, mark_steps: bool) -> tuple[list[float], list[float]]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=arguments.device == "cuda")
        seconds, losses = [], []
        for batch in batches:
            if mark_steps:
                torch.compiler.cudagraph_mark_step_begin()
            synchronize(arguments.device)
            begin = time.perf_counter()
            loss = loss_function(model, batch.input_ids, batch.document_ids, batch.labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            synchronize(arguments.device)
            seconds.append(time.perf_counter() - begin)
        return seconds, losses

    seconds, losses = train(model, compiled, mark_steps=True)
    result = {
        "config": {
            k: getattr(config, k) for k in ("sequence", "max_documents", "length", "hidden", "layers", "attention")
        },
        "budget_fill": sum(batch.num_tokens for batch in batches)
        / (len(batches) * arguments.model_batch * config.length),
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": sum(counters["inductor"].get(key, 0) for key in ("cudagraph_skips",)),
        "step_ms": [s * 1e3 for s in seconds],
        "median_step_ms": statistics.median(seconds[2:] or seconds) * 1e3,
        "losses": losses,
    }
    if result["graph_breaks"]:
        run.failures.append(f"model: {result['graph_breaks']} graph breaks")
    if upstream_available():
        # Upstream's rows at the packer's budget (packed_layout's minimum_length): the same area as packfn's.
        upstream_loss_function = functools.partial(upstream_loss, minimum_length=config.length)
        upstream_seconds, upstream_losses = train(reference, upstream_loss_function, mark_steps=False)
        result["upstream_eager_median_step_ms"] = statistics.median(upstream_seconds[1:]) * 1e3
        result["first_step_loss_difference"] = abs(losses[0] - upstream_losses[0])
    print(f"model    {result}", flush=True)
    return result


SECTION_FUNCTIONS = {
    "correctness": section_correctness,
    "codegen": section_codegen,
    "sync": section_sync,
    "bandwidth": section_bandwidth,
    "upstream": section_upstream,
    "model": section_model,
}


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    arguments = parse_args(argv)
    if arguments.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available (torch "
            f"{torch.__version__}); nothing to check on this machine. Run it where a GPU is lent.",
            file=sys.stderr,
        )
        return 2
    run = Run(arguments)
    summary = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if arguments.device == "cuda" else platform.processor() or "cpu",
        "arguments": {key: str(value) for key, value in vars(arguments).items()},
        "sections": {},
    }
    for name in arguments.sections:  # in the order given: the budget skips the last ones
        if run.over_budget(f"section {name}"):
            summary["sections"][name] = {"skipped": f"budget of {arguments.budget:.0f} s spent"}
            continue
        print(f"== {name} ({run.elapsed:.0f} s in) ==", flush=True)
        try:
            summary["sections"][name] = SECTION_FUNCTIONS[name](run)
        except Exception as error:  # record and go on: one failed section must not hide the others
            summary["sections"][name] = {"error": repr(error), "traceback": traceback.format_exc()[-4000:]}
            run.failures.append(f"section {name}: {type(error).__name__}: {_first_line(error)}")
            print(f"{name} FAILED: {error!r}", flush=True)
        torch._dynamo.reset()
    summary["seconds"] = run.elapsed
    summary["failures"] = run.failures
    summary["skipped"] = run.skipped
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {arguments.json} after {summary['seconds']:.0f} s", flush=True)
    if run.skipped:
        print(f"skipped past the budget: {len(run.skipped)} ({', '.join(run.skipped[:5])}, ...)", flush=True)
    for failure in run.failures:
        print(f"FAILED {failure}", flush=True)
    return 1 if run.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
