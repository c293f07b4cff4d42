"""The MoE part of `conveyor demo`: train cv.moe's expert-parallel layer, its exchange overlapped
with the expert matmuls (peer by peer), with optax on 8 simulated CPU devices (a 2 x 4 data x
expert mesh), check its gradients against the dense reference, and ask the simulator what the
layer's expert matmuls would take on an H100 and a TPU v5e."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import conveyor as cv

MESH_SHAPE, AXES = (2, 4), ("data", "expert")
DEVICES = MESH_SHAPE[0] * MESH_SHAPE[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layer:
    tokens: int = 512
    d: int = 64
    f: int = 128
    experts: int = 8
    top_k: int = 2
    steps: int = 40
    learning_rate: float = 3e-3
    aux_weight: float = 0.01
    overlap: str | None = "peers"  # cv.moe.moe_ffn_expert_parallel's (docs/moe.md)


SPECS = dict(router_w=P(), w_gate=P("expert"), w_up=P("expert"), w_down=P("expert"))


def _init(c: Layer, rng):
    n = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), jnp.float32)
    return dict(
        router_w=n(c.d, c.experts),
        w_gate=n(c.experts, c.d, c.f),
        w_up=n(c.experts, c.d, c.f),
        w_down=n(c.experts, c.f, c.d),
    )


def _loss_fn(c: Layer, mesh):
    def local(params, x, target):
        y, aux, _ = cv.moe.moe_ffn_expert_parallel(
            x, **params, top_k=c.top_k, axis_name="expert", loss_axes=AXES, overlap=c.overlap
        )
        return jax.lax.pmean(jnp.mean((y - target) ** 2), AXES) + c.aux_weight * aux

    return jax.shard_map(local, mesh=mesh, in_specs=(SPECS, P(AXES), P(AXES)), out_specs=P())


def _reference_loss(c: Layer):
    def loss(params, x, target):
        y, aux = cv.moe.moe_ffn_reference(x, **params, top_k=c.top_k)
        return jnp.mean((y - target) ** 2) + c.aux_weight * aux

    return loss


def train(c: Layer = Layer()) -> bool:
    import optax

    if jax.device_count() < DEVICES:
        raise RuntimeError(
            f"the MoE demo needs {DEVICES} devices; run it as `python examples/demo.py` (which "
            f"sets XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES})"
        )
    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(MESH_SHAPE), AXES)
    rng = np.random.default_rng(1)
    params = _init(c, rng)
    teacher = _init(c, np.random.default_rng(2))
    x = jnp.asarray(rng.standard_normal((c.tokens, c.d)), jnp.float32)
    target, _ = cv.moe.moe_ffn_reference(x, **teacher, top_k=c.top_k)  # a task the layer can learn
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    params = {k: put(v, SPECS[k]) for k, v in params.items()}
    x, target = put(x, P(AXES)), put(target, P(AXES))
    print(
        f"\nMoE layer: {c.tokens} tokens, d={c.d}, SwiGLU hidden {c.f}, {c.experts} experts, "
        f"top-{c.top_k}; {DEVICES} CPU devices as data {MESH_SHAPE[0]} x expert {MESH_SHAPE[1]} (2 "
        f"experts per device); exchange overlapped with the experts: {c.overlap}"
    )

    loss = _loss_fn(c, mesh)
    # One compiled forward + backward serves the gradient check and every training step.
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    _, grads = value_and_grad(params, x, target)
    ref = jax.jit(jax.grad(_reference_loss(c)))(
        {k: jnp.asarray(v) for k, v in params.items()}, x, target
    )
    grad_err = max(float(jnp.abs(grads[k] - ref[k]).max() / jnp.abs(ref[k]).max()) for k in params)
    grad_ok = grad_err < 1e-4
    print(
        "gradients vs the dense reference (every token through every expert): max relative error "
        f"{grad_err:.1e}: {'OK' if grad_ok else 'MISMATCH'}"
    )

    optimizer = optax.adam(c.learning_rate)

    @jax.jit
    def update(params, opt_state, g):
        updates, opt_state = optimizer.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    losses, t0 = [], None
    for i in range(c.steps):
        value, g = value_and_grad(params, x, target)
        params, opt_state = update(params, opt_state, g)
        losses.append(float(value))
        if i == 0:
            t0 = time.perf_counter()
        if i % 8 == 0 or i == c.steps - 1:
            print(f"  step {i:3d}  loss {losses[-1]:.4f}")
    per_step = (time.perf_counter() - t0) / max(1, c.steps - 1)
    falling = losses[-1] < 0.7 * losses[0]
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {c.steps} adam steps ({per_step * 1e3:.1f} "
        f"ms/step on CPU): {'OK' if falling else 'NOT FALLING'}"
    )
    _predict(
        c,
        np.asarray(
            jax.jit(lambda p, x: cv.moe.route(x, p["router_w"], top_k=c.top_k).experts)(params, x)
        ),
    )
    return grad_ok and falling


def _predict(c: Layer, experts: np.ndarray) -> None:
    """The simulator's time for the layer's three expert matmuls (forward) with the routing the
    trained router produces, per device: each expert-axis device owns E / 4 experts."""
    sizes = np.bincount(experts.reshape(-1), minlength=c.experts)
    print(f"tokens per expert after training: {sizes.tolist()}")
    for hw in ("h100", "v5e"):
        gate = cv.sim.simulate_gmm(sizes.tolist(), c.d, c.f, dtype="bf16", hardware=hw)
        down = cv.sim.simulate_gmm(sizes.tolist(), c.f, c.d, dtype="bf16", hardware=hw)
        total = 2 * gate.time_s + down.time_s
        print(
            f"simulated on {gate.hardware.name}: the expert matmuls of one forward (all "
            f"{c.experts} experts, bf16) {total * 1e6:.1f} us ({gate.bottleneck}-bound)"
        )
