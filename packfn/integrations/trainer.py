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
(``packfn_loader_<process>.pt``, one per process: each has its own share
of the batches) and, when a run resumes at step ``N``, loads it before the
first batch: each worker reads its current window again, packs it the same
way, skips the batches already sent and goes on, so the documents trained
on are exactly an uninterrupted run's, at the cost of one window per worker
(the Trainer's own skip would rebuild every batch since the epoch began).
``ignore_data_skip=True`` is required for that reason.

NOTE [Data parallel: each process reads its own batches]
Under DDP (``torchrun``) the training loop iterates the loader that
``get_train_dataloader`` returns as it is: accelerate prepares (shards
across processes, or dispatches from process 0) only the loaders the
Trainer builds itself, so the :class:`PackedLoader` yields this process's
share of the epoch's one packing plan (``PackedDataset(..., rank=
args.process_index, world=args.world_size)``: batch ``g`` to process
``g % world_size``) and nothing else. Evaluation is the one place where the
Trainer would prepare a loader over a ``PackedDataset``, and accelerate
would dispatch an iterable dataset's items from process 0 (each process
getting rows of process 0's batches, the other processes' never read):
``apply_packfn_to_trainer`` replaces ``get_eval_dataloader`` too. With
transformers' ``average_tokens_across_devices=True`` (its default) each
process's loss is divided by the targets of every process's batches and
DDP averages the gradients, so a step is one process's step over the
world's batches accumulated (``tests/integrations/test_hf_ddp.py``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from packfn.data import PackedDataset
from packfn.data.examples import is_hf_dataset
from packfn.data.stats import STATS_FIELDS, PackingStats, stats_dict
from packfn.formats import IGNORE_INDEX
from packfn.integrations.hf import PackedForward, apply_packfn, causal_lm_labels

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
_DOCUMENTS_MAX = STATS_FIELDS.index("documents_max")
_SUMMED = [index for index in range(len(STATS_FIELDS)) if index != _DOCUMENTS_MAX]
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
    zero again on a resume); :meth:`epoch_progress` says where the loader
    stands instead.

    Args:
        dataset: The packed dataset (its ``rank`` and ``world`` are this process's).
        num_workers, pin_memory, prefetch_factor, multiprocessing_context,
        timeout: As ``torch.utils.data.DataLoader``'s. Workers are not
            persistent: each epoch's workers copy the dataset with its new epoch.

    Attributes:
        epoch: The dataset epoch of the current (or last) iteration.
        position: The batches of that epoch yielded so far.
        num_workers: As given.
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
        self.num_workers = num_workers
        self._loader_options = {
            "batch_size": None,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "prefetch_factor": prefetch_factor if num_workers > 0 else None,
            "multiprocessing_context": multiprocessing_context if num_workers > 0 else None,
            "timeout": timeout,
        }
        self._stats: torch.Tensor | None = None  # the combined packing_stats since take_stats (one row: bounded)
        self._stats_batches = 0
        self._epoch_batches: tuple[int, int | None] | None = None  # (epoch, its batches), counted once an epoch
        self._start_epoch(dataset.epoch)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
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
                self.position += 1
                stats = batch.pop("packing_stats", None)
                if stats is not None:
                    self._add_stats(stats)
                yield batch
            self._finished = True
            if yielded:
                return

    def _add_stats(self, stats: torch.Tensor) -> None:
        # Summed as they come, documents_max the largest: one row however long nothing takes them
        # (logging_strategy="no", log_stats=False). The summed ratios mean nothing: take_stats recomputes them.
        stats = stats.to(torch.float64)
        if self._stats is None:
            self._stats = stats.clone()
        else:
            self._stats[_DOCUMENTS_MAX] = torch.maximum(self._stats[_DOCUMENTS_MAX], stats[_DOCUMENTS_MAX])
            self._stats[_SUMMED] += stats[_SUMMED]
        self._stats_batches += 1

    def take_stats(self) -> tuple[torch.Tensor | None, int]:
        """The packing of the batches yielded since the last call, and how many they are (then forget them).

        Returns:
            ``(stats, batches)``: their ``packing_stats`` combined (float64
            ``[len(STATS_FIELDS)]``, as :meth:`packfn.data.PackingStats.from_tensor`
            combines a stack; None when there were none) and their number.
        """
        stats = None if self._stats is None else PackingStats.from_tensor(self._stats).tensor()
        taken = (stats, self._stats_batches)
        self._stats, self._stats_batches = None, 0
        return taken

    def epoch_batches(self) -> int | None:
        """The batches this process's loader yields in the current epoch; None for examples without a length.

        Counted once an epoch by replaying the epoch's packing plan from the
        documents' lengths (no batch is built).
        """
        if self._epoch_batches is None or self._epoch_batches[0] != self.epoch:
            self._epoch_batches = (self.epoch, _count_batches(self.dataset, self.epoch))
        return self._epoch_batches[1]

    def epoch_progress(self) -> float:
        """Epochs done, fraction included: ``epoch + position / epoch_batches()`` (``epoch`` without a length)."""
        total = self.epoch_batches()
        return self.epoch + (min(self.position, total) / total if total else 0.0)

    def state_dict(self) -> dict[str, Any]:
        """The loader's progress after the batches it yielded: the epoch and the ``StatefulDataLoader`` state."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "finished": self._finished,
            "num_workers": self.num_workers,
            "loader": self._loader.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where :meth:`state_dict` was taken (a dataset with the same settings and ``num_workers``).

        Raises:
            ValueError: the state was saved with another ``num_workers``
                (``TrainingArguments.dataloader_num_workers``).
        """
        if state["num_workers"] != self.num_workers:
            raise ValueError(
                f"the loader state was saved with dataloader_num_workers={state['num_workers']} "
                f"(TrainingArguments), this run has {self.num_workers}: the state holds each worker's progress through "
                "its own batches (a process's j-th batch is worker j % dataloader_num_workers's, the main process's "
                f"with 0), so resume with dataloader_num_workers={state['num_workers']}"
            )
        self._start_epoch(state["epoch"])
        self.position = state["position"]
        self._stats, self._stats_batches = None, 0
        if state["finished"]:
            self._finished = True  # the next iteration starts the next epoch
        else:
            self._loader.load_state_dict(state["loader"])


def _count_batches(dataset: PackedDataset, epoch: int) -> int | None:
    """The batches ``DataLoader(dataset, num_workers=...)`` yields in ``epoch`` in this process (None: no length).

    :meth:`PackedDataset.batches_per_rank`: the same on every rank, with
    any number of workers (the dataset's state is left alone).
    """
    if dataset.settings()["examples"] is None:
        return None
    return dataset.batches_per_rank(epoch)


def _checkpoint_file(args: Any, step: int) -> str:
    folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    return os.path.join(folder, LOADER_STATE_NAME.format(process=args.process_index))


class PackedLoaderCallback(TrainerCallback):
    """Write the :class:`PackedLoader`'s state into every checkpoint; load it when a run resumes; keep the epoch.

    ``on_save`` writes ``checkpoint-N/packfn_loader_<process>.pt``;
    ``on_train_begin`` of a run resumed at step ``N`` (from
    ``args.output_dir``'s ``checkpoint-N``, as ``resume_from_checkpoint=True``
    picks it) loads it before the first batch. See NOTE [How a Trainer
    checkpoint holds the loader]. ``on_step_end`` sets the Trainer's
    ``state.epoch`` (what its logs and checkpoints say) to the loader's
    :meth:`PackedLoader.epoch_progress`: the Trainer itself, with no length
    to go by, counts ``step / max_steps``.

    Raises:
        FileNotFoundError: a resumed run whose checkpoint holds no loader state.
        ValueError: a resumed run with another ``dataloader_num_workers``
            than the checkpoint's.
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

    def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
        if isinstance(train_dataloader, PackedLoader):
            state.epoch = train_dataloader.epoch_progress()

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
        stats, batches = train_dataloader.take_stats()
        if batches:
            self._logging = True
            try:
                Trainer.log(self.trainer, packing_logs(stats, batches=batches))
            finally:
                self._logging = False


def packing_logs(stats: torch.Tensor, *, batches: int | None = None) -> dict[str, float]:
    """The entries :class:`PackingStatsCallback` logs for ``stats``.

    Args:
        stats: float ``[batches, len(STATS_FIELDS)]``, a stack of batches'
            ``packing_stats``, or ``[len(STATS_FIELDS)]``, several combined
            (:meth:`PackedLoader.take_stats`).
        batches: How many batches ``stats`` holds (default: its rows).
    """
    combined = stats_dict(stats)
    if batches is None:
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
      ``dataloader_*`` settings of ``trainer.args``, handed to the training
      loop as it is: under DDP each process trains on its own share of the
      batches, which accelerate neither shards nor dispatches (NOTE [Data
      parallel: each process reads its own batches]);
    - an evaluation dataset (``trainer.eval_dataset``, one of a dict of
      them, or ``evaluate``'s argument; ``predict``'s) that is a ``PackedDataset`` is read
      the same way, through a new :class:`PackedLoader` each evaluation:
      one whole batch at a time with no collator, each process its own
      share; any other goes to the trainer's own loader;
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
      the head's backbone call gets the document masks). A PEFT model
      (``get_peft_model(apply_packfn(model))``) keeps packfn's forward on
      its base model, under the adapters. With ``Trainer(model_init=...)``
      (which ``train()`` calls again for a new model) the trainer's
      ``model_init`` is wrapped so that the models it returns get packfn's
      forward with the same ``options`` (called with or without ``trial``
      as the one given);
    - a loss that shifts the labels itself (``label_smoothing_factor``,
      ``compute_loss_func``, TRL's label smoothing) gets
      :func:`~packfn.integrations.hf.causal_lm_labels` as ``labels`` (the
      trainer's ``compute_loss`` sees them): each document's next-token
      targets, none across a boundary. transformers' ``LabelSmoother``
      shifts only for a model whose (unwrapped) class name is a causal LM's
      (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``): not under
      ``torch_compile=True`` (``OptimizedModule``) nor for a class of one's
      own. Where it will not shift (decided at each step as transformers
      decides it) it gets those targets already aligned with the logits
      (``causal_lm_labels(...)[:, 1:]``, ``-100`` last), so the objective
      is the same either way. A ``compute_loss_func`` must shift them;
    - the trainer counts ``dataset.batch`` rows a batch in its samples
      (``train_samples_per_second``, ``Total train batch size``), not
      ``per_device_train_batch_size``, and its ``epoch`` is the loader's
      (:meth:`PackedLoader.epoch_progress`).

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
        ValueError: ``ignore_data_skip`` is False, ``auto_find_batch_size``
            is True, the dataset's ``rank`` / ``world`` are not the
            trainer's process index and world size (an evaluation
            ``PackedDataset``'s: when its loader is built).
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
    if args.auto_find_batch_size:
        raise ValueError(
            "set TrainingArguments(auto_find_batch_size=False): it retries with a smaller "
            "per_device_train_batch_size, which a PackedDataset (batch rows a batch) does not read"
        )
    _check_process(dataset, args, "the training dataset")
    _patch_model(trainer.model, options)
    if trainer.model_init is not None:
        trainer.model_init = _packed_model_init(trainer.model_init, options)

    def loader(packed: PackedDataset) -> PackedLoader:
        return PackedLoader(
            packed,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and args.device.type != "cpu",
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None),
        )

    def get_train_dataloader() -> PackedLoader:
        return loader(dataset)

    get_eval_dataloader = trainer.get_eval_dataloader

    def get_packed_eval_dataloader(eval_dataset: Any = None) -> Any:
        # NOTE [Data parallel: each process reads its own batches]: accelerate would dispatch a PackedDataset's
        # batches from process 0; each process evaluates its own share instead, one whole batch at a time (a new
        # loader each evaluation, from the dataset's current epoch; its packing_stats are moved aside, unlogged).
        name = eval_dataset if isinstance(eval_dataset, str) else None
        chosen = trainer.eval_dataset if eval_dataset is None else eval_dataset
        if name is not None and isinstance(trainer.eval_dataset, Mapping):
            chosen = trainer.eval_dataset[name]
        if not isinstance(chosen, PackedDataset):
            return get_eval_dataloader(eval_dataset)
        _check_process(chosen, args, "eval_dataset" if name is None else f"eval_dataset[{name!r}]")
        return loader(chosen)

    get_test_dataloader = trainer.get_test_dataloader

    def get_packed_test_dataloader(test_dataset: Any) -> Any:
        # predict(): the same as an evaluation dataset.
        if not isinstance(test_dataset, PackedDataset):
            return get_test_dataloader(test_dataset)
        _check_process(test_dataset, args, "test_dataset")
        return loader(test_dataset)

    compute_loss, total_train_batch_size = trainer.compute_loss, trainer.get_total_train_batch_size

    def compute_loss_on_documents(model: Any, inputs: dict[str, Any], *rest: Any, **kwargs: Any) -> Any:
        # The LabelSmoother and compute_loss_func take the batch's labels (the model, given labels, builds
        # shift_labels itself). One that shifts them gets labels whose shift stops at each document's end; the
        # LabelSmoother where transformers does not shift (decided at each call, as transformers decides it) gets
        # the targets already aligned with the logits.
        if (trainer.label_smoother is not None or trainer.compute_loss_func is not None) and all(
            isinstance(inputs.get(key), torch.Tensor) for key in ("labels", "document_ids")
        ):
            labels = causal_lm_labels(inputs["document_ids"], inputs["labels"])
            if trainer.compute_loss_func is None and not _smoother_shifts(trainer, model):
                labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
            inputs = {**inputs, "labels": labels}
        return compute_loss(model, inputs, *rest, **kwargs)

    def get_total_train_batch_size(arguments: Any) -> int:
        # Rows a step: the dataset's batch where the Trainer counts per_device_train_batch_size (x GPUs).
        return total_train_batch_size(arguments) // arguments.train_batch_size * dataset.batch

    trainer.get_train_dataloader = get_train_dataloader
    trainer.get_eval_dataloader = get_packed_eval_dataloader
    trainer.get_test_dataloader = get_packed_test_dataloader
    trainer.compute_loss = compute_loss_on_documents
    trainer.get_total_train_batch_size = get_total_train_batch_size
    trainer.add_callback(PackedLoaderCallback())
    if log_stats and dataset.packing_stats:
        trainer.add_callback(PackingStatsCallback(trainer))
    return trainer


def _patch_model(model: Any, options: dict[str, Any]) -> Any:
    """Give ``model`` packfn's forward (``options``) unless it is already the outermost one and no option is given."""
    # PEFT's forward runs the adapters and calls its base model's: packfn's forward belongs there.
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    patched = next((part for part in (model, base) if isinstance(part.__dict__.get("forward"), PackedForward)), None)
    if options or patched is None:
        apply_packfn(patched or base, **options)
    return model


def _packed_model_init(model_init: Any, options: dict[str, Any]) -> Any:
    """``Trainer(model_init=...)`` whose models get packfn's forward: ``train()`` builds its model again with it.

    transformers calls ``model_init()`` or ``model_init(trial)`` by its
    number of arguments; the wrapper takes as many.
    """
    import transformers.trainer as hf_trainer

    if isinstance(model_init, _PackedModelInit):
        model_init = model_init.inner
    return _PackedModelInit(model_init, options, hf_trainer.number_of_arguments(model_init))


class _PackedModelInit:
    """A ``model_init`` whose model :func:`_patch_model` patches (as many arguments as the one it wraps)."""

    def __init__(self, inner: Any, options: dict[str, Any], arguments: int) -> None:
        self.inner, self.options, self.arguments = inner, options, arguments

    @property
    def __signature__(self) -> inspect.Signature:
        # transformers counts these to call model_init() or model_init(trial) (a 2-argument one it refuses itself).
        parameter = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return inspect.Signature([inspect.Parameter(f"arg{i}", parameter) for i in range(self.arguments)])

    def __call__(self, *args: Any) -> Any:
        model = self.inner(*args)
        return model if model is None else _patch_model(model, self.options)


def _check_process(dataset: PackedDataset, args: Any, name: str) -> None:
    """Refuse a dataset whose ``rank`` / ``world`` are not the trainer's process index and world size."""
    if (dataset.rank, dataset.world) != (args.process_index, args.world_size):
        raise ValueError(
            f"{name} is the PackedDataset of rank {dataset.rank} of {dataset.world}, the trainer runs process "
            f"{args.process_index} of {args.world_size}: build PackedDataset(..., rank=args.process_index, "
            "world=args.world_size), so that each process reads its own share of the batches of the epoch's "
            "packing plan (batch g goes to process g % world_size)"
        )


def _smoother_shifts(trainer: Any, model: Any) -> bool:
    """Whether the trainer's ``compute_loss`` has its ``LabelSmoother`` shift the labels for ``model`` (this call).

    TRL's ``SFTTrainer`` always does. transformers' ``Trainer.compute_loss``
    does where the class name of ``accelerator.unwrap_model(model)`` (a PEFT
    model's base model's) is one of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``:
    not under ``torch_compile=True`` (the name is ``OptimizedModule``), nor
    for a class of one's own. The same test, read from transformers' module.
    """
    if any(cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl.") for cls in type(trainer).__mro__):
        return True
    import transformers.trainer as hf_trainer

    unwrapped = trainer.accelerator.unwrap_model(model)
    name = unwrapped.base_model.model._get_name() if hf_trainer._is_peft_model(unwrapped) else unwrapped._get_name()
    return name in hf_trainer.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def loss_mask_from_trl(dataset: Any, *, completion_only_loss: bool = True) -> Any:
    """A tokenized HF dataset with TRL's loss masks turned into packfn's ``loss_mask`` column.

    TRL marks the tokens that take a loss with ``completion_mask`` (the
    completion of a prompt-completion example; applied when
    ``completion_only_loss``, as ``SFTConfig(completion_only_loss=...)``)
    and ``assistant_masks`` (the assistant's turns,
    ``assistant_only_loss=True``). :class:`packfn.data.PackedDataset`
    reads one ``loss_mask`` column (labels ``-100`` where it is 0): this
    is their product (and an existing ``loss_mask``'s), int8 per token.
    The masks hold integers (nonzero: a loss), booleans, or floats 0 / 1 (0 / False: no loss). TRL's
    columns are always dropped, ``completion_mask`` with
    ``completion_only_loss=False`` too (it is then left out of the
    product). A dataset with none of them is returned as is.

    Args:
        dataset: A ``datasets.Dataset`` with ``input_ids`` and the masks, or
            a ``datasets.DatasetDict`` of them (each split is converted).
        completion_only_loss: Apply ``completion_mask``.

    Returns:
        The dataset (or ``DatasetDict``) with ``loss_mask``.

    Raises:
        TypeError: ``dataset`` is neither a ``datasets.Dataset`` nor a
            ``datasets.DatasetDict`` of them (a streaming ``IterableDataset``
            included).
        ValueError: a mask whose length is not its example's ``input_ids``',
            a mask that is None (the column and the example are named), or
            a float mask value that is not 0 or 1 (0.5: the column is named).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(dataset, Mapping) and all(is_hf_dataset(split) for split in dataset.values()):
        # A DatasetDict (a dict of splits): each split converted, in a dict of the same type.
        return type(dataset)(
            {
                name: loss_mask_from_trl(part, completion_only_loss=completion_only_loss)
                for name, part in dataset.items()
            }
        )
    if isinstance(dataset, Mapping) or not is_hf_dataset(dataset):
        raise TypeError(
            "dataset must be a datasets.Dataset (TRL's tokenized dataset) or a datasets.DatasetDict of them, "
            f"got {type(dataset).__name__}"
        )
    columns = dataset.column_names
    trl = [name for name in ("completion_mask", "assistant_masks") if name in columns]
    masks = [name for name in trl if completion_only_loss or name != "completion_mask"]
    if "loss_mask" in columns:
        masks.append("loss_mask")
    if not masks:
        return dataset.remove_columns(trl)

    def combine(table: pa.Table, indices: list[int]) -> pa.Table:
        length = pc.list_value_length(table.column("input_ids")).combine_chunks()
        keep = None
        for name in masks:
            column = table.column(name).combine_chunks()
            lengths = pc.list_value_length(column)
            if column.null_count or pc.any(pc.is_null(lengths)).as_py():
                row = indices[pc.index(pc.is_null(lengths), True).as_py()]
                raise ValueError(f"{name} is None in example {row}: every example needs a mask as long as input_ids")
            if not pc.all(pc.equal(lengths, length)).as_py():
                raise ValueError(f"{name} must have as many entries as input_ids in every example")
            flat = pc.list_flatten(column)
            if flat.null_count:
                raise ValueError(f"{name} holds None entries: its values must be 0 or 1 (or booleans)")
            # Integers: nonzero takes a loss (as documented); a float mask must hold 0 or 1 (0.5 is no answer).
            if pa.types.is_floating(flat.type):
                binary = pc.is_in(flat, pa.array([0, 1], flat.type))
                if not pc.all(binary).as_py():
                    wrong = pc.filter(flat, pc.invert(binary))[0].as_py()
                    raise ValueError(f"{name} holds {wrong!r}: a float mask's values must be 0 or 1")
            values = flat if pa.types.is_boolean(flat.type) else pc.not_equal(flat, 0)
            keep = values if keep is None else pc.and_(keep, values)
        offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(pc.cast(length, pa.int64()))])
        loss_mask = pa.LargeListArray.from_arrays(offsets, pc.cast(keep, pa.int8()))
        kept = table.drop_columns([name for name in (*trl, "loss_mask") if name in table.column_names])
        return kept.append_column("loss_mask", loss_mask)

    # An Arrow batch's result is the whole batch; the indices name an example whose mask is None.
    mapped = dataset.with_format("arrow").map(combine, batched=True, with_indices=True)
    return mapped.with_format(dataset.format["type"])
