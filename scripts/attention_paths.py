"""The main job's attention paths (``--attention``): what each pipeline feeds one kernel from, and its loss.

``scripts/main_job.py`` trains the same model by three pipelines on one
attention kernel, chosen by ``--attention``: ``dense`` (SDPA over a bool
block-causal mask), ``varlen`` (``torch.nn.attention.varlen.varlen_attn``
over the unpadded tokens) or ``flex`` (FlexAttention over a document
``BlockMask``). This module builds each pipeline's inputs for that kernel
(packfn's from its static ops inside the compiled step, upstream's from NeMo
AutoModel's helpers) and the loss functions the drivers call; the main
job's docstring says what each path runs and why ``varlen`` is the CUDA
default.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from packfn import document_block_mask, packed_position_ids, pad, unpad, varlen_metadata

from examples.packed_decoder import (
    IGNORE_INDEX,
    PackedDecoder,
    _rotate,
    lengths_from_boundaries,
    packed_loss,
)
from scripts.upstream import upstream_loss_function

__all__ = [
    "ATTENTIONS",
    "ATTENTION_LINES",
    "CUDA_GRAPHS",
    "FLEX_BLOCK_SIZE",
    "GPU_ATTENTION",
    "UPSTREAM_HELPERS",
    "TokenStream",
    "attention_error",
    "compiled_flex_functions",
    "decode_with",
    "document_causal_mask_mod",
    "packfn_loss_function",
    "packfn_token_stream",
    "precision",
    "upstream_block_mask",
    "upstream_loss_for",
    "upstream_token_stream",
    "varlen_attend",
]

ATTENTIONS = ("dense", "varlen", "flex")
GPU_ATTENTION = "varlen"  # --attention's default on CUDA (the module docstring says why); the CPU's is "dense"
FLEX_BLOCK_SIZE = 128  # FlexAttention's query and key block (NOTE [FlexAttention in the main job])
# packfn's step on CUDA: the Inductor options torch.compile(mode="reduce-overhead") stands for ({"triton.cudagraphs":
# True}), applied as a config patch because the step's backend is the counting Inductor (a backend takes no mode).
CUDA_GRAPHS = torch._inductor.list_mode_options("reduce-overhead")
ATTENTION_LINES = {
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
UPSTREAM_HELPERS = {
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
def compiled_flex_functions() -> tuple[Callable[..., torch.Tensor], Callable[..., BlockMask]]:
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
    attend_with, build = compiled_flex_functions() if compiled_flex else (flex_attention, create_block_mask)

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
