"""`input_output_aliases` for kernels: an output that starts as one of the inputs, so that the
kernel writes only what changes and everything else keeps the input's values.

Design notes: docs/internals/core.md, section `aliasing.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def check_aliases(where: str, aliases: Any) -> dict[int, int]:
    """`aliases` as a dict {input index: output index}, one input per output (a second input
    aliased to the same output would be silently dropped)."""
    if not isinstance(aliases, Mapping):
        raise TypeError(
            f"{where}: input_output_aliases must be a dict {{input index: output index}}, got "
            f"{aliases!r}"
        )
    by_output: dict[int, int] = {}
    for src, dst in aliases.items():
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (src, dst)):
            raise TypeError(
                f"{where}: input_output_aliases must map int input indices to int output indices, "
                f"got {{{src!r}: {dst!r}}}"
            )
        if dst in by_output:
            raise ValueError(
                f"{where}: input_output_aliases maps inputs {by_output[dst]} and {src} to output "
                f"{dst}; an output can start as one input only"
            )
        by_output[dst] = src
    return dict(aliases)


def check_alias_operands(
    where: str, aliases: Mapping[int, int], inputs: Sequence[Any], outputs: Sequence[Any]
) -> None:
    """Each alias names an existing input and output of the same shape and dtype."""
    for src, dst in aliases.items():
        if not (0 <= src < len(inputs) and 0 <= dst < len(outputs)):
            raise ValueError(
                f"{where}: input_output_aliases {{{src}: {dst}}} is out of range ({len(inputs)} "
                f"inputs, {len(outputs)} outputs)"
            )
        a, o = inputs[src], outputs[dst]
        if tuple(a.shape) != tuple(o.shape) or jnp.dtype(a.dtype) != jnp.dtype(o.dtype):
            raise ValueError(
                f"{where}: input {src} ({jnp.dtype(a.dtype)}{list(a.shape)}) cannot alias output "
                f"{dst} ({jnp.dtype(o.dtype)}{list(o.shape)}): shapes and dtypes must match"
            )


def call_with_aliases(
    make_kernel: Callable[[Callable[..., None], tuple], Callable[..., Any]],
    body: Callable[..., None],
    inputs: Sequence[Any],
    outs: Sequence[Any],
    aliases: Mapping[int, int],
    *,
    fence_aliased: bool = False,
) -> list[Any]:
    """Run `body(*in_refs, *out_refs, *scratch_refs)` as the kernel `make_kernel(wrapped_body,
    out_type)` builds (a `plgpu.kernel` or `pl.kernel`, which take no aliases), with the aliased
    outputs held in jax Refs that start as their inputs. Returns the outputs in order.

    `fence_aliased` puts the aliased outputs behind `lax.optimization_barrier` (Mosaic GPU): in a
    loop, XLA:GPU otherwise fuses a kernel whose result lands in a slice of a stacked output (a
    `lax.map`, `vmap`'s loop, a scan's stacked results) into a dynamic-slice fusion that hands the
    kernel a result buffer apart from its aliased operand, and the kernel's writes are lost (seen
    on an H200, jax 0.11.2: a gmm under lax.map returned zeros). The barrier keeps the kernel out
    of that fusion; the slice is then written by a copy."""
    n_in = len(inputs)
    aliased = sorted(aliases.items(), key=lambda kv: kv[1])  # (input, output), by output
    refs = [jax.new_ref(jnp.asarray(inputs[i])) for i, _ in aliased]
    ref_outputs = [o for _, o in aliased]
    free = [j for j in range(len(outs)) if j not in ref_outputs]

    def wrapped(*all_refs):
        ins, mine, rest = (
            all_refs[:n_in],
            all_refs[n_in : n_in + len(refs)],
            all_refs[n_in + len(refs) :],
        )
        out_refs: list[Any] = [None] * len(outs)
        for o, r in zip(ref_outputs, mine):
            out_refs[o] = r
        for o, r in zip(free, rest[: len(free)]):
            out_refs[o] = r
        return body(*ins, *out_refs, *rest[len(free) :])

    results = make_kernel(
        wrapped, tuple(jax.ShapeDtypeStruct(tuple(outs[j].shape), outs[j].dtype) for j in free)
    )(*inputs, *refs)
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    out: list[Any] = [None] * len(outs)
    frozen = [jax.freeze(r) for r in refs]
    if fence_aliased and frozen:
        frozen = list(jax.lax.optimization_barrier(tuple(frozen)))
    for o, r in zip(ref_outputs, frozen):
        out[o] = r
    for o, x in zip(free, results):
        out[o] = x
    return out
