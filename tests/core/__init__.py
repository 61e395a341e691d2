"""Tests of the sync-free core (:mod:`packfn`): static ops, layouts, masks, varlen inputs, formats, the packer."""
