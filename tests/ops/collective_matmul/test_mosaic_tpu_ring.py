"""The Mosaic TPU ring kernel through the TPU interpreter on simulated devices, race detector on.

A race makes the interpreter raise; both DMA execution modes are run because a race can hide in
one of them (the upstream ring example is wrong in on_wait mode only).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import conveyor as cv
from tests.tolerance import matmul_tolerance

RNG = np.random.default_rng(11)


def _with_modes(configs):
    """Each (ring, bidirectional) config in on_wait mode, where the upstream ring example's race
    shows; eager mode, the other interleaving of the same DMAs, on the largest ring under 8
    devices of each direction (the smaller rings run the same protocol with fewer steps), to keep
    the suite's time in budget."""
    eager = [
        max((c for c in configs if c[1] == bidi and c[0] < 8), key=lambda c: c[0], default=None)
        for bidi in (False, True)
    ]
    return [(*c, "on_wait") for c in configs] + [(*c, "eager") for c in eager if c is not None]


def _run(ring, mode, buffering=2, grad=False, bidirectional=False):
    mesh = Mesh(np.array(jax.devices()[:ring]), ("x",))
    x = jnp.asarray(RNG.standard_normal((8, 128 * ring)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((128 * ring, 128)), jnp.float32)
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)

    def local(a, b):
        f = lambda a, b: cv.all_gather_matmul(
            a,
            b,
            axis_name="x",
            bidirectional=bidirectional,
            buffering=buffering,
            backend="mosaic_tpu",
            interpret=ip,
        )
        if grad:
            return jax.grad(lambda a: jnp.sum(f(a, b) ** 2))(a)[None]
        return f(a, b)[None]

    fn = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(None, "x"), P()), out_specs=P("x"), check_vma=False
        )
    )
    out = np.asarray(
        fn(
            jax.device_put(x, NamedSharding(mesh, P(None, "x"))),
            jax.device_put(w, NamedSharding(mesh, P())),
        )
    )
    return out, x, w


@pytest.mark.parametrize(
    "ring, bidirectional, mode", _with_modes([(r, b) for r in (2, 4, 8) for b in (False, True)])
)
def test_ring_is_correct_and_race_free(ring, mode, bidirectional):
    out, x, w = _run(ring, mode, bidirectional=bidirectional)
    for d in range(ring):  # another summation order: tests/tolerance.py
        np.testing.assert_allclose(out[d], x @ w, rtol=0, atol=matmul_tolerance(x, w))


@pytest.mark.parametrize("ring, bidirectional", [(4, False), (5, True)])
def test_deeper_buffering_and_odd_rings_are_correct_and_race_free(ring, bidirectional):
    out, x, w = _run(ring, "on_wait", buffering=3, bidirectional=bidirectional)
    for d in range(ring):  # another summation order: tests/tolerance.py
        np.testing.assert_allclose(out[d], x @ w, rtol=0, atol=matmul_tolerance(x, w))


def test_gradient_through_the_kernel():
    out, x, w = _run(4, "eager", grad=True)
    # d/dx sum((x @ w)^2) summed over the 4 devices' identical losses, sliced per device shard
    full = np.asarray(4 * 2 * (x @ w) @ w.T)
    # f32 sums of 512 products: summation-order error ~ eps * sqrt(512) * the largest magnitude
    atol = 4 * np.finfo(np.float32).eps * np.sqrt(512) * np.abs(full).max()
    np.testing.assert_allclose(
        out.reshape(4, 8, -1), np.stack(np.split(full, 4, axis=1)), rtol=1e-5, atol=atol
    )


def test_unsupported_configurations_are_refused_when_named():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x = jax.device_put(jnp.ones((8, 256)), NamedSharding(mesh, P(None, "x")))
    bad = jax.shard_map(
        lambda a, b: cv.matmul_reduce_scatter(
            a, b, axis_name="x", backend="mosaic_tpu", interpret=True
        ),
        mesh=mesh,
        in_specs=(P(None, "x"), P()),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(NotImplementedError, match="needs an even count; pass bidirectional=False"):
        jax.jit(bad)(x, jax.device_put(jnp.ones((128, 127)), NamedSharding(mesh, P())))
    bad1 = jax.shard_map(
        lambda a, b: cv.matmul_reduce_scatter(
            a, b, axis_name="x", scatter_dim=1, backend="mosaic_tpu", interpret=True
        ),
        mesh=mesh,
        in_specs=(P(None, "x"), P("x", None)),
        out_specs=P(None, "x"),
        check_vma=False,
    )
    with pytest.raises(
        NotImplementedError, match="splits each device's 3 output columns in halves"
    ):
        jax.jit(bad1)(x, jax.device_put(jnp.ones((256, 6)), NamedSharding(mesh, P("x", None))))
    # 32 columns per device: HBM is sliced in whole 128-lane tiles by the real Mosaic TPU lowering
    # (the interpreter would run it), so it is refused before lowering, in interpret mode too.
    with pytest.raises(
        NotImplementedError,
        match=r"slice rhs \[128, 64\] in HBM at 16-column ranges \(each "
        r"device's 32 output columns in halves\).*128-lane tiles",
    ):
        jax.jit(bad1)(x, jax.device_put(jnp.ones((256, 64)), NamedSharding(mesh, P("x", None))))
    # bf16 row blocks of 8 rows per device: not whole (16, 128) tiles
    xb = jax.device_put(jnp.ones((16, 256), jnp.bfloat16), NamedSharding(mesh, P(None, "x")))
    with pytest.raises(
        NotImplementedError,
        match=r"lhs \(each device's row block\) out of HBM in blocks of 8 "
        r"rows per device; .* bfloat16 in whole tiles of 16 rows",
    ):
        jax.jit(bad)(
            xb, jax.device_put(jnp.ones((128, 256), jnp.bfloat16), NamedSharding(mesh, P()))
        )


def test_exports_for_tpu():
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    mesh = AbstractMesh(
        (4,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice("TPU v5 lite", 4, "tpu")
    )
    f = jax.jit(
        jax.shard_map(
            lambda a, b: cv.all_gather_matmul(
                a, b, axis_name="x", bidirectional=False, backend="mosaic_tpu"
            ),
            mesh=mesh,
            in_specs=(P(None, "x"), P()),
            out_specs=P(),
            check_vma=False,
        )
    )
    exported = jax.export.export(f, platforms=["tpu"])(
        jax.ShapeDtypeStruct((8, 512), jnp.float32), jax.ShapeDtypeStruct((512, 128), jnp.float32)
    )
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize(
    # rings up to 4 (3 steps: every slot reused); the 8-chip ring runs the gather's protocol
    # above, and compile-check compiles the reduce-scatter ring at 8 chips
    "ring, bidirectional, mode",
    _with_modes([(r, b) for r in (2, 3, 4) for b in (False, True)]),
)
def test_reduce_scatter_ring_is_correct_and_race_free(ring, mode, bidirectional):
    mesh = Mesh(np.array(jax.devices()[:ring]), ("x",))
    a = jnp.asarray(RNG.standard_normal((8 * ring, 128 * ring)), jnp.float32)
    b = jnp.asarray(RNG.standard_normal((128 * ring, 128)), jnp.float32)
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    fn = jax.jit(
        jax.shard_map(
            lambda l, r: cv.matmul_reduce_scatter(
                l, r, axis_name="x", bidirectional=bidirectional, backend="mosaic_tpu", interpret=ip
            ),
            mesh=mesh,
            in_specs=(P(None, "x"), P("x", None)),
            out_specs=P("x", None),
            check_vma=False,
        )
    )
    out = fn(
        jax.device_put(a, NamedSharding(mesh, P(None, "x"))),
        jax.device_put(b, NamedSharding(mesh, P("x", None))),
    )
    # another summation order: tests/tolerance.py
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(a @ b), rtol=0, atol=matmul_tolerance(a, b)
    )


def test_reduce_scatter_exports_for_tpu():
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    mesh = AbstractMesh(
        (4,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice("TPU v5 lite", 4, "tpu")
    )
    f = jax.jit(
        jax.shard_map(
            lambda a, b: cv.matmul_reduce_scatter(
                a, b, axis_name="x", bidirectional=False, backend="mosaic_tpu"
            ),
            mesh=mesh,
            in_specs=(P(None, "x"), P("x", None)),
            out_specs=P("x", None),
            check_vma=False,
        )
    )
    exported = jax.export.export(f, platforms=["tpu"])(
        jax.ShapeDtypeStruct((32, 512), jnp.float32), jax.ShapeDtypeStruct((512, 128), jnp.float32)
    )
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize(
    "ring, bidirectional, mode",
    # rings up to 4 (3: an odd bidirectional one); 8-chip rings run the same protocol in the
    # tests above, and which dimension a step's blocks index does not depend on the ring's size
    _with_modes([(2, False), (4, False), (3, True), (4, True)]),
)
def test_row_gather_and_column_scatter_rings(ring, bidirectional, mode):
    """gather_dim=0 (each computing record writes the output row block of its shard's source)
    and scatter_dim=1 (rhs column windows per step; bidi: column halves per direction)."""
    mesh = Mesh(np.array(jax.devices()[:ring]), ("x",))
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    x = jnp.asarray(RNG.standard_normal((8 * ring, 128)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((128, 128)), jnp.float32)
    ag = jax.jit(
        jax.shard_map(
            lambda a, b: cv.all_gather_matmul(
                a,
                b,
                axis_name="x",
                gather_dim=0,
                bidirectional=bidirectional,
                backend="mosaic_tpu",
                interpret=ip,
            )[None],
            mesh=mesh,
            in_specs=(P("x", None), P()),
            out_specs=P("x"),
            check_vma=False,
        )
    )
    out = np.asarray(
        ag(
            jax.device_put(x, NamedSharding(mesh, P("x", None))),
            jax.device_put(w, NamedSharding(mesh, P())),
        )
    )
    for d in range(ring):  # another summation order: tests/tolerance.py
        np.testing.assert_allclose(out[d], x @ w, rtol=0, atol=matmul_tolerance(x, w))
    cols = 256 if bidirectional else 128  # bidirectional halves stay 128 lanes wide
    a = jnp.asarray(RNG.standard_normal((8, 128 * ring)), jnp.float32)
    b = jnp.asarray(RNG.standard_normal((128 * ring, cols * ring)), jnp.float32)
    rs = jax.jit(
        jax.shard_map(
            lambda l, r: cv.matmul_reduce_scatter(
                l,
                r,
                axis_name="x",
                scatter_dim=1,
                bidirectional=bidirectional,
                backend="mosaic_tpu",
                interpret=ip,
            ),
            mesh=mesh,
            in_specs=(P(None, "x"), P("x", None)),
            out_specs=P(None, "x"),
            check_vma=False,
        )
    )
    got = rs(
        jax.device_put(a, NamedSharding(mesh, P(None, "x"))),
        jax.device_put(b, NamedSharding(mesh, P("x", None))),
    )
    # f32 sums of up to 1024 products of unit normals (|values| ~ 32): 4 * eps * sqrt(1024) * 32 ~
    # 5e-4
    np.testing.assert_allclose(np.asarray(got), np.asarray(a @ b), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("op, dim", [("gather", 1), ("gather", 0), ("scatter", 0), ("scatter", 1)])
def test_inner_pipelines_of_several_blocks(op, dim):
    """Small cv.RingBlocks: every compute and accumulate is a pipeline of several VMEM blocks in
    each dimension (the production shape of the kernel, at interpreter size), race detector on."""
    ring, blocks = 3, cv.RingBlocks(rows=8, cols=128, depth=128)
    mesh = Mesh(np.array(jax.devices()[:ring]), ("x",))
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    if op == "gather":
        x = jnp.asarray(
            RNG.standard_normal((16, 256 * ring) if dim == 1 else (16 * ring, 256)), jnp.float32
        )
        w = jnp.asarray(RNG.standard_normal((256 * ring if dim == 1 else 256, 256)), jnp.float32)
        specs, out_spec = ((P(None, "x") if dim == 1 else P("x")), P()), P()
        f = functools.partial(cv.all_gather_matmul, gather_dim=dim)
    else:
        x = jnp.asarray(RNG.standard_normal((16 * ring, 256 * ring)), jnp.float32)
        w = jnp.asarray(
            RNG.standard_normal((256 * ring, 512 * ring if dim == 1 else 512)), jnp.float32
        )
        specs, out_spec = (P(None, "x"), P("x", None)), (P("x", None) if dim == 0 else P(None, "x"))
        f = functools.partial(cv.matmul_reduce_scatter, scatter_dim=dim)
    local = functools.partial(f, axis_name="x", backend="mosaic_tpu", interpret=ip, blocks=blocks)
    fn = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)
    )
    out = fn(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)))
    want = np.asarray(x @ w)
    # float32 sums of up to 768 products in a different order: eps * sqrt(terms) * magnitude
    atol = 4 * np.finfo(np.float32).eps * np.sqrt(768) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=atol)


def test_ring_blocks_are_validated_and_refused_where_ignored():
    with pytest.raises(ValueError, match="RingBlocks: depth must be an int >= 1, got 0"):
        cv.RingBlocks(depth=0)
    with pytest.raises(TypeError):
        cv.RingBlocks(512, 512, 512)  # keyword-only
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x = jax.device_put(jnp.ones((8, 256)), NamedSharding(mesh, P(None, "x")))
    w = jax.device_put(jnp.ones((256, 128)), NamedSharding(mesh, P()))
    for backend in ("xla", "reference"):
        f = jax.shard_map(
            lambda a, b: cv.all_gather_matmul(
                a,
                b,
                axis_name="x",
                backend=backend,  # noqa: B023
                blocks=cv.RingBlocks(rows=8),
            ),
            mesh=mesh,
            in_specs=(P(None, "x"), P()),
            out_specs=P(),
            check_vma=False,
        )
        with pytest.raises(
            ValueError,
            match=(
                f"blocks: only the mosaic_tpu ring kernels have VMEM blocks; backend='{backend}' "
                "would ignore"
            ),
        ):
            jax.jit(f)(x, w)
    g = jax.shard_map(
        lambda a, b: cv.all_gather_matmul(
            a, b, axis_name="x", backend="mosaic_tpu", blocks=(8, 8, 8)
        ),
        mesh=mesh,
        in_specs=(P(None, "x"), P()),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(
        TypeError, match=r"blocks: expected a cv.RingBlocks or None, got \(8, 8, 8\)"
    ):
        jax.jit(g)(x, w)
