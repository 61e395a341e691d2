"""pyproject.toml's extras for the transformers recipes: what they import, at versions the tests run."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

EXTRAS = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]


def requirements(extra: str) -> dict[str, Requirement]:
    """The extra's requirements that apply here (markers evaluated), by package name."""
    parsed = (Requirement(line) for line in EXTRAS[extra])
    return {
        requirement.name: requirement
        for requirement in parsed
        if requirement.marker is None or requirement.marker.evaluate()
    }


def test_the_hf_and_trl_extras_hold_what_the_recipes_import():
    """The Trainer recipe reads an HF datasets.Dataset; the SFTTrainer recipe adds TRL to it."""
    assert {"transformers", "accelerate", "torchdata", "datasets"} <= set(requirements("hf"))
    assert set(requirements("hf")) | {"trl"} == set(requirements("trl"))


def test_the_versions_the_tests_run_satisfy_the_user_extras_and_the_test_pins():
    test = requirements("test")
    for extra in ("hf", "trl"):
        for name, requirement in requirements(extra).items():
            installed = importlib.metadata.version(name)
            assert requirement.specifier.contains(installed), f"[{extra}] {requirement} excludes {name} {installed}"
            assert name in test and test[name].specifier.contains(installed), f"[test] {test.get(name)}, {installed}"
    assert test["peft"].specifier.contains(importlib.metadata.version("peft"))
