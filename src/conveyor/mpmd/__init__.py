"""mpmd_map: several programs on several meshes in one call, sharing memory."""

from conveyor.mpmd.api import Mesh, mpmd_map
from conveyor.mpmd.cpu import MpmdDeadlock
from conveyor.mpmd.errors import mpmd_errors

__all__ = ["Mesh", "mpmd_map", "MpmdDeadlock", "mpmd_errors"]
