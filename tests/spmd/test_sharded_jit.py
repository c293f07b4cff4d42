"""gmm / tgmm under plain `jax.jit` with sharded operands (8 simulated devices, a 4x2 data x model
mesh).

The ops carry a sharding rule (conveyor.ops.gmm.partitioning): tokens sharded over `data` stay
where they are (no all-gather), output features sharded over `model` stay sharded, a sharded
contraction or tgmm's row sum costs exactly one all-reduce. Each test counts the collectives in
the compiled HLO and checks the values against a float64 NumPy oracle, on meshes with Auto axes
(sharding by propagation) and Explicit axes (sharding in types, `jax.make_mesh`'s default).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import conveyor as cv
from tests.ops.gmm.base import assert_close
from tests.ops.gmm.problems import numpy_gmm, numpy_tgmm

M, K, N, G = 64, 32, 48, 4
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.fixture(params=["Auto", "Explicit"])
def mesh(request):
    return jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(getattr(AxisType, request.param),) * 2
    )


def collectives(fn, *args) -> dict:
    hlo = fn.lower(*args).compile().as_text()
    return {c: len(re.findall(rf"\b{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}


def none_but(**expected) -> dict:
    return {c: expected.get(c.replace("-", "_"), 0) for c in COLLECTIVES}


def operands(seed, sizes, groups=G, k=K):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, k)).astype(np.float32)
    w = rng.standard_normal((groups, k, N)).astype(np.float32)
    return x, w, np.asarray(sizes, np.int32)


def put(mesh, x, *spec):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(*spec)))


# Group boundaries fall inside device row ranges (16 rows each), one group is empty, 6 rows are
# padding past the last group.
SIZES = [13, 0, 30, 15]


def test_token_sharded_gmm_runs_without_collectives(mesh):
    x, w, sizes = operands(0, SIZES)
    f = jax.jit(lambda x, w, s: cv.gmm(x, w, s))
    args = (put(mesh, x, "data", None), put(mesh, w, None, None, "model"), put(mesh, sizes))
    assert collectives(f, *args) == none_but()
    out = f(*args)
    assert out.sharding.spec == P("data", "model")
    assert_close(out, numpy_gmm(x, w, sizes), K, jnp.float32)


def test_gradients_cost_one_all_reduce_per_sharded_sum(mesh):
    """d lhs contracts the model-sharded features (one all-reduce over model); d rhs sums the
    data-sharded rows (one all-reduce over data). Nothing is gathered."""
    x, w, sizes = operands(1, SIZES)
    dy = np.random.default_rng(2).standard_normal((M, N)).astype(np.float32)

    def loss(x, w, s, dy):
        return jnp.sum(cv.gmm(x, w, s) * dy)

    f = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (
        put(mesh, x, "data", None),
        put(mesh, w, None, None, "model"),
        put(mesh, sizes),
        put(mesh, dy, "data", "model"),
    )
    assert collectives(f, *args) == none_but(all_reduce=2)
    dx, dw = f(*args)
    dx_want = numpy_gmm(dy, np.swapaxes(w, 1, 2), sizes)  # dy[rows_g] @ w_g^T
    dw_want = numpy_tgmm(x.T, dy, sizes)  # x[rows_g]^T @ dy[rows_g]
    assert_close(dx, dx_want, N, jnp.float32)
    assert_close(dw, dw_want, M, jnp.float32)


def test_contraction_sharded_over_model_is_one_all_reduce(mesh):
    """A row-parallel layer: lhs and rhs share a model-sharded k; rows outside every group keep
    existing_out, which must not be summed over the model axis."""
    x, w, sizes = operands(3, SIZES)
    existing = np.random.default_rng(4).standard_normal((M, N)).astype(np.float32)
    f = jax.jit(lambda x, w, s, e: cv.gmm(x, w, s, existing_out=e))
    args = (
        put(mesh, x, "data", "model"),
        put(mesh, w, None, "model", None),
        put(mesh, sizes),
        put(mesh, existing, "data", None),
    )
    assert collectives(f, *args) == none_but(all_reduce=1)
    assert_close(f(*args), numpy_gmm(x, w, sizes, existing=existing), K, jnp.float32)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_token_sharded_tgmm_sums_partial_products_once(mesh, out_dtype):
    x, _, sizes = operands(5, SIZES)
    dy = np.random.default_rng(6).standard_normal((M, N)).astype(np.float32)
    existing = np.random.default_rng(7).standard_normal((G, K, N)).astype(np.float32)
    f = jax.jit(
        lambda a, b, s, e: cv.tgmm(a, b, s, existing_out=e, preferred_element_type=out_dtype)
    )
    args = (
        put(mesh, x.T, None, "data"),
        put(mesh, dy, "data", "model"),
        put(mesh, sizes),
        put(mesh, existing),
    )
    assert collectives(f, *args) == none_but(all_reduce=1)
    out = f(*args)
    assert out.dtype == out_dtype
    # bf16: the rows' partial sums are added in float32, then rounded once (2 ulps in the bound).
    assert_close(out, numpy_tgmm(x.T, dy, sizes, existing=existing), M, out_dtype)


def test_local_experts_with_group_offset_and_transposed_weights(mesh):
    """Expert subset 1..2 of 4 (group_offset) with rhs stored as [g, n, k]: rows of other experts
    keep existing_out; still no collective."""
    x, _, sizes = operands(8, SIZES)
    w_t = np.random.default_rng(9).standard_normal((2, N, K)).astype(np.float32)
    existing = np.random.default_rng(10).standard_normal((M, N)).astype(np.float32)
    f = jax.jit(
        lambda x, w, s, e: cv.gmm(x, w, s, transpose_rhs=True, group_offset=1, existing_out=e)
    )
    args = (
        put(mesh, x, "data", None),
        put(mesh, w_t, None, "model", None),
        put(mesh, sizes),
        put(mesh, existing, "data", "model"),
    )
    assert collectives(f, *args) == none_but()
    assert_close(
        f(*args),
        numpy_gmm(x, w_t, sizes, transpose_rhs=True, existing=existing, offset=1),
        K,
        jnp.float32,
    )


def test_lax_ragged_dot_baseline_also_has_no_collective():
    """The bar: lax.ragged_dot under the same sharding gathers nothing either. (Auto axes only:
    with Explicit axes jax 0.12's ragged_dot raises NotImplementedError, where cv.gmm works.)"""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x, w, sizes = operands(11, SIZES)
    f = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
    args = (put(mesh, x, "data", None), put(mesh, w, None, None, "model"), put(mesh, sizes))
    assert collectives(f, *args)["all-gather"] == 0
