"""Collective matmul rings on multi-axis meshes, inside shard_map with check_vma=True.

The ring runs over one mesh axis; every other axis keeps its coordinate (independent rings). Each
device gets its own data (operands vary over every mesh axis), and each variant is compared,
device by device, with the `reference` backend (lax.all_gather / psum_scatter and a dot) run in
the same shard_map. The Mosaic TPU kernels run through the TPU interpreter with race detection on.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec as P

import conveyor as cv

MESHES = {"2x4": ((2, 4), ("dp", "x")), "2x2x2": ((2, 2, 2), ("dp", "x", "mp"))}
# (op, dim) -> (local lhs shape, local rhs shape, rhs varies per device?) for a ring of size D.
SHAPES = {
    ("agm", 1): lambda d: ((8, 128), (128 * d, 128), False),
    ("agm", 0): lambda d: ((8, 128), (128, 128), False),
    ("mrs", 0): lambda d: ((8 * d, 128), (128, 256), True),
    ("mrs", 1): lambda d: ((16, 128), (128, 128 * d), True),
}
# f32 dots of at most 512 terms, summed over at most 4 devices in another order than the
# reference: rounding ~ eps * sqrt(terms) * |largest partial| stays below 1e-4 relative here.
RTOL = 1e-4


def _mesh(name):
    shape, axes = MESHES[name]
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), axes)


def _operands(mesh, op, dim, seed):
    d = mesh.shape["x"]
    lhs_shape, rhs_shape, rhs_varies = SHAPES[(op, dim)](d)
    rng = np.random.default_rng(seed)
    n = mesh.devices.size
    lhs = jnp.asarray(rng.standard_normal((n, *lhs_shape)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((n if rhs_varies else 1, *rhs_shape)), jnp.float32)
    return lhs, rhs, rhs_varies


def _call(op, dim, bidirectional, backend, interpret, a, b):
    if op == "agm":
        return cv.all_gather_matmul(
            a,
            b,
            axis_name="x",
            gather_dim=dim,
            bidirectional=bidirectional,
            backend=backend,
            interpret=interpret,
        )
    return cv.matmul_reduce_scatter(
        a,
        b,
        axis_name="x",
        scatter_dim=dim,
        bidirectional=bidirectional,
        backend=backend,
        interpret=interpret,
    )


def _run(mesh, op, dim, bidirectional, backend, interpret, lhs, rhs, rhs_varies, grad=False):
    every = P(mesh.axis_names)

    def local(a, b):
        a, b = a[0], b[0]
        f = functools.partial(_call, op, dim, bidirectional, backend, interpret)
        if grad:
            ga, gb = jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1))(a, b)
            return ga[None], gb[None]
        return f(a, b)[None]

    out_specs = (every, every if rhs_varies else P()) if grad else every
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(every, every if rhs_varies else P()), out_specs=out_specs
    )
    return jax.jit(fn)(lhs, rhs)


VARIANTS = [(op, dim, bidi) for op, dim in SHAPES for bidi in (False, True)]


# Both DMA modes, one per mesh: what the meshes test (remote copies addressed by mesh axis) does
# not depend on the mode, and tests/ops/collective_matmul runs every ring in both.
@pytest.mark.parametrize("mesh_name, mode", [("2x4", "on_wait"), ("2x2x2", "eager")])
@pytest.mark.parametrize("op, dim, bidirectional", VARIANTS)
def test_mosaic_tpu_ring_on_multi_axis_mesh_matches_reference(
    mesh_name, mode, op, dim, bidirectional
):
    mesh = _mesh(mesh_name)
    lhs, rhs, varies = _operands(
        mesh, op, dim, seed=zlib.crc32(f"{mesh_name}{op}{dim}{bidirectional}".encode())
    )
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    got = _run(mesh, op, dim, bidirectional, "mosaic_tpu", ip, lhs, rhs, varies)
    want = _run(mesh, op, dim, bidirectional, "reference", False, lhs, rhs, varies)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(jnp.abs(want).max()))


GRADIENT_VARIANTS = [("agm", 1, True), ("agm", 0, False), ("mrs", 0, True), ("mrs", 1, False)]


# Every variant's forward runs on both meshes above; a gradient composes the same kernels (each
# op's transpose is the other ring). On the TPU interpreter (7-9 s a case) two variants, one per
# op, run the transposed kernels on the multi-axis mesh; xla runs all four.
@pytest.mark.parametrize(
    "backend, op, dim, bidirectional",
    [("xla", *v) for v in GRADIENT_VARIANTS]
    + [("mosaic_tpu", *v) for v in (GRADIENT_VARIANTS[0], GRADIENT_VARIANTS[3])],
)
def test_ring_gradients_on_multi_axis_mesh_match_reference(backend, op, dim, bidirectional):
    mesh = _mesh("2x4")
    lhs, rhs, varies = _operands(mesh, op, dim, seed=7)
    ip = pltpu.InterpretParams(detect_races=True) if backend == "mosaic_tpu" else False
    got = _run(mesh, op, dim, bidirectional, backend, ip, lhs, rhs, varies, grad=True)
    want = _run(mesh, op, dim, bidirectional, "reference", False, lhs, rhs, varies, grad=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * float(jnp.abs(w).max()))


@pytest.mark.parametrize("op, dim, bidirectional", VARIANTS)
def test_xla_ring_on_3_axis_mesh_matches_reference(op, dim, bidirectional):
    mesh = _mesh("2x2x2")
    lhs, rhs, varies = _operands(mesh, op, dim, seed=3)
    got = _run(mesh, op, dim, bidirectional, "xla", False, lhs, rhs, varies)
    want = _run(mesh, op, dim, bidirectional, "reference", False, lhs, rhs, varies)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(jnp.abs(want).max()))
