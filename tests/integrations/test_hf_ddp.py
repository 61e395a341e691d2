"""transformers' Trainer under DDP: ``torchrun --nproc-per-node 2``, gloo on the CPU, ``apply_packfn_to_trainer``.

``tests/integrations/hf_ddp_run.py`` trains a tiny float64 Llama for 5
steps on two processes, one batch a step each (6 batches an epoch, so the
run crosses into epoch 1), checkpointing every 2 steps, then resumes a copy
of ``checkpoint-2`` in a new Trainer to step 5, and evaluates each run.
The reference trains the same model here in one process with
``gradient_accumulation_steps=2``: its step ``s`` takes the epoch's batches
``2s`` and ``2s + 1``, which under DDP are process 0's and process 1's
``s``-th (batch ``g`` goes to process ``g % 2``).

Why the two are equal up to rounding: with transformers'
``average_tokens_across_devices=True`` (its default) each process's
``num_items_in_batch`` is the targets of both processes' batches (a
gather) and its loss is multiplied by the world size, and DDP averages the
gradients, so each step's gradient is the sum over both batches of their
token losses' gradients divided by both batches' targets; one process
accumulating the two batches with ``num_items_in_batch`` counting both
sums the same two gradients. Multiplying and dividing by 2 is exact in
binary floating point; what is left is the summation order inside the
kernels (this process may run on more threads), far below float64's
tolerance. The logged loss of a step is the mean of the processes' scaled
losses, the loss over both batches, as the reference's accumulated one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from packfn.integrations.hf import apply_packfn
from packfn.integrations.trainer import LOADER_STATE_NAME, apply_packfn_to_trainer

from tests.integrations.hf_ddp_run import RESUME_AT, STEPS, dataset, evaluation, train
from tests.integrations.packed_training import tiny_llama

REPO = Path(__file__).resolve().parents[2]
WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each process's result of the torchrun runs, the one-process reference's, and the runs' folder."""
    output = tmp_path_factory.mktemp("ddp")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]
    # Each process's output in a file of its own: torchrun's report of a failure does not hold the
    # process's own traceback (or a C++ abort's message), and it would push them out of the message below.
    command += ["--log-dir", str(output / "logs"), "--redirects", "3"]
    command += ["-m", "tests.integrations.hf_ddp_run", str(output)]
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    # Its own session, so that a failure here ends torchrun and both processes together.
    done = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=environment,
        start_new_session=True,
    )  # fmt: skip
    try:
        # The reference trains here meanwhile. The two processes mostly import transformers (on two shared
        # cores), then train a few steps: far under the limit.
        reference = train(tmp_path_factory.mktemp("reference"), gradient_accumulation_steps=WORLD)
        _, stderr = done.communicate(timeout=240)
    finally:
        if done.poll() is None:
            os.killpg(done.pid, signal.SIGKILL)
            done.communicate()
    if done.returncode != 0:
        logs = sorted((output / "logs").glob("**/std*.log"))
        tails = [f"{log.relative_to(output)}:\n{log.read_text()[-3000:]}" for log in logs]
        pytest.fail("\n".join(tails) + stderr[-2000:])

    def load(name: str) -> list[dict]:
        return [torch.load(output / f"{name}-{rank}.pt", weights_only=False) for rank in range(WORLD)]

    return {
        "uninterrupted": load("uninterrupted"),
        "resumed": load("resumed"),
        "reference": reference,
        "output": output,
    }


def training(result: dict) -> list[dict]:
    return [batch for batch in result["batches"] if batch["training"]]


def pieces(batch: dict) -> tuple:
    return batch["documents"], batch["offsets"]


def losses(result: dict) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in result["log_history"] if "loss" in entry}


def test_each_process_trains_on_its_own_batches_which_accelerate_neither_shards_nor_dispatches(runs):
    reference = training(runs["reference"])
    assert runs["reference"]["world"] == 1 and len(reference) == WORLD * STEPS
    for rank, result in enumerate(runs["uninterrupted"]):
        assert (result["world"], result["backend"]) == (WORLD, "gloo")
        # The training loop iterates packfn's loader itself, not an accelerate DataLoaderShard / Dispatcher.
        assert result["loader"] == "packfn.integrations.trainer.PackedLoader"
        batches = training(result)
        assert [batch["step"] for batch in batches] == list(range(STEPS))
        # Whole batches (no rows split off between processes), batch g of the plan on process g % 2.
        assert [pieces(batch) for batch in batches] == [pieces(batch) for batch in reference[rank::WORLD]]
    first, second = (training(result) for result in runs["uninterrupted"])
    assert all(pieces(a) != pieces(b) for a, b in zip(first, second, strict=True))


def test_every_steps_loss_and_the_weights_equal_one_process_accumulating_the_same_batches(runs):
    reference = runs["reference"]
    first, second = runs["uninterrupted"]
    assert list(losses(reference)) == list(range(1, STEPS + 1))
    for result in (first, second):
        assert losses(result) == pytest.approx(losses(reference), rel=1e-6)
    for name, value in first["weights"].items():
        assert torch.equal(value, second["weights"][name]), name  # DDP keeps the replicas equal
        torch.testing.assert_close(value, reference["weights"][name], msg=name)
    assert not torch.equal(first["weights"]["lm_head.weight"], tiny_llama().lm_head.weight.double())  # it trained


def test_every_checkpoint_holds_the_loader_state_of_every_process(runs):
    folder = runs["output"] / "uninterrupted"
    per_rank = dataset(0, WORLD).batches_per_rank(0)
    assert per_rank == dataset(0, WORLD).batches_per_rank(1) == 3
    for step in (2, 4, 5):
        for rank in range(WORLD):
            state = torch.load(folder / f"checkpoint-{step}" / LOADER_STATE_NAME.format(process=rank))
            assert (state["epoch"], state["position"]) == divmod(step, per_rank), (step, rank)
        assert not (folder / f"checkpoint-{step}" / LOADER_STATE_NAME.format(process=WORLD)).exists()


def test_a_resumed_run_continues_on_the_same_batches_on_every_process_to_the_same_weights(runs):
    for uninterrupted, resumed in zip(runs["uninterrupted"], runs["resumed"], strict=True):
        after = [batch for batch in training(uninterrupted) if batch["step"] >= RESUME_AT]
        assert [batch["step"] for batch in training(resumed)] == list(range(RESUME_AT, STEPS))
        assert [pieces(batch) for batch in training(resumed)] == [pieces(batch) for batch in after]
        # The history before the checkpoint comes with it; the steps after it are trained again, alike.
        assert losses(resumed) == pytest.approx(losses(uninterrupted), rel=1e-6)
        for name, value in resumed["weights"].items():
            torch.testing.assert_close(value, uninterrupted["weights"][name], msg=name)


def test_evaluation_reads_each_process_share_of_the_packed_batches(runs):
    """accelerate would dispatch process 0's batches (rows of them) to both; each evaluates its own whole batches."""
    for rank, result in enumerate(runs["uninterrupted"]):
        evaluated = [pieces(batch) for batch in result["batches"] if not batch["training"]]
        own = [(batch["documents"].tolist(), batch["document_offsets"].tolist()) for batch in evaluation(rank, WORLD)]
        assert evaluated == own
    # transformers divides each process's evaluation loss by the targets of every process's batch of the step
    # (and multiplies it by the world), as in training: eval_loss is the mean over the steps of the loss over
    # the step's batches of both processes, computed here with the reference's (equal) weights.
    model = apply_packfn(tiny_llama().double())
    model.load_state_dict(runs["reference"]["weights"])
    model.eval()
    steps = []
    with torch.no_grad():
        for batches in zip(*(evaluation(rank, WORLD) for rank in range(WORLD)), strict=True):
            targets = sum(int((batch["shift_labels"] != -100).sum()) for batch in batches)
            steps.append(sum(float(model(**inputs(batch), num_items_in_batch=targets).loss) for batch in batches))
        alone = [float(model(**inputs(batch)).loss) for batch in evaluation(0, 1)]
    assert len(steps) == 2
    for result in (*runs["uninterrupted"], *runs["resumed"]):
        assert result["eval_loss"] == pytest.approx(sum(steps) / len(steps), rel=1e-6)
    # One process: the mean of its 4 batches' losses, each batch read whole.
    assert runs["reference"]["eval_loss"] == pytest.approx(sum(alone) / len(alone), rel=1e-6)


def test_an_evaluation_dataset_of_another_process_is_refused_naming_it(tmp_path):
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, ignore_data_skip=True
    )
    trainer = transformers.Trainer(
        model=apply_packfn(tiny_llama()),
        args=arguments,
        train_dataset=evaluation(0, 1),
        eval_dataset={"held_out": evaluation(1, WORLD)},
    )
    apply_packfn_to_trainer(trainer)
    with pytest.raises(
        ValueError, match=r"eval_dataset\['held_out'\] is the PackedDataset of rank 1 of 2.*process 0 of 1"
    ):
        trainer.evaluate()


def inputs(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != "packing_stats"}
