"""The one module that touches JAX internals: primitive machinery and private Pallas names.

Everything else in Conveyor imports these names from here, so a JAX upgrade is mended in one place.
"""
from __future__ import annotations

import threading
import time

from jax._src import config as _config  # the check_vma switch, for lowering per-device code
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["Primitive", "ad", "batching", "mlir", "is_undefined_primal", "Zero",
           "register_lowering_from_function"]

is_undefined_primal = ad.is_undefined_primal
Zero = ad.Zero


def register_lowering_from_function(prim: Primitive, impl, platform: str | None = None) -> None:
    """Lower `prim` (on `platform`, or every platform) by tracing `impl(*args, **params)`.

    Inside `shard_map(check_vma=True)` the primitive's avals carry the mesh axes they vary over
    (its abstract eval gives the output the inputs' common set, see `match_varying`). The
    implementation is traced without them: it computes per device, where replication is
    meaningless, and its loops and Pallas calls would otherwise each need the types threaded by hand.
    """
    lowered = mlir.lower_fun(impl, multiple_results=False)
    mlir.register_lowering(prim, lambda ctx, *args, **params: _lower_per_device(lowered, ctx, *args, **params),
                           platform=platform)


def _lower_per_device(lowered, ctx, *args, **params):
    """Run a `mlir.lower_fun` rule with the avals' varying axes stripped and the checks off."""
    inner = ctx.replace(avals_in=[strip_varying(a) for a in ctx.avals_in],
                        avals_out=[strip_varying(a) for a in ctx.avals_out])
    with per_device_tracing():
        out = lowered(inner, *args, **params)
    if inner.tokens_out is not None:  # effectful (interpreted) kernels thread tokens
        ctx.set_tokens_out(inner.tokens_out)
    return out


# ---- JAX state (refs) for the XLA kernel executor ----------------------------------------------
# `run_state_reference` discharges the stateful function at trace time (the plain `run_state`
# defers it to lowering, where the axis names of an enclosing vmap are gone, so
# `lax.axis_index(thread_name)` inside a threaded xla kernel would fail).
from jax._src.state.discharge import run_state_reference as run_state  # noqa: E402  (no public alias)

__all__ += ["run_state"]


def varying_axes(x) -> frozenset:
    """Mesh axes over which `x` varies inside shard_map (jax 0.12: aval.mat.varying; older: aval.vma)."""
    import jax
    aval = jax.typeof(x)
    return _varying_axes_of_aval(getattr(aval, "inner_aval", aval))  # a ref varies as its contents do


def _varying_axes_of_aval(aval) -> frozenset:
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def per_device_tracing():
    """A context in which code is traced per device: shard_map's varying-axes checks are off."""
    return _config._check_vma(False)


def without_internal_ref_effects(effects):
    """`effects` less the one a jax Ref created and frozen inside a function leaves in its trace
    (cv.kernel's input_output_aliases on mosaic_gpu): nothing outside sees that Ref, and a
    primitive that declared the effect could not be lowered under jit."""
    from jax._src import core
    return {e for e in effects if e is not core.internal_mutable_array_effect}


def strip_varying(aval):
    """`aval` without manual-axis (varying) information nor an explicit sharding (it is traced per
    device); other avals unchanged."""
    from jax._src import core
    if isinstance(aval, core.ShapedArray) and not aval.manual_axis_type.empty:
        aval = aval.update(manual_axis_type=core.empty_mat)
    if explicit_axes_spec(aval) is not None:
        aval = core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)
    return aval


def explicit_axes_spec(aval):
    """The PartitionSpec of an aval sharded over a mesh with Explicit axes (sharding in types, the
    default of `jax.make_mesh`), else None."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh._any_axis_explicit:
        return None
    return sharding.spec


def with_explicit_spec(aval, like, spec):
    """`aval` sharded by `spec` over the explicit mesh of the aval `like` (unchanged without one)."""
    import jax
    if explicit_axes_spec(like) is None:
        return aval
    return aval.update(sharding=jax.sharding.NamedSharding(like.sharding.mesh, spec))


def match_varying(*xs):
    """Cast every array to vary over the union of the mesh axes any of them varies over.

    The rule JAX applies before binding its own primitives inside `shard_map(check_vma=True)`:
    the cast (pvary) transposes to a psum, so the cotangent of a replicated operand comes back
    replicated. Outside shard_map, or with check_vma=False, nothing changes.
    """
    import jax
    axes = frozenset().union(*(varying_axes(x) for x in xs))
    if not axes:
        return xs
    return tuple(x if varying_axes(x) == axes else
                 jax.lax.pcast(x, tuple(sorted(axes - varying_axes(x), key=str)), to="varying") for x in xs)


def out_struct(shape, dtype, *like):
    """A ShapeDtypeStruct for a kernel output that varies over the mesh axes its inputs vary over
    (what `pallas_call` needs inside `shard_map(check_vma=True)`)."""
    import jax
    from jax._src import core
    axes = frozenset().union(*(varying_axes(x) for x in like))
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=core.ManualAxisType(varying=axes))


class _Hashable:
    """A function as a primitive parameter, compared by identity."""
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


def _per_device_abstract(*avals, fn, out_avals):
    from jax._src import core
    axes = frozenset().union(*(_varying_axes_of_aval(a) for a in avals))
    mat = core.ManualAxisType(varying=axes)
    return [core.ShapedArray(a.shape, a.dtype, sharding=core.get_cur_mesh_sharding(), manual_axis_type=mat)
            for a in out_avals]


per_device_p = Primitive("conveyor_per_device")
per_device_p.multiple_results = True
per_device_p.def_abstract_eval(_per_device_abstract)


def _per_device_lowering(ctx, *args, fn, out_avals):
    return _lower_per_device(mlir.lower_fun(fn.fn, multiple_results=True), ctx, *args)


mlir.register_lowering(per_device_p, _per_device_lowering)


def per_device_call(fn, out_shapes, *args):
    """`fn(*args)` (a list of arrays of `out_shapes`), traced per device inside shard_map.

    With operands that vary over shard_map axes (check_vma=True), `fn` is staged out as one
    primitive whose outputs vary over the union of those axes, and traced at lowering time without
    varying-axes types, so code that cannot carry them (Pallas-style kernels over refs, threads
    traced with their own `axis_index`) runs unchanged. Elsewhere `fn` is simply called.
    Not differentiable (kernels over refs are not).
    """
    import jax
    if not frozenset().union(*(varying_axes(x) for x in args)):
        return fn(*args)
    out_avals = tuple(jax.core.ShapedArray(tuple(s.shape), s.dtype) for s in out_shapes)
    return per_device_p.bind(*args, fn=_Hashable(fn), out_avals=out_avals)


__all__ += ["varying_axes", "per_device_tracing", "strip_varying", "match_varying", "out_struct",
            "per_device_call"]


# ---- running code "as thread t": lax.axis_index(name) evaluated to a constant ------------------
def call_as_thread(fn, axis_name: str, axis_size: int, index: int):
    """Run `fn()` with `lax.axis_index(axis_name)` meaning `index` (of `axis_size`)."""
    return call_with_axis_values(fn, {axis_name: (axis_size, index)})


def call_with_axis_values(fn, axes: dict):
    """Run `fn()` with `lax.axis_index(name)` meaning `index` for every `name: (size, index)`.

    Traces `fn` to a jaxpr with the axes bound, replaces every `axis_index(name)` (also in
    nested jaxprs: loops, conds, pjit) by the literal index, and evaluates the result in the
    current trace, so refs and tracers `fn` closes over are used as they are.
    """
    import jax
    import numpy as np
    from jax._src import core
    from jax._src.lax import parallel

    closed, out_shape = jax.make_jaxpr(fn, axis_env=[(k, size) for k, (size, _) in axes.items()],
                                       return_shape=True)()

    def names(eqn):
        n = eqn.params.get("axis_name")
        return tuple(n) if isinstance(n, (tuple, list)) else (n,)

    def substitute(jaxpr):
        env = {}

        def read(v):
            return env.get(v, v) if isinstance(v, core.Var) else v

        eqns = []
        for eqn in jaxpr.eqns:
            if eqn.primitive is parallel.axis_index_p and len(names(eqn)) == 1 and names(eqn)[0] in axes:
                out = eqn.outvars[0]
                env[out] = core.Literal(np.asarray(axes[names(eqn)[0]][1], out.aval.dtype), out.aval)
                continue
            params = {k: convert(v) for k, v in eqn.params.items()}
            eqns.append(eqn.replace(invars=[read(v) for v in eqn.invars], params=params))
        return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])

    def convert(v):  # jax 0.12: a Jaxpr carries its consts (ClosedJaxpr is gone)
        if isinstance(v, core.Jaxpr):
            return substitute(v)
        if isinstance(v, tuple) and any(isinstance(x, core.Jaxpr) for x in v):
            return tuple(convert(x) for x in v)
        return v

    jaxpr = substitute(closed)
    flat = core.eval_jaxpr(jaxpr, jaxpr.consts)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)


__all__ += ["call_as_thread", "call_with_axis_values"]


# ---- tracing kernels over refs and interpreting their jaxprs (mpmd CPU executor) ---------------
def trace_ref_program(fn, ref_avals, axis_env):
    """Trace `fn(*refs)` (refs with the given ShapedArray avals) to a jaxpr, with `axis_env`
    ([(name, size)]) bound so `lax.axis_index` can be traced."""
    import jax
    from jax._src import api_util, core
    from jax._src.state.discharge import initial_style_jaxpr
    from jax._src.state.types import AbstractRef

    avals = [AbstractRef(a) for a in ref_avals]
    tree = jax.tree_util.tree_structure(tuple(range(len(avals))))
    dbg = api_util.debug_info("mpmd_map", fn, tuple(range(len(avals))), {})
    # Traced per program instance (inside shard_map too): the program's mesh axes are not
    # shard_map axes, so varying-axes checks do not apply to them.
    with core.extend_axis_env_nd(list(axis_env)), per_device_tracing():
        return initial_style_jaxpr(lambda refs: fn(*refs), tree, avals, dbg)


def ref_and_transforms(x, api: str):
    """Split a ref or a view (`ref.at[i]`) into the ref and its flat transform leaves + treedef."""
    import jax
    from jax._src.state.primitives import get_ref_and_transforms
    ref, transforms = get_ref_and_transforms(x, None, api)
    leaves, tree = jax.tree_util.tree_flatten(transforms)
    return ref, leaves, tree


def state_primitives():
    """The primitives an interpreter of ref programs must handle itself."""
    from jax._src import core
    from jax._src.lax import control_flow, parallel
    from jax._src.pjit import jit_p
    from jax._src.state import primitives as sp
    from jax._src.state.types import AbstractRef
    from jax._src.pallas import primitives as pallas_primitives
    return dict(get=sp.get_p, swap=sp.swap_p, addupdate=sp.addupdate_p, axis_index=parallel.axis_index_p,
                while_=control_flow.loops.while_p, scan=control_flow.loops.scan_p, cond=control_flow.conditionals.cond_p,
                jit=jit_p, run_scoped=pallas_primitives.run_scoped_p, AbstractRef=AbstractRef, Literal=core.Literal,
                Var=core.Var)


def is_jax_ref(x) -> bool:
    """A jax Ref (`jax.new_ref`, eager or traced) or a view of one (`ref.at[...]`)."""
    from jax._src.state.types import AbstractRef, TransformedRef
    if isinstance(x, TransformedRef):
        return True
    return isinstance(getattr(x, "aval", None), AbstractRef)


def underlying_ref(x):
    """The Ref a view (`ref.at[...]`) looks into; a Ref itself otherwise."""
    from jax._src.state.types import TransformedRef
    return x.ref if isinstance(x, TransformedRef) else x


def pallas_scratch_kind(s) -> str | None:
    """What a Pallas scratch type is: "semaphore" (REGULAR, any backend's spelling), "dma_semaphore",
    "barrier" (plgpu.Barrier), "array" (a memory-space shape such as pltpu.VMEM), or None."""
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    if isinstance(s, gpu_core.Barrier):
        return "barrier"
    dtype = getattr(getattr(s, "inner_aval", None), "dtype", None)
    if dtype is not None:
        if isinstance(dtype, pallas_core.AbstractSemaphoreTy):
            return "dma_semaphore" if "dma" in str(dtype) else "semaphore"
        return "array"
    return None


def ndindexer_parts(t):
    """(indices, is_slice flags) of a state NDIndexer; None for other transforms."""
    from jax._src.state.indexing import NDIndexer, Slice
    if not isinstance(t, NDIndexer):
        return None
    return [(("slice", i.start, i.size, i.stride) if isinstance(i, Slice) else ("index", i)) for i in t.indices]


def write_effect(index: int):
    from jax._src.state.types import WriteEffect
    return WriteEffect(index)


__all__ += ["trace_ref_program", "ref_and_transforms", "state_primitives", "ndindexer_parts", "write_effect",
            "is_jax_ref", "underlying_ref", "pallas_scratch_kind"]


# ---- the Mosaic GPU interpreter on several devices (shard_map) ----------------------------------
_GPU_INTERPRETER_PATCHED = False


def gpu_interpreter_multi_device_fix() -> None:
    """Let the jax 0.12 Mosaic GPU interpreter run one kernel on several devices at once.

    At the end of a kernel each device's interpreter asserts that *no* barrier is allocated in the
    interpreter's shared state, which holds every device's barriers: a device that finishes
    first sees another device's live barriers and fails ("Barrier remains allocated"; seen with
    `cv.kernel` inside `shard_map` over 4 CPU devices, intermittently). We make every device reach
    that point (the interpreter's own cross-device `threading.Barrier`) before the check runs, so
    the check keeps its meaning: all barriers of all devices were deallocated.
    """
    global _GPU_INTERPRETER_PATCHED
    if _GPU_INTERPRETER_PATCHED:
        return
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    @gpu_callbacks.fail_on_exception
    def _assert_no_barriers_allocated(token):
        shared = gpu_callbacks._get_shared_memory()
        if shared.num_devices > 1:
            shared.barrier.wait()  # every device has finished its kernel and freed its barriers
        shared.assert_no_barriers_allocated()
        if shared.num_devices > 1:
            shared.barrier.wait()  # nobody starts cleaning up while another device still checks
        return token

    gpu_callbacks._assert_no_barriers_allocated = _assert_no_barriers_allocated
    _GPU_INTERPRETER_PATCHED = True


__all__ += ["gpu_interpreter_multi_device_fix"]


# ---- data flow of a traced function (pipeline index maps) -------------------------------------

def args_reaching_outputs(fn, num_args: int) -> tuple[int, frozenset]:
    """Trace `fn(*num_args int32 scalars)`; return (number of outputs, the argument positions
    some output depends on). Decided on the jaxpr's data flow (an equation's outputs depend on all
    of its inputs), so it is exact for what the function reads, never sampled."""
    import jax
    import jax.numpy as jnp
    from jax.extend.core import Var
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct((), jnp.int32)] * num_args)
    jaxpr = closed.jaxpr
    origin = {v: frozenset([i]) for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        reached = frozenset().union(*[origin.get(v, frozenset()) for v in eqn.invars if isinstance(v, Var)])
        for v in eqn.outvars:
            origin[v] = reached
    used = frozenset().union(*[origin.get(v, frozenset()) for v in jaxpr.outvars if isinstance(v, Var)])
    return len(jaxpr.outvars), used


def requires_devices_during_lowering(prim: Primitive) -> None:
    """Declare that lowering `prim` needs the device assignment (its rule emits a
    custom_partitioning call, whose partitioner needs the concrete mesh)."""
    from jax._src import dispatch
    dispatch.prim_requires_devices_during_lowering.add(prim)


# ---- where the CUDA toolkit wheel lives (compile-check's standalone ptxas) ----------------------

def cuda_toolkit_path() -> str | None:
    """The folder of the nvidia-cuda-nvcc wheel jaxlib found (bin/ptxas), or None."""
    try:
        from jax._src.lib import cuda_path
    except ImportError:
        return None
    return cuda_path


__all__ += ["cuda_toolkit_path"]


# ---- differences between the supported jax versions (0.11.2 .. 0.12.0.1) -----------------------

def _accepts(fn, name: str) -> bool:
    import inspect
    return name in inspect.signature(fn).parameters


def gpu_kernel_options(*, cost_estimate=None, kernel_name: str | None = None) -> dict:
    """Keyword arguments for `plgpu.kernel`: `cost_estimate` exists from jax 0.12 on; on older jax
    a given one is refused by name rather than dropped."""
    import jax
    options = {"kernel_name": kernel_name} if kernel_name else {}
    if cost_estimate is not None:
        if not gpu_kernel_takes_cost_estimate():
            raise NotImplementedError(f"cost_estimate on mosaic_gpu needs jax >= 0.12 (plgpu.kernel of jax "
                                      f"{jax.__version__} has no cost_estimate); leave it out on this jax")
        options["cost_estimate"] = cost_estimate
    return options


def gpu_kernel_takes_cost_estimate() -> bool:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return _accepts(plgpu.kernel, "cost_estimate")


def interpreter_races_raise() -> None:
    """Make the Pallas TPU and GPU interpreters raise on a detected race on every supported jax.

    jax >= 0.12 raises RuntimeError("RACE DETECTED ...") by default (`InterpretParams.on_race`);
    jax 0.11 prints the two accesses and only sets `races_found` on its race state. There, setting
    that flag raises the same error at the same point, so a race fails a run on both ends of the
    range. The test suite calls this once; users on jax 0.11 read the printed report instead.
    """
    import dataclasses
    from jax._src.pallas.mosaic.interpret import race_detection_state as rds
    cls = rds.RaceDetectionState
    if "on_race" in {f.name for f in dataclasses.fields(cls)} or getattr(cls, "_conveyor_raises", False):
        return

    def get(self) -> bool:
        return self.__dict__.get("_races_found", False)

    def set_(self, value: bool) -> None:
        self.__dict__["_races_found"] = value
        if value:
            raise RuntimeError("RACE DETECTED (the interpreter printed both accesses above)")

    cls.races_found = property(get, set_)   # GPURaceDetectionState inherits it
    cls._conveyor_raises = True


_WAIT_DEADLINE = {"seconds": 0.0}   # set by interpreter_wait_deadline
_SEMAPHORE_LEAKS: list[str] = []


def record_interpreter_semaphore_leaks() -> None:
    """Record the semaphores the Pallas TPU interpreter finds with a non-zero count at kernel exit.

    That is a DMA started and never awaited (or a signal never consumed): on a TPU the kernel fails.
    jax 0.11 and 0.12 only print it (raising inside the interpreter's callback could hang other
    devices' clean-up), so the interpreter's query is wrapped to keep what it found; the test
    suite fails a test that leaves any (`take_interpreter_semaphore_leaks`).
    """
    from jax._src.pallas.mosaic.interpret import shared_memory as sm
    cls = sm.SharedMemory
    if getattr(cls, "_conveyor_records_leaks", False):
        return
    original = cls.get_sempahores_with_nonzero_count

    def recording(self, device_id, *args, **kwargs):
        found = original(self, device_id, *args, **kwargs)
        for sem, core in found:
            _SEMAPHORE_LEAKS.append(f"semaphore {sem.id} has count {sem.count_by_core[core]} on device {device_id} "
                                    f"(core {core}) at kernel exit")
        return found

    cls.get_sempahores_with_nonzero_count = recording
    cls._conveyor_records_leaks = True


def interpreter_wait_deadline(seconds: float) -> None:
    """Make a Pallas interpreter wait that is still blocked after `seconds` raise, on TPU and GPU.

    A semaphore that nothing will ever signal (a DMA never started, a signal never sent), or a
    barrier phase that never completes (an arrival never made), makes an interpreter wait forever.
    After the deadline the wait raises instead, naming what it waits for, and the kernel call fails
    with that message. Setting it again only changes `seconds`.
    - TPU: the interpreter's semaphore wait loop polls `SharedMemory.check_failed` every 0.1 s
      while it blocks; the deadline is checked there, in the waiting thread.
    - GPU: a barrier wait blocks on the barrier's condition variable; each barrier gets one whose
      untimed wait raises when nothing arrives at the barrier for `seconds` (an arrival notifies it).
    """
    if not seconds > 0:
        raise ValueError(f"interpreter_wait_deadline: seconds must be > 0, got {seconds!r}")
    _WAIT_DEADLINE["seconds"] = float(seconds)
    _gpu_barrier_deadline()
    from jax._src.pallas.mosaic.interpret import shared_memory as sm
    if getattr(sm.Semaphore, "_conveyor_deadline", False):
        return
    waiting = threading.local()
    original_wait, original_check = sm.Semaphore.wait, sm.SharedMemory.check_failed

    def wait(self, value, global_core_id, *args, **kwargs):
        waiting.since, waiting.what = time.monotonic(), (self.id, value, int(global_core_id))
        try:
            return original_wait(self, value, global_core_id, *args, **kwargs)
        finally:
            waiting.since = None

    def check_failed(self):
        original_check(self)
        since, limit = getattr(waiting, "since", None), _WAIT_DEADLINE["seconds"]
        if since is not None and time.monotonic() - since > limit:
            sem, value, core = waiting.what
            waiting.since = None
            raise RuntimeError(f"Pallas TPU interpreter: core {core} waited {limit:g} s on semaphore {sem} for a count "
                               f"of {value}, and nothing signals it: a DMA never started or a signal never sent "
                               f"(a deadlock; cv.sim.check finds schedule deadlocks with a trace)")

    sm.Semaphore.wait, sm.SharedMemory.check_failed = wait, check_failed
    sm.Semaphore._conveyor_deadline = True


def _gpu_barrier_deadline() -> None:
    """The GPU interpreter's half of `interpreter_wait_deadline` (installed once)."""
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gsm
    barrier_cls = gsm.Barrier
    if getattr(barrier_cls, "_conveyor_deadline", False):
        return
    waiting = threading.local()

    class DeadlineCondition(threading.Condition):
        def __init__(self, barrier):
            super().__init__()
            self.barrier = barrier

        def wait(self, timeout=None):
            limit = _WAIT_DEADLINE["seconds"]
            if timeout is not None or not limit:
                return super().wait(timeout)
            if super().wait(limit):
                return True
            b = self.barrier
            raise RuntimeError(
                f"Pallas GPU interpreter: {getattr(waiting, 'thread', 'a thread')} waited {limit:g} s at barrier "
                f"{id(b)} ({b.num_arrivals} arrival(s) per phase) for phase {b.phase} to complete, and nothing "
                f"arrived meanwhile: an arrival never made or a copy never issued (a deadlock; cv.sim.check finds "
                f"schedule deadlocks with a trace)")

    original_init, original_wait = barrier_cls.__init__, barrier_cls._wait

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.cv = DeadlineCondition(self)

    def wait(self, thread, *args, **kwargs):
        waiting.thread = thread
        return original_wait(self, thread, *args, **kwargs)

    barrier_cls.__init__, barrier_cls._wait = init, wait
    barrier_cls._conveyor_deadline = True


def take_interpreter_semaphore_leaks() -> list[str]:
    """The leaks recorded since the last call (see `record_interpreter_semaphore_leaks`)."""
    leaks = list(_SEMAPHORE_LEAKS)
    _SEMAPHORE_LEAKS.clear()
    return leaks


def avoid_interpreter_dispatch_deadlock() -> None:
    """jax 0.11 only: run CPU computations inline (no async dispatch). Call before the first one.

    The Pallas TPU interpreter runs eager jax ops inside its io_callbacks (e.g. `int()` over a
    jax Array of grid indices); with async dispatch the main thread can meanwhile dispatch the
    next eager op, and on jax 0.11.2 the two then wait on each other forever (seen in 3 of 4 full
    suite runs, always in an eager `jax.grad` over an interpreted tgmm; never on jax 0.12.0.1).
    """
    import jax
    if jax.__version_info__ < (0, 12):
        jax.config.update("jax_cpu_enable_async_dispatch", False)


def reset_interpreter_state() -> None:
    """Drop the Pallas TPU and GPU interpreters' shared state. A kernel that raised (a race, a
    failed check) leaves it behind on purpose, for inspection; the next kernel would then run on a
    stale, ever-growing state (seen on jax 0.11 as a test slowed past its timeout)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import tpu as pltpu
    pltpu.reset_tpu_interpret_mode_state()
    gpu_callbacks.reset_gpu_interpret_mode_state()


__all__ += ["gpu_kernel_options", "gpu_kernel_takes_cost_estimate", "interpreter_races_raise",
            "avoid_interpreter_dispatch_deadlock", "reset_interpreter_state",
            "record_interpreter_semaphore_leaks", "take_interpreter_semaphore_leaks", "interpreter_wait_deadline"]
