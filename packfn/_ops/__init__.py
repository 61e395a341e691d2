"""Op families registered in the ``packfn`` namespace (importing a module registers its ops)."""

from packfn._ops import metadata  # noqa: F401
