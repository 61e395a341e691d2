"""Tests of the NeMo AutoModel drop-ins (:mod:`packfn.nemo_automodel`): upstream parity, exact CPU paths, tracing."""
