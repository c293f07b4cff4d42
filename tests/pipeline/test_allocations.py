"""Plain pipelines on caller-owned allocations, with scratches, and prefetched ahead of their call.

`run.get_allocations` / `run.with_allocations` / `emit_pipeline_with_allocations` give the on-chip
memory a pipeline runs on, so several calls share one allocation; `run.prefetch` issues a
pipeline's prologue fetches early, into its own allocations, so they overlap what runs before it.
Values are checked exactly on xla (fast and checked) and the TPU interpreter (race detection on);
the copies the TPU lowering issues are compared with the plan's events; and it exports for TPU.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor.pipeline.lowering import record_issued
from tests.platform import gpu_interpret
from tests import schedule

B = (8, 128)
ROWS = 4  # blocks per array
TPU = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")


def _pipeline(lookahead=False, rows=ROWS):
    """out block = 2 * x block (through a scratch ref) + the previous step's x block (+ 0 at step
    0);
    x is read with its own two slots, with lookahead when asked."""

    def body(idx, xb, ob, scratch, previous):
        scratch[...] = 2.0 * xb[...]
        ob[...] = scratch[...] + jnp.where(idx[0] == 0, 0.0, previous[...])
        previous[...] = xb[...]

    mode = pl.Buffered(2, use_lookahead=True) if lookahead else None
    return cv.emit_pipeline(
        body,
        grid=(rows,),
        in_specs=[pl.BlockSpec(B, lambda i: (i, 0), pipeline_mode=mode)],
        out_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
        max_concurrent_steps=2,
    )


def _reference(x):
    x = np.asarray(x)
    shifted = np.concatenate([np.zeros(B, x.dtype), x[: -B[0]]])
    return 2 * x + shifted


def _two_pipelines(prefetch: bool, lookahead: bool, dynamic: bool):
    """Pipeline a runs on x, then on y, on one allocation; pipeline b (its own allocation) runs on
    z, its first blocks prefetched before a's first call when asked."""

    def kernel(x_ref, y_ref, z_ref, ox, oy, oz, scratch, previous):
        rows = cv.program_id(0) + ROWS if dynamic else ROWS
        a, b = _pipeline(rows=rows), _pipeline(lookahead, rows=rows)

        def on_a(alloc_a):
            def on_b(alloc_b):
                early = b.prefetch(z_ref, oz, allocations=alloc_b) if prefetch else None
                a(x_ref, ox, allocations=alloc_a, scratches=(scratch, previous))
                a(y_ref, oy, allocations=alloc_a, scratches=(scratch, previous))
                b(z_ref, oz, allocations=alloc_b, scratches=(scratch, previous), prefetched=early)

            b.with_allocations(on_b, z_ref, oz)

        a.with_allocations(on_a, x_ref, ox)

    return kernel


@pytest.mark.parametrize("backend", ["xla", "xla checked", "mosaic_tpu"])
@pytest.mark.parametrize(
    "prefetch, lookahead, dynamic",
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
)
def test_shared_allocations_scratches_and_prefetch_values(backend, prefetch, lookahead, dynamic):
    # Small integers in float32: every sum is exact, so the comparison is exact.
    rng = np.random.default_rng(4712)
    xs = [jnp.asarray(rng.integers(-8, 8, (ROWS * 8, 128)), jnp.float32) for _ in range(3)]
    name = backend.split()[0]
    out = jax.ShapeDtypeStruct(xs[0].shape, jnp.float32)
    f = cv.kernel(
        _two_pipelines(prefetch, lookahead, dynamic),
        (out,) * 3,
        backend=name,
        interpret=TPU if name == "mosaic_tpu" else False,
        grid=(1,),
        scratch_shapes=[jax.ShapeDtypeStruct(B, jnp.float32)] * 2,
    )
    with cv.pipeline.checked_schedule(backend == "xla checked"):
        results = jax.jit(f)(*xs)
    for x, result in zip(xs, results):
        np.testing.assert_array_equal(result, _reference(x))


def test_a_prefetched_pipeline_issues_no_prologue_of_its_own():
    """The prefetch and the pipeline together issue the plan's schedule exactly once: the prologue
    fetches (recorded at -1) are the prefetch's, not repeated by the pipeline."""
    x = jnp.arange(ROWS * 8 * 128, dtype=jnp.float32).reshape(ROWS * 8, 128)
    pipe = _pipeline(lookahead=True)

    def kernel(x_ref, o_ref, scratch, previous):
        def on(alloc):
            early = pipe.prefetch(x_ref, o_ref, allocations=alloc)
            pipe(x_ref, o_ref, allocations=alloc, scratches=(scratch, previous), prefetched=early)

        pipe.with_allocations(on, x_ref, o_ref)

    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        backend="mosaic_tpu",
        interpret=TPU,
        grid=(1,),
        scratch_shapes=[jax.ShapeDtypeStruct(B, jnp.float32)] * 2,
    )
    with record_issued() as log:
        np.testing.assert_array_equal(jax.jit(f)(x), _reference(x))
    expected = schedule.issued(pipe.plan.with_grid((ROWS,)))
    # lookahead: both slots are filled before step 0
    assert sum(1 for a in expected if a.at == -1) == 2
    assert collections.Counter(log) == collections.Counter(expected)


def test_upstream_spelling_with_run_scoped():
    """`emit_pipeline_with_allocations` returns (pipeline, make_allocations), as upstream TPU's; the
    allocations come from a `pl.run_scoped` the caller writes."""
    x = jnp.arange(ROWS * 8 * 128, dtype=jnp.float32).reshape(ROWS * 8, 128) % 13

    def body(idx, xb, ob):
        ob[...] = xb[...] + 1.0

    pipeline, make_allocations = cv.pipeline.emit_pipeline_with_allocations(
        body,
        grid=(ROWS,),
        in_specs=[pl.BlockSpec(B, lambda i: (i, 0))],
        out_specs=[pl.BlockSpec(B, lambda i: (i, 0))],
    )

    def kernel(x_ref, o_ref):
        pl.run_scoped(
            lambda alloc: pipeline(x_ref, o_ref, allocations=alloc), make_allocations(x_ref, o_ref)
        )

    for backend in ("xla", "mosaic_tpu"):
        f = cv.kernel(
            kernel,
            jax.ShapeDtypeStruct(x.shape, jnp.float32),
            backend=backend,
            interpret=TPU if backend == "mosaic_tpu" else False,
            grid=(1,),
        )
        np.testing.assert_array_equal(jax.jit(f)(x), np.asarray(x) + 1)


def _run_kernel(kernel, backend="mosaic_tpu", interpret=TPU):
    x = jax.ShapeDtypeStruct((ROWS * 8, 128), jnp.float32)
    f = cv.kernel(kernel, x, backend=backend, interpret=interpret, grid=(1,))
    return jax.jit(f).lower(jnp.zeros(x.shape))


def test_misuses_are_refused_by_name():
    plain = cv.emit_pipeline(
        lambda idx, xb, ob: None,
        grid=(ROWS,),
        in_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
        out_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
    )
    other = cv.emit_pipeline(
        lambda idx, xb, ob: None,
        grid=(ROWS,),
        in_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
        out_specs=[cv.BlockSpec(B, lambda i: (i, 0))],
    )
    wide = cv.emit_pipeline(
        lambda idx, xb, ob: None,
        grid=(ROWS // 2,),
        in_specs=[cv.BlockSpec((16, 128), lambda i: (i, 0))],
        out_specs=[cv.BlockSpec((16, 128), lambda i: (i, 0))],
    )

    def inside(fn):
        return lambda x_ref, o_ref: plain.with_allocations(
            lambda a: fn(x_ref, o_ref, a), x_ref, o_ref
        )

    cases = [
        (
            ValueError,
            r"the slots of in\[0\] are float32\(1, 8, 128\), this pipeline needs float32\(1, 16, "
            r"128\)",
            lambda x, o, a: wide(x, o, allocations=a),
        ),
        (
            ValueError,
            r"prefetched for another pipeline",
            lambda x, o, a: other(
                x, o, allocations=a, prefetched=plain.prefetch(x, o, allocations=a)
            ),
        ),
        (
            ValueError,
            r"already consumed",
            lambda x, o, a: [
                plain(x, o, allocations=a, prefetched=p)
                for p in [plain.prefetch(x, o, allocations=a)] * 2
            ],
        ),
        (
            ValueError,
            r"a prefetch is filling these allocations",
            lambda x, o, a: (plain.prefetch(x, o, allocations=a), plain(x, o, allocations=a)),
        ),
        (
            ValueError,
            r"must run on the allocations its prefetch filled",
            lambda x, o, a: plain(x, o, prefetched=plain.prefetch(x, o, allocations=a)),
        ),
        (
            TypeError,
            r"prefetched: expected what run.prefetch",
            lambda x, o, a: plain(x, o, allocations=a, prefetched=1),
        ),
        (
            ValueError,
            r"scratches: expected a tuple or list",
            lambda x, o, a: plain(x, o, scratches=x),
        ),
        (
            NotImplementedError,
            r"first_cycle=, last_cycle=.*not supported",
            lambda x, o, a: plain(x, o, first_cycle=True, last_cycle=True),
        ),
    ]
    for error, message, misuse in cases:
        with pytest.raises(error, match=message):
            _run_kernel(inside(misuse))
    with pytest.raises(ValueError, match=r"allocations: on xla a pipeline has no on-chip memory"):
        _run_kernel(
            lambda x, o: plain(x, o, allocations={"slots": []}), backend="xla", interpret=False
        )
    with pytest.raises(
        NotImplementedError, match=r"prefetch on mosaic_gpu: caller-owned allocations"
    ):
        _run_kernel(
            lambda x, o: plain.prefetch(x, o, allocations={}),
            backend="mosaic_gpu",
            interpret=gpu_interpret(),
        )


def test_prefetch_exports_for_tpu():
    xs = [jax.ShapeDtypeStruct((ROWS * 8, 128), jnp.float32)] * 3
    for dynamic in (False, True):
        f = jax.jit(
            cv.kernel(
                _two_pipelines(True, True, dynamic),
                tuple(xs),
                backend="mosaic_tpu",
                grid=(1,),
                scratch_shapes=[jax.ShapeDtypeStruct(B, jnp.float32)] * 2,
            )
        )
        assert jax.export.export(f, platforms=["tpu"])(*xs).platforms == ("tpu",)
