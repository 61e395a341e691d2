"""The ``packfn::*`` ops, one module per family (importing a module registers its ops).

Each op is a fake, an eager kernel, an Inductor decomposition and, where an
output is differentiable, an autograd formula (NOTE [One body, three roles]
in :mod:`packfn._ops._registry`). The typed callers are named ``<op>_op``.
"""

from packfn._ops import formats, layout, masks, metadata, varlen  # noqa: F401
