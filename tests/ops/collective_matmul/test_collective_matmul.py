"""Collective matmuls on simulated CPU devices: every device's result against the unfused reference.

Each device returns its own output (stacked on a new leading axis), so a device that computes a
wrong shard cannot hide behind another's correct one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import conveyor as cv
from tests.tolerance import matmul_tolerance
from conveyor.ops.collective_matmul import RingPlan


def ring_mesh(n, other=1):
    devs = np.array(jax.devices()[: n * other]).reshape(other, n)
    return Mesh(devs, ("y", "x"))


def per_device(mesh, fn, in_specs, *args):
    """Run fn under shard_map; returns an array [y, x, ...] of every device's output."""
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    f = jax.shard_map(
        lambda *a: fn(*a)[None, None], mesh=mesh, in_specs=tuple(in_specs), out_specs=P("y", "x")
    )
    return np.asarray(jax.jit(f)(*placed))


RNG = np.random.default_rng(7)


def arr(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("d", range(1, 10))
@pytest.mark.parametrize("bidi", [False, True])
def test_ring_plan_uses_every_shard_once(d, bidi):
    plan = RingPlan(num_devices=d, bidirectional=bidi, buffering=2)
    plan.check_covers_ring()
    assert plan.num_steps == (d // 2 + 1 if bidi else d)


@pytest.mark.parametrize("d", range(1, 10))
@pytest.mark.parametrize("buffering", [2, 3, 5])
@pytest.mark.parametrize("bidi", [False, True])
def test_ring_plan_credits_balance(d, buffering, bidi):
    plan = RingPlan(num_devices=d, bidirectional=bidi, buffering=min(buffering, d))
    for direction in ["right", "left"] if bidi else ["right"]:
        assert plan.credit_balance(direction) == 0
        # in lockstep, a sender never needs more credits than its neighbour has granted by then
        granted = plan.initial_credits(direction)
        used = 0
        for s in range(d):
            if plan.sends_at(s, direction):
                used += 1
                assert used <= granted, (d, buffering, direction, s)
            if plan.grants_credit_after(s, direction):
                granted += 1
    uses = plan.stream_uses("right") + plan.stream_uses("left")
    assert uses == d - 1  # every other device's shard arrives exactly once


@pytest.fixture(params=["per_step", "merged"])
def dot_schedule(request, monkeypatch):
    """Run the xla ring with one dot per step (what GPU/TPU lowerings get) and with the merged dots
    the CPU lowering gets, whatever platform the test runs on. Its tests name backend="xla": with
    backend=None each call would also trace the Mosaic ring for a TPU lowering (tested apart)."""
    from conveyor.ops.collective_matmul import xla

    merge = request.param == "merged"
    monkeypatch.setattr(
        xla, "_per_platform", lambda run, lhs, rhs, **cfg: run(lhs, rhs, merge=merge, **cfg)
    )
    return request.param


def _variants():
    for ring, other in [(8, 1), (4, 2), (3, 1), (2, 1)]:
        for bidi in (False, True):
            yield ring, other, bidi


@pytest.mark.parametrize("ring, other, bidi", list(_variants()))
def test_all_gather_matmul_contraction_sharded(ring, other, bidi, dot_schedule):
    mesh = ring_mesh(ring, other)
    # lhs [n, K] sharded over K on x, over n on y
    x, w = (
        arr(2 * other * 8, ring * 16),
        arr(ring * 16, 24),
    )
    out = per_device(
        mesh,
        lambda a, b: cv.all_gather_matmul(a, b, axis_name="x", bidirectional=bidi, backend="xla"),
        [P("y", "x"), P()],
        x,
        w,
    )
    expect = np.asarray(x @ w).reshape(other, -1, 24)
    # Another summation order than NumPy's: tests/tolerance.py derives the bound.
    tol = matmul_tolerance(x, w)
    for yi in range(other):
        for xi in range(ring):
            np.testing.assert_allclose(out[yi, xi], expect[yi], rtol=0, atol=tol)


@pytest.mark.parametrize("ring, other, bidi", list(_variants()))
def test_all_gather_matmul_row_sharded(ring, other, bidi, dot_schedule):
    mesh = ring_mesh(ring, other)
    x, w = arr(ring * 8, 32), arr(32, other * 16)
    out = per_device(
        mesh,
        lambda a, b: cv.all_gather_matmul(
            a, b, axis_name="x", gather_dim=0, bidirectional=bidi, backend="xla"
        ),
        [P("x", None), P(None, "y")],
        x,
        w,
    )
    # Another summation order than NumPy's: tests/tolerance.py derives the bound.
    tol = matmul_tolerance(x, w)
    for yi in range(other):
        expect = np.asarray(x @ w[:, yi * 16 : (yi + 1) * 16])
        for xi in range(ring):
            np.testing.assert_allclose(out[yi, xi], expect, rtol=0, atol=tol)


@pytest.mark.parametrize("scatter_dim", [0, 1])
@pytest.mark.parametrize("ring, other, bidi", list(_variants()))
def test_matmul_reduce_scatter(ring, other, bidi, scatter_dim, dot_schedule):
    mesh = ring_mesh(ring, other)
    a, b = arr(ring * 8, ring * 16), arr(ring * 16, ring * 4 * other)
    out = per_device(
        mesh,
        lambda l, r: cv.matmul_reduce_scatter(
            l, r, axis_name="x", scatter_dim=scatter_dim, bidirectional=bidi, backend="xla"
        ),
        [P(None, "x"), P("x", "y")],
        a,
        b,
    )
    for yi in range(other):
        cols = b.shape[1] // other
        full = np.asarray(a @ b[:, yi * cols : (yi + 1) * cols])
        blocks = np.split(full, ring, axis=scatter_dim)
        for xi in range(ring):  # another summation order: tests/tolerance.py
            np.testing.assert_allclose(out[yi, xi], blocks[xi], rtol=0, atol=matmul_tolerance(a, b))


@pytest.mark.parametrize("op, dim", [("agm", 1), ("agm", 0), ("mrs", 0), ("mrs", 1)])
def test_gradients_match_autodiff_of_the_reference(op, dim):
    mesh = ring_mesh(4)
    if op == "agm":
        shapes = ((8, 4 * 8), (4 * 8, 12)) if dim == 1 else ((4 * 4, 16), (16, 12))
        specs = [P(None, "x"), P()] if dim == 1 else [P("x", None), P()]
        call = lambda backend: (
            lambda l, r: cv.all_gather_matmul(l, r, axis_name="x", gather_dim=dim, backend=backend)
        )
    else:
        shapes = ((16, 4 * 8), (4 * 8, 8))
        specs = [P(None, "x"), P("x", None)]
        call = lambda backend: (
            lambda l, r: cv.matmul_reduce_scatter(
                l, r, axis_name="x", scatter_dim=dim, backend=backend
            )
        )
    lhs, rhs = arr(*shapes[0]), arr(*shapes[1])

    def grads(backend):
        def local(l, r):
            def loss(l, r):
                return jnp.sum(jnp.sin(call(backend)(l, r)))

            gl, gr = jax.grad(loss, argnums=(0, 1))(l, r)
            return gl[None, None], gr[None, None]

        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((lhs, rhs), specs)]
        f = jax.shard_map(
            local, mesh=mesh, in_specs=tuple(specs), out_specs=(P("y", "x"), P("y", "x"))
        )
        return [np.asarray(g) for g in jax.jit(f)(*placed)]

    for got, want in zip(grads("xla"), grads("reference")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_input_errors():
    mesh = ring_mesh(4)
    x, w = arr(8, 32), arr(32, 8)

    def run(fn, specs, *args):
        return per_device(mesh, fn, specs, *args)

    with pytest.raises(ValueError, match=r"axis_name: 'nope' is not a mesh axis"):
        run(
            lambda a, b: cv.all_gather_matmul(a, b, axis_name="nope"),
            [P(None, "x"), P()],
            x,
            arr(128, 8),
        )
    with pytest.raises(
        ValueError,
        match=r"rhs: contraction size rhs.shape\[0\] must be 32 \(4 devices x lhs.shape\[1\]=8\)",
    ):
        run(
            lambda a, b: cv.all_gather_matmul(a, b, axis_name="x"),
            [P(None, "x"), P()],
            x,
            arr(16, 8),
        )
    with pytest.raises(ValueError, match=r"buffering: expected an int >= 1"):
        run(
            lambda a, b: cv.all_gather_matmul(a, b, axis_name="x", buffering=0),
            [P(None, "x"), P()],
            x,
            w,
        )
    with pytest.raises(ValueError, match=r"must be divisible by the ring size 4"):
        run(lambda a, b: cv.matmul_reduce_scatter(a, b, axis_name="x"), [P(), P()], arr(6, 32), w)
    with pytest.raises(
        ValueError, match=r"rhs: contraction size rhs.shape\[0\] must match lhs.shape\[1\]=32"
    ):
        run(
            lambda a, b: cv.matmul_reduce_scatter(a, b, axis_name="x"),
            [P(), P()],
            arr(8, 32),
            arr(16, 8),
        )
    with pytest.raises(ValueError, match=r"gather_dim: expected 0 or 1"):
        run(
            lambda a, b: cv.all_gather_matmul(a, b, axis_name="x", gather_dim=2),
            [P(None, "x"), P()],
            x,
            w,
        )


def test_cpu_lowering_merges_the_dots_and_accelerator_lowerings_keep_one_per_step():
    mesh = ring_mesh(4)
    f = jax.jit(
        jax.shard_map(
            lambda a, b: cv.all_gather_matmul(a, b, axis_name="x", bidirectional=False),
            mesh=mesh,
            in_specs=(P(None, "x"), P()),
            out_specs=P(),
            check_vma=False,
        )
    )
    args = (jax.ShapeDtypeStruct((8, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))
    cpu_text = f.lower(*args).as_text()
    assert (
        cpu_text.count("stablehlo.dot_general") == 1 and cpu_text.count("collective_permute") == 3
    )
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    tpu = AbstractMesh(
        (4,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice("TPU v5 lite", 4, "tpu")
    )
    g = jax.jit(
        jax.shard_map(
            lambda a, b: cv.all_gather_matmul(
                a, b, axis_name="x", bidirectional=False, backend="xla"
            ),
            mesh=tpu,
            in_specs=(P(None, "x"), P()),
            out_specs=P(),
            check_vma=False,
        )
    )
    tpu_text = jax.export.export(g, platforms=["tpu"])(*args).mlir_module()
    assert tpu_text.count("stablehlo.dot_general") == 4
