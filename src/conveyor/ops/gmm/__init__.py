"""Grouped matmul (gmm, tgmm): the core op of Mixture-of-Experts layers."""

from conveyor.ops.gmm.api import gmm, gmm_scatter_add, ragged_dot, tgmm
from conveyor.ops.gmm.metadata import GroupMetadata, make_group_metadata

__all__ = ["gmm", "gmm_scatter_add", "tgmm", "ragged_dot", "make_group_metadata", "GroupMetadata"]
