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
  NOTE [FlexAttention in the main job] gives its block size, BlockMask
  reuse and compile options. Training needs CUDA (torch 2.13 has no
  FlexAttention backward on the CPU).

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
import functools
import importlib.util
import inspect
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from packfn import document_block_mask, packed_position_ids, pad, safe_budget, unpad, varlen_metadata

from examples.packed_decoder import (
    IGNORE_INDEX,
    DecoderConfig,
    PackedDecoder,
    _rotate,
    lengths_from_boundaries,
    packed_loss,
)
from scripts.batches import Batch, add_model_arguments, decoder_config, loader_batches, pieces
from scripts.corpus import add_data_argument, documents_source, training_documents
from scripts.measure import CountingInductor, graph_breaks, graph_breaks_since, synchronize
from scripts.upstream import neat_packing, neat_packing_batches, upstream_available, upstream_loss_function

__all__ = [
    "ATTENTIONS",
    "GPU_ATTENTION",
    "Driver",
    "MainJobReport",
    "Pipelines",
    "Progress",
    "TokenStream",
    "TraceSummary",
    "attention_error",
    "decode_with",
    "main",
    "make_pipelines",
    "packfn_loss_function",
    "packfn_token_stream",
    "parse_args",
    "plot_summary",
    "precision",
    "run",
    "summarize_trace",
    "time_upstream_helpers",
    "upstream_block_mask",
    "upstream_loss_for",
    "upstream_token_stream",
    "varlen_attend",
]

# Each Inductor C++ kernel a named event in the trace (both compiled drivers are compiled with it).
KERNEL_PROFILE = {"cpp.enable_kernel_profile": True}
PACKFN = "packfn compiled"
PLOT_INSTALL = "pip install -e '.[profile]'"
UPSTREAM_EAGER = "upstream eager"
UPSTREAM_COMPILED = "upstream compiled"
_TITLES = {
    UPSTREAM_EAGER: "upstream eager",
    UPSTREAM_COMPILED: "upstream torch.compile",
    PACKFN: "packfn torch.compile(fullgraph=True)",
}


# ---------------------------------------------------------------- attention paths (--attention)

ATTENTIONS = ("dense", "varlen", "flex")
GPU_ATTENTION = "varlen"  # --attention's default on CUDA (the module docstring says why); the CPU's is "dense"
FLEX_BLOCK_SIZE = 128  # FlexAttention's query and key block (NOTE [FlexAttention in the main job])
# packfn's step on CUDA: the Inductor options torch.compile(mode="reduce-overhead") stands for ({"triton.cudagraphs":
# True}), applied as a config patch because the step's backend is the counting Inductor (a backend takes no mode).
CUDA_GRAPHS = torch._inductor.list_mode_options("reduce-overhead")
_ATTENTION_LINES = {
    "dense": "SDPA over a dense bool block-causal mask [batch, 1, rows, rows]",
    "varlen": (
        "torch.nn.attention.varlen.varlen_attn over the unpadded tokens (packfn: varlen_metadata, unpad / pad, "
        "its longest document bounded statically by the sequence; upstream: get_unpad_data, its max_seqlen read "
        "on the host)"
    ),
    "flex": (
        f"FlexAttention with one document BlockMask of {FLEX_BLOCK_SIZE}-token blocks a step, shared by every "
        "layer (packfn: document_block_mask inside the compiled step; upstream: create_block_mask over a document "
        "mask_mod and flex_attention, each torch.compile'd, as torchtitan does)"
    ),
}
_UPSTREAM_HELPERS = {
    "dense": "build_packed_sequence_metadata, packed_layout, get_unpad_data",
    "flex": "build_packed_sequence_metadata, packed_layout, get_unpad_data, create_block_mask",
    "varlen": "get_unpad_data",
}

# NOTE [FlexAttention in the main job]
# Block size: 128 queries by 128 keys, create_block_mask's default and the tile of the Triton template the
# kernels run; the aligned rows' --alignment (16) need not match it: a block that straddles a document edge is
# a partial block, evaluated through mask_mod, and separate_full_blocks=True (both builders' default) keeps the
# full blocks apart so the kernel skips mask_mod there.
# BlockMask reuse: every layer attends over the same documents, so each step builds one BlockMask and hands it to
# every layer (packfn: document_block_mask of the layout's sequence_ids, from per-block first / last ids, inside
# the one compiled graph; upstream: create_block_mask evaluates mask_mod over the rows, once a step).
# Compile options: packfn's flex_attention is lowered by Inductor inside the compiled training step
# (fullgraph=True, default kernel options, CUDA graphs on CUDA); upstream compiles flex_attention and
# create_block_mask on their own (torch.compile, default mode), as torchtitan does. NeMo AutoModel's own
# FlexAttention module compiles with mode="max-autotune-no-cudagraphs"; neither side autotunes here, which would
# add minutes of compile to both. q and k leave RoPE in float32 (cos / sin are float32): decode_with casts them
# to the value's dtype (bf16 under autocast): every kernel here takes one dtype, and FlexAttention given float32
# queries would run its float32 kernel.


def precision(device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's precision: bf16 autocast on CUDA (the GPU default), nothing on the CPU (float32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _varlen_attn() -> Callable[..., torch.Tensor]:
    """torch's ``varlen_attn`` with ``window_size`` (torch 2.11 and later); ``RuntimeError`` naming the need else."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is None or "window_size" not in inspect.signature(varlen_attn).parameters:
        raise RuntimeError(
            "needs torch.nn.attention.varlen.varlen_attn with window_size (torch 2.11 or later); this is torch "
            f"{torch.__version__}"
        )
    return varlen_attn


def attention_error(attention: str, device: torch.device) -> str | None:
    """Why ``--attention`` cannot train on ``device``, or None when it can: its kernel's error on tiny inputs.

    ``dense`` always can. ``varlen`` runs ``varlen_attn`` (FlashAttention
    kernels: CUDA only, bf16 or fp16) forward and backward; ``flex`` runs
    ``flex_attention`` forward and backward eagerly (torch 2.13 has no
    FlexAttention backward on the CPU).
    """
    if attention == "dense":
        return None
    try:
        if attention == "varlen":
            kernel = _varlen_attn()
            values = torch.zeros(16, 1, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
            bounds = torch.tensor([0, 16], device=device, dtype=torch.int32)
            kernel(values, values, values, bounds, bounds, 16, 16, window_size=(-1, 0)).sum().backward()
        else:
            values = torch.zeros(1, 1, 16, 16, device=device, requires_grad=True)
            flex_attention(values, values, values).sum().backward()
    except (RuntimeError, NotImplementedError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"--attention {attention} cannot train on {device}: {type(error).__name__}: {first[:200]}"
    return None


class TokenStream(NamedTuple):
    """A batch's tokens as one unpadded stream ``[1, rows, ...]``, for :func:`decode_with` and :func:`varlen_attend`.

    ``pack`` moves ``[batch, sequence, ...]`` activations into the stream,
    ``restore`` takes the stream's ``[1, rows, ...]`` back to what the loss
    reads. For the example mask ``[[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]``
    both builders give ``cu_seqlens`` ``[0, 2, 5, 9]`` (packfn's then repeats
    9 to its fixed size) and positions ``[0, 1, 0, 1, 2, 0, 1, 2, 3]``.

    Attributes:
        indices: int64 ``[rows]``: each row's token in the flattened
            ``[batch * sequence]`` batch (packfn: valid tokens first, then padding).
        cu_seqlens: int32 document boundaries over the rows (packfn
            ``[batch * D + 1]``, upstream ``[documents + 1]``).
        max_seqlen: the kernel's bound of the longest document (packfn: the
            static ``sequence``; upstream: its host read).
        position_ids: int64 ``[1, rows]``: each token's position in its document.
        valid: bool ``[rows]``: the rows ``cu_seqlens`` covers, or None when
            it covers them all (packfn's fixed-size stream has a tail of padding).
    """

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    valid: torch.Tensor | None
    pack: Callable[[torch.Tensor], torch.Tensor]
    restore: Callable[[torch.Tensor], torch.Tensor]


def packfn_token_stream(document_ids: torch.Tensor, max_documents: int) -> TokenStream:
    """packfn's stream: :func:`packfn.varlen_metadata` at the packer's cap, :func:`packfn.unpad` / :func:`packfn.pad`.

    Every shape is fixed (``batch * sequence`` rows, ``batch * D + 1``
    boundaries) and nothing is read on the host: the kernel's maximum is the
    static bound ``sequence``, which varlen kernels take as a grid size.
    """
    metadata = varlen_metadata(document_ids, max_documents=max_documents)
    rows = metadata.indices.numel()
    positions = unpad(packed_position_ids(document_ids), metadata)
    return TokenStream(
        indices=metadata.indices,
        cu_seqlens=metadata.cu_seqlens,
        max_seqlen=metadata.max_seqlen_bound,
        position_ids=positions.unsqueeze(0),
        valid=torch.arange(rows, device=document_ids.device) < metadata.num_tokens,
        pack=lambda values: unpad(values, metadata).unsqueeze(0),
        restore=lambda values: pad(values.squeeze(0), metadata),
    )


def upstream_token_stream(document_ids: torch.Tensor, unpad_data: Callable | None = None) -> TokenStream:
    """NeMo AutoModel's stream: ``get_unpad_data`` (a ``nonzero`` and a host read of ``max_seqlen``), then indexing.

    Its rows are exactly the batch's real tokens (a data-dependent count);
    positions restart at each of its ``cu_seqlens``; ``restore`` leaves the
    rows in stream order (the loss reads the labels at ``indices``).
    """
    if unpad_data is None:
        from nemo_automodel.components.datasets.packing import get_unpad_data as unpad_data
    indices, cu_seqlens, max_seqlen = unpad_data(document_ids)
    tokens = indices.numel()
    starts = cu_seqlens[:-1].long().repeat_interleave(cu_seqlens.diff().long(), output_size=tokens)
    positions = torch.arange(tokens, device=document_ids.device) - starts
    return TokenStream(
        indices=indices,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        position_ids=positions.unsqueeze(0),
        valid=None,
        pack=lambda values: values.flatten(0, 1)[indices].unsqueeze(0),
        restore=lambda values: values.squeeze(0),
    )


def varlen_attend(stream: TokenStream, kernel: Callable[..., torch.Tensor] | None = None) -> Callable[..., Any]:
    """Causal attention within each document of ``stream``: ``attend(query, key, value)``, ``[1, heads, rows, dim]``.

    ``kernel`` is ``varlen_attn`` (the default) or one of its signature.
    Rows past ``cu_seqlens[-1]`` (packfn's tail) are left unwritten by the
    kernel, forward and backward, and may hold anything: ``valid`` zeroes
    them in the output and stops their gradients at the inputs, so nothing
    of them reaches the weights' gradients.
    """
    kernel = kernel or _varlen_attn()
    keep = None if stream.valid is None else stream.valid[:, None, None]

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        query, key, value = (tensor.squeeze(0).transpose(0, 1) for tensor in (query, key, value))  # [rows, heads, dim]
        if keep is not None:
            query, key, value = (torch.where(keep, tensor, 0) for tensor in (query, key, value))
        bound = stream.max_seqlen
        attended = kernel(query, key, value, stream.cu_seqlens, stream.cu_seqlens, bound, bound, window_size=(-1, 0))
        if keep is not None:
            attended = torch.where(keep, attended, 0)
        return attended.transpose(0, 1).unsqueeze(0)

    return attend


def document_causal_mask_mod(sequence_ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A ``mask_mod``: query sees key when both are in the same document (id > 0) and the key is not after it."""

    def mask_mod(batch, head, query_index, key_index):
        document = sequence_ids[batch, query_index]
        return (document == sequence_ids[batch, key_index]) & (document > 0) & (key_index <= query_index)

    return mask_mod


def upstream_block_mask(sequence_ids: torch.Tensor, build: Callable[..., BlockMask] = create_block_mask) -> BlockMask:
    """Upstream's BlockMask of ``[batch, rows]`` sequence ids: ``create_block_mask`` over a document ``mask_mod``."""
    batch, rows = sequence_ids.shape
    mask_mod = document_causal_mask_mod(sequence_ids)
    return build(mask_mod, batch, None, rows, rows, device=sequence_ids.device, BLOCK_SIZE=FLEX_BLOCK_SIZE)


@functools.cache
def _compiled_flex() -> tuple[Callable[..., torch.Tensor], Callable[..., BlockMask]]:
    """``flex_attention`` and ``create_block_mask``, each under its own ``torch.compile`` (torchtitan's way)."""
    return torch.compile(flex_attention), torch.compile(create_block_mask)


def _block_with(block, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
    """One :class:`examples.packed_decoder.Block` over ``[batch, rows, hidden]``, its attention ``attend``."""
    batch, length, width = hidden.shape
    qkv = block.qkv(block.attention_norm(hidden)).view(batch, length, 3, block.heads, width // block.heads)
    query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, rows, head_dim]
    # RoPE runs in float32: back to the projection's dtype (bf16 under autocast), as the kernels take one dtype.
    query, key = _rotate(query, cos, sin).to(value.dtype), _rotate(key, cos, sin).to(value.dtype)
    attended = attend(query, key, value)
    hidden = hidden + block.out(attended.transpose(1, 2).reshape(batch, length, width))
    return hidden + block.down(F.gelu(block.up(block.mlp_norm(hidden))))


def decode_with(model: PackedDecoder, input_ids: torch.Tensor, layout, attend) -> torch.Tensor:
    """:meth:`PackedDecoder.decode` with the attention ``attend(query, key, value)`` over ``[batch, heads, rows, dim]``.

    ``layout`` is a :class:`packfn.PackedSequenceLayout` (aligned rows) or a
    :class:`TokenStream` (one unpadded row): its ``pack``, ``position_ids``
    and ``restore``. Returns the logits of ``restore``'s rows.
    """
    hidden = layout.pack(model.embed(input_ids))
    cos, sin = model.rotary(layout.position_ids)
    for block in model.blocks:
        hidden = _block_with(block, hidden, cos, sin, attend)
    return model.lm_head(model.norm(layout.restore(hidden)))


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``[..., vocab]`` logits against labels of the same rows (``IGNORE_INDEX`` skipped)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def packfn_loss_function(attention: str, *, varlen_kernel: Callable | None = None) -> Callable[..., torch.Tensor]:
    """packfn's loss ``loss(model, input_ids, document_ids, labels)`` for ``--attention``: static shapes, no host read.

    ``dense`` is :func:`examples.packed_decoder.packed_loss` (the model's own
    SDPA path); ``flex`` runs the aligned layout with
    :func:`packfn.document_block_mask`; ``varlen`` runs
    :func:`packfn_token_stream` through ``varlen_kernel`` (``varlen_attn``).
    """
    if attention == "dense":
        return packed_loss
    if attention == "flex":

        def flex_loss(model, input_ids, document_ids, labels):
            layout = model.layout(document_ids, None)
            mask = document_block_mask(layout.sequence_ids, block_size=FLEX_BLOCK_SIZE)  # one a step, every layer's
            return _token_loss(
                decode_with(model, input_ids, layout, functools.partial(flex_attention, block_mask=mask)), labels
            )

        return flex_loss
    kernel = varlen_kernel or _varlen_attn()

    def varlen_loss(model, input_ids, document_ids, labels):
        stream = packfn_token_stream(document_ids, model.config.max_documents)
        return _token_loss(decode_with(model, input_ids, stream, varlen_attend(stream, kernel)), labels)

    return varlen_loss


def upstream_loss_for(
    attention: str,
    *,
    minimum_length: int = 0,
    eager_helpers: bool = False,
    varlen_kernel: Callable | None = None,
    compiled_flex: bool = True,
) -> Callable[..., torch.Tensor]:
    """The example model's loss driven by NeMo AutoModel's helpers for ``--attention``.

    ``dense`` is :func:`scripts.upstream.upstream_loss_function`. ``flex``
    lays the rows out as it does (``build_packed_sequence_metadata``,
    ``packed_layout``) and builds the BlockMask with
    :func:`upstream_block_mask` (``compiled_flex``: ``create_block_mask`` and
    ``flex_attention`` each ``torch.compile``'d, as torchtitan does; else
    eager). ``varlen`` unpads with :func:`upstream_token_stream`. Both reduce
    over the tokens ``get_unpad_data`` lists; ``eager_helpers`` as
    :func:`scripts.upstream.upstream_loss_function`.
    """
    if attention == "dense":
        return upstream_loss_function(minimum_length=minimum_length, eager_helpers=eager_helpers)
    from nemo_automodel.components.datasets.packing import build_packed_sequence_metadata, get_unpad_data
    from nemo_automodel.components.models.deepseek_v41.packing import packed_layout

    helpers = (build_packed_sequence_metadata, packed_layout, get_unpad_data)
    if eager_helpers:
        helpers = tuple(torch.compiler.disable(helper) for helper in helpers)
    metadata_of, layout_of, unpad_data = helpers
    if attention == "varlen":
        kernel = varlen_kernel or _varlen_attn()

        def varlen_loss(model, input_ids, document_ids, labels):
            stream = upstream_token_stream(document_ids, unpad_data)
            logits = decode_with(model, input_ids, stream, varlen_attend(stream, kernel))
            return _token_loss(logits, labels.flatten()[stream.indices])

        return varlen_loss
    attend_with, build = _compiled_flex() if compiled_flex else (flex_attention, create_block_mask)

    def flex_loss(model, input_ids, document_ids, labels):
        metadata = metadata_of(document_ids)
        layout = layout_of(
            lengths_from_boundaries(metadata["cu_seqlens"]),
            seq_lens_padded=None,
            input_shape=tuple(document_ids.shape),
            alignment=model.config.alignment,
            minimum_length=minimum_length,
        )
        mask = upstream_block_mask(layout.sequence_ids, build)
        logits = decode_with(model, input_ids, layout, functools.partial(attend_with, block_mask=mask))
        indices, _, _ = unpad_data(document_ids)
        return _token_loss(logits.flatten(0, 1)[indices], labels.flatten()[indices])

    return flex_loss


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
            result.append(f"attention:    {self.attention}: {_ATTENTION_LINES[self.attention]}")
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
                f"              its helpers ({_UPSTREAM_HELPERS[self.attention]}) take "
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
        build = _compiled_flex()[1] if device.type == "cuda" else create_block_mask
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
