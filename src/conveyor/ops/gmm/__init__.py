"""Grouped matmul (gmm, tgmm): the core op of Mixture-of-Experts layers."""
from conveyor.ops.gmm.api import gmm, tgmm
from conveyor.ops.gmm.metadata import GroupMetadata, make_group_metadata

__all__ = ["gmm", "tgmm", "make_group_metadata", "GroupMetadata"]
