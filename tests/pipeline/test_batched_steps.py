"""The xla executor's batched steps (`conveyor.pipeline.batched_steps`): which pipelines run their
independent grid steps together, and that they give exactly the values of the step-by-step fast
path and of the checked schedule. Data are small integers in float32, so every sum is exact and
the three paths must agree bit for bit, whatever order a batched dot adds in."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import conveyor as cv
from conveyor import _compat

B = (8, 128)


def _ints(rng, shape):
    return rng.integers(-4, 5, shape).astype(np.float32)


def _run(kernel, out_shape, args, mode):
    """The kernel's output and the batching recorded while tracing it, on one of the xla paths."""
    f = cv.kernel(kernel, out_shape, backend="xla")
    with cv.pipeline.checked_schedule(mode == "checked"), cv.pipeline.batch_independent_steps(mode == "batched"), \
            cv.pipeline.record_batching() as log:
        out = jax.tree_util.tree_map(np.asarray, jax.jit(f)(*args))
    return out, log


def _matmul(grid_ij_k=(3, 2, 4), bm=8, bk=16, bn=128):
    gi, gj, gk = grid_ij_k

    def body(idx, xb, yb, ob):
        ob[...] = jnp.where(idx[2] == 0, 0.0, ob[...]) + jnp.dot(xb[...], yb[...], preferred_element_type=jnp.float32)

    def kernel(x, y, o):
        cv.emit_pipeline(body, grid=grid_ij_k, max_concurrent_steps=2,
                         in_specs=[cv.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                                   cv.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
                         out_specs=[cv.BlockSpec((bm, bn), lambda i, j, k: (i, j))])(x, y, o)
    rng = np.random.default_rng()
    x, y = _ints(rng, (gi * bm, gk * bk)), _ints(rng, (gk * bk, gj * bn))
    return kernel, jax.ShapeDtypeStruct((gi * bm, gj * bn), jnp.float32), (x, y), x @ y, 2


def _reduction_first():
    """grid (k, i), output block i: every output block is visited under every k: not independent."""
    def body(idx, xb, ob):
        ob[...] = xb[...] * (idx[0] + 1).astype(jnp.float32)

    def kernel(x, o):
        cv.emit_pipeline(body, grid=(4, 3), in_specs=[cv.BlockSpec(B, lambda k, i: (i, k))],
                         out_specs=[cv.BlockSpec(B, lambda k, i: (i, 0))])(x, o)
    x = _ints(np.random.default_rng(), (3 * B[0], 4 * B[1]))
    # Step by step the output block i is written back after every step (its index changes at the
    # next one), so a revisit starts from a fresh slot: the last k's block is what remains.
    want = 4.0 * x[:, 3 * B[1]:]
    return kernel, jax.ShapeDtypeStruct((3 * B[0], B[1]), jnp.float32), (x,), want, 0


def _revisits_within_a_row():
    """grid (i, k), output block (i, k % 2): revisited non-consecutively under one i (a fresh slot
    at each visit), written back after every step: batched over i, stored at every k."""
    def body(idx, xb, ob):
        ob[...] = 3.0 * xb[...] + idx[1].astype(jnp.float32)

    def kernel(x, o):
        cv.emit_pipeline(body, grid=(3, 4), in_specs=[cv.BlockSpec(B, lambda i, k: (i, k))],
                         out_specs=[cv.BlockSpec(B, lambda i, k: (i, k % 2))])(x, o)
    x = _ints(np.random.default_rng(), (3 * B[0], 4 * B[1]))
    want = np.concatenate([3.0 * x[:, 2 * B[1]:3 * B[1]] + 2, 3.0 * x[:, 3 * B[1]:] + 3], axis=1)
    return kernel, jax.ShapeDtypeStruct((3 * B[0], 2 * B[1]), jnp.float32), (x,), want, 1


def _out_of_bounds():
    """A grid one block past both arrays: the last input block reads zeros, the last output block
    is not written (the output keeps what it held: poison on xla, so compare only the rows written)."""
    def body(idx, xb, ob):
        ob[...] = xb[...] + 1.0

    def kernel(x, o):
        cv.emit_pipeline(body, grid=(4,), in_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
                         out_specs=[cv.BlockSpec(B, lambda i: (i, 0))])(x, o)
    x = _ints(np.random.default_rng(), (3 * B[0], B[1]))
    return kernel, jax.ShapeDtypeStruct((3 * B[0], B[1]), jnp.float32), (x,), x + 1.0, 1


def _element_windows_and_squeezed_output():
    """Inputs read from element offsets (overlapping windows); the output's leading dimension is
    squeezed, so its buffer cannot follow the array's order (grid axis in front)."""
    def body(idx, xb, ob):
        ob[...] = xb[...].sum(axis=0)

    def kernel(x, o):
        cv.emit_pipeline(body, grid=(5,), in_specs=[pl.BlockSpec((pl.Element(B[0]), B[1]), lambda g: (3 * g, 0))],
                         out_specs=[pl.BlockSpec((None, B[1]), lambda g: (g, 0))])(x, o)
    x = _ints(np.random.default_rng(), (3 * 4 + B[0], B[1]))
    want = np.stack([x[3 * g:3 * g + B[0]].sum(axis=0) for g in range(5)])
    return kernel, jax.ShapeDtypeStruct((5, B[1]), jnp.float32), (x,), want, 1


def _two_outputs_and_an_invariant_input():
    def body(idx, xb, bias, sb, db):
        sb[...] = xb[...] + bias[...]
        db[...] = xb[...] * 2.0

    def kernel(x, bias, s, d):
        cv.emit_pipeline(body, grid=(2, 3), in_specs=[cv.BlockSpec(B, lambda i, j: (i, j)),
                                                      cv.BlockSpec(B, lambda i, j: (0, 0))],
                         out_specs=[cv.BlockSpec(B, lambda i, j: (i, j)),
                                    cv.BlockSpec(B, lambda i, j: (j, i))])(x, bias, s, d)
    rng = np.random.default_rng()
    x, bias = _ints(rng, (2 * B[0], 3 * B[1])), _ints(rng, B)
    d = np.zeros((3 * B[0], 2 * B[1]), np.float32)
    for i in range(2):
        for j in range(3):
            d[j * 8:(j + 1) * 8, i * 128:(i + 1) * 128] = 2 * x[i * 8:(i + 1) * 8, j * 128:(j + 1) * 128]
    shapes = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(d.shape, jnp.float32))
    return kernel, shapes, (x, bias), (x + np.tile(bias, (2, 3)), d), 2


CASES = {"matmul": _matmul, "reduction first": _reduction_first, "revisits within a row": _revisits_within_a_row,
         "out of bounds": _out_of_bounds, "element windows": _element_windows_and_squeezed_output,
         "two outputs": _two_outputs_and_an_invariant_input}


@pytest.mark.parametrize("case", CASES)
def test_batched_steps_give_the_values_of_the_step_by_step_paths(case):
    kernel, out_shape, args, want, axes = CASES[case]()
    got = {mode: _run(kernel, out_shape, args, mode) for mode in ("batched", "steps", "checked")}
    assert got["batched"][1] == [(got["batched"][1][0][0], axes)]   # the decision this case expects
    assert all(log[0][1] == 0 for _, log in (got["steps"],)) and got["checked"][1] == []
    outs = {mode: out if isinstance(out_shape, tuple) else (out,) for mode, (out, _) in got.items()}
    wants = want if isinstance(out_shape, tuple) else (want,)
    rows = slice(None) if case != "out of bounds" else slice(0, 3 * B[0])
    for mode, out in outs.items():
        for o, w in zip(out, wants):
            np.testing.assert_array_equal(o[rows], w, err_msg=mode)
    for o_b, o_s in zip(outs["batched"], outs["steps"]):
        np.testing.assert_array_equal(o_b, o_s)   # poison where nothing was written, too


def test_the_warp_specialized_matmul_is_batched():
    gi, gj, gk, bm, bk, bn = 2, 3, 4, 16, 16, 128

    def body(idx, xb, yb, ob):
        rows = pl.ds(jax.lax.axis_index("wg") * (bm // 2), bm // 2)
        ob[rows, :] = jnp.where(idx[2] == 0, 0.0, ob[rows, :]) + jnp.dot(xb[rows, :], yb[...])

    def kernel(x, y, o):
        cv.emit_pipeline_warp_specialized(
            body, grid=(gi, gj, gk), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            in_specs=[cv.BlockSpec((bm, bk), lambda i, j, k: (i, k)), cv.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
            out_specs=[cv.BlockSpec((bm, bn), lambda i, j, k: (i, j))])(x, y, o)
    rng = np.random.default_rng()
    x, y = _ints(rng, (gi * bm, gk * bk)), _ints(rng, (gk * bk, gj * bn))
    f = cv.kernel(kernel, jax.ShapeDtypeStruct((gi * bm, gj * bn), jnp.float32), backend="xla", num_threads=3,
                  thread_name="wg")
    with cv.pipeline.checked_schedule(False), cv.pipeline.record_batching() as log:
        out = np.asarray(jax.jit(f)(x, y))
        program = str(jax.make_jaxpr(f)(x, y))
    assert log == [((gi, gj, gk), 2)]
    np.testing.assert_array_equal(out, x @ y)
    # Each thread's half-block write stays a dynamic_update_slice of the batched blocks, in their
    # layout (`_compat.layout_keeping_slice_batching`), not a scatter with the blocks transposed.
    assert "scatter" not in program and "dynamic_update_slice" in program
    # The two threads' dots of their rows by the same block run as one (`_compat.eval_merging_dots`).
    assert program.count("dot_general") == 1, program


def _dots_in(fn, *args) -> int:
    """How many dot_generals `fn`'s jaxpr holds when run through `eval_merging_dots`."""
    closed = jax.make_jaxpr(fn)(*args)
    merged = jax.make_jaxpr(lambda *a: _compat.eval_merging_dots(closed.jaxpr, closed.consts, *a))(*args)
    return str(merged).count("dot_general")


def test_dots_sharing_an_operand_run_as_one_where_nothing_orders_them():
    """`eval_merging_dots` runs dots of row slices of one array by the same operand as one dot, a
    consumer of the first dot's result that comes before the second dot waits for it, and dots that
    depend on another dot's result, or multiply by different operands, run as written. Values are
    those of the jaxpr run as it is (exact: small integers)."""
    rng = np.random.default_rng()
    x, y, z = _ints(rng, (12, 16)), _ints(rng, (16, 8)), _ints(rng, (16, 8))

    def threads(x, y):     # each "thread" its rows of x by y, the first's result used in between
        a = jnp.dot(x[:4], y)
        b = a * 2.0 + 1.0
        c = jnp.dot(x[4:12], y)
        return b, c, a.sum() + c.sum()

    def chained(x, y):     # the second dot's rows come from the first dot's result
        a = jnp.dot(x[:4], y)
        return jnp.dot(jnp.concatenate([a, a], axis=1)[:, :16], y)

    def other_operands(x, y, z):
        return jnp.dot(x[:4], y), jnp.dot(x[4:8], z)

    for fn, args, dots in ((threads, (x, y), 1), (chained, (x, y), 2), (other_operands, (x, y, z), 2)):
        closed = jax.make_jaxpr(fn)(*args)
        got = jax.jit(lambda *a: _compat.eval_merging_dots(closed.jaxpr, closed.consts, *a))(*args)
        want = jax.tree_util.tree_leaves(fn(*args))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=fn.__name__)
        assert _dots_in(fn, *args) == dots, fn.__name__


def _simple(body, carry=None):
    """A pipeline over the (8, 128) blocks of a (3 * 8, 128) x into o, with `body` as given."""
    spec = cv.BlockSpec(B, lambda i: (i, 0))

    def kernel(x, o):
        cv.emit_pipeline(body, grid=(3,), in_specs=[spec], out_specs=[spec], init_carry=carry)(x, o)
    return kernel


def _scratch_kernel(x, o):
    acc = jax.new_ref(jnp.zeros(B, jnp.float32))   # a running sum across steps: they are not independent

    def body(idx, xb, ob):
        acc[...] += xb[...]
        ob[...] = acc[...]
    cv.emit_pipeline(body, grid=(3,), in_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
                     out_specs=[cv.BlockSpec(B, lambda i: (i, 0))])(x, o)


def _writes_input(idx, xb, ob):
    xb[...] = xb[...] + 1.0
    ob[...] = xb[...]


def _prints(idx, xb, ob):
    jax.debug.callback(lambda v: None, idx[0])
    ob[...] = xb[...]


def _carries(idx, xb, ob, c):
    ob[...] = xb[...] + c
    return c + 1.0


STEP_BY_STEP = {
    "a scratch ref": _scratch_kernel,
    "writes its input block": _simple(_writes_input),
    "a callback": _simple(_prints),
    "a carry": _simple(_carries, carry=jnp.float32(0.0)),
}


@pytest.mark.parametrize("case", STEP_BY_STEP)
def test_bodies_with_other_effects_run_step_by_step(case):
    """A body that touches more than its blocks, or threads a carry, is not batched; its values
    are those of the checked schedule."""
    x = _ints(np.random.default_rng(), (3 * B[0], B[1]))
    out_shape = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    fast, log = _run(STEP_BY_STEP[case], out_shape, (x,), "batched")
    checked, _ = _run(STEP_BY_STEP[case], out_shape, (x,), "checked")
    assert log == [((3,), 0)]
    np.testing.assert_array_equal(fast, checked)


def test_an_input_that_is_the_output_runs_step_by_step():
    """In place (the output ref is also an input): a later step reads what an earlier one wrote."""
    def body(idx, xb, ob):
        ob[...] = xb[...] * 2.0

    def kernel(x, o):
        o[...] = x[...]
        cv.emit_pipeline(body, grid=(3,), in_specs=[cv.BlockSpec(B, lambda i: (0, 0))],
                         out_specs=[cv.BlockSpec(B, lambda i: (0, 0))])(o, o)
    x = _ints(np.random.default_rng(), (B[0], B[1]))
    out, log = _run(kernel, jax.ShapeDtypeStruct(x.shape, jnp.float32), (x,), "batched")
    assert log == [((3,), 0)]
    np.testing.assert_array_equal(out, 2.0 * x)


def test_an_output_map_of_traced_values_runs_step_by_step_and_an_input_map_is_batched():
    def body(idx, xb, ob):
        ob[...] = xb[...]

    def kernel(off, x, o, o2):
        shift = off[0]
        cv.emit_pipeline(body, grid=(3,), in_specs=[cv.BlockSpec(B, lambda i: ((i + shift) % 3, 0))],
                         out_specs=[cv.BlockSpec(B, lambda i: (i, 0))])(x, o)
        cv.emit_pipeline(body, grid=(3,), in_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
                         out_specs=[cv.BlockSpec(B, lambda i: ((i + shift) % 3, 0))])(x, o2)
    x = _ints(np.random.default_rng(), (3 * B[0], B[1]))
    shape = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    (o, o2), log = _run(kernel, (shape, shape), (jnp.array([1], jnp.int32), x), "batched")
    assert log == [((3,), 1), ((3,), 0)]
    rolled = np.roll(x, -B[0], axis=0)
    np.testing.assert_array_equal(o, rolled)
    np.testing.assert_array_equal(o2, np.roll(x, B[0], axis=0))


def test_batch_independent_steps_takes_a_bool():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with cv.pipeline.batch_independent_steps("yes"):
            pass


def _input_read(in_map, x_blocks, want_of_x):
    """A (2, 3) grid copying input blocks (16, 128) chosen by `in_map` into the output's (i, j)
    blocks; x has `x_blocks` blocks per dimension."""
    bs = (16, 128)

    def kernel(x, o):
        cv.emit_pipeline(lambda idx, xb, ob: ob.__setitem__(..., xb[...] + 1.0), grid=(2, 3),
                         in_specs=[cv.BlockSpec(bs, in_map)],
                         out_specs=[cv.BlockSpec(bs, lambda i, j: (i, j))])(x, o)
    x = _ints(np.random.default_rng(), (x_blocks[0] * bs[0], x_blocks[1] * bs[1]))
    return kernel, jax.ShapeDtypeStruct((2 * bs[0], 3 * bs[1]), jnp.float32), x, want_of_x(x, bs) + 1.0


def _blocks(x, bs, rows, cols):
    """The (2, 3) blocks x[rows(i, j), cols(i, j)] as one (2 * 16, 3 * 128) array."""
    return np.block([[x[rows(i, j) * bs[0]:(rows(i, j) + 1) * bs[0], cols(i, j) * bs[1]:(cols(i, j) + 1) * bs[1]]
                      for j in range(3)] for i in range(2)])


INPUT_READS = {
    # map, x's blocks, the expected output, whether the blocks are one slab per step (no gather)
    "the grid's order": (lambda i, j: (i, j), (2, 3), lambda x, bs: x, True),
    "axes swapped": (lambda i, j: (j, i), (3, 2), lambda x, bs: _blocks(x, bs, lambda i, j: j, lambda i, j: i), True),
    "offset": (lambda i, j: (i + 1, j), (3, 3), lambda x, bs: x[bs[0]:], True),
    "one axis": (lambda i, j: (0, j), (1, 3), lambda x, bs: np.tile(x, (2, 1)), True),
    "axes mixed": (lambda i, j: (0, i + j), (1, 4), lambda x, bs: _blocks(x, bs, lambda i, j: 0, lambda i, j: i + j),
                   False),
    "partly out of bounds": (lambda i, j: (i, j + 1), (2, 3),
                             lambda x, bs: np.concatenate([x[:, bs[1]:], np.zeros((2 * bs[0], bs[1]), np.float32)],
                                                          axis=1), False),
}


@pytest.mark.parametrize("case", INPUT_READS)
def test_input_blocks_are_read_as_one_slab_per_step_where_they_tile_one(case):
    in_map, x_blocks, want_of_x, slab = INPUT_READS[case]
    kernel, out_shape, x, want = _input_read(in_map, x_blocks, want_of_x)
    for mode in ("batched", "steps"):
        out, log = _run(kernel, out_shape, (x,), mode)
        assert log == [((2, 3), 2 if mode == "batched" else 0)]
        np.testing.assert_array_equal(out, want, err_msg=mode)
    with cv.pipeline.checked_schedule(False):
        program = str(jax.make_jaxpr(cv.kernel(kernel, out_shape, backend="xla"))(x))
    assert ("gather" not in program) == slab, program
