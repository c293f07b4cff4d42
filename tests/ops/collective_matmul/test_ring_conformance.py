"""The ring plan's records: what they say, and that the TPU ring kernels do exactly that.

Conformance: while the TPU interpreter runs a ring kernel on simulated devices, the kernel reports
each operation it performs (`pipeline.lowering.record_issued`); per device, the recorded
`RingOperation`s must be those of `RingPlan.operation_records()`, as many times each.
The callbacks are unordered, so order is checked between grid steps, not within one; the order
within a step is the plan's `phases()`, which the checker and the simulator run. Each compute and
accumulate runs one inner `cv.emit_pipeline` over VMEM blocks, which reports its own copies and
waits (their schedule is the pipeline's, checked by tests/pipeline).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import conveyor as cv
from conveyor.ops.collective_matmul import RingPlan, ring_plan
from conveyor.pipeline.lowering import record_issued
from conveyor.plans.program import Compute, Copy, Wait
from conveyor.plans.ring import RingOperation

pytestmark = pytest.mark.timeout(180)


def _run(collective, ring, bidirectional, buffering):
    mesh = Mesh(np.array(jax.devices()[:ring]), ("x",))
    rng = np.random.default_rng(5)
    ip = pltpu.InterpretParams(detect_races=True)
    if collective == "gather":
        x = jnp.asarray(rng.standard_normal((8, 128 * ring)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((128 * ring, 128)), jnp.float32)
        f = lambda a, b: cv.all_gather_matmul(
            a,
            b,
            axis_name="x",
            bidirectional=bidirectional,  # noqa: E731
            buffering=buffering,
            backend="mosaic_tpu",
            interpret=ip,
        )[None]
        specs, expect = (P(None, "x"), P()), lambda out: [np.asarray(x @ w)] * ring
    else:
        x = jnp.asarray(rng.standard_normal((8 * ring, 128 * ring)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((128 * ring, 256)), jnp.float32)
        f = lambda a, b: cv.matmul_reduce_scatter(
            a,
            b,
            axis_name="x",
            bidirectional=bidirectional,  # noqa: E731
            buffering=buffering,
            backend="mosaic_tpu",
            interpret=ip,
        )[None]
        specs, expect = (
            (P(None, "x"), P("x", None)),
            lambda out: np.split(np.asarray(x @ w), ring, axis=0),
        )
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=False))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
    with record_issued() as log:
        out = np.asarray(fn(*args))
        jax.effects_barrier()
    for d, want in enumerate(expect(out)):
        np.testing.assert_allclose(out[d], want, rtol=1e-5, atol=1e-3)
    return log


@pytest.mark.parametrize(
    "collective, ring, bidirectional, buffering",
    [
        ("gather", 4, False, 2),
        ("gather", 5, True, 2),
        ("gather", 4, True, 3),
        ("scatter", 4, False, 2),
        ("scatter", 3, True, 2),
        ("scatter", 4, False, 3),
    ],
)
def test_ring_kernel_does_what_the_records_say(collective, ring, bidirectional, buffering):
    log = _run(collective, ring, bidirectional, buffering)
    plan = ring_plan(
        collective=collective, num_devices=ring, bidirectional=bidirectional, buffering=buffering
    )
    got = collections.Counter(r for r in log if isinstance(r, RingOperation))
    want = collections.Counter(
        {r: n * ring for r, n in collections.Counter(plan.operation_records()).items()}
    )
    assert got == want, (sorted(map(str, got - want)), sorted(map(str, want - got)))
    # one inner pipeline (here of one block: one write-back) per compute and per accumulate
    pipelines = sum(n for r, n in got.items() if r.operation in ("compute", "accumulate"))
    assert sum(1 for a in log if isinstance(a, Copy) and a.queue == "stores") == pipelines


def test_records_of_a_unidirectional_gather():
    plan = ring_plan(collective="gather", num_devices=4, bidirectional=False, buffering=2)
    (first,), (second,), _, (last,) = plan.steps()
    assert (first.receives, first.computes, first.source, first.sends, first.send_slot) == (
        False,
        True,
        0,
        True,
        1,
    )
    assert (second.receives, second.slot, second.source, second.grants_credit) == (
        True,
        1,
        -1,
        True,
    )
    # the last shard is neither forwarded nor followed by another: no send, no credit
    assert (last.slot, last.source, last.sends, last.awaits_send_of, last.grants_credit) == (
        1,
        -3,
        False,
        None,
        False,
    )


def test_both_directions_are_in_flight_at_once():
    """A bidirectional gather starts both streams' sends before either stream's matmul, and waits
    for them only after both matmuls."""
    plan = ring_plan(collective="gather", num_devices=5, bidirectional=True, buffering=2)
    acts = [a for a in plan.program()["dev0"] if isinstance(a, (Copy, Compute, Wait))]
    step1 = [
        a
        for a in acts
        if (isinstance(a, Compute) and a.step == 1)
        or (isinstance(a, Copy) and a.name.endswith("#2"))
        or (isinstance(a, Wait) and a.counter[0] == "sent" and a.counter[-1] == 1)
    ]
    kinds = [
        type(a).__name__ + ("" if isinstance(a, Wait) else f" {getattr(a, 'stream', '') or a.name}")
        for a in step1
    ]
    assert kinds == [
        "Copy dev0->dev1 right #2",
        "Copy dev0->dev4 left #2",
        "Compute right",
        "Compute left",
        "Wait",
        "Wait",
    ], kinds


def test_a_reduce_scatter_hop_overlaps_the_next_partial_product():
    """The send of step t is awaited at step t + 1, after that step's partial product."""
    plan = ring_plan(collective="scatter", num_devices=4, bidirectional=False, buffering=2)
    acts = plan.program()["dev0"]
    send0 = next(i for i, a in enumerate(acts) if isinstance(a, Copy) and a.name.endswith("#1"))
    compute1 = next(i for i, a in enumerate(acts) if isinstance(a, Compute) and a.step == 1)
    wait0 = next(
        i
        for i, a in enumerate(acts)
        if isinstance(a, Wait) and a.counter == ("sent", "right", 0, 0)
    )
    assert send0 < compute1 < wait0
    assert [r.awaits_send_of for (r,) in plan.steps()] == [None, 0, 1, 2]


def test_the_table_holds_the_records():
    plan = ring_plan(collective="scatter", num_devices=3, bidirectional=True, buffering=2)
    table = plan.step_table()
    for records in plan.steps():
        for r in records:
            assert table[plan.table_index(r.step, r.direction, "source")] == r.source
            assert table[plan.table_index(r.step, r.direction, "sends")] == r.sends
            awaited = -1 if r.awaits_send_of is None else plan.slot(r.awaits_send_of)
            assert table[plan.table_index(r.step, r.direction, "awaits_slot")] == awaited


def test_ring_plan_normalizes_and_refuses_bad_fields():
    assert not ring_plan(
        collective="gather", num_devices=2, bidirectional=True, buffering=4
    ).bidirectional
    p = ring_plan(collective="scatter", num_devices=2, bidirectional=True, buffering=4)
    assert p.bidirectional and p.buffering == 2
    with pytest.raises(ValueError, match="buffering must be an int >= 1, got 0"):
        RingPlan(num_devices=4, bidirectional=False, buffering=0)
    with pytest.raises(ValueError, match="collective must be one of"):
        RingPlan(num_devices=4, bidirectional=False, buffering=2, collective="reduce")
    with pytest.raises(TypeError):
        RingPlan(4, False, 2)  # keyword-only: positional fields are easy to swap
