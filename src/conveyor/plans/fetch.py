"""When a pipeline input is fetched: its fetch rule, and the cursor every executor carries.

Design notes: docs/internals/plans.md, section `plans/fetch.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from conveyor.plans.grid import Int

if TYPE_CHECKING:
    from conveyor.plans.pipeline import OperandPlan, PipelinePlan

EVERY_STEP, ON_CHANGE, LOOKAHEAD = "every step", "on change", "lookahead"

# fetch(step, slot, go): issue the copy of the input's block of `step` into `slot` where `go` (a
# Python bool, or a traced one inside a kernel) holds.
Fetch = Callable[[Int, Int, Any], None]
# loop(cond, body, init): `lax.while_loop`'s signature, for a scan whose bounds are traced.
Loop = Callable[[Callable[[Any], Any], Callable[[Any], Any], Any], Any]


class Cursor(NamedTuple):
    """Where one input stands in its schedule (a pytree, so it can be a loop carry)."""

    reads: Int  # distinct blocks the body has read so far, this step's included
    fetches: Int  # distinct blocks fetched so far: the next one goes to slot fetches % S
    scanned: Int  # LOOKAHEAD: every step before it has had its block fetched (or reuses one)
    done: Int  # LOOKAHEAD: distinct blocks no step will read again (their slots are free)


def concrete(x: Any) -> Any:
    """A Python bool/int for a value known at trace time (e.g. an index map's jnp result on Python
    ints), the value itself when it is traced."""
    if isinstance(x, (bool, int)):
        return x
    try:
        return x.item() if hasattr(x, "item") else x
    except jax.errors.ConcretizationTypeError:
        return x


def _count(flag: Any) -> Int:
    flag = concrete(flag)
    return int(flag) if isinstance(flag, bool) else jnp.asarray(flag, jnp.int32)


def _and(a: Any, b: Any) -> Any:
    a, b = concrete(a), concrete(b)
    if isinstance(a, bool) and isinstance(b, bool):
        return a and b
    if a is False or b is False:
        return False
    return jnp.logical_and(a, b)


# Above this many steps, a grid's block keys are not enumerated (`block_keys`): the pipeline is
# treated as one whose blocks are known only per step.
ENUMERATED_STEPS = 1 << 16
# Up to this many steps, a map of plain Python arithmetic is called step by step (faster than
# tracing it for short grids, e.g. the simulator's searches over block sizes).
PYTHON_STEPS = 1 << 12


def changes_every_step(p: PipelinePlan, op: OperandPlan) -> bool:
    """True when the grid is static and the index map, evaluated at every step, gives each step a
    block different from the previous step's: then no step can reuse a block, and the executors
    need no per-step test (no branch in the kernel). False when unknown (a map reading kernel
    values, a dynamic or very long grid). Found once per plan
    (`PipelinePlan.inputs_changing_every_step`)."""
    return op.name in p.inputs_changing_every_step


def block_keys(p: PipelinePlan, op: OperandPlan) -> np.ndarray | None:
    """`op`'s block key (`PipelinePlan.block_key`) at every step of a static grid, as an int array
    [steps, key entries]; None when unknown here: a dynamic grid or one of more than
    ENUMERATED_STEPS steps, or an index map that depends on traced values (kernel data) or
    branches in Python on its indices. The executors' own per-step calls report a faulty map."""
    if not p.is_static or p.num_steps > ENUMERATED_STEPS:
        return None
    keys = _python_block_keys(p, op) if p.num_steps <= PYTHON_STEPS else None
    if keys is not None:
        return keys

    def key_at(s):
        return jnp.stack([jnp.asarray(k, jnp.int32) for k in p.block_key(op, s)])

    try:
        # Traced on its own first: a map reading kernel values closes over the kernel's tracers,
        # and evaluating it here would put this function's constants into the kernel's trace.
        if any(isinstance(c, jax.core.Tracer) for c in jax.make_jaxpr(key_at)(jnp.int32(0)).consts):
            return None
        with jax.ensure_compile_time_eval():
            return np.asarray(jax.vmap(key_at)(jnp.arange(p.num_steps, dtype=jnp.int32)))
    except Exception:  # noqa: BLE001  (unknown here, see above)
        return None


def _python_block_keys(p: PipelinePlan, op: OperandPlan) -> np.ndarray | None:
    """`block_keys` of an index map that returns Python ints on Python ints (plain arithmetic),
    called step by step; None for any other map (then `block_keys` traces it)."""
    keys = []
    for s in range(p.num_steps):
        try:
            key = p.block_key(op, s)
        except Exception:  # noqa: BLE001  (a map that needs traced indices: traced instead)
            return None
        if not all(type(k) is int for k in key):
            return None
        keys.append(key)
    return np.asarray(keys, np.int64).reshape(len(keys), -1)


def _min(a: Int, b: Int) -> Int:
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a: Int, b: Int) -> Int:
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def changes_at(p: PipelinePlan, op: OperandPlan, t: Int) -> Any:
    """Whether step t starts a new block of input `op` (one that must be fetched and waited for)."""
    if op.invariant:
        return concrete(t == 0)
    if op.fetch_rule == EVERY_STEP or changes_every_step(p, op):
        return True
    if isinstance(t, int):
        return t == 0 or concrete(p.block_changes(op, t - 1))
    return jnp.logical_or(t == 0, p.block_changes(op, jnp.maximum(t - 1, 0)))


def read_slot(op: OperandPlan, cursor: Cursor) -> Int:
    """The slot the body reads at the step `begin_step` returned `cursor` for."""
    return 0 if op.invariant else (cursor.reads - 1) % op.num_slots


def _issue(op: OperandPlan, number: Int, go: Any, fetch: Fetch, step: Int) -> None:
    """Hand fetch number `number` of `op` (step `step`'s block) to `fetch` under `go`, and not
    where the caller prefetched it."""
    if op.prefetched:
        go = _and(go, number >= op.prefetched)
    go = concrete(go)
    if go is not False:
        fetch(step, number % op.num_slots, go)


def prologue(p: PipelinePlan, op: OperandPlan, fetch: Fetch, loop: Loop | None = None) -> Cursor:
    """Issue the fetches before step 0; the cursor step 0 starts from. With a dynamic grid each
    fetch is predicated on its step existing."""
    if op.fetch_rule == LOOKAHEAD and not op.invariant:
        return _scan(p, op, Cursor(0, 0, 0, 0), op.num_slots, fetch, loop)  # every slot is free
    fetches: Int = 0
    for t in p.prologue_steps(op):
        go = _and(p.before_end(t), changes_at(p, op, t))
        _issue(op, fetches, go, fetch, t)
        fetches = fetches + _count(go)
    return Cursor(0, fetches, 0, 0)


def begin_step(p: PipelinePlan, op: OperandPlan, cursor: Cursor, s: Int) -> tuple[Cursor, Any, Int]:
    """Step s is about to run: its cursor, whether it waits for a new block (one that changed and
    was not prefetched by the caller), and the slot it reads."""
    changed = changes_at(p, op, s)
    cursor = cursor._replace(reads=cursor.reads + _count(changed))
    waits = changed
    # the block is read number `reads` (from 1): the first `prefetched` are in place
    if op.prefetched:
        waits = _and(changed, cursor.reads > op.prefetched)
    return cursor, waits, read_slot(op, cursor)


def after_step(
    p: PipelinePlan, op: OperandPlan, cursor: Cursor, s: Int, fetch: Fetch, loop: Loop | None = None
) -> Cursor:
    """The body of step s is done: issue this input's next fetches; the cursor for step s + 1."""
    if op.invariant:
        return cursor
    n = p.num_steps
    if op.fetch_rule == LOOKAHEAD:
        # Step r = s - delay_release has finished reading; if its block changes after it, that
        # block is done (blocks end in order, so a count suffices), and its slot may be refilled.
        r = s - p.delay_release
        ended = _and(r >= 0, p.block_changes(op, _max(r, 0)))
        cursor = cursor._replace(done=cursor.done + _count(ended))
        return _scan(p, op, cursor, cursor.done + op.num_slots, fetch, loop)
    t = p.fetch_step(op, s)
    clamped = _min(t, n - 1)
    go = _and(t < n, changes_at(p, op, clamped))
    _issue(op, cursor.fetches, go, fetch, clamped)
    return cursor._replace(fetches=cursor.fetches + _count(go))


def _scan(
    p: PipelinePlan, op: OperandPlan, cursor: Cursor, limit: Int, fetch: Fetch, loop: Loop | None
) -> Cursor:
    """LOOKAHEAD: walk the steps not yet scanned, fetching each new block, while fewer than
    `limit` blocks were fetched and steps remain: a Python loop while everything is concrete,
    then the executor's `loop`."""
    n = p.num_steps

    def go_on(c: Cursor) -> Any:
        return _and(c.scanned < n, c.fetches < limit)

    def visit(c: Cursor) -> Cursor:
        changed = changes_at(p, op, c.scanned)
        _issue(op, c.fetches, changed, fetch, c.scanned)
        return c._replace(fetches=c.fetches + _count(changed), scanned=c.scanned + 1)

    # A Python loop while everything is concrete (an index map computing with jnp inside a kernel
    # may make the cursor traced mid-way: the rest of the scan is then a traced loop).
    while all(isinstance(concrete(x), int) for x in (*cursor, limit, n)):
        if not go_on(cursor):
            return cursor
        cursor = visit(cursor)
    if loop is None:
        raise TypeError(
            f"{op.name}: its lookahead scan has traced bounds; the executor must pass a loop"
        )
    cursor = Cursor(*(jnp.asarray(x, jnp.int32) for x in cursor))
    return loop(lambda c: jnp.asarray(go_on(c)), visit, cursor)


def as_carry(cursor: Cursor) -> Cursor:
    """The cursor as int32 scalars, for a traced loop's carry."""
    return Cursor(*(jnp.asarray(x, jnp.int32) for x in cursor))
