"""packfn's test suite: one package per layer (core, nemo_automodel, integrations, distributed, scripts)."""
