"""cv.moe inside an Equinox model (the `examples` extra: pip install conveyor[examples]).

Conveyor's core has no framework dependency: the MoE layer is plain functions of arrays, so a
framework module only holds the parameters and calls `cv.moe.moe_ffn`. Here an `eqx.Module` with a
residual MoE block is trained for a few optax steps, and its output is checked against the dense
reference with the same parameters.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import conveyor as cv


class MoEBlock(eqx.Module):
    """x + MoE(x), top-k routing over `experts` SwiGLU experts."""

    router_w: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    top_k: int = eqx.field(static=True)

    def __init__(self, d: int, f: int, experts: int, top_k: int, *, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.router_w = jax.random.normal(k1, (d, experts)) / d**0.5
        self.w_gate = jax.random.normal(k2, (experts, d, f)) / d**0.5
        self.w_up = jax.random.normal(k3, (experts, d, f)) / d**0.5
        self.w_down = jax.random.normal(k4, (experts, f, d)) / f**0.5
        self.top_k = top_k

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, aux = cv.moe.moe_ffn(
            x, self.router_w, self.w_gate, self.w_up, self.w_down, top_k=self.top_k
        )
        return x + y, aux


def main() -> None:
    tokens, d, f, experts = 256, 32, 64, 4
    model = MoEBlock(d, f, experts, top_k=2, key=jax.random.PRNGKey(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((tokens, d)), jnp.float32)
    target = jnp.tanh(
        x @ jnp.asarray(np.random.default_rng(1).standard_normal((d, d)) / d**0.5, jnp.float32)
    )

    def loss(model, x, target):
        y, aux = model(x)
        return jnp.mean((y - target) ** 2) + 0.01 * aux

    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, target)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    losses = []
    for _ in range(30):
        model, opt_state, value = step(model, opt_state)
        losses.append(float(value))
    print(f"equinox MoE block: loss {losses[0]:.4f} -> {losses[-1]:.4f} in 30 adam steps")
    assert losses[-1] < 0.8 * losses[0], losses

    y, _ = model(x)
    y_ref, _ = cv.moe.moe_ffn_reference(
        x, model.router_w, model.w_gate, model.w_up, model.w_down, top_k=2
    )
    err = float(jnp.abs(y - (x + y_ref)).max())
    print(f"max |error| vs the dense reference: {err:.1e}")
    assert err < 1e-4


if __name__ == "__main__":
    main()
