"""Tests of context parallelism and microbatch splits (:mod:`packfn.distributed`), in one process and on gloo ranks."""
