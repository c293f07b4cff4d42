"""Megacore: `emit_pipeline(core_axis=..., dimension_semantics=...)` splits a pipeline's grid over
the programs of a core axis, each running its own part with the whole grid's indices.

Data are small random integers stored as float32, so every matmul below is exact in float32 and
results are compared for equality against NumPy. Outputs start poisoned (xla) or uninitialized
(interpreters), so a part no core writes shows up.
"""

import base64
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor.plans.grid import partition_grid
from tests.platform import gpu_interpret, gpu_interpreter_always

BM, BK, BN = 8, 128, 128


def _covered(grid, semantics, num_cores):
    """Every (core, whole-grid point) each core's part visits, walking its part row-major."""
    seen = []
    for core in range(num_cores):
        local, offsets = partition_grid(grid, semantics, num_cores, core)
        for point in itertools.product(*(range(g) for g in local)):
            seen.append((core, tuple(i + o for i, o in zip(point, offsets))))
    return seen


@pytest.mark.parametrize(
    "grid, semantics, num_cores, cut_dim, sizes",
    [
        ((3, 4), ("parallel", "parallel"), 2, 1, [2, 2]),  # first parallel dim that divides evenly
        ((4, 3), ("arbitrary", "parallel"), 2, 1, [2, 1]),  # the only parallel dim, cut unevenly
        # none divides: the largest, first cores get more
        (
            (5, 3),
            ("parallel", "parallel"),
            2,
            0,
            [3, 2],
        ),
        # a tie: the first largest
        (
            (3, 3, 2),
            ("parallel", "parallel", "arbitrary"),
            2,
            0,
            [2, 1],
        ),
        ((7,), ("parallel",), 3, 0, [3, 2, 2]),
        ((2,), ("parallel",), 4, 0, [1, 1, 0, 0]),  # more cores than steps: some run none
        ((6, 2), ("parallel", "arbitrary"), 1, None, [6]),  # one core: the whole grid
    ],
)
def test_partition_visits_every_point_once(grid, semantics, num_cores, cut_dim, sizes):
    seen = _covered(grid, semantics, num_cores)
    points = [p for _, p in seen]
    assert sorted(points) == list(itertools.product(*(range(g) for g in grid)))
    for core in range(num_cores):
        local, _ = partition_grid(grid, semantics, num_cores, core)
        want = list(grid)
        if cut_dim is not None:
            want[cut_dim] = sizes[core]
        assert list(local) == want, core
        # Each core's part is one contiguous run of the cut dimension.
        mine = sorted({p[cut_dim] for c, p in seen if c == core}) if cut_dim is not None else []
        assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else True


def test_partition_with_a_traced_core_id_matches_the_static_one():
    grid, semantics = (5, 3), ("parallel", "arbitrary")
    traced = jax.jit(lambda c: partition_grid(grid, semantics, 3, c))
    for core in range(3):
        local, offsets = traced(jnp.int32(core))
        assert tuple(int(x) for x in local) == partition_grid(grid, semantics, 3, core)[0]
        assert tuple(int(x) for x in offsets) == partition_grid(grid, semantics, 3, core)[1]


def _matmul_kernel(grid, semantics, **core):
    """o = x @ y over a (i, j, k) grid, accumulating in the resident output block over k."""

    def body(x_ref, y_ref, o_ref):
        def step(idx, xb, yb, ob):
            @pl.when(idx[2] == 0)
            def _():
                ob[...] = jnp.zeros_like(ob)

            ob[...] += jnp.dot(xb[...], yb[...], preferred_element_type=jnp.float32)

        cv.emit_pipeline(
            step,
            grid=grid,
            dimension_semantics=semantics,
            max_concurrent_steps=2,
            in_specs=[
                pl.BlockSpec((BM, BK), lambda i, j, k: (i, k)),
                pl.BlockSpec((BK, BN), lambda i, j, k: (k, j)),
            ],
            out_specs=[pl.BlockSpec((BM, BN), lambda i, j, k: (i, j))],
            **core,
        )(x_ref, y_ref, o_ref)

    return body


def _operands(grid):
    rng = np.random.default_rng(4720)
    gi, gj, gk = grid
    x = rng.integers(-4, 5, (gi * BM, gk * BK)).astype(np.float32)
    y = rng.integers(-4, 5, (gk * BK, gj * BN)).astype(np.float32)
    return x, y


INTERPRET = {
    "xla": False,
    "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
}


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
@pytest.mark.parametrize(
    "grid, semantics, num_cores",
    [
        ((3, 2, 2), ("parallel", "parallel", "arbitrary"), 2),  # j cut evenly
        ((3, 1, 2), ("parallel", "arbitrary", "arbitrary"), 2),  # i cut unevenly: 2 + 1
        ((3, 2, 2), ("parallel", "parallel", "arbitrary"), 3),  # i cut evenly over 3
    ],
)
def test_megacore_pipeline_is_exact(backend, grid, semantics, num_cores):
    x, y = _operands(grid)
    # a float32 jnp matmul body: Mosaic GPU lowers none (wgmma pipelines: test_dot.py)
    interpret = (
        INTERPRET.get(backend)
        if backend != "mosaic_gpu"
        else gpu_interpreter_always(detect_races=True)
    )
    f = cv.kernel(
        _matmul_kernel(grid, semantics, core_axis=0),
        jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), jnp.float32),
        backend=backend,
        interpret=interpret,
        grid=(num_cores,),
        dimension_semantics=("parallel",),
    )
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, y)), x @ y)


def test_core_axis_name_splits_over_a_named_axis_on_xla():
    """A named axis in scope (here a kernel's thread axis; upstream, a TensorCore mesh axis)."""
    grid, semantics = (3, 2, 2), ("parallel", "arbitrary", "arbitrary")
    x, y = _operands(grid)
    f = cv.kernel(
        _matmul_kernel(grid, semantics, core_axis_name="core"),
        jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), jnp.float32),
        num_threads=2,
        thread_name="core",
    )
    np.testing.assert_array_equal(np.asarray(f(x, y)), x @ y)


def test_each_core_runs_only_its_part():
    """Core 0 of 2 alone writes rows 0..1 of the i blocks; the rest stays poisoned."""
    grid = (3, 1, 2)
    x, y = _operands(grid)

    def body(x_ref, y_ref, o_ref):
        with_core = _matmul_kernel(grid, ("parallel", "arbitrary", "arbitrary"), core_axis=0)

        @pl.when(cv.program_id(0) == 0)
        def _():
            with_core(x_ref, y_ref, o_ref)

    out = np.asarray(
        cv.kernel(body, jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), jnp.float32), grid=(2,))(
            x, y
        )
    )
    np.testing.assert_array_equal(out[: 2 * BM], (x @ y)[: 2 * BM])
    assert np.isnan(out[2 * BM :]).all()


def test_checker_and_simulator_take_one_cores_part():
    grid, semantics = (4, 2, 2), ("parallel", "parallel", "arbitrary")
    run = cv.emit_pipeline(
        lambda idx, xb, yb, ob: None,
        grid=grid,
        dimension_semantics=semantics,
        max_concurrent_steps=2,
        in_specs=[
            cv.BlockSpec((BM, BK), lambda i, j, k: (i, k)),
            cv.BlockSpec((BK, BN), lambda i, j, k: (k, j)),
        ],
        out_specs=[cv.BlockSpec((BM, BN), lambda i, j, k: (i, j))],
    )
    whole = run.plan
    parts = [whole.for_core(c, 2) for c in range(2)]
    assert [p.grid for p in parts] == [(2, 2, 2)] * 2 and [p.grid_offsets for p in parts] == [
        (0, 0, 0),
        (2, 0, 0),
    ]
    for part in parts:
        assert cv.sim.check(part).ok
    # Core 1's blocks are those of steps 8..15 of the whole grid.
    assert [parts[1].block_indices(op, s) for op in whole.inputs for s in range(8)] == [
        whole.block_indices(op, s) for op in whole.inputs for s in range(8, 16)
    ]
    t_whole = cv.sim.simulate(whole, "h100").time_s
    t_core = max(cv.sim.simulate(p, "h100").time_s for p in parts)
    assert t_core < t_whole
    with pytest.raises(ValueError, match=r"already one core's part"):
        parts[0].for_core(0, 2)
    with pytest.raises(ValueError, match=r"core_id: expected an int in \[0, 2\), got 2"):
        whole.for_core(2, 2)
    with pytest.raises(ValueError, match=r"num_cores: expected a static int >= 1"):
        whole.for_core(0, 0)


def test_bad_megacore_options_are_refused_by_name():
    spec = cv.BlockSpec((BM, BN), lambda i, j: (i, j))
    x = jnp.ones((2 * BM, 2 * BN), jnp.float32)

    def launch(grid=(2,), **options):
        def body(x_ref, o_ref):
            cv.emit_pipeline(
                lambda idx, xb, ob: None, grid=(2, 2), in_specs=[spec], out_specs=[spec], **options
            )(x_ref, o_ref)

        return cv.kernel(body, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid)(x)

    with pytest.raises(
        ValueError, match=r"give core_axis \(0\) or core_axis_name \('c'\), not both"
    ):
        launch(core_axis=0, core_axis_name="c", dimension_semantics=("parallel", "parallel"))
    with pytest.raises(
        ValueError, match=r"core_axis: expected an axis of this kernel's grid \(2,\).*got 1"
    ):
        launch(core_axis=1, dimension_semantics=("parallel", "parallel"))
    with pytest.raises(
        ValueError,
        match=r"dimension_semantics \('arbitrary', 'arbitrary'\): splitting the grid "
        r"over 2 cores needs a 'parallel' dimension",
    ):
        launch(core_axis=0)
    with pytest.raises(ValueError, match=r"cv.kernel: dimension_semantics: expected 1 of"):
        cv.kernel(
            lambda x_ref, o_ref: None,
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(2,),
            dimension_semantics=("parallel", "arbitrary"),
        )


def test_plain_pipeline_in_a_multithreaded_gpu_kernel_is_refused_by_name():
    spec = cv.BlockSpec((BM, BN), lambda i: (i, 0))
    x = jnp.ones((2 * BM, BN), jnp.float32)

    def body(x_ref, o_ref):
        cv.emit_pipeline(lambda idx, xb, ob: None, grid=(2,), in_specs=[spec], out_specs=[spec])(
            x_ref, o_ref
        )

    f = cv.kernel(
        body,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        backend="mosaic_gpu",
        interpret=gpu_interpret(),
        num_threads=2,
        thread_name="wg",
    )
    with pytest.raises(
        NotImplementedError, match=r"plain pipeline inside a mosaic_gpu kernel with num_threads=2"
    ):
        f(x)


def _mosaic_module(exported) -> bytes:
    """The Mosaic TPU kernel serialized in an exported module's custom call (base64 MLIR
    bytecode)."""
    body = re.search(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", exported.mlir_module()).group(1)
    return base64.b64decode(body)


def test_megacore_exports_with_the_kernels_semantics():
    grid, semantics = (4, 2, 2), ("parallel", "parallel", "arbitrary")
    shapes = [
        jax.ShapeDtypeStruct((4 * BM, 2 * BK), jnp.float32),
        jax.ShapeDtypeStruct((2 * BK, 2 * BN), jnp.float32),
    ]
    out = jax.ShapeDtypeStruct((4 * BM, 2 * BN), jnp.float32)
    kernel = _matmul_kernel(grid, semantics, core_axis=0)
    modules = {}
    for kernel_semantics in (("parallel",), ("arbitrary",)):
        f = jax.jit(
            cv.kernel(
                kernel, out, backend="mosaic_tpu", grid=(2,), dimension_semantics=kernel_semantics
            )
        )
        modules[kernel_semantics] = _mosaic_module(jax.export.export(f, platforms=["tpu"])(*shapes))
    # The kernel's grid semantics reach Mosaic (what puts the programs on two TensorCores).
    assert b"parallel" in modules[("parallel",)] and b"parallel" not in modules[("arbitrary",)]


def test_megacore_exports_for_cuda():
    spec = pl.BlockSpec((BM, BN), lambda i, j: (i, j))

    def body(x_ref, o_ref):
        def double(idx, xb, ob):
            ob[...] = 2.0 * xb[...]

        cv.emit_pipeline(
            double,
            grid=(3, 2),
            in_specs=[spec],
            out_specs=[spec],
            core_axis=0,
            max_concurrent_steps=2,
            dimension_semantics=("parallel", "arbitrary"),
        )(x_ref, o_ref)

    shape = jax.ShapeDtypeStruct((3 * BM, 2 * BN), jnp.float32)
    f = jax.jit(
        cv.kernel(body, shape, backend="mosaic_gpu", grid=(2,), dimension_semantics=("parallel",))
    )
    assert jax.export.export(f, platforms=["cuda"])(shape).platforms == ("cuda",)
