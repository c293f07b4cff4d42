"""The CPU executor of mpmd_map: every instance of every program runs at once, on shared memory.

Design notes: docs/internals/mpmd.md, section `mpmd/cpu.py`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np

from conveyor.jaxprs import ndindexer_parts, state_primitives
from conveyor.kernel import poison_numpy
from conveyor.sync import barrier_p, semaphore_signal_p, semaphore_wait_p

P = state_primitives()


def _select_n(pred, *cases):
    pred = np.asarray(pred)
    return np.where(pred, cases[1], cases[0]) if pred.dtype == np.bool_ else np.choose(pred, cases)


# Elementwise primitives evaluated with NumPy: the scalar index arithmetic of loops and
# semaphores would otherwise pay a JAX dispatch per operation. Same IEEE results; operands of a
# lax binary op always share one dtype, so NumPy's promotion rules never apply.
NUMPY_PRIMITIVES = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "rem": np.fmod,
    "neg": np.negative,
    "max": np.maximum,
    "min": np.minimum,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "not": np.invert,
    "select_n": _select_n,
}
# Accelerator memory fences: CPU memory is coherent, so they have nothing to order here.
NO_OPS_ON_CPU = frozenset({"commit_smem", "commit_smem_to_gmem_group"})


class MpmdDeadlock(TimeoutError):
    """A wait in an mpmd_map call was not satisfied within the timeout."""


class _Aborted(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Buffer:
    name: str
    array: np.ndarray
    kind: str = "array"  # "array" | "semaphore" | "barrier"
    barrier: threading.Barrier | None = None  # set for kind "barrier" when a call starts


@dataclasses.dataclass(frozen=True, eq=False)
class Ref:
    """A ref value inside the interpreter: the memory it names (shared, or an instance's own)."""

    buffer: Buffer


@dataclasses.dataclass(frozen=True)
class Instance:
    program: int
    label: str  # "program 1 ('consumer')"
    point: tuple[tuple[str, int], ...]

    @property
    def coords(self) -> dict[str, int]:
        return dict(self.point)

    def __str__(self):
        where = ", ".join(f"{k}={v}" for k, v in self.point) or "the single point"
        return f"{self.label} at {where}"


class Shared:
    """Memory and synchronization state shared by all instances of one call."""

    def __init__(self, buffers: list[Buffer], instances: list[Instance], timeout_s: float):
        self.buffers = buffers
        self.cond = threading.Condition()
        self.timeout_s = timeout_s
        self.aborted = False
        self.state: dict[Instance, str] = {i: "running" for i in instances}
        self.report: str | None = None
        for b in buffers:
            if b.kind == "barrier":
                b.barrier = threading.Barrier(len(instances))
        self.print_lock = threading.Lock()

    def set_state(self, inst: Instance, what: str):
        with self.cond:
            self.state[inst] = what

    def abort(self, report: str | None = None):
        with self.cond:
            if report and self.report is None:
                self.report = report
            self.aborted = True
            self.cond.notify_all()
        for b in self.buffers:
            if b.barrier is not None:
                b.barrier.abort()

    def table(self) -> str:
        return "\n".join(f"  {inst}: {what}" for inst, what in self.state.items())


def _view_index(buf: np.ndarray, transforms) -> tuple[np.ndarray, Any]:
    """Resolve ref transforms to (array, index) so that array[index] is the viewed element(s)."""
    base, idx = buf, (Ellipsis,)
    for t in transforms:
        parts = ndindexer_parts(t)
        if parts is None:
            raise NotImplementedError(
                f"mpmd_map on CPU: ref transform {type(t).__name__} is not supported"
            )
        base = base[idx] if idx != (Ellipsis,) else base
        out = []
        for part in parts:
            if part[0] == "slice":
                _, start, size, stride = part
                start = int(np.asarray(start))
                out.append(slice(start, start + int(size) * int(stride), int(stride)))
            else:
                a = np.asarray(part[1])
                out.append(int(a) if a.ndim == 0 else a)
        idx = tuple(out)
    return base, idx


class Interpreter:
    def __init__(self, shared: Shared, inst: Instance):
        self.shared, self.inst = shared, inst

    def run(self, jaxpr, consts, args):
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, P["Literal"]) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            if self.shared.aborted:
                raise _Aborted()
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _touches_state(self, eqn) -> bool:
        return bool(eqn.effects) or any(isinstance(v.aval, P["AbstractRef"]) for v in eqn.invars)

    def eqn(self, eqn, vals):
        prim, params = eqn.primitive, eqn.params
        if prim is P["get"]:
            arr, idx = self._resolve(vals[0], vals[1:], params["tree"])
            return np.array(arr[idx])
        if prim is P["swap"]:
            arr, idx = self._resolve(vals[0], vals[2:], params["tree"])
            old = np.array(arr[idx])
            arr[idx] = np.asarray(vals[1])
            return old
        if prim is P["addupdate"]:
            arr, idx = self._resolve(vals[0], vals[2:], params["tree"])
            arr[idx] += np.asarray(vals[1])
            return []
        if prim is P["axis_index"]:
            name = params["axis_name"]
            name = name[0] if isinstance(name, (tuple, list)) else name
            coords = self.inst.coords
            if name not in coords:
                raise NameError(
                    f"{self.inst}: lax.axis_index({name!r}) names an axis this program's mesh does "
                    f"not have (it has {sorted(coords)})"
                )
            return np.int32(coords[name])
        if prim is semaphore_signal_p:
            return self._signal(vals, params)
        if prim is semaphore_wait_p:
            return self._wait(vals, params)
        if prim is barrier_p:
            return self._barrier(vals[0])
        if prim.name in NO_OPS_ON_CPU:
            return []
        if prim is P["run_scoped"]:
            return self._run_scoped(eqn, vals)
        if prim.name == "debug_print":
            return self._print(vals, params)
        if prim.name in NUMPY_PRIMITIVES and not params.get("accumulation_type"):
            return NUMPY_PRIMITIVES[prim.name](*(np.asarray(v) for v in vals))
        if prim.name == "convert_element_type":
            return np.asarray(vals[0]).astype(params["new_dtype"])
        if prim is P["jit"] and _numpy_only(params["jaxpr"]):
            # small scalar helpers (jnp.remainder, ...): cheaper in NumPy than a dispatch
            j = params["jaxpr"]
            return self.run(j, j.consts, vals)
        if not self._touches_state(eqn):
            return self._evaluate(prim, vals, params)
        if prim is P["while_"]:
            return self._while(vals, params)
        if prim is P["scan"]:
            return self._scan(vals, params)
        if prim is P["cond"]:
            index = int(np.asarray(vals[0]))
            branch = params["branches"][index]
            return self.run(branch, branch.consts, vals[1:])
        if prim is P["jit"]:
            j = params["jaxpr"]
            return self.run(j, j.consts, vals)
        raise NotImplementedError(
            f"mpmd_map on CPU: {prim} over refs is not supported (in {self.inst})"
        )

    def _evaluate(self, prim, vals, params):
        """A pure primitive, evaluated eagerly. One JAX cannot evaluate (a fusible dtype's
        pack/unpack, which only `fuser.physicalize` rewrites) is refused naming it."""
        try:
            return prim.bind(*vals, **params)
        except NotImplementedError as e:
            if "Evaluation rule" not in str(e):
                raise
            raise NotImplementedError(
                f"{self.inst}: mpmd_map on CPU evaluates each primitive eagerly, and JAX has no "
                f"evaluation rule for {prim.name!r}; a fusible dtype's pack/unpack, for one, must "
                "be physicalized away inside the program"
            ) from e

    def _resolve(self, ref, leaves, tree):
        if not isinstance(ref, Ref):
            raise TypeError(f"{self.inst}: expected a ref, got {type(ref).__name__}")
        transforms = jax.tree_util.tree_unflatten(tree, list(leaves))
        return _view_index(ref.buffer.array, transforms)

    def _run_scoped(self, eqn, vals):
        """`pl.run_scoped` in a program: fresh memory of this instance alone, for the body's
        duration."""
        body = eqn.params["jaxpr"]
        scoped = []
        for v in body.invars:
            aval = v.aval.inner_aval
            if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
                scoped.append(
                    Ref(
                        Buffer(
                            f"{self.inst}'s scoped semaphore",
                            np.zeros(aval.shape, np.int32),
                            "semaphore",
                        )
                    )
                )
            else:
                scoped.append(
                    Ref(
                        Buffer(f"{self.inst}'s scoped buffer", poison_numpy(aval.shape, aval.dtype))
                    )
                )
        return self.run(body, vals, scoped)

    def _print(self, vals, params):
        """`pl.debug_print` in a program: one line, prefixed with the instance that printed it."""
        values = [np.asarray(v) for v in vals]
        fmt = params["fmt"]
        text = (
            fmt.format(*values)
            if params.get("has_placeholders")
            else " ".join([fmt, *map(str, values)])
        )
        with self.shared.print_lock:
            print(f"[{self.inst}] {text}", flush=True)
        return []

    def _while(self, vals, params):
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cconsts, bconsts, carry = vals[:cn], vals[cn : cn + bn], list(vals[cn + bn :])
        cj, bj = params["cond_jaxpr"], params["body_jaxpr"]
        while bool(np.asarray(self.run(cj, cj.consts, [*cconsts, *carry])[0])):
            carry = self.run(bj, bj.consts, [*bconsts, *carry])
        return carry

    def _scan(self, vals, params):
        consts, carry, xs = _scan_split(params, vals)
        n_carry = len(carry)
        j, length = params["jaxpr"], params["length"]
        ys = []
        order = range(length - 1, -1, -1) if params.get("reverse") else range(length)
        for i in order:
            out = self.run(j, j.consts, [*consts, *carry, *[np.asarray(x)[i] for x in xs]])
            carry, y = out[:n_carry], out[n_carry:]
            ys.append(y)
        if params.get("reverse"):
            ys.reverse()
        n_ys = len(j.outvars) - n_carry
        stacked = [
            np.stack([np.asarray(y[k]) for y in ys])
            if ys
            else np.zeros(
                (0, *j.outvars[n_carry + k].aval.shape), j.outvars[n_carry + k].aval.dtype
            )
            for k in range(n_ys)
        ]
        return [*carry, *stacked]

    def _sem(self, vals, params, api):
        buf = vals[0].buffer
        if buf.kind != "semaphore":
            raise TypeError(
                f"{self.inst}: {api} needs a cv.SemaphoreType scratch, got {buf.name} ({buf.kind})"
            )
        arr, idx = _view_index(
            buf.array, jax.tree_util.tree_unflatten(params["tree"], list(vals[2:]))
        )
        if np.asarray(arr[idx]).ndim:
            raise ValueError(
                f"{self.inst}: {api} on {buf.name} needs one semaphore; index it (sems.at[i])"
            )
        return buf, arr, idx, int(np.asarray(vals[1]))

    def _signal(self, vals, params):
        buf, arr, idx, inc = self._sem(vals, params, "cv.semaphore_signal")
        with self.shared.cond:
            arr[idx] += inc
            self.shared.cond.notify_all()
        return []

    def _wait(self, vals, params):
        buf, arr, idx, value = self._sem(vals, params, "cv.semaphore_wait")
        sh = self.shared
        where = f"{buf.name}{list(i for i in idx) if idx != (Ellipsis,) else ''}"
        deadline = time.monotonic() + sh.timeout_s
        with sh.cond:
            while int(arr[idx]) < value:
                if sh.aborted:
                    raise _Aborted()
                sh.state[self.inst] = (
                    f"waits on semaphore {where} >= {value} (holds {int(arr[idx])})"
                )
                left = deadline - time.monotonic()
                if left <= 0:  # (the condition's lock is re-entrant: abort may take it again)
                    sh.abort(
                        f"mpmd_map: a wait was not satisfied within {sh.timeout_s:g} s (set "
                        "compiler_params={'timeout_s': ...} to change it). "
                        f"Instances:\n{sh.table()}"
                    )
                    raise _Aborted()
                sh.cond.wait(min(left, 0.5))
            arr[idx] -= value
            sh.state[self.inst] = "running"
        return []

    def _barrier(self, ref):
        sh, buf = self.shared, ref.buffer
        if buf.kind != "barrier":
            raise TypeError(
                f"{self.inst}: cv.barrier_wait needs a cv.BarrierType scratch, got {buf.name} "
                f"({buf.kind})"
            )
        sh.set_state(self.inst, f"waits at barrier {buf.name}")
        try:
            buf.barrier.wait(timeout=sh.timeout_s)
        except threading.BrokenBarrierError:
            if not sh.aborted:
                sh.abort(
                    "mpmd_map: the barrier was not reached by every instance within "
                    f"{sh.timeout_s:g} s. Instances:\n{sh.table()}"
                )
            raise _Aborted() from None
        sh.set_state(self.inst, "running")
        return []


_NUMPY_ONLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _numpy_only(jaxpr) -> bool:
    """A small jaxpr made only of primitives the interpreter evaluates with NumPy."""
    key = jaxpr
    if key not in _NUMPY_ONLY:
        ok = len(jaxpr.eqns) <= 32
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name == "jit":
                ok = ok and _numpy_only(e.params["jaxpr"])
            elif name not in NUMPY_PRIMITIVES and name != "convert_element_type":
                ok = False
        _NUMPY_ONLY[key] = ok
    return _NUMPY_ONLY[key]


def _scan_split(params, vals):
    """(consts, carry, xs) of a scan's operands (jax 0.12 keeps the split in a flat tree)."""
    if "num_consts" in params:
        nc, nk = params["num_consts"], params["num_carry"]
        return list(vals[:nc]), list(vals[nc : nc + nk]), list(vals[nc + nk :])
    consts, carry, xs = params["ft_in"].update(list(vals)).unpack()
    return list(consts), list(carry), list(xs)


def execute(
    programs: list[tuple[Any, list[Any], list[Instance]]],
    buffers: list[Buffer],
    arg_refs: list[Ref],
    timeout_s: float,
) -> None:
    """Run every instance of every program (jaxpr, its constants, instances) concurrently; raise on
    failure."""
    instances = [inst for _, _, insts in programs for inst in insts]
    shared = Shared(buffers, instances, timeout_s)
    errors: list[tuple[Instance, BaseException]] = []

    def work(jaxpr, consts, inst):
        try:
            Interpreter(shared, inst).run(jaxpr, consts, arg_refs)
            shared.set_state(inst, "done")
        except _Aborted:
            pass
        except BaseException as e:  # re-raised in the caller with the instance named
            errors.append((inst, e))
            shared.set_state(inst, f"failed: {type(e).__name__}")
            shared.abort()

    threads = [
        threading.Thread(target=work, args=(j, consts, inst), name=str(inst), daemon=True)
        for j, consts, insts in programs
        for inst in insts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # re-raised as itself: JAX's error classes cannot be rebuilt from a message
        inst, e = errors[0]
        if not str(e).startswith(str(inst)):
            e.add_note(f"raised by {inst} of cv.mpmd_map")
        raise e
    if shared.report:
        raise MpmdDeadlock(shared.report)
