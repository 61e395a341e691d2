"""Hugging Face transformers: a packed batch as a model's keyword arguments, in one call.

:func:`hf_model_inputs` turns a document-id mask (the packing format of
:mod:`packfn.metadata`) into what a transformers causal LM needs to
treat every document as a sequence of its own: position ids that restart
per document (:func:`packfn.packed_position_ids`), the attention input of the
model's ``attn_implementation`` (looked up in packfn's one registry of
backends, :data:`packfn.ATTENTION_BACKENDS`), and labels that never ask a
document to predict the next one. The mask is checked and parsed once (NOTE [Check
once] in :mod:`packfn._ops.metadata`). It reads the model's config (attention backend, sliding
windows, layer types) and never imports transformers; under
``torch.compile(fullgraph=True)`` it adds no graph break and no host sync.

:func:`apply_packfn` patches a model in place (its ``forward`` only) so that
it takes a packed batch's ``document_ids`` and calls :func:`hf_model_inputs`
itself, inside the compiled forward; the model keeps its class, config and
state dict, so it saves and loads as the plain transformers model.
:class:`PackedCollator` pads rows of documents into static packed batches.
The Trainer's loader, checkpoints and logs are :mod:`packfn.integrations.trainer`.

NOTE [transformers' own packed path needs use_cache=False]
Given restarting ``position_ids`` and no ``attention_mask``, transformers
(``masking_utils.find_packed_sequence_indices``) builds document masks
itself, but only when ``past_key_values`` is None. A config's default
``use_cache=True`` makes the model create a cache even in ``train()`` mode,
so the detection is skipped and every token silently attends the earlier
documents of its row. packfn passes the mask explicitly, so ``use_cache``
does not matter (``tests/integrations/test_hf.py`` pins both facts).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from packfn._checks import check_int, check_mask, check_positive_int, check_scalar_fits, check_tensor
from packfn._ops import formats as _format_ops
from packfn._ops import masks as _mask_ops
from packfn._ops._registry import assert_rules
from packfn._ops.metadata import mask_rules
from packfn.attention import AttentionInputKind, attention_backend, attention_inputs, passthrough_inputs
from packfn.data.examples import token_tensor
from packfn.formats import IGNORE_INDEX, document_ids_from_seq_lens, ignore_first_tokens, shift_labels
from packfn.masks import additive_mask, check_window, checked_block_mask

__all__ = ["PackedCollator", "PackedForward", "apply_packfn", "causal_lm_labels", "hf_model_inputs"]


# Models whose use_bidirectional_attention=True makes every layer attend both
# ways, with sliding windows |dp| < w (Gemma3 text, EmbeddingGemma). On Gemma
# and Gemma2 the flag flips only the attention modules, not the masks, so a
# document run alone is causal on one backend and bidirectional on another.
_BIDIRECTIONAL_MODELS = ("gemma3_text", "step3p7")


@dataclass(frozen=True)
class _Attention:
    """What every layer of a model sees, read off its config.

    Attributes:
        causal: Keys after the query are hidden.
        inclusive: Bidirectional windows keep ``|dp| <= W`` (``is_causal=False``
            configs, transformers' ``create_bidirectional_sliding_window_mask``)
            rather than ``|dp| < W`` (Gemma3's bidirectional overlay).
        layers: ``(kind, size)`` per layer type (``None``: every layer, for a
            config without ``layer_types``); kind ``"full"``, ``"window"``
            (``size`` positions) or ``"chunk"`` (chunks of ``size`` positions).
    """

    causal: bool
    inclusive: bool
    layers: dict[str | None, tuple[str, int | None]]


def _attention(config: Any, window: Any, causal: bool | None) -> _Attention:
    """Read the config's attention flags and layer types (see docs/transformers.md), refusing what a mask cannot say."""
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be None or a bool, got {type(causal).__name__}")
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    bidirectional = getattr(text, "use_bidirectional_attention", None)
    model_type = getattr(text, "model_type", None)
    if getattr(text, "is_causal", True) is False:  # Gemma4 "all", or any config given is_causal=False
        inferred, inclusive = False, True
    elif bidirectional is True and model_type in _BIDIRECTIONAL_MODELS:
        inferred, inclusive = False, False
    elif bidirectional is True:
        raise ValueError(
            f"use_bidirectional_attention=True on model type {model_type!r} flips only its attention modules, "
            "not its masks, so a document alone attends one way on one backend and both ways on another; "
            "hf_model_inputs cannot give a mask that matches it"
        )
    else:  # None, False, "vision" (the text attends causally)
        inferred, inclusive = True, False
    causal = inferred if causal is None else causal
    if isinstance(window, str) and window == "config":
        window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        size = check_window(window, "sliding_window")
        return _Attention(causal, inclusive, {None: ("full", None) if size is None else ("window", size)})
    layers: dict[str | None, tuple[str, int | None]] = {}
    for layer_type in layer_types:
        if layer_type == "full_attention":
            layers[layer_type] = ("full", None)
        elif layer_type == "sliding_attention":
            layers[layer_type] = ("window", check_positive_int(window, "sliding_window"))
        elif layer_type == "chunked_attention" and causal:
            chunk = getattr(text, "attention_chunk_size", None)
            layers[layer_type] = ("chunk", check_positive_int(chunk, "attention_chunk_size"))
        else:
            supported = "'full_attention', 'sliding_attention' and (causal) 'chunked_attention'"
            raise ValueError(
                f"hf_model_inputs supports the layer types {supported}, got {layer_type!r} in config.layer_types"
            )
    return _Attention(causal, inclusive, layers)


def _check_backend(
    attention: _Attention, implementation: str, kind: AttentionInputKind, text: Any, sequence: int, labels: object
) -> None:
    """Refuse the combinations of backend, flags and shape that no input of hf_model_inputs can serve."""
    chunks = [size for layer, size in attention.layers.values() if layer == "chunk"]
    if kind == "block_mask" and (not attention.causal or chunks):
        raise ValueError(
            "hf_model_inputs builds causal, unchunked FlexAttention block masks only: use sdpa or eager for "
            "bidirectional attention (use_bidirectional_attention, is_causal=False) or chunked_attention layers"
        )
    # The kernel of a varlen or document-id backend takes one input for every layer, and applies windows itself.
    if kind in ("flash_varlen", "document_ids") and chunks and isinstance(sequence, int) and sequence > min(chunks):
        what = "set of cu_seq_lens" if kind == "flash_varlen" else "document-id mask"
        raise ValueError(
            f"{implementation} cannot restrict chunked_attention layers to chunks of {min(chunks)} positions "
            f"(one {what} serves every layer) and the rows hold {sequence}: use sdpa or eager"
        )
    floor = getattr(text, "floor_scale", None)
    tuning = getattr(text, "attn_temperature_tuning", False)
    if tuning and isinstance(floor, int) and isinstance(sequence, int) and sequence >= floor:
        raise ValueError(
            f"attn_temperature_tuning scales queries by their column in the row once it reaches floor_scale="
            f"{floor}, not by their position in the document, so packed rows of {sequence} differ from each "
            "document alone; set attn_temperature_tuning=False or pack rows shorter than floor_scale"
        )
    if labels is not None and not attention.causal:
        raise ValueError(
            "labels are shifted as a causal LM's next-token targets; with bidirectional attention build the "
            "targets yourself (padding: -100) and pass none"
        )


def _check_labels(labels: object) -> None:
    if isinstance(labels, torch.Tensor) and labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be an int32 or int64 tensor (they hold -100), got {labels.dtype}")


def _dense_mask(
    document_ids: torch.Tensor, positions: torch.Tensor, attention: _Attention, layer: tuple[str, int | None]
) -> torch.Tensor:
    """The document mask of one layer kind, bool ``[batch, 1, sequence, sequence]``.

    Windows and chunks count position ids, not columns, so padding inside a
    document does not shrink them, and chunks start at each document's first
    token.
    """
    if attention.causal:
        mask = _mask_ops.block_causal_mask_op(document_ids, False).mask
    else:
        ids = document_ids.to(torch.int64)
        mask = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & (ids != 0).unsqueeze(2)).unsqueeze(1)
    kind, size = layer
    query, key = positions.unsqueeze(2), positions.unsqueeze(1)
    if kind == "window":
        distance = query - key if attention.causal else (query - key).abs()
        mask = mask & ((distance <= size) if attention.inclusive else (distance < size)).unsqueeze(1)
    elif kind == "chunk":
        mask = mask & (
            torch.div(query, size, rounding_mode="floor") == torch.div(key, size, rounding_mode="floor")
        ).unsqueeze(1)
    return mask


def hf_model_inputs(
    document_ids: torch.Tensor,
    config: Any,
    *,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    attn_implementation: str | None = None,
    block_size: int = 128,
    dtype: torch.dtype | None = None,
    sliding_window: int | str | None = "config",
    causal: bool | None = None,
) -> dict[str, Any]:
    """Return the keyword arguments of a transformers model for a packed batch.

    Every shape is a function of ``[batch, sequence]`` and nothing is read
    back to the host, so it belongs inside the compiled training step.
    ``model(**hf_model_inputs(document_ids, model.config, input_ids=...,
    labels=...))`` then equals running each document alone: the logits of
    every valid token, and the loss.

    Keys:

    - ``input_ids`` when given.
    - ``position_ids``: :func:`packfn.packed_position_ids`.
    - ``labels`` and ``shift_labels`` when ``labels`` is given. Causal LMs
      compute their loss from ``shift_labels`` where given (transformers'
      ``ForCausalLMLoss``): each valid token's target is the label of the
      next valid token of its document (across padding inside it), and
      ``-100`` at padding and at each document's last token, so no document
      predicts the next one. ``labels`` are the given ones with ``-100`` at
      padding and at each document's first token, the same targets once
      shifted where no padding sits inside a document (for a loss that reads
      ``labels`` only).
    - By ``attn_implementation`` (default ``config._attn_implementation``),
      the :data:`packfn.AttentionInputKind` it has in
      :data:`packfn.ATTENTION_BACKENDS` (register another backend there):

      - ``"block_causal"`` (``"sdpa"``): ``attention_mask``, the bool mask
        ``[batch, 1, sequence, sequence]`` (:func:`packfn.block_causal_mask`);
      - ``"additive_mask"`` (``"eager"``): the same mask, additive in ``dtype``;
      - ``"block_mask"`` (``"flex_attention"``): ``attention_mask``, a ``BlockMask``
        (:func:`packfn.document_block_mask` with ``block_size``);
      - ``"flash_varlen"`` (``"flash_attention_2"`` / ``"_3"`` / ``"_4"``):
        ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``,
        ``max_length_k``: the static physical boundaries of
        :func:`packfn.physical_varlen_metadata` over the flattened
        ``[batch * sequence]`` stream (every padding run a segment of its
        own, ``max_length_*`` the bound ``sequence``). A document with
        padding inside it is cut there, as upstream's varlen path cuts it;
        pack documents contiguously for flash attention;
      - ``"document_ids"``: ``attention_mask``, ``document_ids`` itself, for
        a kernel that reads the ids (and applies windows itself).

      With sliding windows (``sliding_window``, by default
      ``config.sliding_window``; per layer type where the config lists
      ``layer_types``) the masks carry the window, counted
      in position ids (padding inside a document does not shrink it), and
      models with ``layer_types`` get a dict, one mask per layer type, as
      transformers' own mask mapping. Flash kernels apply the window
      themselves. ``chunked_attention`` layers (Llama 4) see their
      document's chunk of ``config.attention_chunk_size`` positions.

    Bidirectional configs get masks that attend both ways within each
    document: Gemma3 text's ``use_bidirectional_attention=True`` (windows
    ``|dp| < sliding_window``) and ``is_causal=False`` (Gemma4 ``"all"``, any
    config; windows ``|dp| <= sliding_window``), as the model builds its own;
    the flash arguments need no change (the kernel's ``causal`` comes from
    the model). The composite configs' text config (``get_text_config()``)
    is the one read. What no mask can match is refused with a
    ``ValueError``: ``use_bidirectional_attention=True`` on Gemma and Gemma2
    (their masks stay causal while their attention modules flip), flex
    attention with bidirectional or chunked layers, flash (or document-id)
    attention with chunked layers shorter than the row, Llama 4's
    ``attn_temperature_tuning`` on rows of ``floor_scale`` columns or more,
    ``labels`` of a bidirectional model, and layer types with recurrent
    state or sparse selection.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        config: The model's config (``model.config``).
        input_ids, labels: Optional ``[batch, sequence]`` integer tensors
            (``labels`` int32 or int64, unshifted, as transformers takes them;
            the ``labels`` and ``shift_labels`` returned are int64, the
            dtype transformers' cross-entropy loss requires).
        attn_implementation: Overrides ``config._attn_implementation``.
        block_size: FlexAttention block size (16 or more on the CPU: compiled
            CPU flex attention is wrong under 16 in torch 2.13).
        dtype: Floating dtype of the eager backend's additive mask (default:
            ``config.dtype`` when it is a ``torch.dtype``, else the default dtype).
        sliding_window: The window of a config without ``layer_types``
            (every layer), or of its ``"sliding_attention"`` layers; by
            default ``config.sliding_window``. Pass ``None`` for an
            architecture that ignores a ``sliding_window`` its config
            carries (Llama does; Mistral, Mixtral, Phi3 and Starcoder2 apply
            it to every layer).
        causal: Overrides what the config says: ``False`` for a model whose
            attention is bidirectional without a config flag (a forward-time
            ``is_causal=False``, an encoder), windows then ``|dp| <= W``.

    Returns:
        A dict of keyword arguments for ``model(**...)``.

    Raises:
        ValueError: a malformed mask, pass-through tensors not shaped
            ``[batch, sequence]``, an attention implementation not in
            :data:`packfn.ATTENTION_BACKENDS` or none set, a layer type not
            listed above, or a config no mask can match (above).
        TypeError: a non-integer ``block_size`` or sliding window, labels
            not int32 / int64, input ids not integer, a non-floating ``dtype``,
            an ``attn_implementation`` that is not a str.
        RuntimeError: (a sync-free assert) negative or decreasing ids.
    """
    check_mask(document_ids)
    implementation = attn_implementation or getattr(config, "_attn_implementation", None)
    if implementation is None:
        raise ValueError(
            "hf_model_inputs needs an attention backend, got None: pass attn_implementation=, or build the model "
            "so its config has one"
        )
    kind = attention_backend(implementation, "attn_implementation")
    block_size = check_positive_int(block_size, "block_size")
    attention = _attention(config, sliding_window, causal)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    _check_backend(attention, implementation, kind, text, document_ids.shape[1], labels)
    if dtype is None:
        dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (the eager mask's), got {dtype!r}")
    _check_labels(labels)
    if isinstance(input_ids, torch.Tensor) and (input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool):
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    inputs = passthrough_inputs(document_ids, input_ids=input_ids, labels=labels)
    parsed = _format_ops.document_positions_op(document_ids)
    assert_rules(parsed.broken, mask_rules(document_ids.shape[1]))
    positions = inputs["position_ids"] = parsed.position_ids
    if labels is not None:
        labels = labels.long()  # transformers' loss takes int64 targets only
        inputs["labels"] = ignore_first_tokens(labels, document_ids, positions)
    # The mask rules are checked (above): the masks are built without checks (NOTE [Check once]).
    inputs.update(
        attention_inputs(
            document_ids,
            implementation,
            build_mask=lambda kind: _attention_masks(document_ids, positions, kind, attention, block_size, dtype),
        )
    )
    if labels is not None:
        inputs["shift_labels"] = shift_labels(labels, parsed.next_token)
    return inputs


def causal_lm_labels(document_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Labels for a loss that shifts them itself: ``labels[:, 1:]`` are the targets of ``logits[:, :-1]``.

    transformers' ``LabelSmoother`` (``TrainingArguments(label_smoothing_factor=...)``),
    a ``Trainer(compute_loss_func=...)`` and TRL's label smoothing read a
    causal LM's ``labels`` and pair ``logits[:, t]`` with ``labels[:, t + 1]``.
    On a packed row that asks each document's last token to predict the next
    document's first; this returns ``shift_labels`` of
    :func:`hf_model_inputs` moved one column right instead, so the shift
    gives every token the next token of its own document (across padding
    inside it) and ``-100`` at each document's last token and at padding.
    Where no padding sits inside a document, it equals the ``labels``
    :func:`hf_model_inputs` returns (``-100`` at each first token). For the
    example mask ``[[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]`` and labels
    ``[[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]``:
    ``[[-100, 2, -100, 4, 5, -100], [-100, 7, 8, 9, -100, -100]]``.

    Args:
        document_ids: ``[batch, sequence]`` integer or bool document ids.
        labels: ``[batch, sequence]`` int32 or int64 labels, unshifted.

    Returns:
        int64 ``[batch, sequence]``.

    Raises:
        ValueError: a malformed mask, labels not shaped ``[batch, sequence]``.
        TypeError: labels not an int32 / int64 tensor.
        RuntimeError: (a sync-free assert) negative or decreasing ids.
    """
    check_mask(document_ids)
    check_tensor(labels, "labels")
    _check_labels(labels)
    labels = passthrough_inputs(document_ids, labels=labels)["labels"].long()
    parsed = _format_ops.document_positions_op(document_ids)
    assert_rules(parsed.broken, mask_rules(document_ids.shape[1]))
    shifted = shift_labels(labels, parsed.next_token)
    return torch.cat([shifted.new_full((shifted.shape[0], 1), IGNORE_INDEX), shifted[:, :-1]], dim=1)


def _attention_masks(
    document_ids: torch.Tensor,
    positions: torch.Tensor,
    kind: AttentionInputKind,
    attention: _Attention,
    block_size: int,
    dtype: torch.dtype,
) -> torch.Tensor | BlockMask | dict[str, torch.Tensor | BlockMask]:
    """The attention mask of a checked mask: one, or one per layer type (a dict) where the config lists them."""

    def mask(layer: tuple[str, int | None]) -> torch.Tensor | BlockMask:
        if kind == "block_mask":  # causal, windows only (_check_backend)
            return checked_block_mask(document_ids, block_size, layer[1], True, positions, check=False)
        dense = _dense_mask(document_ids, positions, attention, layer)
        return additive_mask(dense, dtype) if kind == "additive_mask" else dense

    if None in attention.layers:
        return mask(attention.layers[None])
    masks = {layer: mask(layer) for layer in dict.fromkeys(attention.layers.values())}
    return {layer_type: masks[layer] for layer_type, layer in attention.layers.items()}


# ------------------------------------------------ Trainer: static packed batches


class PackedCollator:
    """A ``transformers.Trainer`` / TRL data collator: static ``[batch, sequence]`` rows with their document ids.

    Each feature is one row: ``input_ids`` (a list or a 1-d tensor), optional
    ``labels`` (default: the input ids), and optionally the lengths of the
    documents packed into it, ``seq_lengths`` (TRL's ``pack_dataset``) or
    ``seq_lens``; without them the row is one document. An
    ``attention_mask`` may come along if it marks no padding (a tokenizer's
    all-ones mask): the rows must be unpadded. Rows are padded to
    ``sequence``, so every batch has the same shape: unlike
    ``DataCollatorWithFlattening``, whose ``[1, T]`` changes with every batch,
    one compiled graph serves every step. Pair it with a model patched by
    :func:`apply_packfn`, which turns the ids into the model's inputs inside
    that graph.

    Returns a dict of int64 ``[batch, sequence]`` tensors: ``input_ids``
    (``pad_token_id`` at padding), ``labels`` (-100 at padding and at each
    document's first token, so the labels Trainer counts are the targets)
    and ``document_ids`` (1-based per row, 0 at padding).

    Args:
        sequence: The row length (the pack size).
        pad_token_id: The id written at padding.

    Raises:
        ValueError / TypeError: no features, a feature without ``input_ids``,
            ids that are not 1-D integers, labels of another length, an
            ``attention_mask`` that marks padding, a row
            longer than ``sequence``, or lengths that are negative or do not
            add up to its tokens.
    """

    def __init__(self, sequence: int, *, pad_token_id: int = 0) -> None:
        self.sequence = check_positive_int(sequence, "sequence")
        self.pad_token_id = check_scalar_fits(check_int(pad_token_id, "pad_token_id"), torch.int64, "pad_token_id")

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = len(features)
        if rows == 0:
            raise ValueError("PackedCollator got no features (a batch needs at least one row)")
        input_ids = torch.full((rows, self.sequence), self.pad_token_id, dtype=torch.int64)
        given = []  # the rows whose feature has labels, with them
        tables = []
        for row, feature in enumerate(features):
            if not isinstance(feature, Mapping) or feature.get("input_ids") is None:
                raise ValueError(f"feature {row} has no 'input_ids'")
            tokens = token_tensor(feature["input_ids"], row, "input_ids", kind="feature")
            count = tokens.numel()
            if count > self.sequence:
                raise ValueError(f"feature {row} holds {count} tokens, more than sequence={self.sequence}")
            if feature.get("labels") is not None:
                targets = token_tensor(feature["labels"], row, "labels", kind="feature")
                if targets.numel() != count:
                    raise ValueError(f"feature {row}: its {targets.numel()} labels do not match its {count} tokens")
                given.append((row, targets))
            if feature.get("attention_mask") is not None:
                try:
                    mask = torch.as_tensor(feature["attention_mask"])  # ints or bools
                except (TypeError, ValueError, RuntimeError):
                    raise TypeError(f"feature {row}: attention_mask must be a sequence of 0 / 1") from None
                if mask.shape != (count,) or not bool((mask != 0).all()):
                    raise ValueError(
                        f"feature {row}: its attention_mask marks padding or does not match its {count} tokens: "
                        "PackedCollator takes unpadded rows (it pads them itself)"
                    )
            lengths = feature.get("seq_lengths", feature.get("seq_lens", [count]))
            lengths = token_tensor(lengths, row, "seq_lengths", kind="feature")
            if bool((lengths < 0).any()):
                raise ValueError(f"feature {row}: its lengths {lengths.tolist()} hold a negative length")
            if int(lengths.sum()) != count:
                raise ValueError(f"feature {row}: its lengths {lengths.tolist()} do not add up to its {count} tokens")
            input_ids[row, :count] = tokens
            tables.append(lengths)
        width = max(1, max(table.numel() for table in tables))
        seq_lens = torch.zeros(rows, width, dtype=torch.int64)
        for row, table in enumerate(tables):
            seq_lens[row, : table.numel()] = table
        document_ids = document_ids_from_seq_lens(seq_lens, self.sequence)
        labels = input_ids  # a row without labels learns its tokens (ignore_first_tokens copies)
        if given:
            labels = input_ids.clone()
            for row, targets in given:
                labels[row, : targets.numel()] = targets
        # -100 at padding and at first tokens. The ids are the collator's own, within the mask rules: no check.
        labels = ignore_first_tokens(labels, document_ids, _format_ops.position_ids_op(document_ids).position_ids)
        return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids}


# ------------------------------------------------ the model patched in place

_PACKED_ONLY = ("seq_lens", "seq_lens_padded", "documents", "document_offsets", "packing_stats")
"""Keys of a :class:`packfn.data.PackedDataset` batch that no model reads: accepted by the patched forward, dropped."""

_REBUILT = ("position_ids", "shift_labels")
"""Keys of a packed batch that :func:`hf_model_inputs` builds again from its document ids, inside the graph."""


class PackedForward:
    """The forward :func:`apply_packfn` puts on a model (``model.forward``): packed batches in, the model's outputs out.

    A plain object, not a module and not a bound method: it adds no
    parameter, buffer or submodule (the state dict keeps its keys), and it
    pickles and deep-copies with its model (a copy's forward runs the
    copy's weights; a bound method would unpickle as the class's forward).

    Called with ``document_ids`` (``[batch, sequence]``, the packing format
    of :mod:`packfn.metadata`), it builds the model's inputs with
    :func:`hf_model_inputs` (``input_ids``, ``labels``, ``options``) and
    calls the forward it replaced with them and every other keyword
    (``num_items_in_batch``, ``use_cache``, ``inputs_embeds``, ...). The
    other keys of a :class:`packfn.data.PackedDataset` batch are accepted:
    ``position_ids`` and ``shift_labels`` are built again from the ids
    (the same values, in the graph), and ``seq_lens``, ``seq_lens_padded``,
    ``documents``, ``document_offsets`` and ``packing_stats`` are dropped.
    ``input_ids`` may come positionally (``model(tokens, document_ids=ids)``);
    any other positional argument is a ``TypeError`` naming the parameters
    to pass by keyword. A key the ids build (``attention_mask``, ...) given
    as well is a ``ValueError``, unless it is None (PEFT's forward passes
    ``attention_mask=None``). ``document_ids`` of shape ``[n, batch,
    sequence]`` (the Trainer's own ``DataLoader`` stacked ``n``
    ``PackedDataset`` batches) is a ``ValueError`` that names
    :func:`packfn.integrations.trainer.apply_packfn_to_trainer`.
    Without ``document_ids`` it is the forward it replaced (``generate``
    and unpacked batches are unchanged).

    Attributes:
        model: The patched model.
        options: The keyword arguments of :func:`hf_model_inputs`.
        inner: The instance forward it replaced (another patch, such as
            TRL's fused LM head), or None for the class's own ``forward``.
    """

    def __init__(self, model: torch.nn.Module, inner: Any, options: dict[str, Any]) -> None:
        self.model, self.inner, self.options = model, inner, options

    @property
    def __signature__(self) -> inspect.Signature:
        """The replaced forward's signature, the packed batch's keys added (what ``inspect.signature`` reports)."""
        return _packed_signature(self.inner if self.inner is not None else type(self.model).forward.__get__(self.model))

    def __call__(self, *args: Any, document_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        for key in _PACKED_ONLY:
            kwargs.pop(key, None)
        if document_ids is None:
            return self._forward(*args, **kwargs)
        if isinstance(document_ids, torch.Tensor) and document_ids.ndim == 3:
            # The Trainer's own DataLoader stacked per_device_train_batch_size PackedDataset batches into one.
            raise ValueError(
                f"document_ids must have shape [batch, sequence], got {tuple(document_ids.shape)}: a stack of "
                "packed batches, as the Trainer's own DataLoader collates a PackedDataset's items; call "
                "apply_packfn_to_trainer(trainer) (packfn.integrations.trainer) before trainer.train()"
            )
        if len(args) > 1:
            extra = _positional_names(self.__signature__, len(args))[1:]
            raise TypeError(
                f"with document_ids the patched forward takes input_ids as its only positional argument, got "
                f"{len(args)}: pass {', '.join(extra)} by keyword"
            )
        if args and "input_ids" in kwargs:
            raise TypeError("input_ids was given twice: positionally and by keyword")
        input_ids = args[0] if args else kwargs.pop("input_ids", None)
        labels = kwargs.pop("labels", None)
        for key in _REBUILT:
            kwargs.pop(key, None)
        inputs = hf_model_inputs(document_ids, self.model.config, input_ids=input_ids, labels=labels, **self.options)
        # A wrapper that forwards every argument it has (PEFT passes attention_mask=None) has not given them.
        clash = sorted(key for key in inputs.keys() & kwargs.keys() if kwargs[key] is not None)
        if clash:
            raise ValueError(f"document_ids build {clash} for the model: pass one or the other, not both")
        return self._forward(**inputs, **{key: value for key, value in kwargs.items() if key not in inputs})

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """The forward this one replaced: another patch's, or the class's (looked up at call time)."""
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)


def _positional_names(signature: inspect.Signature, count: int) -> list[str]:
    """The names of the first ``count`` positional arguments of a call with ``signature``."""
    names = []
    for parameter in signature.parameters.values():
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    return [names[index] if index < len(names) else f"positional argument {index + 1}" for index in range(count)]


def _packed_signature(forward: Any) -> inspect.Signature:
    """``forward``'s signature with ``document_ids`` and the other packed batch keys as keyword-only parameters.

    Trainer reads it to keep a batch's columns (``remove_unused_columns``)
    and to pass ``num_items_in_batch`` (a ``**kwargs`` parameter).
    """
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        signature = inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    parameters = list(signature.parameters.values())
    names = {parameter.name for parameter in parameters}
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        for name in ("document_ids", *_REBUILT, *_PACKED_ONLY)
        if name not in names
    ]
    tail = [parameter for parameter in parameters if parameter.kind == inspect.Parameter.VAR_KEYWORD]
    head = [parameter for parameter in parameters if parameter.kind != inspect.Parameter.VAR_KEYWORD]
    if not tail:
        tail = [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    return signature.replace(parameters=[*head, *added, *tail])


def apply_packfn(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Patch a transformers causal LM in place so its forward takes packed batches (``document_ids``); return it.

    As Liger-Kernel's ``apply_liger_kernel_to_*`` do, the model stays what
    it was: the same class, config and state dict keys, so
    ``save_pretrained``, the Trainer's ``save_model`` and every
    ``checkpoint-N`` write the plain model, which
    ``AutoModelForCausalLM.from_pretrained`` loads (unpatched: apply the
    patch again to train it on packed batches). Only ``model.forward``
    changes, to a :class:`PackedForward`::

        model = apply_packfn(AutoModelForCausalLM.from_config(config))
        loss = model(input_ids=tokens, document_ids=ids, labels=tokens).loss   # each document alone

    The inputs are built inside the forward, so ``torch.compile(model,
    fullgraph=True)`` (or Trainer's ``torch_compile=True``) compiles them
    with the model into one graph, with no host read, and batches of one
    shape with new contents reuse it.

    Applied again, the forward stays packfn's and takes the new
    ``options``. A model whose forward another patch replaced after
    packfn's (TRL's ``SFTTrainer`` puts its fused LM head there) gets
    packfn's on top again, so the documents reach that patch's backbone
    call as masks and position ids.

    Args:
        model: A transformers causal LM (``PreTrainedModel``; any module
            with a ``config`` whose forward takes transformers' keywords).
        **options: Keyword arguments of :func:`hf_model_inputs`
            (``attn_implementation``, ``block_size``, ``sliding_window``,
            ``dtype``, ``causal``).

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not a module with a ``config``, or an
            option is not a keyword of :func:`hf_model_inputs`.
    """
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(
            f"apply_packfn patches a transformers model (a module with a config), got {type(model).__name__}"
        )
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(f"apply_packfn takes the options of hf_model_inputs ({sorted(_OPTIONS)}), got {unknown}")
    current = model.__dict__.get("forward")
    if isinstance(current, PackedForward):
        current.options = dict(options)
    else:
        model.forward = PackedForward(model, current, dict(options))
    return model


_OPTIONS = frozenset(
    name
    for name, parameter in inspect.signature(hf_model_inputs).parameters.items()
    if parameter.kind == inspect.Parameter.KEYWORD_ONLY and name not in ("input_ids", "labels")
)
