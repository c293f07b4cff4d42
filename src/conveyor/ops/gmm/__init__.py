"""Grouped matmul (gmm, tgmm): the core op of Mixture-of-Experts layers."""

from conveyor.ops.gmm.api import gmm, ragged_dot, tgmm
from conveyor.ops.gmm.metadata import GroupMetadata, make_group_metadata

__all__ = ["gmm", "tgmm", "ragged_dot", "make_group_metadata", "GroupMetadata"]
