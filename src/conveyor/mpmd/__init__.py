"""mpmd_map: several programs on several meshes in one call, sharing memory."""
from conveyor.mpmd.api import Mesh, mpmd_map
from conveyor.mpmd.cpu import MpmdDeadlock

__all__ = ["Mesh", "mpmd_map", "MpmdDeadlock"]
