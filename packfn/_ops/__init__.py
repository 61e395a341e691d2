"""Op families registered in the ``packfn`` namespace (importing a module registers its ops)."""

from packfn._ops import attention, layout, metadata  # noqa: F401
