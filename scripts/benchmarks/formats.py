"""Format conversions: each pipeline's own conversion against packfn's (eager, compiled), with host reads counted.

Each anchor runs where it is installed (transformers, TRL, torchtitan,
megatron-core, torchtune; the test extra pins them). Every case also
records, per eager variant, the host reads and data-dependent ops of one
call (``count_data_dependent``); packfn's are counted through their
decompositions, the static path compiled, exported and GPU code runs.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import torch

import packfn
from packfn.integrations import megatron as packfn_megatron
from packfn.integrations import torchtune as packfn_torchtune
from packfn.integrations.hf import PackedCollator

from scripts.benchmarks.common import FLOOR, Case, Inputs, compiled_variant, count_data_dependent, floor_variant


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _torchtitan_attention():
    """``torchtitan.models.common.attention`` without its package ``__init__`` (which imports triton)."""
    torchtitan = _optional("torchtitan")
    if torchtitan is None:
        return None
    name = "torchtitan.models.common"
    if name not in sys.modules:
        importlib.import_module("torchtitan.models")
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(os.path.dirname(torchtitan.__file__), "models", "common")]
        package.__package__ = name
        sys.modules[name] = package
    return _optional("torchtitan.models.common.attention")


masking_utils = _optional("transformers.masking_utils")
trl_sft = _optional("trl.trainer.sft_trainer")
titan = _torchtitan_attention()
gpt_dataset = _optional("megatron.core.datasets.gpt_dataset")
torchtune_attention = _optional("torchtune.modules.attention_utils")
torchtune_collate = _optional("torchtune.data")

DENSE_LIMIT = 4096
"""Above this sequence the anchors' dense masks (float ``[S, S]`` per row, bool ``[B, S, S]``) take seconds or GiB."""
EOD = 0


def _case(name: str, inputs: Inputs, variants: dict, baseline: str, notes: dict | None = None, floor: bool = True):
    if floor:
        variants.update(floor_variant(inputs.document_ids))
    if baseline not in variants:
        baseline = next(label for label in variants if label.startswith("packfn"))
    counts = {}
    for label, function in variants.items():
        if "compiled" in label or label == FLOOR:
            continue
        # packfn's static functions are counted through their decompositions; drop-ins and collators
        # (host-side, by design) as they run in eager.
        counts[label] = count_data_dependent(function, decompose=label.startswith("packfn eager"))
    return Case("formats", name, inputs.sequence, variants, baseline, notes or {}, FLOOR if floor else None, counts)


def _positions(inputs: Inputs) -> torch.Tensor:
    """torchtitan's ``positions``: restarting at 0 per document, the padding tail restarting too (``ChatDataset``)."""
    rows = []
    for lengths in inputs.lengths:
        row = [p for n in lengths for p in range(n)]
        rows.append(row + list(range(inputs.sequence - len(row))))
    return torch.tensor(rows, dtype=torch.int64, device=inputs.device)


def _eod_tokens(inputs: Inputs) -> torch.Tensor:
    """Megatron's token rows: every document ends with an EOD, the tail after the last is one more document."""
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(1, 50_000, (inputs.batch, inputs.sequence), generator=generator)
    for row, lengths in enumerate(inputs.lengths):
        ends = torch.tensor(lengths).cumsum(0) - 1
        tokens[row, ends] = EOD
    return tokens.to(inputs.device)


def _torchtune_seq_lens(inputs: Inputs) -> list[torch.Tensor]:
    """torchtune's ``seq_lens`` of each pack: its documents, then the padding as one more entry."""
    packs = []
    for lengths in inputs.lengths:
        padding = inputs.sequence - sum(lengths)
        packs.append(torch.tensor(lengths + ([padding] if padding else []), dtype=torch.int64))
    return packs


def _position_id_cases(inputs: Inputs) -> list[Case]:
    positions = _positions(inputs)

    def ours(positions):
        return packfn.document_ids_from_position_ids(positions)

    def varlen(positions):
        return packfn.physical_varlen_metadata(packfn.document_ids_from_position_ids(positions))

    conversion = {}
    if masking_utils is not None:
        conversion["transformers find_packed_sequence_indices"] = lambda: masking_utils.find_packed_sequence_indices(
            positions
        )
    conversion["torchtitan cumsum(positions == 0) - 1"] = lambda: torch.cumsum((positions == 0).int(), dim=1) - 1
    conversion["packfn eager"] = lambda: ours(positions)
    conversion["packfn compiled"] = compiled_variant(ours, positions, dynamic=False)
    cases = [_case("position ids to document ids", inputs, conversion, "transformers find_packed_sequence_indices")]
    metadata = {}
    if titan is not None:
        metadata["torchtitan create_varlen_metadata_for_document"] = lambda: titan.create_varlen_metadata_for_document(
            positions
        )
    metadata["packfn eager"] = lambda: varlen(positions)
    metadata["packfn compiled"] = compiled_variant(varlen, positions, dynamic=False)
    cases.append(
        _case("position ids to varlen metadata", inputs, metadata, "torchtitan create_varlen_metadata_for_document")
    )
    return cases


def _collator_case(inputs: Inputs) -> Case:
    generator = torch.Generator().manual_seed(3)
    features = [
        {"input_ids": torch.randint(1, 50_000, (sum(lengths),), generator=generator).tolist(), "seq_lengths": lengths}
        for lengths in inputs.lengths
    ]
    variants = {}
    if trl_sft is not None:
        trl = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
        variants["TRL padding-free collator"] = lambda: trl(features)
    ours = PackedCollator(inputs.sequence)
    variants["packfn collator (static rows)"] = lambda: ours(features)
    return _case("collator of packed rows", inputs, variants, "TRL padding-free collator", floor=False)


def _megatron_cases(inputs: Inputs) -> list[Case]:
    tokens = _eod_tokens(inputs)
    switches = (True, True, True)  # reset_position_ids, reset_attention_mask, eod_mask_loss

    def per_row(function, dense):
        return lambda: [function(row, EOD, *switches, dense) for row in tokens]

    def batched(tokens):
        return packfn.document_ids_from_eos(tokens, EOD, eod_mask_loss=True)

    cases = []
    for dense in (False, True):
        if dense and inputs.sequence > DENSE_LIMIT:
            continue
        variants = {}
        if gpt_dataset is not None:
            variants["megatron-core ltor (per row)"] = per_row(gpt_dataset._get_ltor_masks_and_position_ids, dense)
        variants["packfn drop-in (per row)"] = per_row(packfn_megatron.get_ltor_masks_and_position_ids, dense)
        if not dense:
            variants["packfn eager (batched)"] = lambda: batched(tokens)
            variants["packfn compiled (batched)"] = compiled_variant(batched, tokens, dynamic=False)
        name = "EOD ltor masks and position ids" + (", dense mask" if dense else "")
        cases.append(_case(name, inputs, variants, "megatron-core ltor (per row)"))
    return cases


def _torchtune_cases(inputs: Inputs) -> list[Case]:
    seq_lens = _torchtune_seq_lens(inputs)
    width = max(pack.numel() for pack in seq_lens)
    table = torch.stack([torch.nn.functional.pad(pack, (0, width - pack.numel())) for pack in seq_lens])

    def ours(table):
        return packfn.document_ids_from_seq_lens(table, inputs.sequence)

    variants = {}
    if torchtune_attention is not None:
        variants["torchtune _get_document_ids_from_seq_lens"] = lambda: (
            torchtune_attention._get_document_ids_from_seq_lens(seq_lens)
        )
    variants["packfn eager"] = lambda: ours(table)
    variants["packfn compiled"] = compiled_variant(ours, table, dynamic=False)
    cases = [_case("seq_lens to document ids", inputs, variants, "torchtune _get_document_ids_from_seq_lens")]
    if inputs.sequence <= DENSE_LIMIT:
        zeros = torch.zeros(inputs.sequence, dtype=torch.int64)
        packs = [{"tokens": zeros, "labels": zeros, "input_pos": zeros, "seq_lens": pack} for pack in seq_lens]
        collate = {}
        if torchtune_collate is not None:
            collate["torchtune padded_collate_packed"] = lambda: torchtune_collate.padded_collate_packed(packs)
        collate["packfn drop-in"] = lambda: packfn_torchtune.padded_collate_packed(packs)
        collate["packfn collate_packed (document ids)"] = lambda: packfn_torchtune.collate_packed(packs)
        cases.append(_case("torchtune padded_collate_packed", inputs, collate, "torchtune padded_collate_packed"))
    return cases


def _position_ids_case(inputs: Inputs) -> Case:
    mask = inputs.document_ids
    positions = packfn.packed_position_ids(mask)
    variants = {
        "packfn eager": lambda: packfn.packed_position_ids(mask),
        "packfn compiled": compiled_variant(packfn.packed_position_ids, mask, dynamic=False),
        "position ids to document ids by cumsum": lambda: torch.cumsum((positions == 0).int(), dim=1),
    }
    return _case("packed_position_ids", inputs, variants, FLOOR)


def cases(inputs: Inputs) -> list[Case]:
    return [
        _position_ids_case(inputs),
        *_position_id_cases(inputs),
        _collator_case(inputs),
        *_megatron_cases(inputs),
        *_torchtune_cases(inputs),
    ]
