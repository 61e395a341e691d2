"""GPU checks of SPEC section 6, prepared for a lent CUDA GPU (one short run, under five minutes).

Sections, run in the order ``--sections`` names them (a section that would
start past ``--budget`` seconds is skipped and says so in the summary):

1. ``codegen``: each static op compiled (``fullgraph=True``, ``dynamic=False``)
   through ``torch._inductor.utils.run_and_get_code``: Triton kernel
   definitions (``@triton.jit``) and launches (``<kernel>.run(``) in the
   output code, aten / extern fallbacks, and no call back into ``packfn``.
   Target: at most 2 kernels per static metadata op.
2. ``compiled``: every static op compiled with static and with dynamic
   shapes at two sequence lengths (``--compiled-sequences``, batch 3), and the
   backward of ``pack``, ``restore`` and ``unpad``, each against eager on the
   device: Inductor's Triton code paths are not the CPU's C++ ones (NOTE
   [One flat search] in ``packfn/_ops/metadata.py``).
3. ``sync``: ``torch.cuda.set_sync_debug_mode("error")`` around the static
   path, eager and compiled: any host sync raises and is recorded.
4. ``bandwidth``: compiled ``pack`` / ``restore`` against ``values.clone()``
   (``[batch, sequence, hidden]`` float32), GB/s of bytes read and written.
   Target: pack at 80% of copy bandwidth.
5. ``upstream``: the compiled static ops against NeMo AutoModel's eager
   helpers on the same inputs (CUDA-event medians).
6. ``model``: the example model (``examples/packed_decoder.py``) trained a few
   steps under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), with
   CUDA-graph skips counted, against the same model driven by upstream eagerly.

Writes a JSON summary (``--json``). Uses no API newer than torch 2.11.
Without CUDA it parses its arguments and exits with a message (status 2).
``--device cpu`` walks every section on the CPU at whatever sizes are given
(wall-clock timings, C++ kernels, no sync check): the tests use it so that
the script cannot rot between the sessions that are lent a GPU.

    python scripts/gpu_check.py --json gpu_check.json
    python scripts/gpu_check.py --sequences 4096 --sections codegen sync
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import functools
import json
import platform
import re
import statistics
import time
import traceback
from collections.abc import Callable

import torch

from scripts.measure import synchronize

SECTIONS = ("codegen", "compiled", "sync", "bandwidth", "upstream", "model")
METADATA_OPS = ("varlen_metadata", "batch_metadata", "flatten_metadata")
MODEL_MAX_DOCUMENTS = 16
KERNEL_TARGET = 2
BANDWIDTH_TARGET = 0.8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, nargs="+", default=[32768], help="sequence lengths (SPEC: 32768)")
    parser.add_argument("--mask-sequence", type=int, default=4096, help="sequence for the dense block-causal mask")
    parser.add_argument("--mean", type=int, default=300, help="mean document length")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="activation width for pack / restore")
    parser.add_argument("--alignment", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--compiled-sequences", type=int, nargs=2, default=[4096, 2944])
    parser.add_argument("--model-sequence", type=int, default=2048)
    parser.add_argument("--model-batch", type=int, default=4)
    parser.add_argument("--model-hidden", type=int, default=256)
    parser.add_argument("--model-layers", type=int, default=2)
    parser.add_argument("--model-steps", type=int, default=6)
    parser.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa", help="attention of the model")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds; later sections are skipped past it")
    parser.add_argument("--json", type=Path, default=Path("bench_results/gpu_check.json"))
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script itself")
    arguments = parser.parse_args(argv)
    for name in ("batch", "hidden", "alignment", "repeats", "mean", "model_steps"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return arguments


# ------------------------------------------------------------------ helpers


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


_LAUNCH = re.compile(r"\b(triton_\w+)\.run\(|\b(cpp_fused_\w+)\(")


def count_kernels(codes: list[str]) -> dict[str, object]:
    """Triton definitions and kernel launches (C++ ones on the CPU), fallbacks and packfn calls in Inductor's code."""
    text = "\n".join(codes)
    return {
        "triton_jit_definitions": text.count("@triton.jit"),
        "kernel_launches": len(_LAUNCH.findall(text)),
        "extern_calls": len(re.findall(r"\bextern_kernels\.\w+\(", text)),
        "aten_calls": sorted(set(re.findall(r"\btorch\.ops\.aten\.(\w+)", text))),
        "packfn_calls": text.count("torch.ops.packfn") + text.count("packfn::"),
    }


def static_ops(inputs, alignment: int) -> dict[str, tuple[Callable[..., object], tuple]]:
    """Name to ``(function, args)`` for every static op, on ``inputs`` (scripts/benchmarks/common.Inputs)."""
    import packfn
    from packfn import aligned_layout, document_block_mask, physical_varlen_metadata, safe_budget, unpad

    mask, seq_lens, capacity = inputs.document_ids, inputs.seq_lens, inputs.max_documents
    sequence = mask.shape[1]
    budget = safe_budget(sequence, seq_lens.shape[1], alignment)
    narrow = packfn.batch_metadata(mask, max_documents=capacity)

    def layout_of(seq_lens):
        return aligned_layout(seq_lens, sequence_length=sequence, alignment=alignment, budget=budget)

    return {
        **format_ops(mask, capacity),
        "varlen_metadata": (lambda mask: packfn.varlen_metadata(mask, max_documents=capacity), (mask,)),
        "batch_metadata": (lambda mask: packfn.batch_metadata(mask, max_documents=capacity), (mask,)),
        "flatten_metadata": (packfn.flatten_metadata, (narrow.packed_token_indices, narrow.cu_seqlens)),
        "aligned_layout": (layout_of, (seq_lens,)),
        "pack": (lambda seq_lens, values: layout_of(seq_lens).pack(values), (seq_lens, inputs.values)),
        "physical_varlen_metadata": (physical_varlen_metadata, (mask,)),
        "document_block_mask": (lambda mask: document_block_mask(mask).kv_num_blocks, (mask,)),
        "unpad": (
            lambda mask, values: unpad(values, packfn.varlen_metadata(mask, max_documents=capacity)),
            (mask, inputs.values),
        ),
    }


def format_ops(mask: torch.Tensor, capacity: int) -> dict[str, tuple[Callable[..., object], tuple]]:
    """The format conversions (``packfn.formats``) on one packed batch in each format, and back."""
    import packfn

    batch, sequence = mask.shape
    valid = mask > 0
    positions = packfn.packed_position_ids(mask)
    ends = valid & (mask != torch.nn.functional.pad(mask, (0, 1))[:, 1:])
    tokens = torch.where(ends, 0, 1 + torch.arange(sequence, device=mask.device) % 1000).masked_fill(~valid, 1001)
    flat = packfn.physical_varlen_metadata(mask).cu_seqlens
    rows = packfn.batch_metadata(mask, max_documents=capacity).cu_seqlens
    seq_lens = packfn.seq_lens_from_document_ids(mask, max_documents=capacity)
    return {
        "packed_position_ids": (packfn.packed_position_ids, (mask,)),
        "document_ids_from_position_ids": (
            lambda positions, valid: packfn.document_ids_from_position_ids(positions, attention_mask=valid),
            (positions, valid),
        ),
        "document_ids_from_eos": (lambda tokens: packfn.document_ids_from_eos(tokens, 0, pad_token_id=1001), (tokens,)),
        "document_ids_from_seq_lens": (
            lambda seq_lens: packfn.document_ids_from_seq_lens(seq_lens, sequence),
            (seq_lens,),
        ),
        "document_ids_from_cu_seqlens": (lambda rows: packfn.document_ids_from_cu_seqlens(rows, sequence), (rows,)),
        "document_ids_from_cu_seqlens_flat": (
            lambda flat, valid: packfn.document_ids_from_cu_seqlens(flat, sequence, batch=batch, attention_mask=valid),
            (flat, valid),
        ),
        "seq_idx_round_trip": (
            lambda mask: packfn.document_ids_from_seq_idx(packfn.seq_idx_from_document_ids(mask), pad_index=-1),
            (mask,),
        ),
        "thd_metadata": (lambda mask: packfn.thd_metadata(mask, max_documents=capacity), (mask,)),
    }


def _mask_op(mask_inputs):
    from packfn import block_causal_mask

    return "block_causal_mask", (block_causal_mask, (mask_inputs.document_ids,))


# ----------------------------------------------------------------- sections


def section_codegen(arguments, inputs_by_sequence, mask_inputs) -> dict:
    from torch._inductor.utils import run_and_get_code

    result = {}
    for sequence, inputs in inputs_by_sequence.items():
        ops = static_ops(inputs, arguments.alignment)
        ops.update([_mask_op(mask_inputs)] if sequence == max(inputs_by_sequence) else [])
        for name, (function, args) in ops.items():
            compiled = torch.compile(function, fullgraph=True, dynamic=False)
            _, codes = run_and_get_code(compiled, *args)
            counts = count_kernels(codes)
            if name in METADATA_OPS:
                counts["target_max_kernels"] = KERNEL_TARGET
                counts["meets_target"] = counts["kernel_launches"] <= KERNEL_TARGET
            result[f"{name}@{sequence if name != 'block_causal_mask' else arguments.mask_sequence}"] = counts
            print(f"codegen  {name:<26} S={sequence:<6} {counts}", flush=True)
    return result


def section_sync(arguments, inputs_by_sequence, mask_inputs) -> dict:
    if arguments.device != "cuda":
        return {"skipped": "torch.cuda.set_sync_debug_mode needs CUDA"}
    result = {}
    inputs = inputs_by_sequence[max(inputs_by_sequence)]
    ops = static_ops(inputs, arguments.alignment)
    ops.update([_mask_op(mask_inputs)])
    for mode in ("eager", "compiled"):
        for name, (function, args) in ops.items():
            runner = torch.compile(function, fullgraph=True, dynamic=False) if mode == "compiled" else function
            runner(*args)  # compile (or warm) outside the checked region
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                runner(*args)
                outcome = "no sync"
            except RuntimeError as error:
                outcome = f"SYNC: {str(error).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            result[f"{mode}:{name}"] = outcome
            print(f"sync     {mode:<9} {name:<26} {outcome}", flush=True)
    return result


def _leaves(value) -> list:
    """Tensors and plain values of ``value``, looking inside dataclasses (layouts) and pytrees."""
    if dataclasses.is_dataclass(value):
        return _leaves([getattr(value, field.name) for field in dataclasses.fields(value)])
    leaves = torch.utils._pytree.tree_leaves(value)
    return leaves if leaves == [value] else [leaf for item in leaves for leaf in _leaves(item)]


def _same(got, want) -> bool:
    got, want = _leaves(got), _leaves(want)
    return len(got) == len(want) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, want, strict=True)
    )


def _gradient_of(function, values: torch.Tensor, args: tuple) -> torch.Tensor:
    values = values.detach().requires_grad_(True)
    out = function(*args, values)
    weights = torch.arange(out.numel(), device=out.device, dtype=out.dtype).reshape(out.shape).sin()
    (out * weights).sum().backward()
    return values.grad


def section_compiled(arguments, inputs_by_sequence, mask_inputs) -> dict:
    import packfn
    from packfn import aligned_layout, block_causal_mask, safe_budget, unpad

    from scripts.benchmarks.common import make_inputs

    result = {}
    sizes = [
        make_inputs(sequence, arguments.mean, batch=3, device=arguments.device, hidden=64)
        for sequence in arguments.compiled_sequences
    ]
    for dynamic in (False, True):
        for inputs in sizes:
            ops = static_ops(inputs, arguments.alignment)
            ops["block_causal_mask"] = (block_causal_mask, (inputs.document_ids,))
            for name, (function, args) in ops.items():
                key = f"{name}@{inputs.sequence}:{'dynamic' if dynamic else 'static'}"
                try:
                    runner = torch.compile(function, fullgraph=True, dynamic=dynamic)
                    result[key] = "ok" if _same(runner(*args), function(*args)) else "MISMATCH"
                except Exception as error:  # record and go on
                    result[key] = f"ERROR {type(error).__name__}: {str(error)[:600]}"
                print(f"compiled {key:<40} {result[key][:200]}", flush=True)
    # Backward at batch > 1 through the differentiable ops.
    inputs = sizes[0]
    layout = aligned_layout(
        inputs.seq_lens,
        sequence_length=inputs.sequence,
        alignment=arguments.alignment,
        budget=safe_budget(inputs.sequence, inputs.seq_lens.shape[1], arguments.alignment),
    )
    metadata = packfn.varlen_metadata(inputs.document_ids, max_documents=inputs.max_documents)
    packed = layout.pack(inputs.values)
    backward = {
        "pack": (lambda values: layout.pack(values), inputs.values),
        "restore": (lambda values: layout.restore(values), packed),
        "unpad": (lambda values: unpad(values, metadata), inputs.values),
    }
    for name, (function, values) in backward.items():
        key = f"backward:{name}@{inputs.sequence}"
        try:
            runner = torch.compile(function, fullgraph=True)
            same = torch.equal(_gradient_of(runner, values, ()), _gradient_of(function, values, ()))
            result[key] = "ok" if same else "MISMATCH"
        except Exception as error:
            result[key] = f"ERROR {type(error).__name__}: {str(error)[:600]}"
        print(f"compiled {key:<40} {result[key][:200]}", flush=True)
    result["all_ok"] = all(value == "ok" for value in result.values())
    return result


def _bandwidth(arguments, sequence: int, inputs) -> dict:
    from packfn import aligned_layout, safe_budget

    values, seq_lens = inputs.values, inputs.seq_lens
    budget = safe_budget(sequence, seq_lens.shape[1], arguments.alignment)
    layout = aligned_layout(seq_lens, sequence_length=sequence, alignment=arguments.alignment, budget=budget)
    packed = layout.pack(values)
    pack = torch.compile(lambda values: layout.pack(values), fullgraph=True, dynamic=False)
    restore = torch.compile(lambda values: layout.restore(values), fullgraph=True, dynamic=False)
    row_bytes = values.shape[-1] * values.element_size()
    # Bytes moved: every output row written, every real token read once.
    real = int((layout.source_indices >= 0).sum())
    measured = {
        "clone": (
            _median_ms(values.clone, arguments.repeats, arguments.device),
            2 * values.numel() * values.element_size(),
        ),
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
    return entry


def section_bandwidth(arguments, inputs_by_sequence, mask_inputs) -> dict:
    result = {}
    for sequence, inputs in inputs_by_sequence.items():
        result[str(sequence)] = _bandwidth(arguments, sequence, inputs)
        print(f"bandwidth S={sequence:<6} {result[str(sequence)]}", flush=True)
    return result


def _upstream_pairs(arguments, inputs) -> dict[str, tuple[str, Callable[[], object]]]:
    """Label to (static op name, upstream eager call) on the same inputs."""
    from nemo_automodel.components.datasets import packed_seq
    from nemo_automodel.components.datasets import packing as upstream
    from nemo_automodel.components.models.deepseek_v41.packing import packed_layout

    mask, seq_lens = inputs.document_ids, inputs.seq_lens
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
        "pack vs upstream pack": ("pack", lambda: upstream_layout.pack(inputs.values)),
        "physical_varlen_metadata vs packed_seq_params_from_doc_ids": (
            "physical_varlen_metadata",
            lambda: packed_seq.packed_seq_params_from_doc_ids(mask),
        ),
    }


def section_upstream(arguments, inputs_by_sequence, mask_inputs) -> dict:
    try:
        import nemo_automodel.components.datasets.packed_seq
        import nemo_automodel.components.datasets.packing
        import nemo_automodel.components.models.deepseek_v41.packing  # noqa: F401
    except ImportError as error:
        return {"skipped": f"upstream not importable ({error}): pip install --no-deps nemo-automodel==0.7.0"}
    result = {}
    for sequence, inputs in inputs_by_sequence.items():
        ops = static_ops(inputs, arguments.alignment)
        for label, (name, reference) in _upstream_pairs(arguments, inputs).items():
            function, args = ops[name]
            compiled = torch.compile(function, fullgraph=True, dynamic=False)
            ours = _median_ms(lambda compiled=compiled, args=args: compiled(*args), arguments.repeats, arguments.device)
            theirs = _median_ms(reference, arguments.repeats, arguments.device)
            result[f"{label}@{sequence}"] = {
                "packfn_compiled_ms": ours,
                "upstream_eager_ms": theirs,
                "speedup": theirs / ours,
            }
            print(f"upstream S={sequence:<6} {label:<58} x{theirs / ours:8.1f}", flush=True)
    return result


def section_model(arguments, inputs_by_sequence, mask_inputs) -> dict:
    import copy

    from torch._dynamo.utils import counters

    from examples.packed_decoder import DecoderConfig, PackedDecoder, packed_loss
    from scripts.batches import make_batches
    from scripts.upstream import upstream_available, upstream_loss

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
    if upstream_available():
        # Upstream's rows at the packer's budget (packed_layout's minimum_length): the same area as packfn's.
        upstream_loss_function = functools.partial(upstream_loss, minimum_length=config.length)
        upstream_seconds, upstream_losses = train(reference, upstream_loss_function, mark_steps=False)
        result["upstream_eager_median_step_ms"] = statistics.median(upstream_seconds[1:]) * 1e3
        result["first_step_loss_difference"] = abs(losses[0] - upstream_losses[0])
    print(f"model    {result}", flush=True)
    return result


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
    from scripts.benchmarks.common import make_inputs

    started = time.perf_counter()
    inputs_by_sequence = {
        sequence: make_inputs(
            sequence, arguments.mean, batch=arguments.batch, device=arguments.device, hidden=arguments.hidden
        )
        for sequence in arguments.sequences
    }
    mask_inputs = make_inputs(arguments.mask_sequence, arguments.mean, batch=arguments.batch, device=arguments.device)
    summary = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if arguments.device == "cuda" else platform.processor() or "cpu",
        "arguments": {key: str(value) for key, value in vars(arguments).items()},
        "sections": {},
    }
    functions = {
        "codegen": section_codegen,
        "compiled": section_compiled,
        "sync": section_sync,
        "bandwidth": section_bandwidth,
        "upstream": section_upstream,
        "model": section_model,
    }
    for name in arguments.sections:  # in the order given: the budget skips the last ones
        elapsed = time.perf_counter() - started
        if elapsed > arguments.budget:
            summary["sections"][name] = {"skipped": f"budget of {arguments.budget:.0f} s spent ({elapsed:.0f} s)"}
            continue
        print(f"== {name} ({elapsed:.0f} s in) ==", flush=True)
        try:
            summary["sections"][name] = functions[name](arguments, inputs_by_sequence, mask_inputs)
        except Exception as error:  # record and go on: one failed section must not hide the others
            summary["sections"][name] = {"error": repr(error), "traceback": traceback.format_exc()[-4000:]}
            print(f"{name} FAILED: {error!r}", flush=True)
        torch._dynamo.reset()
    summary["seconds"] = time.perf_counter() - started
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {arguments.json} after {summary['seconds']:.0f} s", flush=True)
    return 1 if any("error" in section for section in summary["sections"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
