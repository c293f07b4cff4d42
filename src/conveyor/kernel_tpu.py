"""cv.kernel on the mosaic_tpu backend: one pallas_call with every operand left in HBM (pl.ANY).

Design notes: docs/internals/core.md, section `kernel_tpu.py`.
"""

from __future__ import annotations

import contextlib

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from conveyor.aliasing import check_alias_operands
from conveyor.interpreters import tpu_params
from conveyor.spmd import out_struct
from conveyor.sync import mosaic_scratch


def _tpu_mesh():
    """An abstract mesh whose devices are TPU v5e cores, for tracing TPU kernels without a TPU.

    Inside shard_map the current (manual) mesh cannot change size, so the same axes are kept and
    only the device kind changes; elsewhere a one-device mesh is used.
    """
    tpu = AbstractDevice("TPU v5 lite", 1, "tpu")
    cur = jax.sharding.get_abstract_mesh()
    if cur.empty:
        return jax.sharding.use_abstract_mesh(
            AbstractMesh((1,), ("_cv_tpu",), (AxisType.Auto,), abstract_device=tpu)
        )
    return jax.sharding.use_abstract_mesh(
        AbstractMesh(cur.axis_sizes, cur.axis_names, cur.axis_types, abstract_device=tpu)
    )


def launch(
    body,
    outs,
    scratch,
    single,
    interpret,
    enter_context,
    grid=(),
    dimension_semantics=None,
    aliases=None,
    cost_estimate=None,
):
    def run(*inputs):
        n_in = len(inputs)
        if aliases:
            check_alias_operands("cv.kernel", aliases, inputs, outs)

        def wrapped(*refs):
            with enter_context():
                if body(*refs) is not None:
                    raise TypeError("kernel body must return None (it writes outputs through refs)")

        call = pl.pallas_call(
            wrapped,
            out_shape=tuple(out_struct(s.shape, s.dtype, *inputs) for s in outs),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * n_in,
            out_specs=tuple(pl.BlockSpec(memory_space=pl.ANY) for _ in outs),
            scratch_shapes=[
                mosaic_scratch(s, pltpu.VMEM, pltpu.SemaphoreType.REGULAR) for s in scratch
            ],
            interpret=tpu_params(interpret),
            grid=grid,
            compiler_params=(
                pltpu.CompilerParams(dimension_semantics=dimension_semantics)
                if dimension_semantics
                else None
            ),
            input_output_aliases=dict(aliases or {}),
            cost_estimate=cost_estimate,
            name="conveyor_kernel",
        )
        mesh = (
            _tpu_mesh() if interpret or jax.default_backend() != "tpu" else contextlib.nullcontext()
        )
        with mesh:
            results = call(*inputs)
        return results[0] if single else tuple(results)

    return _batched_as_a_loop(run)


def _batched_as_a_loop(run):
    """`jax.vmap` of a mosaic_tpu kernel: one kernel call per batch element, in a `lax.map`.

    Pallas batches a pallas_call by adding a grid dimension with blocked specs, which operands left
    in HBM (pl.ANY, as every cv.kernel operand on TPU) cannot take ("Kernel input 0 in HBM but does
    not have trivial BlockSpec"). A loop of the unbatched kernel computes the same values; it runs
    the batch elements one after the other.
    """

    @jax.custom_batching.custom_vmap
    def call(*inputs):
        return run(*inputs)

    @call.def_vmap
    def _rule(axis_size, in_batched, *inputs):
        batched = [x for x, b in zip(inputs, in_batched) if b]

        def one(xs):  # through `call` again, so an outer vmap of this loop is a loop too
            it = iter(xs)
            return call(*[next(it) if b else x for x, b in zip(inputs, in_batched)])

        outs = jax.lax.map(one, batched)
        return outs, jax.tree.map(lambda _: True, outs)

    return call
