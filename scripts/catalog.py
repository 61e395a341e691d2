"""Every public function of packfn on one packed batch: what the device check and the codegen tests run.

:func:`catalog` gives, for one batch of SPEC section 5 inputs
(:func:`scripts.benchmarks.common.make_inputs`), each public function of
the core, the format conversions, the distributed shards and their
attention inputs, the integrations' tensor functions and the NeMo
AutoModel drop-ins, with the tensors it takes. ``scripts/gpu_check.py``
runs every entry eagerly and compiled on the device against the CPU, and
``tests/core/test_triton_codegen.py`` writes every entry's Triton code for
an H200 on the CPU (:mod:`scripts.inductor_cuda`).

An entry's ``args`` are the tensors (traced as graph inputs); everything
static is closed over. Its function returns tensors, tuples or records of
tensors (:func:`leaves` flattens them for comparison).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scripts.benchmarks.common import Inputs

__all__ = ["DENSE_LIMIT", "Entry", "catalog", "leaves", "same"]

# Past this many columns an entry that builds a [sequence, sequence] (or [local, budget]) mask is left out:
# 8 rows of 32768 x 32768 bools are 8 GiB.
DENSE_LIMIT = 8193
CP_WORLD = 2
CP_ALIGNMENT = 16


@dataclass(frozen=True)
class Entry:
    """One public function on the batch's tensors.

    Attributes:
        layer: ``core``, ``formats``, ``distributed``, ``integrations`` or ``nemo_automodel``.
        function: Called as ``function(*args)``.
        args: Its tensor arguments.
        compiles: Whether it is meant for a compiled step (False for the host
            Python a data loader runs).
    """

    layer: str
    function: Callable[..., object]
    args: tuple
    compiles: bool = True

    def to(self, device: str | torch.device) -> Entry:
        """The entry with its tensor arguments on ``device``."""
        moved = tuple(arg.to(device) if isinstance(arg, torch.Tensor) else arg for arg in self.args)
        return dataclasses.replace(self, args=moved)


def leaves(value) -> list:
    """The tensors and plain values of ``value``: inside tuples, lists, dicts, dataclasses, records, BlockMasks."""
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(value, BlockMask):
        return leaves(value.as_tuple()[2:-1])  # the block tables, not the mask_mod or the seq_lengths
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return leaves([getattr(value, field.name) for field in dataclasses.fields(value)])
    if isinstance(value, dict):
        return leaves([value[key] for key in sorted(value)])
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in leaves(item)]
    if callable(value) and not isinstance(value, torch.Tensor):
        return []  # a mask_mod: its tables are compared elsewhere
    return [value]


def same(got, want) -> bool:
    """Equal leaves (tensors compared on the CPU, values by ``==``)."""
    got, want = leaves(got), leaves(want)
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.cpu(), b.cpu()):
                return False
        elif a != b:
            return False
    return True


def _formats(inputs: Inputs, capacity: int) -> dict[str, Entry]:
    import packfn
    from packfn.formats import ignore_first_tokens, shift_labels

    mask, seq_lens = inputs.document_ids, _seq_lens(inputs, capacity)
    sequence = mask.shape[1]
    valid = mask > 0
    positions = packfn.packed_position_ids(mask)
    ends = valid & (mask != F.pad(mask, (0, 1))[:, 1:])
    tokens = torch.where(ends, 0, 1 + torch.arange(sequence) % 1000).masked_fill(~valid, 1001)
    flat = packfn.physical_varlen_metadata(mask).cu_seqlens
    rows = packfn.batch_metadata(mask, max_documents=capacity).cu_seqlens
    seq_idx = packfn.seq_idx_from_document_ids(mask)
    next_token = torch.ops.packfn.document_positions(mask)[1]  # what hf_model_inputs shifts labels by
    labels = torch.where(valid, tokens, -100)
    return {
        "packed_position_ids": Entry("formats", packfn.packed_position_ids, (mask,)),
        "document_ids_from_position_ids": Entry(
            "formats",
            lambda positions, valid: packfn.document_ids_from_position_ids(positions, attention_mask=valid),
            (positions, valid),
        ),
        "document_ids_from_position_ids_unpadded": Entry(
            "formats", lambda positions: packfn.document_ids_from_position_ids(positions, start=None), (positions,)
        ),
        "document_ids_from_eos": Entry(
            "formats", lambda tokens: packfn.document_ids_from_eos(tokens, 0, pad_token_id=1001), (tokens,)
        ),
        "document_ids_from_eos_unpadded": Entry(
            "formats", lambda tokens: packfn.document_ids_from_eos(tokens, [0, 7], bos=True), (tokens,)
        ),
        "document_ids_from_seq_lens": Entry(
            "formats",
            lambda seq_lens, mask: packfn.document_ids_from_seq_lens(seq_lens, mask.shape[1]),
            (seq_lens, mask),
        ),
        "document_ids_from_cu_seqlens": Entry(
            "formats", lambda rows, mask: packfn.document_ids_from_cu_seqlens(rows, mask.shape[1]), (rows, mask)
        ),
        "document_ids_from_cu_seqlens_flat": Entry(
            "formats",
            lambda flat, valid: packfn.document_ids_from_cu_seqlens(
                flat, valid.shape[1], batch=valid.shape[0], attention_mask=valid
            ),
            (flat, valid),
        ),
        "document_ids_from_seq_idx": Entry(
            "formats", lambda seq_idx: packfn.document_ids_from_seq_idx(seq_idx, pad_index=-1), (seq_idx,)
        ),
        "seq_idx_from_document_ids": Entry("formats", packfn.seq_idx_from_document_ids, (mask,)),
        "seq_lens_from_document_ids": Entry(
            "formats", lambda mask: packfn.seq_lens_from_document_ids(mask, max_documents=capacity), (mask,)
        ),
        "thd_metadata": Entry("formats", lambda mask: packfn.thd_metadata(mask, max_documents=capacity), (mask,)),
        "shift_labels": Entry("formats", shift_labels, (labels, next_token)),
        "ignore_first_tokens": Entry("formats", ignore_first_tokens, (labels, mask, positions)),
    }


def _seq_lens(inputs: Inputs, capacity: int) -> torch.Tensor:
    """int64 ``[batch, capacity]`` document lengths, 0 for absent slots."""
    return F.pad(inputs.seq_lens, (0, capacity - inputs.seq_lens.shape[1]))


def _layout(seq_lens: torch.Tensor, sequence, alignment: int):
    """The aligned layout at the worst-case budget of ``sequence`` columns (a SymInt under dynamic shapes)."""
    import packfn
    from packfn.layout import worst_case_budget

    budget = worst_case_budget(sequence, seq_lens.shape[1], alignment, 0)
    return packfn.aligned_layout(seq_lens, sequence_length=sequence, alignment=alignment, budget=budget)


def _moved(metadata, indices: torch.Tensor, num_tokens: torch.Tensor):
    """``metadata`` with the tensors ``unpad`` and ``pad`` read taken as the entry's arguments."""
    return metadata._replace(indices=indices, num_tokens=num_tokens)


def _core(inputs: Inputs, capacity: int, alignment: int) -> dict[str, Entry]:
    import packfn

    mask, seq_lens, values = inputs.document_ids, _seq_lens(inputs, capacity), inputs.values
    sequence = mask.shape[1]
    narrow = packfn.batch_metadata(mask, max_documents=capacity)
    metadata = packfn.varlen_metadata(mask, max_documents=capacity)
    packed = _layout(seq_lens, sequence, alignment).pack(values)
    halves = 2 if mask.shape[0] % 2 == 0 else 1
    entries = {
        "varlen_metadata": Entry("core", lambda mask: packfn.varlen_metadata(mask, max_documents=capacity), (mask,)),
        "varlen_metadata_default_cap": Entry("core", packfn.varlen_metadata, (mask,)),
        "batch_metadata": Entry("core", lambda mask: packfn.batch_metadata(mask, max_documents=capacity), (mask,)),
        "flatten_metadata": Entry("core", packfn.flatten_metadata, (narrow.packed_token_indices, narrow.cu_seqlens)),
        "split_batch_metadata": Entry(
            "core",
            lambda indices, cu_seqlens, longest, documents: packfn.split_batch_metadata(
                packfn.BatchMetadata(indices, cu_seqlens, longest, documents, indices.shape[1]), halves
            ),
            tuple(narrow[:4]),
        ),
        # unpad and pad on the metadata a step parses once (varlen_metadata's entry) for both and the attention.
        "unpad": Entry(
            "core",
            lambda indices, num_tokens, values: packfn.unpad(values, _moved(metadata, indices, num_tokens)),
            (metadata.indices, metadata.num_tokens, values),
        ),
        "pad": Entry(
            "core",
            lambda indices, num_tokens, values: packfn.pad(values, _moved(metadata, indices, num_tokens)),
            (metadata.indices, metadata.num_tokens, packfn.unpad(values, metadata)),
        ),
        "aligned_layout": Entry(
            "core", lambda seq_lens, mask: _layout(seq_lens, mask.shape[1], alignment), (seq_lens, mask)
        ),
        "pack": Entry(
            "core",
            lambda seq_lens, values: _layout(seq_lens, values.shape[1], alignment).pack(values),
            (seq_lens, values),
        ),
        "restore": Entry(
            "core",
            lambda seq_lens, mask, packed: _layout(seq_lens, mask.shape[1], alignment).restore(packed),
            (seq_lens, mask, packed),
        ),
        "physical_varlen_metadata": Entry("core", packfn.physical_varlen_metadata, (mask,)),
        "document_block_mask": Entry("core", packfn.document_block_mask, (mask,)),
    }
    for backend in ("block_mask", "flash_varlen", "document_ids") + (
        ("block_causal", "additive_mask") if sequence <= DENSE_LIMIT else ()
    ):
        entries[f"attention_inputs[{backend}]"] = Entry(
            "core", lambda mask, backend=backend: packfn.attention_inputs(mask, backend), (mask,)
        )
    if sequence <= DENSE_LIMIT:
        entries["block_causal_mask"] = Entry("core", packfn.block_causal_mask, (mask,))
    return entries


def _distributed(inputs: Inputs, capacity: int, ranks: tuple[int, ...]) -> dict[str, Entry]:
    import packfn
    from packfn.layout import worst_case_budget

    seq_lens, mask = _seq_lens(inputs, capacity), inputs.document_ids
    sequence = mask.shape[1]
    unit = 2 * CP_WORLD * CP_ALIGNMENT
    input_ids = torch.where(mask > 0, 1 + torch.arange(sequence) % 1000, 0)
    labels = torch.where(mask > 0, input_ids, -100)
    dense = sequence <= DENSE_LIMIT
    entries = {}
    for balance in ("rotated", "head_tail", "contiguous"):
        for rank in ranks:

            def shard(seq_lens, input_ids, labels, rank=rank, balance=balance):
                # A multiple of world * 128 too, so that a rank's shard holds whole blocks of cp_document_block_mask.
                budget = worst_case_budget(input_ids.shape[1], seq_lens.shape[1], max(unit, CP_WORLD * 128), 0)
                return packfn.shard_packed_batch(
                    seq_lens,
                    input_ids=input_ids,
                    labels=labels,
                    rank=rank,
                    world=CP_WORLD,
                    budget=budget,
                    alignment=CP_ALIGNMENT,
                    balance=balance,
                )

            name = f"{balance}:{rank}"
            args = (seq_lens, input_ids, labels)
            entries[f"shard_packed_batch[{name}]"] = Entry("distributed", shard, args)
            entries[f"cp_varlen_metadata[{name}]"] = Entry(
                "distributed", lambda *args, shard=shard: packfn.cp_varlen_metadata(shard(*args))[:4], args
            )
            entries[f"cp_document_block_mask[{name}]"] = Entry(
                "distributed", lambda *args, shard=shard: packfn.cp_document_block_mask(shard(*args)), args
            )
            entries[f"cp_attention_work[{name}]"] = Entry(
                "distributed", lambda *args, shard=shard: packfn.cp_attention_work(shard(*args)), args
            )
            if dense:
                entries[f"cp_block_causal_mask[{name}]"] = Entry(
                    "distributed", lambda *args, shard=shard: packfn.cp_block_causal_mask(shard(*args)), args
                )
    return entries


def _integrations(inputs: Inputs, capacity: int) -> dict[str, Entry]:
    from transformers import LlamaConfig

    from packfn.integrations import megatron
    from packfn.integrations.hf import hf_model_inputs

    mask = inputs.document_ids
    config = LlamaConfig(vocab_size=1024, hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    sequence = mask.shape[1]
    tokens = torch.where(mask > 0, 1 + torch.arange(sequence) % 1000, 0)
    backends = ("flash_attention_2", "flex_attention") + (("sdpa",) if sequence <= DENSE_LIMIT else ())
    entries: dict[str, Entry] = {
        f"hf_model_inputs[{backend}]": Entry(
            "integrations",
            lambda mask, tokens, backend=backend: hf_model_inputs(
                mask, config, input_ids=tokens, labels=tokens, attn_implementation=backend
            ),
            (mask, tokens),
        )
        for backend in backends
    }
    entries["megatron.packed_seq_params"] = Entry(
        "integrations", lambda mask: megatron.packed_seq_params(mask, max_documents=capacity), (mask,)
    )
    entries["megatron.get_ltor_masks_and_position_ids"] = Entry(
        "integrations",
        lambda tokens: megatron.get_ltor_masks_and_position_ids(tokens, 0, True, True, True, False),
        (tokens.reshape(-1),),  # one sample: [batch * sequence] tokens
    )
    return entries


def _nemo_automodel(inputs: Inputs, capacity: int, alignment: int) -> dict[str, Entry]:
    from packfn import nemo_automodel as nemo

    mask, seq_lens, values = inputs.document_ids, _seq_lens(inputs, capacity), inputs.values
    built = nemo.build_packed_sequence_metadata(mask)

    def layout_of(seq_lens, like):
        return nemo.packed_layout(
            seq_lens, seq_lens_padded=None, input_shape=tuple(like.shape[:2]), alignment=alignment
        )

    return {
        "get_seqlens_in_batch": Entry("nemo_automodel", nemo.get_seqlens_in_batch, (mask,)),
        "get_unpad_data": Entry("nemo_automodel", nemo.get_unpad_data, (mask,)),
        "build_packed_sequence_metadata": Entry("nemo_automodel", nemo.build_packed_sequence_metadata, (mask,)),
        "flatten_packed_sequence_metadata": Entry(
            "nemo_automodel",
            lambda indices, cu_seqlens: nemo.flatten_packed_sequence_metadata(
                indices, cu_seqlens, batch_size=indices.shape[0], sequence_length=indices.shape[1]
            ),
            (built["packed_token_indices"], built["cu_seqlens"]),
        ),
        "packed_layout": Entry("nemo_automodel", layout_of, (seq_lens, mask)),
        "packed_layout.pack": Entry(
            "nemo_automodel", lambda seq_lens, values: layout_of(seq_lens, values).pack(values), (seq_lens, values)
        ),
        # Packed and restored by one layout: under compile its length is unbacked, so the packed values come from it.
        "packed_layout.restore": Entry(
            "nemo_automodel",
            lambda seq_lens, values: (lambda layout: layout.restore(layout.pack(values)))(layout_of(seq_lens, values)),
            (seq_lens, values),
        ),
        "packed_seq_params_from_doc_ids": Entry("nemo_automodel", nemo.packed_seq_params_from_doc_ids, (mask,)),
        "to_flash_attention_kwargs": Entry(
            "nemo_automodel",
            lambda mask: nemo.to_flash_attention_kwargs(nemo.packed_seq_params_from_doc_ids(mask)),
            (mask,),
        ),
        "packed_attention_inputs": Entry(
            "nemo_automodel",
            lambda mask: nemo.packed_attention_inputs(mask, _Contract("flash_varlen", True)),
            (mask,),
        ),
        "packed_attention_inputs[static]": Entry(
            "nemo_automodel",
            lambda mask: nemo.packed_attention_inputs(
                mask, _Contract("flash_varlen", True), static=True, max_documents=capacity
            ),
            (mask,),
        ),
    }


@dataclass(frozen=True)
class _Contract:
    """A model's :class:`packfn.nemo_automodel.PackedSequenceContract`."""

    packed_mask_type: str
    requires_packed_sequence_metadata: bool


def _data(inputs: Inputs) -> dict[str, Entry]:
    from packfn import pack_documents

    lengths = [length for row in inputs.lengths for length in row]
    packed = pack_documents(lengths, sequence=inputs.sequence, alignment=1, max_documents=inputs.max_documents)
    documents = [torch.arange(length) % 997 + index for index, length in enumerate(lengths)]
    return {
        "PackedBatch.gather": Entry(
            "data", lambda *documents: packed.gather(dict(enumerate(documents))), tuple(documents), compiles=False
        ),
    }


def catalog(
    inputs: Inputs, *, max_documents: int | None = None, alignment: int = 128, ranks: tuple[int, ...] = (0, 1)
) -> dict[str, Entry]:
    """Every public function on ``inputs`` (CPU tensors; :meth:`Entry.to` moves them), by name.

    Args:
        inputs: One packed batch.
        max_documents: The document cap every function is given (at least
            ``inputs.max_documents``; default that). Everything else an
            entry needs is derived from its tensors' shapes inside it, so
            that with one cap for several batches an entry's function
            compiles once with dynamic shapes for all of them.
        alignment: Of the aligned layouts.
        ranks: The context-parallel ranks (of 2) whose shards and attention inputs are entries.
    """
    capacity = max_documents or inputs.max_documents
    if capacity < inputs.max_documents:
        raise ValueError(f"max_documents={capacity} is below the batch's {inputs.max_documents} documents a row")
    return {
        **_core(inputs, capacity, alignment),
        **_formats(inputs, capacity),
        **_distributed(inputs, capacity, ranks),
        **_integrations(inputs, capacity),
        **_nemo_automodel(inputs, capacity, alignment),
        **_data(inputs),
    }
