"""Fetch rules (`conveyor.plans.fetch`): a plain pipeline fetches an input only at the steps that
change its block, `pl.Buffered(n, use_lookahead=True)` fetches the next changed blocks as far ahead
as its free slots allow, and warp-specialized pipelines fetch every step.

Checked four ways: hand-derived schedules, the protocol checker over many patterns (no race, no
deadlock, one fetch per block change), the values on every backend (xla fast and checked, both
Mosaic interpreters with race detection, static and dynamic grids), and exports for hardware. The
lowerings' recorded copies are compared with the plan's events in `test_conformance.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor.plans import fetch
from tests.platform import gpu_interpret
from tests import schedule

B = (8, 128)
GRID = (4, 3)
# Index maps of the patterned input w over GRID (i, k), and what they exercise:
PATTERNS = {
    "every step": lambda i, k: (i * 3 + k, 0),  # a new block at every step
    "per row": lambda i, k: (i, 0),  # reused across k: one fetch per row
    "every other row": lambda i, k: (i // 2, 0),  # long runs: lookahead fetches far ahead
    "revisits": lambda i, k: (k % 2, 0),  # 0 1 0 | 0 1 0 ...: block 0 comes back and is refetched
}
W_BLOCKS = 12  # w has enough blocks for the largest map ("every step")


def _spec(pattern, count=None, lookahead=False):
    mode = (
        pl.Buffered(count, use_lookahead=True)
        if lookahead
        else (pl.Buffered(count) if count else None)
    )
    return pl.BlockSpec(B, PATTERNS[pattern], pipeline_mode=mode)


def _plan(pattern, *, mcs=2, delay=0, count=None, lookahead=False, grid=GRID):
    return cv.pipeline.plan(
        grid=grid,
        in_specs=[_spec(pattern, count, lookahead)],
        out_specs=[cv.BlockSpec(B, lambda i, k: (i, k))],
        max_concurrent_steps=mcs,
        delay_release=delay,
    )


def _inputs(plan):
    """(issued at, step fetched, slot) of every fetch."""
    return [(c.at, c.step, schedule.slot(c)) for c in schedule.fetches(plan)]


def _waits(plan):
    """(waited at, slot) of every fetch wait."""
    return [(w.at, schedule.slot(w)) for w in schedule.fetch_waits(plan)]


def test_unchanged_blocks_are_not_refetched_and_lookahead_fetches_ahead():
    """grid (2, 3), w at (i, 0), two slots. Block 0 is read at steps 0-2, block 1 at steps 3-5."""
    on_change = _plan("per row", grid=(2, 3))
    assert on_change.inputs[0].fetch_rule == fetch.ON_CHANGE
    # (issued during step, step moved, slot): block 1 is fetched lookahead = 2 steps ahead, during
    # step 1.
    assert _inputs(on_change) == [(-1, 0, 0), (1, 3, 1)]
    assert _waits(on_change) == [(0, 0), (3, 1)]
    lookahead = _plan("per row", grid=(2, 3), lookahead=True, count=2)
    assert lookahead.inputs[0].fetch_rule == fetch.LOOKAHEAD
    # Both blocks fit in the two slots: the prologue fetches block 1 at once, three steps early.
    assert _inputs(lookahead) == [(-1, 0, 0), (-1, 3, 1)]
    assert _waits(lookahead) == [(0, 0), (3, 1)]


def test_lookahead_refills_a_slot_as_soon_as_its_block_is_done():
    """grid (4, 3), w at (i, 0), two slots: block 2 (steps 6-8) goes into slot 0 after the last
    step reading block 0 (step 2), not two steps before it is needed (step 4) as without
    lookahead."""
    assert _inputs(_plan("per row", lookahead=True, count=2)) == [
        (-1, 0, 0),
        (-1, 3, 1),
        (2, 6, 0),
        (5, 9, 1),
    ]
    assert _inputs(_plan("per row")) == [(-1, 0, 0), (1, 3, 1), (4, 6, 0), (7, 9, 1)]
    # With delay_release=1 the block read at step 2 is kept during step 3: its slot is refilled
    # then.
    assert _inputs(_plan("per row", mcs=3, delay=1, lookahead=True, count=2)) == [
        (-1, 0, 0),
        (-1, 3, 1),
        (3, 6, 0),
        (6, 9, 1),
    ]


def _block_changes(pattern, grid=GRID):
    steps = [divmod(s, grid[1]) for s in range(grid[0] * grid[1])]
    blocks = [PATTERNS[pattern](i, k) for i, k in steps]
    return sum(1 for t, b in enumerate(blocks) if t == 0 or b != blocks[t - 1])


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize(
    "mcs, delay, count, lookahead",
    [
        (1, 0, None, False),
        (2, 0, None, False),
        (3, 1, None, False),
        (2, 0, 2, True),
        (3, 0, 3, True),
        (3, 1, 3, True),
        (3, 1, 2, True),
        (2, 0, 1, True),
    ],
)
def test_plans_are_clean_and_fetch_once_per_block_change(pattern, mcs, delay, count, lookahead):
    p = _plan(pattern, mcs=mcs, delay=delay, count=count, lookahead=lookahead)
    assert len(_inputs(p)) == _block_changes(pattern) == len(_waits(p))
    report = cv.sim.check(p, in_flight_steps=delay)
    assert report.ok, str(report)


def test_a_lookahead_one_block_too_far_is_a_race(monkeypatch):
    scan = fetch._scan
    monkeypatch.setattr(
        fetch,
        "_scan",
        lambda p, op, cursor, limit, f, loop: scan(p, op, cursor, limit + 1, f, loop),
    )
    report = cv.sim.check(_plan("per row", lookahead=True, count=2))
    assert not report.ok and report.findings[0].kind == "race", str(report)


def test_use_lookahead_is_refused_where_it_cannot_be_honoured():
    with pytest.raises(ValueError, match=r"out\[0\].*use_lookahead applies to inputs"):
        cv.pipeline.plan(
            grid=(2,),
            out_specs=[
                pl.BlockSpec(B, lambda i: (i, 0), pipeline_mode=pl.Buffered(2, use_lookahead=True))
            ],
        )
    with pytest.raises(
        NotImplementedError,
        match=r"in\[0\]: pl.Buffered\(use_lookahead=True\) is not supported "
        r"by warp-specialized pipelines",
    ):
        cv.emit_pipeline_warp_specialized(
            lambda *a: None,
            grid=GRID,
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=1,
            in_specs=[_spec("per row", 2, True)],
            max_concurrent_steps=2,
        )
    wp = cv.emit_pipeline_warp_specialized(
        lambda *a: None,
        grid=GRID,
        memory_registers=40,
        wg_axis="wg",
        num_compute_wgs=1,
        in_specs=[_spec("per row")],
        max_concurrent_steps=2,
    )
    assert wp.plan.pipeline.inputs[0].fetch_rule == fetch.EVERY_STEP
    with pytest.raises(
        ValueError, match=r"in\[0\]: .*use_lookahead=True.*reuse_unchanged_blocks=False"
    ):
        cv.pipeline.plan(
            grid=GRID, in_specs=[_spec("per row", 2, True)], reuse_unchanged_blocks=False
        )


def _interpret(backend):
    return {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
        "mosaic_gpu": gpu_interpret(detect_races=True),
    }[backend]


def _kernel(w_spec, mcs, delay, dynamic):
    """out block (i, k) = x block (i, k) + 2 * w's patterned block; with `dynamic` the pipeline's
    row count is traced (computed from the kernel's program id, which is 0)."""

    def body(idx, xb, wb, ob):
        ob[...] = xb[...] + 2.0 * wb[...]

    def kernel(x_ref, w_ref, o_ref):
        rows = cv.program_id(0) + GRID[0] if dynamic else GRID[0]
        cv.emit_pipeline(
            body,
            grid=(rows, GRID[1]),
            in_specs=[cv.BlockSpec(B, lambda i, k: (i, k)), w_spec],
            out_specs=[cv.BlockSpec(B, lambda i, k: (i, k))],
            max_concurrent_steps=mcs,
            delay_release=delay,
        )(x_ref, w_ref, o_ref)

    return kernel


def _reference(pattern, x, w):
    out = np.asarray(x).copy()
    for i in range(GRID[0]):
        for k in range(GRID[1]):
            (wb, _), rows, cols = (
                PATTERNS[pattern](i, k),
                slice(i * 8, i * 8 + 8),
                slice(k * 128, k * 128 + 128),
            )
            out[rows, cols] += 2.0 * np.asarray(w)[wb * 8 : wb * 8 + 8]
    return out


CASES = [
    ("per row", 2, 0, None, False),
    ("every other row", 2, 0, 2, True),
    ("revisits", 3, 1, 3, True),
    ("every other row", 3, 1, 2, True),
    ("revisits", 2, 0, None, False),
    ("per row", 2, 0, 1, True),
]


@pytest.mark.parametrize("backend", ["xla", "xla checked", "mosaic_tpu", "mosaic_gpu"])
@pytest.mark.parametrize("pattern, mcs, delay, count, lookahead", CASES)
def test_values_on_every_backend(backend, pattern, mcs, delay, count, lookahead):
    # Small integers in float32: x + 2 w is exact, so the comparison is exact.
    rng = np.random.default_rng(4719)
    x = jnp.asarray(rng.integers(-8, 8, (GRID[0] * 8, GRID[1] * 128)), jnp.float32)
    w = jnp.asarray(rng.integers(-8, 8, (W_BLOCKS * 8, 128)), jnp.float32)
    name = backend.split()[0]
    dynamic = mcs == 3  # half the cases run a traced grid size
    f = cv.kernel(
        _kernel(_spec(pattern, count, lookahead), mcs, delay, dynamic),
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        backend=name,
        interpret=_interpret(name),
        grid=(1,),
    )
    with cv.pipeline.checked_schedule(backend == "xla checked"):
        out = jax.jit(f)(x, w)
    np.testing.assert_array_equal(out, _reference(pattern, x, w))


@pytest.mark.parametrize("backend, platform", [("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_lookahead_exports_for_hardware(backend, platform):
    x = jax.ShapeDtypeStruct((GRID[0] * 8, GRID[1] * 128), jnp.float32)
    w = jax.ShapeDtypeStruct((W_BLOCKS * 8, 128), jnp.float32)
    for dynamic in (False, True):
        f = jax.jit(
            cv.kernel(
                _kernel(_spec("every other row", 2, True), 2, 0, dynamic),
                x,
                backend=backend,
                grid=(1,),
            )
        )
        assert jax.export.export(f, platforms=[platform])(x, w).platforms == (platform,)


def _count_primitive(jaxpr, name: str) -> int:
    """How many equations of `jaxpr`, nested jaxprs included, apply the primitive `name`."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr (jax 0.11) or a Jaxpr
                if hasattr(sub, "eqns"):
                    count += _count_primitive(sub, name)
    return count


def test_a_block_changing_at_every_step_needs_no_test_in_the_kernel():
    """With a static grid and a map that changes the block at every step, no per-step branch is
    traced (what keeps small-block pipelines as fast as before on XLA:CPU)."""
    assert fetch.changes_every_step(_plan("every step"), _plan("every step").inputs[0])
    for pattern in ("per row", "revisits"):
        assert not fetch.changes_every_step(_plan(pattern), _plan(pattern).inputs[0])
    dynamic = cv.pipeline.plan(grid=(jnp.int32(4), 3), in_specs=[_spec("every step")])
    assert not fetch.changes_every_step(dynamic, dynamic.inputs[0])  # unknown: tested per step

    def conds(pattern):
        f = cv.kernel(
            _kernel(_spec(pattern), 2, 0, False),
            jax.ShapeDtypeStruct((32, 384), jnp.float32),
            grid=(1,),
            backend="xla",
        )
        # The default executor (the checked one poisons slots in branches).
        with cv.pipeline.checked_schedule(False):
            jaxpr = jax.make_jaxpr(f)(jnp.zeros((32, 384)), jnp.zeros((96, 128)))
        return _count_primitive(jaxpr.jaxpr, "cond")

    assert conds("every step") == 0 < conds("per row")


@pytest.mark.parametrize(
    "index_map",
    [
        lambda i, k: (i // 2, k % 2),  # Python arithmetic: called step by step
        lambda i, k: (jnp.minimum(i, 2), k),  # jnp: traced
        lambda i, k: (i, jnp.int32(0) * k),  # ints and an array: traced
    ],
    ids=["python", "jnp", "mixed"],
)
def test_block_keys_are_the_maps_values_at_every_step(index_map):
    """`block_keys` gives each step's block key, however the map is written (the two ways it is
    evaluated must agree with calling the map)."""
    p = cv.pipeline.plan(grid=(5, 3), in_specs=[cv.BlockSpec(B, index_map)])
    op = p.inputs[0]
    want = [[int(x) for x in index_map(i, k)] for i in range(5) for k in range(3)]
    np.testing.assert_array_equal(fetch.block_keys(p, op), want)
