"""Glue between mpmd_map and the CPU executor: trace the programs, lay out memory, run on the host.

Under `jax.jit` the whole call becomes one host callback (`jax.pure_callback`), so mpmd_map
composes with jitted code on CPU; outside jit it runs directly.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conveyor._compat import trace_ref_program
from conveyor.kernel import poison_numpy
from conveyor.mpmd import cpu
from conveyor.mpmd.api import _label, call_program
from conveyor.sync import SYNC_BACKEND, BarrierType, SemaphoreType

MAX_CPU_SCRATCH_BYTES = 4 << 30


def scratch_buffer(s: Any, label: str):
    """Initial contents and kind of scratch `i` on the CPU executor."""
    if isinstance(s, SemaphoreType):
        return np.zeros(tuple(s.shape), np.int32), "semaphore"
    if isinstance(s, BarrierType):
        return np.zeros((), np.int32), "barrier"
    if hasattr(s, "shape") and hasattr(s, "dtype"):
        nbytes = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
        if nbytes > MAX_CPU_SCRATCH_BYTES:
            raise ValueError(f"mpmd_map: {label} of {nbytes / 2**30:.1f} GiB is more than the CPU executor holds "
                             f"({MAX_CPU_SCRATCH_BYTES / 2**30:.0f} GiB)")
        return poison_numpy(s.shape, s.dtype), "array"
    raise ValueError(f"mpmd_map: {label} must be a jax.ShapeDtypeStruct, cv.SemaphoreType or cv.BarrierType; the "
                     f"CPU executor cannot hold {s!r}")


def _trace(i, fn, avals, n_fixed, scratch_names, axes, print_jaxpr):
    def program(*refs):
        call_program(i, fn, refs[:n_fixed], refs[n_fixed:], scratch_names)

    token = SYNC_BACKEND.set("cpu")
    try:
        jaxpr = trace_ref_program(program, avals, axes.items())
    finally:
        SYNC_BACKEND.reset(token)
    if print_jaxpr:
        print(f"{_label(i, fn)}:\n{jaxpr}")
    return jaxpr


def run(programs, axes, in_leaves, out_leaves, scratch, scratch_names, aliases, params, name):
    avals = ([jax.core.ShapedArray(tuple(x.shape), jnp.dtype(x.dtype)) for x in in_leaves]
             + [jax.core.ShapedArray(tuple(s.shape), jnp.dtype(s.dtype)) for s in out_leaves])
    scratch_init = [scratch_buffer(s, f"scratch {scratch_names[i] if scratch_names else i}")
                    for i, s in enumerate(scratch)]
    avals += [jax.core.ShapedArray(a.shape, a.dtype) for a, _ in scratch_init]
    n_fixed = len(in_leaves) + len(out_leaves)
    jaxprs = [_trace(i, fn, avals, n_fixed, scratch_names, axes, params["print_jaxpr"])
              for i, (_, fn) in enumerate(programs)]
    instances = [[cpu.Instance(i, _label(i, fn), tuple(point.items())) for point in mesh.points()]
                 for i, (mesh, fn) in enumerate(programs)]
    out_specs = [jax.ShapeDtypeStruct(tuple(s.shape), jnp.dtype(s.dtype)) for s in out_leaves]

    def host(*arrays):
        buffers = [cpu.Buffer(f"input {i}", np.array(a)) for i, a in enumerate(arrays)]
        refs = [cpu.Ref(i) for i in range(len(buffers))]
        for j, s in enumerate(out_leaves):
            src = next((a for a, b in aliases.items() if b == j), None)
            if src is None:
                buffers.append(cpu.Buffer(f"output {j}", poison_numpy(s.shape, s.dtype)))
                refs.append(cpu.Ref(len(buffers) - 1))
            else:
                refs.append(cpu.Ref(src))   # the output is the input's memory, updated in place
        for k, (init, kind) in enumerate(scratch_init):
            label = f"scratch {scratch_names[k] if scratch_names else k}"
            buffers.append(cpu.Buffer(label, init.copy(), kind))
            refs.append(cpu.Ref(len(buffers) - 1))
        cpu.execute([(j, insts) for j, insts in zip(jaxprs, instances)], buffers, refs, params["timeout_s"])
        return tuple(np.asarray(buffers[refs[len(arrays) + j].index].array, dtype=s.dtype)
                     for j, s in enumerate(out_specs))

    if any(isinstance(x, jax.core.Tracer) for x in in_leaves):
        return jax.pure_callback(host, tuple(out_specs), *in_leaves)
    return tuple(jnp.asarray(o) for o in host(*[np.asarray(x) for x in in_leaves]))
