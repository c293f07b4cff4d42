"""cv.moe: a Mixture-of-Experts feed-forward layer as plain JAX functions (no framework).

Design notes: docs/internals/moe.md, section `moe/__init__.py`.
"""

from conveyor.moe.expert_parallel import moe_ffn_expert_parallel
from conveyor.moe.layer import moe_ffn
from conveyor.moe.reference import moe_ffn_reference
from conveyor.moe.routing import Routing, load_balancing_loss, route

__all__ = [
    "moe_ffn",
    "moe_ffn_expert_parallel",
    "moe_ffn_reference",
    "route",
    "Routing",
    "load_balancing_loss",
]
