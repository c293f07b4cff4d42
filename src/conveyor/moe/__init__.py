"""cv.moe: a Mixture-of-Experts feed-forward layer as plain JAX functions (no framework).

    y, aux_loss = cv.moe.moe_ffn(x, router_w, w_gate, w_up, w_down, top_k=2)

Top-k softmax routing (gates renormalised over the chosen k), a load-balancing auxiliary loss,
tokens permuted into expert order, SwiGLU experts through `cv.gmm`, and the outputs combined by
the gates; dropless. `reference` holds the dense definition it is tested against.
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
