"""Pipeline rules every backend follows: bodies that touch other refs, out-of-bounds blocks,
Pallas BlockSpec fields (honoured or refused by name) and exact index-map invariance.

Mosaic backends run through their interpreters with race detection; outputs start poisoned.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

BACKENDS = ["xla", "mosaic_tpu", "mosaic_gpu"]
# The on-chip scratch type a body allocates with pl.run_scoped on each backend.
SCOPED = {"xla": pl.ANY, "mosaic_tpu": pltpu.VMEM, "mosaic_gpu": plgpu.SMEM}
BLOCK = (8, 128)


def arr(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def run(kernel_body, out_shape, *args, backend, scratch_shapes=()):
    interpret = {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True),
        "mosaic_gpu": gpu_interpret(detect_races=True),
    }[backend]
    return jax.jit(
        cv.kernel(
            kernel_body,
            out_shape,
            backend=backend,
            interpret=interpret,
            scratch_shapes=scratch_shapes,
        )
    )(*args)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_body_accumulates_into_kernel_scratch_and_a_scoped_buffer(backend):
    """A reduction written the ordinary way: the body adds each block into refs that are not its
    own block refs (kernel scratch, a buffer scoped around the pipeline), read after the loop."""
    steps = 5
    x = arr(1, steps * BLOCK[0], BLOCK[1])

    def k(x_ref, sum_ref, sq_ref, acc_ref):
        def with_scoped(sq_acc):
            acc_ref[...] = jnp.zeros(BLOCK, jnp.float32)
            sq_acc[...] = jnp.zeros(BLOCK, jnp.float32)

            def body(idx, xb, sum_blk, sq_blk):
                acc_ref[...] += xb[...]
                sq_acc[...] += xb[...] * xb[...]
                sum_blk[...] = acc_ref[...]
                sq_blk[...] = sq_acc[...]

            whole = cv.BlockSpec(BLOCK, lambda i: (0, 0))
            cv.emit_pipeline(
                body,
                grid=(steps,),
                in_specs=[cv.BlockSpec(BLOCK, lambda i: (i, 0))],
                out_specs=[whole, whole],
                max_concurrent_steps=2,
            )(x_ref, sum_ref, sq_ref)

        pl.run_scoped(with_scoped, SCOPED[backend](BLOCK, jnp.float32))

    out = jax.ShapeDtypeStruct(BLOCK, jnp.float32)
    got_sum, got_sq = run(k, (out, out), x, backend=backend, scratch_shapes=[out])
    blocks = np.asarray(x, np.float64).reshape(steps, *BLOCK)
    # f32 sums of 5 terms of size O(1): rounding error ~ 5 * 2**-24 * |terms| < 1e-5.
    np.testing.assert_allclose(got_sum, blocks.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_sq, (blocks**2).sum(0), rtol=1e-5, atol=1e-5)


# ---- Pallas BlockSpec fields: honoured or refused by name ---------------------------------------


def _imap(i):
    return (i, 0)


@pytest.mark.parametrize(
    "spec, match",
    [
        (pl.BlockSpec(BLOCK, _imap, memory_space=pltpu.SMEM), "memory_space"),  # TPU scalar memory
        (plgpu.BlockSpec(BLOCK, _imap, collective_axes=("x",)), "collective_axes"),
    ],
)
def test_unsupported_blockspec_fields_are_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        cv.pipeline.plan(grid=(4,), in_specs=[spec], max_concurrent_steps=2)


def test_output_delay_release_is_refused():
    with pytest.raises(ValueError, match="out\\[0\\].*delay_release applies to inputs"):
        cv.pipeline.plan(grid=(4,), out_specs=[plgpu.BlockSpec(BLOCK, _imap, delay_release=1)])


def test_honoured_blockspec_fields():
    # A spec's delay_release raises the pipeline's (every input then waits as long: never less
    # safe).
    p = cv.pipeline.plan(
        grid=(4,),
        in_specs=[plgpu.BlockSpec(BLOCK, _imap, delay_release=1), cv.BlockSpec(BLOCK, _imap)],
        max_concurrent_steps=3,
    )
    assert (p.delay_release, p.lookahead) == (1, 2)
    with pytest.raises(ValueError, match="greater than delay_release=2"):
        cv.pipeline.plan(
            grid=(4,),
            in_specs=[plgpu.BlockSpec(BLOCK, _imap, delay_release=2)],
            max_concurrent_steps=2,
        )
    # An invariant input is fetched once: Buffered(2) asks for a slot it would never use, and gets
    # 1.
    p = cv.pipeline.plan(
        grid=(4,),
        in_specs=[pl.BlockSpec(BLOCK, lambda i: (0, 0), pipeline_mode=pl.Buffered(2))],
        max_concurrent_steps=2,
    )
    assert p.inputs[0].num_slots == 1
    with pytest.raises(
        ValueError,
        match=r"in\[0\]: prefetched_count=2 but this index-invariant input is "
        r"fetched once into 1 slot",
    ):
        cv.pipeline.plan(
            grid=(4,),
            in_specs=[
                pl.BlockSpec(
                    BLOCK, lambda i: (0, 0), pipeline_mode=pl.Buffered(2, prefetched_count=2)
                )
            ],
        )
    # Buffered(n) matching the plan's slots: n = max_concurrent_steps, 1 for an invariant operand.
    p = cv.pipeline.plan(
        grid=(4,),
        in_specs=[
            pl.BlockSpec(BLOCK, _imap, pipeline_mode=pl.Buffered(2)),
            pl.BlockSpec(BLOCK, lambda i: (0, 0), pipeline_mode=pl.Buffered(1)),
        ],
        out_specs=[pl.BlockSpec(BLOCK, _imap, pipeline_mode=pl.Buffered(2))],
        max_concurrent_steps=2,
    )
    assert [op.num_slots for op in p.inputs + p.outputs] == [2, 1, 2]


# ---- index-map invariance is decided exactly ---------------------------------------------------


def test_invariance_is_decided_by_data_flow_not_sampling():
    grid = (600,)
    rare = lambda i: (jnp.where(i == 317, 1, 0), 0)  # depends on the step in one step of 600
    constant = lambda i: (0, 0)
    p = cv.pipeline.plan(
        grid=grid,
        in_specs=[cv.BlockSpec(BLOCK, rare), cv.BlockSpec(BLOCK, constant)],
        max_concurrent_steps=2,
    )
    assert [op.invariant for op in p.inputs] == [False, True]
    inside = jax.jit(lambda: jnp.int32(p.inputs[0].invariant))()  # same decision inside a trace
    assert int(inside) == 0


def test_index_map_errors_propagate_with_the_operand_name():
    def broken(i):
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError, match="boom") as info:
        cv.pipeline.plan(
            grid=(4,), in_specs=[cv.BlockSpec(BLOCK, _imap), cv.BlockSpec(BLOCK, broken)]
        )
    assert any("in[1]" in note for note in info.value.__notes__)
    with pytest.raises(
        ValueError, match="in\\[0\\]: index_map returned 1 indices for a 2-d block_shape"
    ):
        cv.pipeline.plan(grid=(4,), in_specs=[cv.BlockSpec(BLOCK, lambda i: i)])


def test_rarely_varying_index_map_gives_the_right_rows(backend):
    """A map that changes block at one grid point of 600 that a sampling classifier never probes
    (it used to be called invariant, fetched once, and the TPU kernel returned the wrong rows)."""
    grid, special = (30, 20), (17, 7)
    x = arr(3, 2 * BLOCK[0], BLOCK[1])

    def k(x_ref, o_ref):
        def body(idx, xb, ob):
            i, j = idx

            @pl.when((i == 0) & (j == 0))
            def _():
                ob[...] = jnp.zeros_like(ob)

            @pl.when((i == special[0]) & (j == special[1]))
            def _():
                ob[...] += xb[...]

        # Plain arithmetic, so a sampler evaluating it on Python ints sees the same constant 0.
        rare = lambda i, j: (1 * ((i == special[0]) & (j == special[1])), 0)
        cv.emit_pipeline(
            body,
            grid=grid,
            in_specs=[cv.BlockSpec(BLOCK, rare)],
            out_specs=[cv.BlockSpec(BLOCK, lambda i, j: (0, 0))],
            max_concurrent_steps=2,
        )(x_ref, o_ref)

    out = run(k, jax.ShapeDtypeStruct(BLOCK, jnp.float32), x, backend=backend)
    np.testing.assert_array_equal(out, x[BLOCK[0] :])


# ---- out-of-bounds blocks: one rule on every backend (conveyor.pipeline.lowering) -------------


def test_out_of_bounds_blocks_read_zeros_and_are_not_written(backend):
    """Input block i - 1 and output block i + 1 over 6 steps: steps 0 and 5 read outside x (zeros),
    step 5 writes outside o (dropped: a clamping executor would overwrite the last block)."""
    x = arr(4, 4 * BLOCK[0], BLOCK[1])

    def k(x_ref, o_ref):
        def body(idx, xb, ob):
            ob[...] = 2.0 * xb[...] + 1.0

        cv.emit_pipeline(
            body,
            grid=(6,),
            in_specs=[cv.BlockSpec(BLOCK, lambda i: (i - 1, 0))],
            out_specs=[cv.BlockSpec(BLOCK, lambda i: (i + 1, 0))],
            max_concurrent_steps=2,
        )(x_ref, o_ref)

    out = run(k, jax.ShapeDtypeStruct((6 * BLOCK[0], BLOCK[1]), jnp.float32), x, backend=backend)
    rows = BLOCK[0]
    want = np.concatenate([np.ones(BLOCK, np.float32), 2.0 * np.asarray(x) + 1.0])
    # Block 0 is never written (it holds whatever the output memory held); blocks 1..5 are exact.
    np.testing.assert_array_equal(out[rows:], want)


def test_dimension_semantics_validated():
    spec = cv.BlockSpec((8, 128), lambda i, j: (i, j))
    # Semantics alone change nothing (as upstream without a core axis): accepted when well formed.
    cv.emit_pipeline(
        lambda idx, xb: None,
        grid=(2, 2),
        in_specs=[spec],
        dimension_semantics=(pltpu.PARALLEL, "arbitrary"),
    )
    with pytest.raises(
        ValueError, match=r"dimension_semantics: expected 2 of \('parallel', 'arbitrary'\)"
    ):
        cv.emit_pipeline(
            lambda idx, xb: None, grid=(2, 2), in_specs=[spec], dimension_semantics=("parallel",)
        )
    with pytest.raises(
        ValueError, match=r"dimension_semantics: .* got \('parallel', 'sequential'\)"
    ):
        cv.emit_pipeline(
            lambda idx, xb: None,
            grid=(2, 2),
            in_specs=[spec],
            dimension_semantics=("parallel", "sequential"),
        )


def test_upstream_tpu_call_options_are_refused_by_name():
    """Older upstream TPU pipelines took first_cycle / init_accumulators / postyeet... at the call:
    Conveyor's plain pipeline (which takes allocations=, scratches=, prefetched=) refuses them by
    name instead of failing with a TypeError or ignoring them."""
    spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
    run = cv.emit_pipeline(
        lambda idx, x, o: o.__setitem__(..., x[...]), grid=(2,), in_specs=[spec], out_specs=[spec]
    )
    x = jnp.ones((16, 128), jnp.float32)
    with pytest.raises(
        NotImplementedError, match=r"first_cycle=, init_accumulators=\): not supported"
    ):
        cv.kernel(
            lambda x_ref, o_ref: run(
                x_ref, o_ref, allocations={}, first_cycle=True, init_accumulators=False
            ),
            jax.ShapeDtypeStruct(x.shape, x.dtype),
        )(x)
