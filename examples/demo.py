"""`conveyor demo` / `make demo`: grouped matmuls, then a Mixture-of-Experts layer trained on 8
devices. Run it as a script: `python examples/demo.py`.

Part 1 checks an MoE feed-forward block's values and gradients against the reference backend and
times it next to the same block built on `jax.lax.ragged_dot`. Part 2 (`demo_moe`) trains
`cv.moe`'s expert-parallel layer with optax on 8 simulated CPU devices and asks the simulator for
H100 and TPU v5e times. The demo re-executes itself with 8 CPU devices when it has fewer.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import conveyor as cv
from conveyor.bench.timing import interleaved_medians
from conveyor.problems import DEMO_MOE, skewed_group_sizes


def moe_layer(x, w_in, w_out, group_sizes, matmul):
    """Tokens sorted by expert -> per-expert gelu MLP."""
    return matmul(jax.nn.gelu(matmul(x, w_in, group_sizes)), w_out, group_sizes)


FLAG = "--xla_force_host_platform_device_count=8"


def main() -> int:
    if FLAG not in os.environ.get("XLA_FLAGS", ""):  # jax reads it once, at backend start: restart
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip())
        env.setdefault("JAX_PLATFORMS", "cpu")
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)], env)
    try:
        import optax  # noqa: F401  (demo_moe trains with it)
    except ModuleNotFoundError:
        print("the demo trains with optax: pip install 'conveyor[demo]'", file=sys.stderr)
        return 1
    ok = grouped_matmul_demo()
    import demo_moe  # examples/demo_moe.py: this script's folder is on sys.path

    return 0 if demo_moe.train() and ok else 1


def grouped_matmul_demo() -> bool:
    p = DEMO_MOE
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(skewed_group_sizes(p.m, p.groups, seed=0))
    x = jnp.asarray(rng.standard_normal((p.m, p.k)), jnp.float32)
    w_in = jnp.asarray(rng.standard_normal((p.groups, p.k, p.n)) / np.sqrt(p.k), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((p.groups, p.n, p.k)) / np.sqrt(p.n), jnp.float32)
    print(
        f"MoE FFN: {p.m} tokens, d={p.k}, hidden={p.n}, {p.groups} experts, tokens per expert "
        f"{np.asarray(sizes).tolist()}"
    )

    def step(matmul):
        loss = lambda x, a, b: jnp.mean(moe_layer(x, a, b, sizes, matmul) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    ours = step(lambda a, b, s: cv.gmm(a, b, s))
    ref = step(lambda a, b, s: cv.gmm(a, b, s, backend="reference"))
    ragged = step(lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32))

    (l1, g1), (l2, g2) = ours(x, w_in, w_out), ref(x, w_in, w_out)
    errs = [float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(g1, g2)]
    ok = abs(float(l1 - l2)) <= 1e-5 * abs(float(l2)) and max(errs) < 1e-5
    print(
        f"loss {float(l1):.6f} (reference {float(l2):.6f}); max relative gradient error "
        f"{max(errs):.1e}: {'OK' if ok else 'MISMATCH'}"
    )
    t = interleaved_medians(
        {"cv.gmm": lambda: ours(x, w_in, w_out), "lax.ragged_dot": lambda: ragged(x, w_in, w_out)},
        reps=3,
    )
    print(
        f"forward+backward: cv.gmm {t['cv.gmm'] * 1e3:.1f} ms, lax.ragged_dot "
        f"{t['lax.ragged_dot'] * 1e3:.1f} ms ({t['lax.ragged_dot'] / t['cv.gmm']:.1f}x faster) on "
        f"{jax.default_backend()}"
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
