"""Runnable examples of packfn (each ``python examples/<name>.py``), and the example model the scripts train.

A package so that the scripts import the model as ``examples.packed_decoder``.
"""
