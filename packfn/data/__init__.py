"""The data side: packing documents into rows under the static budgets, and loading packed batches.

Plain host Python for a data loader's workers (no op, no graph):

- :mod:`packfn.data.packer`: :func:`pack_documents`, :func:`pack_stream`
  (best fit by default, next fit on request), built on :mod:`packfn.data.fit`;
- :mod:`packfn.data.batch`: :class:`PackedBatch`, what a packed batch holds;
- :mod:`packfn.data.suggest`: :func:`suggest_budgets`;
- :mod:`packfn.data.loader`: :class:`PackedDataset`, over tokenized examples
  (read by :mod:`packfn.data.examples`), sharded and resumable;
- :mod:`packfn.data.stats`: :class:`PackingStats` of a batch (fill,
  documents per row, split pieces, what closed each row), which every
  loader batch carries as ``packing_stats``, and :class:`FillWarning`, which
  the loader gives when the cap or the budget throws fill away.
"""

from packfn.data.batch import CLOSED_BY, PackedBatch, Piece, Pieces
from packfn.data.fit import STRATEGIES
from packfn.data.loader import BATCH_KEYS, IGNORE_INDEX, PackedDataset
from packfn.data.packer import pack_documents, pack_stream
from packfn.data.stats import STATS_FIELDS, FillWarning, PackingStats, packing_stats, stats_dict
from packfn.data.suggest import BudgetSuggestion, suggest_budgets

__all__ = [
    "BATCH_KEYS",
    "CLOSED_BY",
    "IGNORE_INDEX",
    "STATS_FIELDS",
    "STRATEGIES",
    "BudgetSuggestion",
    "FillWarning",
    "PackedBatch",
    "PackedDataset",
    "PackingStats",
    "Piece",
    "Pieces",
    "pack_documents",
    "pack_stream",
    "packing_stats",
    "stats_dict",
    "suggest_budgets",
]
