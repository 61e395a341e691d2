"""transformers.Trainer on packfn's loader with two workers: checkpoints that load, an exact resume, logged packing.

One uninterrupted run (6 optimizer steps of 2 accumulated batches each, 2
``DataLoader`` workers, a shuffled dataset whose first epoch ends mid-run,
checkpoints at steps 3 and 6, TensorBoard on) is the reference. A second
run starts from a copy of its ``checkpoint-3`` (what a run stopped after
3 steps leaves) with ``resume_from_checkpoint=True`` and must train on the
same documents, in the same order, to the same weights. Every checkpoint
loads with ``AutoModelForCausalLM.from_pretrained``; the packing stats of
the run are in its logs and TensorBoard's. The loader's epoch handling is
checked without a Trainer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import accelerate  # noqa: F401  (Trainer needs it)
import pytest
import torch
import transformers

from packfn.data import PackedDataset
from packfn.data.stats import STATS_FIELDS, PackingStats, stats_dict
from packfn.integrations.hf import apply_packfn
from packfn.integrations.trainer import LOADER_STATE_NAME, PackedLoader, apply_packfn_to_trainer, packing_logs

from tests.integrations.packed_training import documents, tiny_llama

BATCH, SEQUENCE = 2, 32
PROBE = torch.arange(1, 17)[None]  # the input whose logits each checkpoint must reproduce


def dataset() -> PackedDataset:
    return PackedDataset(documents(), batch=BATCH, sequence=SEQUENCE, max_documents=6, shuffle=True, seed=1)


class Run(transformers.TrainerCallback):
    """One Trainer run: the documents of every batch the model trained on, its logs, its logits at each save."""

    def __init__(self, output_dir: Path, resume: bool = False, workers: int = 2) -> None:
        self.batches: list[dict] = []  # per forward: the step it belongs to, its documents and real tokens
        self.saved: dict[int, torch.Tensor] = {}
        model = apply_packfn(tiny_llama())
        model.register_forward_pre_hook(self._record, with_kwargs=True)
        arguments = transformers.TrainingArguments(
            output_dir=str(output_dir), use_cpu=True, report_to=["tensorboard"], max_steps=6, save_steps=3,
            logging_steps=2, gradient_accumulation_steps=2, learning_rate=1e-3, ignore_data_skip=True,
            dataloader_num_workers=workers, disable_tqdm=True, seed=0,
        )  # fmt: skip
        self.trainer = transformers.Trainer(model=model, args=arguments, train_dataset=dataset(), callbacks=[self])
        apply_packfn_to_trainer(self.trainer)
        self.trainer.train(resume_from_checkpoint=resume or None)

    def _record(self, module, args, kwargs):
        self.batches.append(
            {
                "step": self.trainer.state.global_step,
                "documents": (kwargs["documents"].tolist(), kwargs["document_offsets"].tolist()),
                "real_tokens": int((kwargs["document_ids"] > 0).sum()),
            }
        )

    def on_save(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            self.saved[state.global_step] = type(model).forward(model.eval(), input_ids=PROBE).logits
        model.train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Run, Run, Path]:
    """The uninterrupted run, the run resumed from a copy of its checkpoint-3, and the first run's folder."""
    first = tmp_path_factory.mktemp("uninterrupted")
    uninterrupted = Run(first)
    second = tmp_path_factory.mktemp("resumed")
    shutil.copytree(first / "checkpoint-3", second / "checkpoint-3")
    return uninterrupted, Run(second, resume=True), first


def test_every_checkpoint_and_save_model_load_with_from_pretrained_and_equal_logits(runs, tmp_path):
    uninterrupted, _, folder = runs
    assert sorted(uninterrupted.saved) == [3, 6]
    uninterrupted.trainer.save_model(str(tmp_path))
    for path, step in ((folder / "checkpoint-3", 3), (folder / "checkpoint-6", 6), (tmp_path, 6)):
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        assert type(loaded) is transformers.LlamaForCausalLM
        assert not any(info.values()), info  # no missing, unexpected or mismatched keys
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(input_ids=PROBE).logits, uninterrupted.saved[step])
    assert (folder / "checkpoint-3" / LOADER_STATE_NAME.format(process=0)).is_file()


def test_a_resumed_run_trains_on_the_documents_of_an_uninterrupted_one(runs):
    uninterrupted, resumed, _ = runs
    after = [batch for batch in uninterrupted.batches if batch["step"] >= 3]
    assert resumed.batches[0]["step"] == 3
    assert [batch["documents"] for batch in resumed.batches] == [batch["documents"] for batch in after]
    # The run crossed an epoch (the shuffled order is new): 6 steps of 2 batches, and one batch left alone at
    # the epoch's end (the Trainer accumulates it into the next step).
    assert len(uninterrupted.batches) == 13
    # It continues the run: the same losses and weights.
    losses = {entry["step"]: entry["loss"] for entry in resumed.trainer.state.log_history if "loss" in entry}
    expected = {entry["step"]: entry["loss"] for entry in uninterrupted.trainer.state.log_history if "loss" in entry}
    assert losses[6] == pytest.approx(expected[6], rel=1e-5)
    for (name, value), (_, other) in zip(
        resumed.trainer.model.state_dict().items(), uninterrupted.trainer.model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(value, other, msg=name)


def test_the_logged_epoch_is_the_loaders_across_its_epoch_end_and_the_resume(runs):
    """13 batches: epoch 0's (a 2-worker DataLoader over the shuffled dataset) then the rest of epoch 1's."""
    uninterrupted, resumed, _ = runs
    counts = []
    for epoch in (0, 1):
        reference = dataset()
        reference.set_epoch(epoch)
        counts.append(sum(1 for _ in torch.utils.data.DataLoader(reference, batch_size=None, num_workers=2)))
    first, second = counts
    assert first < 13 < first + second
    epochs = {entry["step"]: entry["epoch"] for entry in uninterrupted.trainer.state.log_history if "loss" in entry}
    assert epochs == pytest.approx({2: 4 / first, 4: 8 / first, 6: 1 + (13 - first) / second})
    again = {entry["step"]: entry["epoch"] for entry in resumed.trainer.state.log_history if "loss" in entry}
    assert again == pytest.approx(epochs)  # the history before checkpoint-3 comes with it


def test_resuming_with_another_number_of_workers_names_dataloader_num_workers(runs, tmp_path):
    _, _, folder = runs
    shutil.copytree(folder / "checkpoint-3", tmp_path / "checkpoint-3")
    with pytest.raises(ValueError, match=r"saved with dataloader_num_workers=2 .*this run has 0"):
        Run(tmp_path, resume=True, workers=0)


def test_packing_stats_are_logged_beside_the_loss_averaged_over_each_interval(runs):
    uninterrupted, _, _ = runs
    history = uninterrupted.trainer.state.log_history
    logged = {entry["step"]: entry for entry in history if "packing/fill" in entry}
    assert sorted(logged) == sorted(entry["step"] for entry in history if "loss" in entry) == [2, 4, 6]
    previous = 0
    for step, entry in sorted(logged.items()):
        real = [batch["real_tokens"] for batch in uninterrupted.batches if previous <= batch["step"] < step]
        assert entry["packing/real_tokens"] == pytest.approx(sum(real) / len(real))
        assert entry["packing/fill"] == pytest.approx(sum(real) / (len(real) * BATCH * SEQUENCE))
        assert 1 <= entry["packing/documents_mean"] <= entry["packing/documents_max"] <= 6
        previous = step


def test_tensorboard_gets_the_packing_stats(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, folder = runs
    (events,) = {path.parent for path in (folder / "runs").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"train/loss", "train/packing/fill", "train/packing/documents_mean", "train/packing/closed_tokens"} <= tags
    assert [event.step for event in accumulator.Scalars("train/packing/fill")] == [2, 4, 6]


# ------------------------------------------------------------------ the loader alone


def keys(batches) -> list:
    return [(batch["documents"].tolist(), batch["document_offsets"].tolist()) for batch in batches]


def test_the_loader_moves_the_stats_aside_and_starts_the_next_epoch():
    loader = PackedLoader(dataset())
    first = list(loader)
    stats, batches = loader.take_stats()
    assert batches == len(first) and stats.shape == (len(STATS_FIELDS),)
    assert loader.take_stats() == (None, 0)
    assert all("packing_stats" not in batch for batch in first)
    second = list(loader)
    assert loader.epoch == 1
    reference = dataset()
    reference.set_epoch(1)
    assert keys(second) == keys(reference)
    assert keys(second) != keys(first)


@pytest.mark.parametrize("saw_the_end", [False, True])
def test_a_state_at_an_epoch_end_resumes_with_the_next_epoch(saw_the_end):
    """After the last batch (with or without its StopIteration seen) the resumed loader goes on with epoch 1."""
    loader = PackedLoader(dataset())
    count = len(list(PackedLoader(dataset())))
    iterator = iter(loader)
    for _ in range(count):
        next(iterator)
    if saw_the_end:
        assert next(iterator, None) is None
    state = loader.state_dict()
    restored = PackedLoader(dataset())
    restored.load_state_dict(state)
    reference = dataset()
    reference.set_epoch(1)
    assert keys(restored) == keys(reference)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_mid_epoch_resumes_where_it_was_taken(workers):
    """The state after 5 batches, while the workers have prefetched more, resumes at the sixth."""
    everything = keys(PackedLoader(dataset(), num_workers=workers))
    loader = PackedLoader(dataset(), num_workers=workers)
    iterator = iter(loader)
    head = keys(next(iterator) for _ in range(5))
    state = loader.state_dict()
    del iterator
    restored = PackedLoader(dataset(), num_workers=workers)
    restored.load_state_dict(state)
    assert head + keys(restored) == everything


@pytest.mark.parametrize(("saved", "resumed"), [(0, 2), (2, 0), (2, 3), (0, 1)])
def test_a_loader_state_loads_only_with_its_number_of_workers(saved, resumed):
    loader = PackedLoader(dataset(), num_workers=saved)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ValueError, match=rf"dataloader_num_workers={saved} .*this run has {resumed}"):
        PackedLoader(dataset(), num_workers=resumed).load_state_dict(state)


def test_the_loader_keeps_one_combined_stats_row_however_long_nothing_takes_them():
    """logging_strategy="no" or log_stats=False: nothing takes them, and they must not grow with the run."""
    loader = PackedLoader(dataset())
    yielded = list(loader) + list(loader)  # two epochs
    stats, batches = loader.take_stats()
    assert batches == len(yielded) and stats.shape == (len(STATS_FIELDS),)
    each = []
    for epoch in (0, 1):
        reference = dataset()
        reference.set_epoch(epoch)
        each += [batch["packing_stats"] for batch in reference]
    assert packing_logs(stats, batches=batches) == pytest.approx(packing_logs(torch.stack(each)))


def test_the_loaders_epoch_progress_counts_each_epochs_own_batches():
    """Under a window of 4 the shuffled orders pack the epochs into different numbers of batches."""
    loader = PackedLoader(
        PackedDataset(documents(), batch=BATCH, sequence=SEQUENCE, max_documents=6, shuffle=True, seed=1, window=4)
    )
    counts = []
    for epoch in range(3):
        seen = 0
        for _ in loader:
            seen += 1
            assert loader.epoch == epoch
            assert loader.epoch_progress() == pytest.approx(epoch + seen / loader.epoch_batches())
        assert loader.epoch_batches() == seen and loader.epoch_progress() == epoch + 1
        counts.append(seen)
    assert len(set(counts)) > 1, counts  # an epoch's count is not the last one's


def test_packing_logs_average_the_counts_and_combine_the_ratios():
    """Two batches' stats (built by hand): ratios over the summed columns, counts per batch, the largest max."""
    one = PackingStats(0.5, 0.5, 2.0, 3, 1, 1, 0, 1, 0, 64, 4, 2, 128, 128)
    two = PackingStats(1.0, 1.0, 3.0, 4, 0, 2, 0, 0, 0, 128, 6, 2, 128, 128)
    logs = packing_logs(torch.stack([one.tensor(), two.tensor()]))
    assert logs == {
        "packing/fill": 0.75,
        "packing/aligned_fill": 0.75,
        "packing/documents_mean": 2.5,
        "packing/documents_max": 4.0,
        "packing/split_pieces": 0.5,
        "packing/closed_tokens": 1.5,
        "packing/closed_budget": 0.0,
        "packing/closed_documents": 0.5,
        "packing/closed_end": 0.0,
        "packing/real_tokens": 96.0,
        "packing/documents": 5.0,
    }
    assert stats_dict(one.tensor())["real_tokens"] == 64


def test_resuming_from_a_checkpoint_without_the_loader_state_raises(runs, tmp_path):
    _, _, folder = runs
    shutil.copytree(folder / "checkpoint-3", tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3" / LOADER_STATE_NAME.format(process=0)).unlink()
    with pytest.raises(FileNotFoundError, match=r"resumes at step 3, but .*packfn_loader_0\.pt does not exist"):
        Run(tmp_path, resume=True)
