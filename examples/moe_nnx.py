"""cv.moe inside a Flax NNX model (the `examples` extra: pip install conveyor[examples]).

As with Equinox (examples/moe_equinox.py), the framework module only holds the parameters: the
MoE layer is Conveyor's plain functions of arrays. Here an `nnx.Module` with a residual MoE block
is trained for a few optax steps through `nnx.Optimizer`, and its output is checked against the
dense reference with the same parameters.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import conveyor as cv


class MoEBlock(nnx.Module):
    """x + MoE(x), top-k routing over `experts` SwiGLU experts."""

    def __init__(self, d: int, f: int, experts: int, top_k: int, *, rngs: nnx.Rngs):
        # noqa: E731
        normal = lambda shape, fan_in: nnx.Param(
            jax.random.normal(rngs.params(), shape) / fan_in**0.5
        )
        self.router_w = normal((d, experts), d)
        self.w_gate = normal((experts, d, f), d)
        self.w_up = normal((experts, d, f), d)
        self.w_down = normal((experts, f, d), f)
        self.top_k = top_k

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, aux = cv.moe.moe_ffn(
            x,
            self.router_w[...],
            self.w_gate[...],
            self.w_up[...],
            self.w_down[...],
            top_k=self.top_k,
        )
        return x + y, aux


def main() -> None:
    tokens, d, f, experts = 256, 32, 64, 4
    model = MoEBlock(d, f, experts, top_k=2, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((tokens, d)), jnp.float32)
    target = jnp.tanh(
        x @ jnp.asarray(np.random.default_rng(1).standard_normal((d, d)) / d**0.5, jnp.float32)
    )

    def loss(model, x, target):
        y, aux = model(x)
        return jnp.mean((y - target) ** 2) + 0.01 * aux

    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        value, grads = nnx.value_and_grad(loss)(model, x, target)
        optimizer.update(model, grads)
        return value

    losses = [float(step(model, optimizer)) for _ in range(30)]
    print(f"nnx MoE block: loss {losses[0]:.4f} -> {losses[-1]:.4f} in 30 adam steps")
    assert losses[-1] < 0.8 * losses[0], losses

    y, _ = model(x)
    y_ref, _ = cv.moe.moe_ffn_reference(
        x, model.router_w[...], model.w_gate[...], model.w_up[...], model.w_down[...], top_k=2
    )
    err = float(jnp.abs(y - (x + y_ref)).max())
    print(f"max |error| vs the dense reference: {err:.1e}")
    assert err < 1e-4


if __name__ == "__main__":
    main()
