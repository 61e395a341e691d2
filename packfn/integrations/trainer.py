"""transformers' ``Trainer`` (and TRL's ``SFTTrainer``) on packfn's loader: exact resume, packing stats in the logs.

:func:`apply_packfn_to_trainer` sets a trainer up to train on a
:class:`packfn.data.PackedDataset`, whose items are whole static-shape
batches (no collator, no sampler)::

    model = apply_packfn(AutoModelForCausalLM.from_config(config))
    dataset = PackedDataset(tokenized, batch=8, sequence=4096, max_documents=64, shuffle=True)
    args = TrainingArguments(output_dir, max_steps=1000, save_steps=100, ignore_data_skip=True,
                             dataloader_num_workers=2, torch_compile=True, report_to="tensorboard")
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    apply_packfn_to_trainer(trainer)
    trainer.train()                                   # later: trainer.train(resume_from_checkpoint=True)

NOTE [How a Trainer checkpoint holds the loader]
The Trainer would build a ``DataLoader`` over the dataset itself, and on a
resume re-read and drop every batch it already trained on (unless
``ignore_data_skip=True``). Neither fits packfn's loader: its batches are
items (the default collator stacks them), its workers' progress never
reaches the main process, and accelerate's ``set_epoch`` at every epoch
start would reset a state loaded into it. So the trainer's
``get_train_dataloader`` (its documented override point) returns a
:class:`PackedLoader`: torchdata's ``StatefulDataLoader`` over the dataset,
which carries each worker's state (``PackedDataset.state_dict()``, a few
integers and the pieces carried between windows) back with every batch,
so ``state_dict()`` in the main process is the state after the batches
the Trainer consumed, not after the ones the workers prefetched. The
:class:`PackedLoaderCallback` writes it into every ``checkpoint-N``
(``packfn_loader_<process>.pt``, one per process: each rank has its own
shard) and, when a run resumes at step ``N``, loads it before the first
batch: each worker reads its current window again, packs it the same way,
skips the batches already sent and goes on, so the documents trained on
are exactly an uninterrupted run's, at the cost of one window per worker
(the Trainer's own skip would rebuild every batch since the epoch began).
``ignore_data_skip=True`` is required for that reason.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from packfn.data import PackedDataset
from packfn.data.examples import is_hf_dataset
from packfn.data.stats import STATS_FIELDS, stats_dict
from packfn.integrations.hf import PackedForward, apply_packfn

__all__ = [
    "LOADER_STATE_NAME",
    "PackedLoader",
    "PackedLoaderCallback",
    "PackingStatsCallback",
    "apply_packfn_to_trainer",
    "loss_mask_from_trl",
    "packing_logs",
]

LOADER_STATE_NAME = "packfn_loader_{process}.pt"
"""The file of a checkpoint folder that holds one process's :meth:`PackedLoader.state_dict`."""

_STATIC_STATS = ("rows", "columns", "aligned_columns")
_RATIO_STATS = ("fill", "aligned_fill", "documents_mean", "documents_max")


def _stateful_dataloader() -> type:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as error:  # pragma: no cover - torchdata is a test dependency
        raise ImportError(
            "packfn's Trainer loader needs torchdata's StatefulDataLoader: pip install 'torchdata>=0.11'"
        ) from error
    return StatefulDataLoader


class PackedLoader:
    """The Trainer's train dataloader over a :class:`packfn.data.PackedDataset`, resumable and epoch-aware.

    Iterating yields the dataset's batches (dicts of ``[batch, sequence]``
    tensors, :data:`packfn.data.BATCH_KEYS`) through torchdata's
    ``StatefulDataLoader`` with ``num_workers`` workers, with
    ``packing_stats`` moved aside into :attr:`stats` (the model never sees
    it; :class:`PackingStatsCallback` logs it). An iteration that follows
    one that ran to its end starts the dataset's next epoch
    (``set_epoch(epoch + 1)``: a new order with ``shuffle=True``), so the
    Trainer's passes over an iterable dataset are the dataset's epochs, on
    a resumed run too (the epoch travels in :meth:`state_dict`). The
    Trainer's own ``set_epoch`` calls are not taken (it counts epochs from
    zero again on a resume).

    Args:
        dataset: The packed dataset (its ``rank`` and ``world`` are this process's).
        num_workers, pin_memory, prefetch_factor, multiprocessing_context,
        timeout: As ``torch.utils.data.DataLoader``'s. Workers are not
            persistent: each epoch's workers copy the dataset with its new epoch.

    Attributes:
        stats: The ``packing_stats`` tensors of the batches yielded since
            :meth:`take_stats` last emptied it.
        epoch: The dataset epoch of the current (or last) iteration.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
    ) -> None:
        if not isinstance(dataset, PackedDataset):
            raise TypeError(f"PackedLoader reads a packfn.data.PackedDataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self._loader_options = {
            "batch_size": None,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "prefetch_factor": prefetch_factor if num_workers > 0 else None,
            "multiprocessing_context": multiprocessing_context if num_workers > 0 else None,
            "timeout": timeout,
        }
        self.stats: list[torch.Tensor] = []
        self._start_epoch(dataset.epoch)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.dataset.set_epoch(epoch)
        self._loader = _stateful_dataloader()(self.dataset, **self._loader_options)
        self._finished = False  # the current iteration ran to its end

    def __iter__(self):
        # A resumed iteration whose state is at the epoch's end yields nothing: go on with the next epoch rather
        # than end the pass empty (the Trainer stops training at an epoch with no batch).
        for _ in range(2):
            if self._finished:
                self._start_epoch(self.epoch + 1)
            yielded = False
            for batch in self._loader:
                yielded = True
                stats = batch.pop("packing_stats", None)
                if stats is not None:
                    self.stats.append(stats)
                yield batch
            self._finished = True
            if yielded:
                return

    def take_stats(self) -> list[torch.Tensor]:
        """The ``packing_stats`` gathered since the last call (and empty the list)."""
        stats, self.stats = self.stats, []
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The loader's progress after the batches it yielded: the epoch and the ``StatefulDataLoader`` state."""
        return {"epoch": self.epoch, "finished": self._finished, "loader": self._loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where :meth:`state_dict` was taken (a dataset with the same settings and ``num_workers``)."""
        self._start_epoch(state["epoch"])
        self.stats = []
        if state["finished"]:
            self._finished = True  # the next iteration starts the next epoch
        else:
            self._loader.load_state_dict(state["loader"])


def _checkpoint_file(args: Any, step: int) -> str:
    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    return os.path.join(folder, LOADER_STATE_NAME.format(process=args.process_index))


class PackedLoaderCallback(TrainerCallback):
    """Write the :class:`PackedLoader`'s state into every checkpoint; load it when a run resumes.

    ``on_save`` writes ``checkpoint-N/packfn_loader_<process>.pt``;
    ``on_train_begin`` of a run resumed at step ``N`` (from
    ``args.output_dir``'s ``checkpoint-N``, as ``resume_from_checkpoint=True``
    picks it) loads it before the first batch. See NOTE [How a Trainer
    checkpoint holds the loader].

    Raises:
        FileNotFoundError: a resumed run whose checkpoint holds no loader state.
    """

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if not isinstance(train_dataloader, PackedLoader) or state.global_step == 0:
            return
        path = _checkpoint_file(args, state.global_step)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"the run resumes at step {state.global_step}, but {path} does not exist: resume from a checkpoint "
                "that a Trainer set up by apply_packfn_to_trainer saved in args.output_dir"
            )
        train_dataloader.load_state_dict(torch.load(path, weights_only=True))

    def on_save(self, args, state, control, train_dataloader=None, **kwargs):
        if not isinstance(train_dataloader, PackedLoader):
            return
        path = _checkpoint_file(args, state.global_step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(train_dataloader.state_dict(), path)


class PackingStatsCallback(TrainerCallback):
    """Log the packing of the batches trained on, averaged over each logging interval, through the Trainer's logs.

    Each time the Trainer logs its training loss (every ``logging_steps``,
    or each epoch with ``logging_strategy="epoch"``), it reads the
    ``packing_stats`` that the :class:`PackedLoader` moved aside since the
    last time and logs, with ``transformers.Trainer.log`` (so
    ``report_to="tensorboard"`` writes them as ``train/packing/<name>`` and
    ``trainer.state.log_history`` keeps them), an entry of its own at that
    step:

    - ``packing/fill``, ``packing/aligned_fill``: real tokens over the
      interval's columns (aligned columns), the mean fill of its batches;
    - ``packing/documents_mean``: documents per non-empty row;
      ``packing/documents_max``: the most documents a row held;
    - ``packing/<count>``, the mean per batch of ``split_pieces``,
      ``closed_tokens``, ``closed_budget``, ``closed_documents``,
      ``closed_end`` (rows each reason closed), ``real_tokens`` and
      ``documents`` (:data:`packfn.data.stats.STATS_FIELDS`).

    The base class's ``log`` is called, not a subclass's (TRL's
    ``SFTTrainer.log`` adds its running metrics to the entry it is given
    and clears them: they stay in the Trainer's own entries). Each
    process logs its own batches (the Trainer's reporters write process 0's).

    Args:
        trainer: The trainer whose log it writes to.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._logging = False  # inside its own log call (which calls on_log again)

    def on_log(self, args, state, control, logs=None, train_dataloader=None, **kwargs):
        if self._logging or "loss" not in (logs or {}) or not isinstance(train_dataloader, PackedLoader):
            return
        stats = train_dataloader.take_stats()
        if stats:
            self._logging = True
            try:
                Trainer.log(self.trainer, packing_logs(torch.stack(stats)))
            finally:
                self._logging = False


def packing_logs(stats: torch.Tensor) -> dict[str, float]:
    """The entries :class:`PackingStatsCallback` logs for ``stats``, float ``[batches, len(STATS_FIELDS)]``."""
    combined = stats_dict(stats)
    batches = stats.reshape(-1, len(STATS_FIELDS)).shape[0]
    logs = {}
    for name in STATS_FIELDS:
        if name in _STATIC_STATS:
            continue
        value = combined[name]
        logs[f"packing/{name}"] = float(value) if name in _RATIO_STATS else value / batches
    return logs


def apply_packfn_to_trainer(
    trainer: Any, dataset: PackedDataset | None = None, *, log_stats: bool = True, **options: Any
) -> Any:
    """Set up a ``transformers.Trainer`` (or a subclass: TRL's ``SFTTrainer``) to train on a packed dataset.

    - The trainer's train dataloader becomes a :class:`PackedLoader` over
      ``dataset`` (default ``trainer.train_dataset``) with the
      ``dataloader_*`` settings of ``trainer.args``;
    - :class:`PackedLoaderCallback` puts the loader's state into every
      checkpoint and restores it on ``resume_from_checkpoint``: a resumed
      run trains on exactly the documents of an uninterrupted one (NOTE
      [How a Trainer checkpoint holds the loader]);
    - with ``log_stats`` (and the dataset's ``packing_stats`` on),
      :class:`PackingStatsCallback` logs how full the batches were;
    - the model's forward is packfn's (:func:`packfn.integrations.hf.apply_packfn`
      with ``options``) when it is not yet the outermost one: a model not
      patched before, or one whose forward the trainer replaced (TRL's
      ``SFTTrainer`` puts its fused LM head there; packfn's goes on top, so
      the head's backbone call gets the document masks).

    Call it after constructing the trainer and before ``train()``.

    Args:
        trainer: A ``transformers.Trainer`` built with
            ``TrainingArguments(..., ignore_data_skip=True, max_steps=...)``.
        dataset: The :class:`~packfn.data.PackedDataset` to train on
            (``rank=args.process_index``, ``world=args.world_size``); by
            default ``trainer.train_dataset`` (TRL's ``SFTTrainer`` takes an
            HF dataset there: pass the packed dataset over it here).
        log_stats: Log the packing statistics.
        **options: :func:`~packfn.integrations.hf.apply_packfn` options;
            given, they replace those of a model already patched.

    Returns:
        ``trainer``.

    Raises:
        TypeError: no ``PackedDataset`` to train on.
        ValueError: ``ignore_data_skip`` is False, or the dataset's
            ``rank`` / ``world`` are not the trainer's process index and
            world size.
    """
    dataset = trainer.train_dataset if dataset is None else dataset
    if not isinstance(dataset, PackedDataset):
        raise TypeError(
            "apply_packfn_to_trainer trains on a packfn.data.PackedDataset: pass one as train_dataset or as "
            f"dataset (TRL's SFTTrainer takes the tokenized HF dataset as train_dataset), got {type(dataset).__name__}"
        )
    args = trainer.args
    if not args.ignore_data_skip:
        raise ValueError(
            "set TrainingArguments(ignore_data_skip=True): a resumed run restores packfn's loader from its state "
            "in the checkpoint, and the Trainer's own skip would drop that many batches more"
        )
    if (dataset.rank, dataset.world) != (args.process_index, args.world_size):
        raise ValueError(
            f"the dataset shards for rank {dataset.rank} of {dataset.world}, the trainer runs process "
            f"{args.process_index} of {args.world_size}: build PackedDataset(..., rank=args.process_index, "
            "world=args.world_size)"
        )
    if options or not isinstance(trainer.model.__dict__.get("forward"), PackedForward):
        apply_packfn(trainer.model, **options)
    workers = args.dataloader_num_workers

    def get_train_dataloader() -> PackedLoader:
        return PackedLoader(
            dataset,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory and args.device.type != "cpu",
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None),
        )

    trainer.get_train_dataloader = get_train_dataloader
    trainer.add_callback(PackedLoaderCallback())
    if log_stats and dataset.packing_stats:
        trainer.add_callback(PackingStatsCallback(trainer))
    return trainer


def loss_mask_from_trl(dataset: Any, *, completion_only_loss: bool = True) -> Any:
    """A tokenized HF dataset with TRL's loss masks turned into packfn's ``loss_mask`` column.

    TRL marks the tokens that take a loss with ``completion_mask`` (the
    completion of a prompt-completion example; applied when
    ``completion_only_loss``, as ``SFTConfig(completion_only_loss=...)``)
    and ``assistant_masks`` (the assistant's turns,
    ``assistant_only_loss=True``). :class:`packfn.data.PackedDataset`
    reads one ``loss_mask`` column (labels ``-100`` where it is 0): this
    is their product (and an existing ``loss_mask``'s), int8 per token; the
    TRL columns are dropped. A dataset with none of them is returned as is.

    Args:
        dataset: A ``datasets.Dataset`` with ``input_ids`` and the masks.
        completion_only_loss: Apply ``completion_mask``.

    Returns:
        The dataset with ``loss_mask``.

    Raises:
        TypeError: ``dataset`` is not a ``datasets.Dataset``.
        ValueError: a mask whose length is not its example's ``input_ids``'.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if not is_hf_dataset(dataset):
        raise TypeError(f"dataset must be a datasets.Dataset (TRL's tokenized dataset), got {type(dataset).__name__}")
    columns = dataset.column_names
    trl = [name for name in ("completion_mask", "assistant_masks") if name in columns]
    masks = [name for name in trl if completion_only_loss or name != "completion_mask"]
    if "loss_mask" in columns:
        masks.append("loss_mask")
    if not masks:
        return dataset.remove_columns(trl)

    def combine(table: pa.Table) -> pa.Table:
        length = pc.list_value_length(table.column("input_ids")).combine_chunks()
        keep = None
        for name in masks:
            column = table.column(name).combine_chunks()
            if not pc.all(pc.equal(pc.list_value_length(column), length)).as_py():
                raise ValueError(f"{name} must have as many entries as input_ids in every example")
            values = pc.not_equal(pc.list_flatten(column), 0)
            keep = values if keep is None else pc.and_(keep, values)
        offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(pc.cast(length, pa.int64()))])
        loss_mask = pa.LargeListArray.from_arrays(offsets, pc.cast(keep, pa.int8()))
        kept = table.drop_columns([name for name in (*trl, "loss_mask") if name in table.column_names])
        return kept.append_column("loss_mask", loss_mask)

    mapped = dataset.with_format("arrow").map(combine, batched=True)  # an Arrow batch's result is the whole batch
    return mapped.with_format(dataset.format["type"])
