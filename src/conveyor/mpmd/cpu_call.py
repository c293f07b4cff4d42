"""Glue between mpmd_map and the CPU executor: trace the programs, lay out memory, run on the host.

Design notes: docs/internals/mpmd.md, section `mpmd/cpu_call.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conveyor.jaxprs import is_jax_ref, trace_ref_program, underlying_ref
from conveyor.kernel import poison_numpy
from conveyor.mpmd import cpu, errors
from conveyor.mpmd.programs import refuse_high, call_program, program_label
from conveyor.mpmd.scratch import ScratchLayout
from conveyor.kernel import mpmd_program
from conveyor.sync import BarrierType, SemaphoreType

MAX_CPU_SCRATCH_BYTES = 4 << 30


def scratch_buffer(s: Any, label: str) -> cpu.Buffer:
    """The executor's memory for one (normalised) scratch leaf."""
    if isinstance(s, SemaphoreType):
        return cpu.Buffer(label, np.zeros(tuple(s.shape), np.int32), "semaphore")
    if isinstance(s, BarrierType):
        return cpu.Buffer(label, np.zeros((), np.int32), "barrier")
    nbytes = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
    if nbytes > MAX_CPU_SCRATCH_BYTES:
        raise ValueError(
            f"mpmd_map: {label} of {nbytes / 2**30:.1f} GiB is more than the CPU executor holds "
            f"({MAX_CPU_SCRATCH_BYTES / 2**30:.0f} GiB)"
        )
    return cpu.Buffer(label, poison_numpy(s.shape, s.dtype))


def _trace(i, fn, avals, n_fixed, layout, axes, print_jaxpr):
    def program(*refs):
        call_program(i, fn, refs[:n_fixed], refs[n_fixed:], layout)

    with mpmd_program("cpu"):
        jaxpr = trace_ref_program(program, avals, axes.items())
    if print_jaxpr:
        print(f"{program_label(i, fn)}:\n{jaxpr}")
    return jaxpr


class RefPassedTwice(ValueError, NotImplementedError):
    """One jax Ref passed as two inputs. A ValueError (bad input) that `except NotImplementedError`
    also catches, as upstream Pallas raises NotImplementedError for it."""


def check_ref_inputs(in_leaves, aliases) -> list[int]:
    """Positions of the inputs that are jax Refs; each Ref may be passed once and is never
    aliased."""
    ref_inputs = [i for i, x in enumerate(in_leaves) if is_jax_ref(x)]
    seen: dict[int, int] = {}
    for i in ref_inputs:
        base = id(underlying_ref(in_leaves[i]))
        if base in seen:
            raise RefPassedTwice(
                f"mpmd_map: inputs {seen[base]} and {i} are the same jax Ref (or views of it); "
                "pass it once: the programs read and write a Ref in place"
            )
        seen[base] = i
        if i in aliases:
            raise ValueError(
                f"mpmd_map: input {i} is a jax Ref, which the programs already update in place; it "
                f"cannot also be aliased to output {aliases[i]} by input_output_aliases"
            )
    return ref_inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Captures:
    """What the programs' traces closed over: jax Refs (memory, updated in place) and traced values.

    `plans[p][c]` says where constant c of program p comes from when it runs:
    ("input", i) an input Ref, ("ref", k) captured Ref k, ("value", k) traced value k, ("const", x)
    x.
    """

    refs: tuple
    values: tuple
    plans: tuple

    @classmethod
    def of(cls, jaxprs, in_leaves, ref_inputs) -> Captures:
        inputs_by_ref = {id(in_leaves[i]): i for i in ref_inputs}
        viewed = {id(underlying_ref(in_leaves[i])): i for i in ref_inputs}
        refs, values, plans = {}, {}, []
        for p, jaxpr in enumerate(jaxprs):
            plan = []
            for c in jaxpr.consts:
                refuse_high(c, f"program {p} closes over")
                if is_jax_ref(c):
                    if id(c) in inputs_by_ref:
                        plan.append(("input", inputs_by_ref[id(c)]))
                        continue
                    if id(underlying_ref(c)) in viewed:
                        raise ValueError(
                            f"mpmd_map: program {p} closes over a jax Ref of which input "
                            f"{viewed[id(underlying_ref(c))]} is a view; pass the whole Ref instead"
                        )
                    plan.append(("ref", _index_of(refs, c)))
                elif isinstance(c, jax.core.Tracer):
                    plan.append(("value", _index_of(values, c)))
                else:
                    plan.append(("const", c))
            plans.append(tuple(plan))
        return cls(
            refs=tuple(x for _, x in refs.values()),
            values=tuple(x for _, x in values.values()),
            plans=tuple(plans),
        )

    def consts(self, p, input_buffers, ref_buffers, value_arrays) -> list:
        where = {
            "input": lambda i: cpu.Ref(input_buffers[i]),
            "ref": lambda k: cpu.Ref(ref_buffers[k]),
            "value": lambda k: np.asarray(value_arrays[k]),
            "const": lambda x: x,
        }
        return [where[kind](x) for kind, x in self.plans[p]]


def _index_of(seen: dict, x) -> int:
    """x's position among the distinct objects collected in `seen` (by identity), adding it if
    new."""
    return seen.setdefault(id(x), (len(seen), x))[0]


def _struct(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), jnp.dtype(x.dtype))


def run(programs, axes, in_leaves, out_leaves, layout: ScratchLayout, aliases, params, name):
    ref_inputs = check_ref_inputs(in_leaves, aliases)
    in_values = [x[...] if i in ref_inputs else x for i, x in enumerate(in_leaves)]
    scratch_init = [scratch_buffer(s, label) for s, label in zip(layout.leaves, layout.labels)]
    avals = [
        jax.core.ShapedArray(tuple(x.shape), jnp.dtype(x.dtype)) for x in (*in_values, *out_leaves)
    ]
    avals += [jax.core.ShapedArray(b.array.shape, b.array.dtype) for b in scratch_init]
    n_fixed = len(in_leaves) + len(out_leaves)
    jaxprs = [
        _trace(i, fn, avals, n_fixed, layout, axes, params["print_jaxpr"])
        for i, (_, fn) in enumerate(programs)
    ]
    captures = Captures.of(jaxprs, in_leaves, ref_inputs)
    instances = [
        [cpu.Instance(i, program_label(i, fn), tuple(point.items())) for point in mesh.points()]
        for i, (mesh, fn) in enumerate(programs)
    ]
    operands = [*in_values, *(r[...] for r in captures.refs), *captures.values]
    n_in, n_refs = len(in_values), len(captures.refs)
    result_specs = [
        *(_struct(s) for s in out_leaves),
        *(_struct(in_values[i]) for i in ref_inputs),
        *(_struct(r) for r in captures.refs),
    ]

    def host(*arrays):
        inputs = [cpu.Buffer(f"input {i}", np.array(a)) for i, a in enumerate(arrays[:n_in])]
        captured = [
            cpu.Buffer(f"closed-over Ref {k}", np.array(a))
            for k, a in enumerate(arrays[n_in : n_in + n_refs])
        ]
        outputs = []
        for j, s in enumerate(out_leaves):
            # aliased: the input's memory, in place
            src = next((a for a, b in aliases.items() if b == j), None)
            outputs.append(
                inputs[src]
                if src is not None
                else cpu.Buffer(f"output {j}", poison_numpy(s.shape, s.dtype))
            )
        scratch = [dataclasses.replace(b, array=b.array.copy()) for b in scratch_init]
        buffers = [
            *inputs,
            *(o for j, o in enumerate(outputs) if o not in inputs),
            *scratch,
            *captured,
        ]
        arg_refs = [cpu.Ref(b) for b in (*inputs, *outputs, *scratch)]
        cpu.execute(
            [
                (j, captures.consts(p, inputs, captured, arrays[n_in + n_refs :]), insts)
                for p, (j, insts) in enumerate(zip(jaxprs, instances))
            ],
            buffers,
            arg_refs,
            params["timeout_s"],
        )
        finals = [
            *(o.array for o in outputs),
            *(inputs[i].array for i in ref_inputs),
            *(b.array for b in captured),
        ]
        return tuple(np.asarray(a, dtype=s.dtype) for a, s in zip(finals, result_specs))

    def host_under_trace(*arrays):
        try:
            return host(*arrays)
        # XLA keeps only the text; cv.mpmd_errors() recovers the type.
        except Exception as e:
            raise errors.marked(e) from e

    if any(isinstance(x, jax.core.Tracer) for x in operands):
        results = jax.pure_callback(
            host_under_trace, tuple(result_specs), *operands, vmap_method="sequential"
        )
    else:
        results = tuple(jnp.asarray(r) for r in host(*[np.asarray(x) for x in operands]))
    outs, ref_finals = results[: len(out_leaves)], results[len(out_leaves) :]
    for ref, final in zip([*(in_leaves[i] for i in ref_inputs), *captures.refs], ref_finals):
        ref[...] = final
    return tuple(outs)
