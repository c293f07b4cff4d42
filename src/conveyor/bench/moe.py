"""`conveyor bench moe`: the expert-parallel MoE layer's token exchange on 8 simulated CPU devices.

Design notes: docs/internals/benchmarks.md, section `bench/moe.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import conveyor as cv
from conveyor.bench.timing import interleaved_medians
from conveyor.moe.expert_parallel import capacity

DEVICES = 8
AXIS = "expert"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """Per-device tokens, model width, SwiGLU hidden size, experts in all, experts per token."""

    tokens: int = 1024
    d: int = 256
    f: int = 512
    experts: int = 16
    top_k: int = 2


CAPACITY_FACTORS = (None, 2.0, 1.25, 1.0)


def _smap(mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def run(reps: int = 5, shape: Shape = Shape()) -> str:
    devices = jax.devices()
    if len(devices) < DEVICES:
        raise RuntimeError(
            f"bench moe needs {DEVICES} devices, found {len(devices)}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before jax is imported"
        )
    mesh = Mesh(np.array(devices[:DEVICES]), (AXIS,))
    s = shape
    rng = np.random.default_rng(0)
    normal = lambda *dims: jnp.asarray(rng.standard_normal(dims) / np.sqrt(dims[-2]), jnp.float32)
    params = dict(
        router_w=normal(s.d, s.experts),
        w_gate=normal(s.experts, s.d, s.f),
        w_up=normal(s.experts, s.d, s.f),
        w_down=normal(s.experts, s.f, s.d),
    )
    x = jnp.asarray(rng.standard_normal((DEVICES * s.tokens, s.d)), jnp.float32)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    sharded = dict(router_w=P(), w_gate=P(AXIS), w_up=P(AXIS), w_down=P(AXIS))
    replicated = {k: P() for k in params}
    x = put(x, P(AXIS))
    ep_params = {k: put(v, sharded[k]) for k, v in params.items()}
    rep_params = {k: put(v, P()) for k, v in params.items()}

    def layer_step(capacity_factor, overlap=None):
        def loss(p, x):
            y, aux, dropped = cv.moe.moe_ffn_expert_parallel(
                x,
                **p,
                top_k=s.top_k,
                axis_name=AXIS,
                capacity_factor=capacity_factor,
                overlap=overlap,
            )
            return lax.psum(jnp.sum(y * y), AXIS) + aux, lax.psum(dropped, AXIS)

        def step(p, x):
            (value, dropped), grads = jax.value_and_grad(loss, has_aux=True)(p, x)
            return value, dropped, grads

        return _smap(mesh, step, (sharded, P(AXIS)), (P(), P(), sharded))

    def local_step(p, x):
        def loss(p, x):
            y, aux = cv.moe.moe_ffn(x, **p, top_k=s.top_k)  # aux over this device's tokens only
            return lax.psum(jnp.sum(y * y) + aux, AXIS)

        value, grads = jax.value_and_grad(loss)(p, x)
        return value, grads

    no_exchange = _smap(mesh, local_step, (replicated, P(AXIS)), (P(), replicated))

    rows = [
        f"# MoE expert-parallel exchange benchmark, {datetime.date.today().isoformat()}",
        "",
        f"{DEVICES} simulated CPU devices on one host (they share its cores and memory), 1-D mesh "
        f"'{AXIS}'; jax {jax.__version__}. Command: `conveyor bench moe`. Per device: {s.tokens} "
        f"tokens, d={s.d}, SwiGLU hidden {s.f}; {s.experts} experts ({s.experts // DEVICES} per "
        f"device), top-{s.top_k}; f32. Medians of {reps} interleaved runs, ms.",
        "",
        "| capacity | rows per destination | exchange buffer per device (MB) | one all_to_all | "
        "all_to_all rate (GB/s per device) | layer fwd+bwd | no-exchange fwd+bwd | layer / "
        "no-exchange | assignments dropped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for factor in (*CAPACITY_FACTORS, "peers", "experts"):
        overlap = factor if factor in ("peers", "experts") else None
        factor = None if overlap else factor
        if overlap == "experts" and s.experts < 2 * DEVICES:
            rows.append(
                f"| overlapped per expert | - | - | - | - | - | - | - | not run: needs 2 or more "
                f"local experts, this shape has {s.experts // DEVICES} per device |"
            )
            continue
        cap = capacity(s.tokens, s.top_k, DEVICES, factor)
        if overlap == "peers":  # one step's transfer: a whole chunk to the next peer (a ppermute)
            buffer = put(jnp.ones((DEVICES * cap, s.d), jnp.float32), P(AXIS))
            ring = [(i, (i + 1) % DEVICES) for i in range(DEVICES)]
            exchange = _smap(mesh, lambda b: lax.ppermute(b, AXIS, ring), (P(AXIS),), P(AXIS))
        else:
            buffer = jnp.ones((DEVICES * DEVICES, cap, s.d), jnp.float32)
            buffer = put(buffer, P(AXIS))
            exchange = _smap(
                mesh, lambda b: lax.all_to_all(b, AXIS, 0, 0, tiled=True), (P(AXIS),), P(AXIS)
            )
        step = layer_step(factor, overlap)
        _, dropped, _ = step(ep_params, x)
        t = interleaved_medians(
            {
                "exchange": lambda: exchange(buffer).block_until_ready(),
                "layer": lambda: jax.block_until_ready(step(ep_params, x)),
                "no_exchange": lambda: jax.block_until_ready(no_exchange(rep_params, x)),
            },
            reps,
        )
        # what each device sends (and receives) in one exchange (per peer: one step's chunk; per
        # expert: one stage's worst-case blocks, emulated on CPU as the exact exchange is)
        nbytes = (1 if overlap == "peers" else DEVICES) * cap * s.d * 4
        label = {
            "peers": "overlapped per peer, dropless (one chunk per step)",
            "experts": "overlapped per expert, dropless (one stage per step)",
        }.get(overlap, "dropless (worst case)" if factor is None else f"factor {factor}")
        rows.append(
            f"| {label} | {cap} | {nbytes / 1e6:.1f} | {t['exchange'] * 1e3:.2f} | "
            f"{nbytes / t['exchange'] / 1e9:.2f} | {t['layer'] * 1e3:.1f} | "
            f"{t['no_exchange'] * 1e3:.1f} | {t['layer'] / t['no_exchange']:.2f}x | {int(dropped)} "
            f"of {DEVICES * s.tokens * s.top_k} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    rows += [
        "",
        "The dropless capacity is the worst case (every local assignment bound for one device), so "
        "its buffers are D times the balanced need; a capacity factor c sizes them at c times the "
        "balanced share and drops (and counts) what does not fit. Dropless runs the exact "
        "exchange, `ragged_all_to_all` on GPU/TPU; XLA:CPU lacks it, so on CPU it is emulated "
        "with these worst-case blocks. The layer overlapped per peer (`overlap='peers'`) sends one "
        "peer's chunk per step (on CPU a ppermute of a whole worst-case chunk); per expert "
        "(`overlap='experts'`), one stage's exact exchange per step; XLA:CPU runs collectives "
        "synchronously, so here it shows the plan's cost, not its overlap (`conveyor simulate "
        "moe` predicts that).",
    ]
    return "\n".join(rows) + "\n"
