"""Inputs whose first blocks the caller has already put in their slots: upstream's
`pl.Buffered(n, prefetched_count=p)` (`OperandPlan.prefetched`).

The pipeline issues and awaits neither of those fetches, and counts them as usual (fetch p goes to
slot p % n). Checked: the plan's events (no prologue copy or wait for them, the later refills of
their slots still after their last reads; the checker finds no race and the simulator a shorter
run); values on xla (fast and checked: the blocks are read from the input, which holds the same
values) and on the TPU interpreter with race detection, where the kernel fills the slots itself;
that the TPU pipeline really reads the caller's slots (a slot filled with other values shows in the
output); the copies the TPU lowering issues against the plan's events; refusals; export for TPU.
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
from conveyor.plans.program import Copy, Read
from tests.platform import gpu_interpret
from tests import schedule

B = (8, 128)
STEPS = 6
TPU = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
# Fetch rules and how x's block moves: every step, or every second step (a block read by two steps
# is one fetch: the prefetched count is of distinct blocks).
CASES = {
    "every step": (lambda i: (i, 0), False),
    "every second step": (lambda i: (i // 2, 0), False),
    "lookahead": (lambda i: (i // 2, 0), True),
}


def _x_block(i, case):
    return CASES[case][0](i)[0]


def _pipeline(case: str, prefetched: int, slots: int = 2, steps=STEPS):
    """out block i = x's block at step i + y block i; x has `slots` slots, the first `prefetched`
    of its blocks already in place. `steps` may be traced (a dynamic grid)."""
    imap, lookahead = CASES[case]
    mode = pl.Buffered(slots, use_lookahead=lookahead, prefetched_count=prefetched)

    def body(idx, xb, yb, ob):
        ob[...] = xb[...] + yb[...]

    return cv.emit_pipeline(
        body,
        grid=(steps,),
        in_specs=[pl.BlockSpec(B, imap, pipeline_mode=mode), pl.BlockSpec(B, lambda i: (i, 0))],
        out_specs=[pl.BlockSpec(B, lambda i: (i, 0))],
        max_concurrent_steps=2,
    )


def _kernel(case: str, prefetched: int, offset: float = 0.0, dynamic: bool = False):
    """Fills x's first `prefetched` slots itself (plus `offset`) where there are slots (mosaic_tpu),
    then runs the pipeline on those allocations; with `dynamic`, its grid size is traced."""

    def kernel(x_ref, y_ref, o_ref):
        pipe = _pipeline(case, prefetched, steps=cv.program_id(0) + STEPS if dynamic else STEPS)

        def on(allocations):
            if allocations:  # mosaic_tpu; xla has no slots (allocations == {})
                slots = allocations["slots"][0]
                for j in range(prefetched):
                    first_step = next(i for i in range(STEPS) if _x_block(i, case) == j)
                    block = _x_block(first_step, case)
                    pltpu.sync_copy(x_ref.at[pl.ds(block * B[0], B[0])], slots.at[j])
                    if offset:
                        slots[j] = slots[j] + offset
            pipe(x_ref, y_ref, o_ref, allocations=allocations)

        pipe.with_allocations(on, x_ref, y_ref, o_ref)

    return kernel


def _reference(x, y, case):
    rows = [
        np.asarray(x)[_x_block(i, case) * 8 : (_x_block(i, case) + 1) * 8] for i in range(STEPS)
    ]
    return np.concatenate(rows) + np.asarray(y)


def _inputs():
    # Small integers in float32: every sum is exact, so the comparison is exact.
    rng = np.random.default_rng(4723)
    return [jnp.asarray(rng.integers(-8, 8, (STEPS * 8, 128)), jnp.float32) for _ in range(2)]


def _call(kernel, backend, x, y):
    out = jax.ShapeDtypeStruct(y.shape, jnp.float32)
    f = cv.kernel(
        kernel, out, backend=backend, interpret=TPU if backend == "mosaic_tpu" else False, grid=(1,)
    )
    return jax.jit(f)(x, y)


@pytest.mark.parametrize("backend", ["xla", "xla checked", "mosaic_tpu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prefetched", [1, 2])
def test_values(backend, case, prefetched):
    x, y = _inputs()
    name = backend.split()[0]
    with cv.pipeline.checked_schedule(backend == "xla checked"):
        result = _call(_kernel(case, prefetched), name, x, y)
    np.testing.assert_array_equal(result, _reference(x, y, case))


@pytest.mark.parametrize("backend", ["xla checked", "mosaic_tpu"])
@pytest.mark.parametrize("case", ["every second step", "lookahead"])
def test_values_with_a_dynamic_grid(backend, case):
    """The grid size is traced: the skipped fetches and waits are decided inside the kernel."""
    x, y = _inputs()
    name = backend.split()[0]
    with cv.pipeline.checked_schedule(backend == "xla checked"):
        result = _call(_kernel(case, 2, dynamic=True), name, x, y)
    np.testing.assert_array_equal(result, _reference(x, y, case))


def test_tpu_reads_the_callers_slots():
    """What the caller put in the prefetched slot is what the first steps read (nothing refetched
    it): filled with x + 100, step 0 (and step 1, which reads the same block) show the + 100."""
    x, y = _inputs()
    result = np.asarray(_call(_kernel("every second step", 1, offset=100.0), "mosaic_tpu", x, y))
    expected = _reference(x, y, "every second step")
    expected[:16] += 100.0
    np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_program_skips_the_prefetched_fetches(case):
    plain, early = _pipeline(case, 0).plan, _pipeline(case, 2).plan

    def prefetched(a):
        """A fetch of x's block 0 or 1, or a wait for one."""
        if isinstance(a, Copy):
            operand, step = (a.operand, a.step) if a.queue == "loads" else (None, None)
        else:
            operand, step = (a.counter[1], a.counter[3]) if a.counter[0] == "landed" else (None, 0)
        return operand == "in[0]" and _x_block(step, case) < 2

    # The plain plan's fetches of blocks 0 and 1 and its waits for them are gone; the body reads
    # the same slots (the caller's, for those blocks).
    kept = [a for a in schedule.issued(plain) if not prefetched(a)]
    assert len(kept) < len(schedule.issued(plain))
    assert schedule.issued(early) == kept
    reads = [[a for a in schedule.thread(p) if isinstance(a, Read)] for p in (plain, early)]
    assert reads[0] == reads[1]
    assert early.inputs[0].prefetched == 2 and early.inputs[1].prefetched == 0
    # Block 2 refills slot 0 only after the steps reading block 0 are done: the checker finds no
    # race.
    assert cv.sim.check(early).ok
    flops = 2 * 8 * 128 * 128
    assert (
        cv.sim.simulate(early, "v5e", flops_per_step=flops).time_us
        < cv.sim.simulate(plain, "v5e", flops_per_step=flops).time_us
    )


def test_tpu_copies_follow_the_plan():
    pipe = _pipeline("lookahead", 2)
    x, y = _inputs()
    with record_issued() as log:
        np.testing.assert_array_equal(
            _call(_kernel("lookahead", 2), "mosaic_tpu", x, y), _reference(x, y, "lookahead")
        )
    assert collections.Counter(log) == collections.Counter(schedule.issued(pipe.plan))


def test_refusals():
    def spec(mode):
        return pl.BlockSpec(B, lambda i: (i, 0), pipeline_mode=mode)

    plans = [
        (
            r"in\[0\].*prefetched_count=3 must be at most buffer_count=2",
            dict(in_specs=[spec(pl.Buffered(2, prefetched_count=3))]),
        ),
        (
            r"in\[0\].*prefetched_count must be an int >= 0, got -1",
            dict(in_specs=[spec(pl.Buffered(2, prefetched_count=-1))]),
        ),
        (
            r"out\[0\].*prefetched_count applies to inputs",
            dict(out_specs=[spec(pl.Buffered(2, prefetched_count=1))]),
        ),
    ]
    for message, specs in plans:
        with pytest.raises(ValueError, match=message):
            cv.pipeline.plan(grid=(STEPS,), **specs)
    x, y = _inputs()
    pipe = _pipeline("every step", 1)
    with pytest.raises(
        ValueError,
        match=r"in\[0\]: pl.Buffered\(prefetched_count=...\).*must run on the caller's "
        r"allocations",
    ):
        _call(lambda x_ref, y_ref, o_ref: pipe(x_ref, y_ref, o_ref), "mosaic_tpu", x, y)
    out = jax.ShapeDtypeStruct(y.shape, jnp.float32)
    with pytest.raises(
        NotImplementedError,
        match=r"a plain pipeline on mosaic_gpu: in\[0\] use "
        r"pl.Buffered\(prefetched_count",
    ):
        jax.jit(
            cv.kernel(
                lambda x_ref, y_ref, o_ref: pipe(x_ref, y_ref, o_ref),
                out,
                backend="mosaic_gpu",
                interpret=gpu_interpret(),
            )
        ).lower(x, y)
    with pytest.raises(NotImplementedError, match=r"emit_pipeline_warp_specialized: in\[0\] use"):
        cv.emit_pipeline_warp_specialized(
            lambda *a: None,
            grid=(STEPS,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=1,
            in_specs=[spec(pl.Buffered(2, prefetched_count=1))],
        )


def test_exports_for_tpu():
    x = jax.ShapeDtypeStruct((STEPS * 8, 128), jnp.float32)
    for dynamic in (False, True):
        f = jax.jit(
            cv.kernel(_kernel("lookahead", 2, dynamic=dynamic), x, backend="mosaic_tpu", grid=(1,))
        )
        assert jax.export.export(f, platforms=["tpu"])(x, x).platforms == ("tpu",)


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu"])
def test_prefetched_slots_must_be_bound(backend):
    """Without the caller's allocations the pipeline would read slots nobody filled: refused on
    every backend that takes prefetched_count."""
    x, y = _inputs()

    def kernel(x_ref, y_ref, o_ref):
        _pipeline("every step", 1)(x_ref, y_ref, o_ref)  # no allocations=

    with pytest.raises(
        ValueError,
        match=r"in\[0\]: pl.Buffered\(prefetched_count=...\) says the caller has put "
        r"the first blocks in the input's slots, so the pipeline must run on the "
        r"caller's allocations",
    ):
        _call(kernel, backend, x, y)
