"""The scripts that train, profile, benchmark, export and check packfn, and the modules they share.

Entry scripts (each runs as ``python scripts/<name>.py`` from any folder, and
has a ``main(argv)``): ``main_job.py`` (the example model
trained by packfn's and NeMo AutoModel's pipelines, profiled), ``hf_train.py``
(a transformers Llama fed three ways), ``bench.py`` (the ops against
upstream, by family in ``benchmarks/``), ``bench_cp.py`` (context-parallel
shard and gather), ``bench_packer.py`` (packers' fill and speed),
``export.py`` (``torch.export`` and AOTInductor) and ``gpu_check.py`` (the
device checks). Shared modules: ``corpus.py`` (documents), ``batches.py``
(the example model's batches and flags), ``upstream.py`` (NeMo AutoModel's
packer and helpers), ``measure.py`` (synchronization, compile and
graph-break counts), ``benchmarks/common.py`` (the bench inputs and cases).
The example model itself is ``examples/packed_decoder.py``.

Every module imports the others from the repository root
(``from scripts.corpus import ...``, ``from examples.packed_decoder import
...``), as the tests do. Run as a file, a script would find only
``scripts/`` of this repository on ``sys.path`` (Python puts the script's
own folder there), so each entry script starts with the same two lines::

    if not __package__:  # run as a file: import from the repository root (scripts/__init__.py)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

``__package__`` is empty only when the file runs as a script, so an import
(``from scripts import bench``, ``python -m scripts.bench``) leaves
``sys.path`` alone.
"""
