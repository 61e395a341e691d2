"""A Trainer set up by ``apply_packfn_to_trainer`` under DDP (gloo, CPU): the runs that test_hf_ddp.py compares.

Launched by ``tests/integrations/test_hf_ddp.py`` from the repository root::

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.integrations.hf_ddp_run OUTPUT

Each rank trains :data:`STEPS` steps into ``OUTPUT/uninterrupted`` (a
checkpoint every :data:`SAVE_STEPS`), then a new model, dataset and
Trainer resume from a copy of its ``checkpoint-2`` in ``OUTPUT/resumed``
(what a run stopped after two steps leaves) to the same step. Each run
ends with ``trainer.evaluate()`` on a packed evaluation dataset. Each rank
writes ``OUTPUT/<run>-<rank>.pt``: the documents of every batch its model
took (in training and in evaluation), the Trainer's log history, the type
of the train dataloader the training loop iterated, the process group's
backend and the final weights. :func:`train` with world 1 and
``gradient_accumulation_steps=2`` is the test's one-process reference.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from packfn.data import PackedDataset
from packfn.integrations.hf import apply_packfn
from packfn.integrations.trainer import apply_packfn_to_trainer

from tests.integrations.packed_training import documents, tiny_llama

STEPS, SAVE_STEPS, RESUME_AT = 5, 2, 2
# 28 documents pack into 6 batches an epoch (epochs 0 and 1): 3 per rank at world 2, no batch repeated, so
# the 5 steps cross into epoch 1 and one process taking 2 batches a step takes the same batches.
SETTINGS = {"batch": 2, "sequence": 32, "max_documents": 6, "shuffle": True, "seed": 1}
COUNT = 28
EVALUATION = {"count": 20, "seed": 3}  # 4 batches: 2 per rank at world 2


def dataset(rank: int, world: int) -> PackedDataset:
    return PackedDataset(documents(COUNT), **SETTINGS, rank=rank, world=world)


def evaluation(rank: int, world: int) -> PackedDataset:
    return PackedDataset(documents(**EVALUATION), **SETTINGS, rank=rank, world=world)


class Record(transformers.TrainerCallback):
    """The documents of every batch the model takes (with the step it belongs to) and the loop's train dataloader."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.batches: list[dict[str, Any]] = []
        self.loader = ""
        self.trainer: transformers.Trainer | None = None
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        self.batches.append(
            {
                "step": self.trainer.state.global_step,
                "training": module.training,
                "documents": kwargs["documents"].tolist(),
                "offsets": kwargs["document_offsets"].tolist(),
            }
        )

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.loader = type(train_dataloader).__module__ + "." + type(train_dataloader).__qualname__


def train(output_dir: Path, *, resume: bool = False, gradient_accumulation_steps: int = 1) -> dict[str, Any]:
    """One Trainer run on this process's share of the batches; what :class:`Record` saw, its logs and weights."""
    # float64: the reference's kernels may run on another number of threads (another summation order in a
    # matmul); float64 keeps that rounding far below the test's tolerance after AdamW's steps.
    model = apply_packfn(tiny_llama().double())
    record = Record(model)
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, report_to=[], max_steps=STEPS,
        save_steps=SAVE_STEPS, logging_steps=1, gradient_accumulation_steps=gradient_accumulation_steps,
        learning_rate=1e-2, ignore_data_skip=True, dataloader_num_workers=0, disable_tqdm=True, seed=0,
        ddp_timeout=120,  # a process that fails leaves the other waiting in a collective this long at most
    )  # fmt: skip
    rank, world = arguments.process_index, arguments.world_size
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=dataset(rank, world),
        eval_dataset=evaluation(rank, world),
        callbacks=[record],
    )
    record.trainer = trainer
    apply_packfn_to_trainer(trainer)
    trainer.train(resume_from_checkpoint=resume or None)
    metrics = trainer.evaluate()
    return {
        "world": world,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "eval_loss": metrics["eval_loss"],
        "batches": record.batches,
        "loader": record.loader,
        "log_history": trainer.state.log_history,
        "weights": {name: value.clone() for name, value in trainer.model.state_dict().items()},
    }


def main(output: Path) -> None:
    torch.set_num_threads(1)
    uninterrupted = output / "uninterrupted"
    result = train(uninterrupted)
    rank = torch.distributed.get_rank()
    torch.save(result, output / f"uninterrupted-{rank}.pt")
    resumed = output / "resumed"
    checkpoint = f"checkpoint-{RESUME_AT}"
    if rank == 0:
        shutil.copytree(uninterrupted / checkpoint, resumed / checkpoint)
    torch.distributed.barrier()
    torch.save(train(resumed, resume=True), output / f"resumed-{rank}.pt")
    # Both processes leave together, their process group closed: neither exits while the other still
    # talks to it.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
