"""Named problem shapes and the skewed group-size distribution, shared by demo, benchmarks and
docs."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class GmmProblem:
    name: str
    m: int
    k: int
    n: int
    groups: int
    alpha: float = 1.0  # Dirichlet concentration of group sizes: smaller is more skewed


def skewed_group_sizes(m: int, groups: int, *, seed: int = 0, alpha: float = 1.0) -> np.ndarray:
    """int32[groups] summing to m, drawn from a seeded Dirichlet(alpha) split (as MoE routers skew).

    An even split flatters every kernel; real routers give some experts many tokens and some none.
    """
    return dirichlet_split(np.random.default_rng(seed), m, groups, alpha)


def dirichlet_split(rng: np.random.Generator, total: int, groups: int, alpha: float) -> np.ndarray:
    """int32[groups] summing to `total`: a Dirichlet(alpha) split drawn from `rng`, floored, the
    remainder given to the largest group (some groups may be empty)."""
    sizes = np.floor(rng.dirichlet(np.full(groups, alpha)) * total).astype(np.int32)
    sizes[np.argmax(sizes)] += total - int(sizes.sum())
    return sizes


# The benchmark table of issue #2: m=4096, k=n=1024, G in {1, 8, 64, 256}.
BENCH_GMM = tuple(
    GmmProblem(name=f"moe-g{g}", m=4096, k=1024, n=1024, groups=g) for g in (1, 8, 64, 256)
)
# The demo's MoE feed-forward layer: small enough to run in seconds.
DEMO_MOE = GmmProblem(name="demo-moe", m=2048, k=512, n=1024, groups=8)

# The GPU benchmark of issue #12: the Mixtral-8x7B expert shape (tokens x d_model x d_ff), bf16.
BENCH_GMM_GPU = tuple(
    GmmProblem(name=f"mixtral-g{g}", m=8192, k=4096, n=14336, groups=g) for g in (8, 64, 256)
)
