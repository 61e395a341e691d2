"""Benchmark families for scripts/bench.py: each module exposes ``cases(inputs) -> list[Case]``."""
