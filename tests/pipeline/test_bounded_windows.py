"""`pl.BoundedSlice(n)` block dimensions: the index map gives `pl.ds(start, size)` with size <= n,
so a ragged group of rows is one window (MoE token groups), as upstream's TPU pipeline allows.

The window fills the first `size` rows of its slot; an output window writes back only those.
Checked on xla (fast and checked) and the TPU interpreter (race detection on) against a numpy
reference, with groups visited last to first (so a write-back of a whole block instead of the
window would clobber a group already written), an empty group, and two windows with the same
start but different sizes (which must count as different blocks); plus the plan's fetches, the
checker, an export for tpu, and the refusals.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret
from tests import schedule

GROUPS = [5, 16, 3, 0, 12]  # rows per group; group 3 is empty and starts where group 4 does
STARTS = list(np.cumsum([0] + GROUPS[:-1]))
ROWS, WINDOW, COLS = 40, 16, 2  # array rows, BoundedSlice size, column blocks of 128
TPU = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")


def _select(g, values):
    """values[g] for a grid index g (traced in a kernel, a Python int in the plan's events)."""
    out = jnp.int32(values[-1])
    for k in range(len(values) - 2, -1, -1):
        out = jnp.where(g == k, jnp.int32(values[k]), out)
    return out


def _rows(i):
    """The window of grid row i: the groups last to first."""
    g = len(GROUPS) - 1 - i
    return pl.ds(_select(g, STARTS), _select(g, GROUPS))


def _specs(lookahead=False):
    mode = pl.Buffered(2, use_lookahead=True) if lookahead else None
    x = pl.BlockSpec((pl.BoundedSlice(WINDOW), 128), lambda i, k: (_rows(i), k))
    # kept across k
    w = pl.BlockSpec((pl.BoundedSlice(WINDOW), 128), lambda i, k: (_rows(i), 0), pipeline_mode=mode)
    out = pl.BlockSpec((pl.BoundedSlice(WINDOW), 128), lambda i, k: (_rows(i), k))
    return [x, w], [out]


def _kernel(lookahead):
    def body(idx, xb, wb, ob):
        ob[...] = xb[...] + 2.0 * wb[...]

    def kernel(x_ref, w_ref, o_ref):
        in_specs, out_specs = _specs(lookahead)
        cv.emit_pipeline(
            body,
            grid=(len(GROUPS), COLS),
            in_specs=in_specs,
            out_specs=out_specs,
            max_concurrent_steps=2,
        )(x_ref, w_ref, o_ref)

    return kernel


@pytest.mark.parametrize("backend", ["xla", "xla checked", "mosaic_tpu"])
@pytest.mark.parametrize("lookahead", [False, True])
def test_ragged_groups_on_every_backend(backend, lookahead):
    # Small integers in float32: x + 2 w is exact, so the comparison is exact.
    rng = np.random.default_rng(4713)
    x = jnp.asarray(rng.integers(-8, 8, (ROWS, COLS * 128)), jnp.float32)
    w = jnp.asarray(rng.integers(-8, 8, (ROWS, 128)), jnp.float32)
    name = backend.split()[0]
    f = cv.kernel(
        _kernel(lookahead),
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        backend=name,
        interpret=TPU if name == "mosaic_tpu" else False,
        grid=(1,),
    )
    with cv.pipeline.checked_schedule(backend == "xla checked"):
        out = np.asarray(jax.jit(f)(x, w))
    covered = sum(GROUPS)  # rows past the last group are not written
    np.testing.assert_array_equal(
        out[:covered], np.asarray(x)[:covered] + 2 * np.tile(np.asarray(w), COLS)[:covered]
    )


def test_windows_are_blocks_of_their_own():
    """w's window is kept across k and fetched once per group: five fetches, the empty group's
    included (same start as the next group, another size: another block); the schedule is clean."""
    in_specs, out_specs = _specs()
    p = cv.pipeline.plan(
        grid=(len(GROUPS), COLS), in_specs=in_specs, out_specs=out_specs, max_concurrent_steps=2
    )
    fetched = [c.step for c in schedule.fetches(p) if c.operand == "in[1]"]
    assert fetched == [i * COLS for i in range(len(GROUPS))]
    assert [c.step for c in schedule.stores(p)] == list(range(len(GROUPS) * COLS))
    assert p.window(p.inputs[1], 2) == ((24, 0), (0, 128))  # grid row 1: group 3, empty, at row 24
    assert cv.sim.check(p).ok


def test_bounded_windows_export_for_tpu():
    x, w = (
        jax.ShapeDtypeStruct((ROWS, COLS * 128), jnp.float32),
        jax.ShapeDtypeStruct((ROWS, 128), jnp.float32),
    )
    for lookahead in (False, True):
        f = jax.jit(cv.kernel(_kernel(lookahead), x, backend="mosaic_tpu", grid=(1,)))
        assert jax.export.export(f, platforms=["tpu"])(x, w).platforms == ("tpu",)


def _lower(spec, shape=(ROWS, 128), backend="xla", interpret=False):
    def kernel(x_ref, o_ref):
        cv.emit_pipeline(
            lambda idx, xb, ob: None,
            grid=(2,),
            in_specs=[spec],
            out_specs=[cv.BlockSpec((8, 128), lambda i: (i, 0))],
        )(x_ref, o_ref)

    f = cv.kernel(
        kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), backend=backend, interpret=interpret
    )
    return jax.jit(f).lower(jnp.zeros(shape))


def test_bad_windows_are_refused_by_name():
    bounded = (pl.BoundedSlice(8), 128)
    with pytest.raises(
        ValueError,
        match=r"in\[0\]: index_map entry 0 is 3: a pl.BoundedSlice\(8\) dimension takes "
        r"pl.ds\(start, size\)",
    ):
        _lower(pl.BlockSpec(bounded, lambda i: (3, 0)))
    with pytest.raises(ValueError, match=r"pl.ds is only for pl.BoundedSlice dimensions"):
        _lower(pl.BlockSpec((8, 128), lambda i: (pl.ds(i, 8), 0)))
    with pytest.raises(ValueError, match=r"its size must be in \[0, 8\]"):
        _lower(pl.BlockSpec(bounded, lambda i: (pl.ds(i * 8, 9), 0)))
    with pytest.raises(
        ValueError, match=r"pl.BoundedSlice\(64\) in dimension 0 is larger than the array"
    ):
        _lower(pl.BlockSpec((pl.BoundedSlice(64), 128), lambda i: (pl.ds(0, 4), 0)))
    with pytest.raises(
        NotImplementedError, match=r"pl.BoundedSlice windows \(in\[0\]\) on mosaic_gpu"
    ):
        _lower(
            pl.BlockSpec(bounded, lambda i: (pl.ds(i * 8, 4), 0)),
            backend="mosaic_gpu",
            interpret=gpu_interpret(),
        )
    with pytest.raises(NotImplementedError, match=r"pl.Element with padding is not supported"):
        cv.pipeline.plan(
            grid=(2,), in_specs=[pl.BlockSpec((pl.Element(8, (1, 1)), 128), lambda i: (i, 0))]
        )
