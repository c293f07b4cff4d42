"""Tracing functions over refs to jaxprs, and reading or rewriting those jaxprs.

Used by the XLA kernel executor (threads traced with a constant `axis_index`, state discharge),
the pipeline front end (which grid indices an index map reads) and the mpmd CPU executor (an
interpreter of ref programs).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Var

from conveyor import _compat
from conveyor._compat import AbstractRef, TransformedRef, core
from conveyor.spmd import per_device_tracing

# Discharges a stateful function at trace time (the public `run_state` defers it to lowering, where
# the axis names of an enclosing vmap are gone, so `lax.axis_index(thread)` in a threaded xla
# kernel would fail).
run_state = _compat.run_state


def call_as_thread(fn, axis_name: str, axis_size: int, index: int):
    """Run `fn()` with `lax.axis_index(axis_name)` meaning `index` (of `axis_size`)."""
    return call_with_axis_values(fn, {axis_name: (axis_size, index)})


def call_with_axis_values(fn, axes: dict):
    """Run `fn()` with `lax.axis_index(name)` meaning `index` for every `name: (size, index)`.

    Traces `fn` to a jaxpr with the axes bound, replaces every `axis_index(name)` (also in
    nested jaxprs: loops, conds, pjit) by the literal index, and evaluates the result in the
    current trace, so refs and tracers `fn` closes over are used as they are.
    """
    closed, out_shape = jax.make_jaxpr(
        fn, axis_env=[(k, size) for k, (size, _) in axes.items()], return_shape=True
    )()

    def names(eqn):
        n = eqn.params.get("axis_name")
        return tuple(n) if isinstance(n, (tuple, list)) else (n,)

    def substitute(jaxpr):
        env = {}

        def read(v):
            return env.get(v, v) if isinstance(v, core.Var) else v

        eqns = []
        for eqn in jaxpr.eqns:
            if (
                eqn.primitive is _compat.parallel.axis_index_p
                and len(names(eqn)) == 1
                and names(eqn)[0] in axes
            ):
                out = eqn.outvars[0]
                env[out] = core.Literal(
                    np.asarray(axes[names(eqn)[0]][1], out.aval.dtype), out.aval
                )
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


def args_reaching_outputs(fn, num_args: int) -> tuple[int, frozenset]:
    """Trace `fn(*num_args int32 scalars)`; return (number of outputs, the argument positions
    some output depends on). Decided on the jaxpr's data flow (an equation's outputs depend on all
    of its inputs), so it is exact for what the function reads, never sampled."""
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct((), jnp.int32)] * num_args)
    jaxpr = closed.jaxpr
    origin = {v: frozenset([i]) for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        reached = frozenset().union(
            *[origin.get(v, frozenset()) for v in eqn.invars if isinstance(v, Var)]
        )
        for v in eqn.outvars:
            origin[v] = reached
    used = frozenset().union(
        *[origin.get(v, frozenset()) for v in jaxpr.outvars if isinstance(v, Var)]
    )
    return len(jaxpr.outvars), used


def trace_ref_program(fn, ref_avals, axis_env):
    """Trace `fn(*refs)` (refs with the given ShapedArray avals) to a jaxpr, with `axis_env`
    ([(name, size)]) bound so `lax.axis_index` can be traced."""
    avals = [AbstractRef(a) for a in ref_avals]
    tree = jax.tree_util.tree_structure(tuple(range(len(avals))))
    dbg = _compat.api_util.debug_info("mpmd_map", fn, tuple(range(len(avals))), {})
    # Traced per program instance (inside shard_map too): the program's mesh axes are not
    # shard_map axes, so varying-axes checks do not apply to them.
    with core.extend_axis_env_nd(list(axis_env)), per_device_tracing():
        return _compat.initial_style_jaxpr(lambda refs: fn(*refs), tree, avals, dbg)


def ref_and_transforms(x, api: str):
    """Split a ref or a view (`ref.at[i]`) into the ref and its flat transform leaves + treedef."""
    ref, transforms = _compat.state_primitives.get_ref_and_transforms(x, None, api)
    leaves, tree = jax.tree_util.tree_flatten(transforms)
    return ref, leaves, tree


def state_primitives():
    """The primitives an interpreter of ref programs must handle itself."""
    sp, loops = _compat.state_primitives, _compat.control_flow.loops
    return dict(
        get=sp.get_p,
        swap=sp.swap_p,
        addupdate=sp.addupdate_p,
        axis_index=_compat.parallel.axis_index_p,
        while_=loops.while_p,
        scan=loops.scan_p,
        cond=_compat.control_flow.conditionals.cond_p,
        jit=_compat.jit_p,
        run_scoped=_compat.pallas_primitives.run_scoped_p,
        AbstractRef=AbstractRef,
        Literal=core.Literal,
        Var=core.Var,
    )


def is_jax_ref(x) -> bool:
    """A jax Ref (`jax.new_ref`, eager or traced) or a view of one (`ref.at[...]`)."""
    if isinstance(x, TransformedRef):
        return True
    return isinstance(getattr(x, "aval", None), AbstractRef)


def underlying_ref(x):
    """The Ref a view (`ref.at[...]`) looks into; a Ref itself otherwise."""
    return x.ref if isinstance(x, TransformedRef) else x


def pallas_scratch_kind(s) -> str | None:
    """What a Pallas scratch type is: "semaphore" (REGULAR, any backend's spelling),
    "dma_semaphore",
    "barrier" (plgpu.Barrier), "array" (a memory-space shape such as pltpu.VMEM), or None."""
    if isinstance(s, _compat.pallas_gpu_core().Barrier):
        return "barrier"
    if isinstance(s, enum.Enum) and type(s).__name__ == "SemaphoreType":  # a scalar semaphore
        return "dma_semaphore" if "dma" in str(s.value).lower() else "semaphore"
    dtype = getattr(getattr(s, "inner_aval", None), "dtype", None)
    if dtype is not None:
        if isinstance(dtype, _compat.pallas_core.AbstractSemaphoreTy):
            return "dma_semaphore" if "dma" in str(dtype) else "semaphore"
        return "array"
    return None


def ndindexer_parts(t):
    """(indices, is_slice flags) of a state NDIndexer; None for other transforms."""
    if not isinstance(t, _compat.NDIndexer):
        return None
    return [
        (("slice", i.start, i.size, i.stride) if isinstance(i, _compat.Slice) else ("index", i))
        for i in t.indices
    ]


def write_effect(index: int):
    """The effect of a primitive that writes its `index`-th operand (a ref)."""
    return _compat.WriteEffect(index)
