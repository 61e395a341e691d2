"""PEFT LoRA over a patched model, ``get_peft_model(apply_packfn(model))``, trained by the Trainer on packed batches.

PEFT's forward runs the adapters and calls its base model's forward (packfn's)
with every argument it has, ``attention_mask=None`` among them. One run
(2 steps, a checkpoint at 1) and one resumed from a copy of its
``checkpoint-1`` (real ``peft``, a tiny Llama from a config): every step's
loss is the loss of each document run alone through the adapted model, the
adapter saves and loads, and the resumed run ends on the same adapter weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import accelerate  # noqa: F401  (Trainer needs it)
import peft
import pytest
import torch
import transformers

from packfn.data import PackedDataset
from packfn.integrations.hf import PackedForward, apply_packfn
from packfn.integrations.trainer import LOADER_STATE_NAME, apply_packfn_to_trainer

from tests.assertions import assert_same
from tests.integrations.packed_training import documents, per_document_loss, tiny_llama


def lora(model: transformers.PreTrainedModel) -> peft.PeftModel:
    torch.manual_seed(1)  # the adapters' initial A
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def dataset() -> PackedDataset:
    return PackedDataset(documents(), batch=2, sequence=32, max_documents=6, shuffle=True, seed=2)


def adapters(model: peft.PeftModel) -> dict[str, torch.Tensor]:
    return {name: value for name, value in model.state_dict().items() if "lora_" in name}


class Run:
    """A Trainer run of a LoRA model; each forward's loss and the per-document loss of its batch at that moment."""

    def __init__(self, output_dir: Path, resume: bool = False) -> None:
        self.expected: list[float] = []
        self.model = lora(apply_packfn(tiny_llama()))
        self.model.register_forward_pre_hook(self._reference, with_kwargs=True)
        arguments = transformers.TrainingArguments(
            output_dir=str(output_dir), use_cpu=True, report_to=[], max_steps=2, save_steps=1, logging_steps=1,
            learning_rate=1e-2, ignore_data_skip=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        self.trainer = transformers.Trainer(model=self.model, args=arguments, train_dataset=dataset())
        apply_packfn_to_trainer(self.trainer)
        self.trainer.train(resume_from_checkpoint=resume or None)
        self.losses = {entry["step"]: entry["loss"] for entry in self.trainer.state.log_history if "loss" in entry}

    def _reference(self, module, args, kwargs):
        # The base model's own forward, adapters included: each document of the batch alone.
        self.expected.append(float(per_document_loss(self.model.get_base_model(), kwargs)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Run, Run, Path]:
    first = tmp_path_factory.mktemp("lora")
    uninterrupted = Run(first)
    second = tmp_path_factory.mktemp("lora-resumed")
    shutil.copytree(first / "checkpoint-1", second / "checkpoint-1")
    return uninterrupted, Run(second, resume=True), first


def test_lora_trains_on_packed_batches_with_the_per_document_loss(runs):
    uninterrupted, _, _ = runs
    base = uninterrupted.model.get_base_model()
    assert isinstance(base.__dict__.get("forward"), PackedForward)  # under the adapters
    assert "forward" not in uninterrupted.model.__dict__  # PEFT's own forward is not patched again
    assert list(uninterrupted.losses.values()) == pytest.approx(uninterrupted.expected, rel=1e-5)
    trained = adapters(uninterrupted.model)
    assert trained and any(bool(value.abs().sum() > 0) for name, value in trained.items() if "lora_B" in name)


def test_the_adapter_saves_and_loads_on_a_patched_model(runs, tmp_path):
    uninterrupted, _, folder = runs
    assert (folder / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (folder / "checkpoint-1" / LOADER_STATE_NAME.format(process=0)).is_file()
    uninterrupted.model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(apply_packfn(tiny_llama()), tmp_path).eval()
    batch = next(iter(dataset()))
    with torch.no_grad():
        assert_same(loaded(**batch).logits, uninterrupted.model.eval()(**batch).logits)
    uninterrupted.model.train()


def test_a_resumed_lora_run_ends_on_the_uninterrupted_runs_adapter(runs):
    uninterrupted, resumed, _ = runs
    assert resumed.losses == pytest.approx(uninterrupted.losses, rel=1e-5)
    assert list(resumed.losses.values())[1:] == pytest.approx(resumed.expected, rel=1e-5)  # the step it trained
    for (name, value), (_, other) in zip(
        adapters(resumed.model).items(), adapters(uninterrupted.model).items(), strict=True
    ):
        torch.testing.assert_close(value, other, msg=name)


def test_apply_packfn_to_trainer_gives_its_options_to_the_patched_base_model(tmp_path):
    model = lora(apply_packfn(tiny_llama()))
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, ignore_data_skip=True
    )
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=dataset())
    apply_packfn_to_trainer(trainer, block_size=16)
    assert model.get_base_model().forward.options == {"block_size": 16}
    assert "forward" not in model.__dict__
