"""Per-device code inside `shard_map`: varying-axes types, and kernels traced per device.

Design notes: docs/internals/core.md, section `spmd.py`.
"""

from __future__ import annotations

import jax

from conveyor._compat import Primitive, check_vma, core, dispatch, mlir


def varying_axes(x) -> frozenset:
    """Mesh axes over which `x` varies inside shard_map (jax 0.12: aval.mat.varying; older:
    aval.vma)."""
    aval = jax.typeof(x)
    # a ref varies as its contents do
    return _varying_axes_of_aval(getattr(aval, "inner_aval", aval))


def _varying_axes_of_aval(aval) -> frozenset:
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def per_device_tracing():
    """A context in which code is traced per device: shard_map's varying-axes checks are off."""
    return check_vma(False)


def strip_varying(aval):
    """`aval` without manual-axis (varying) information nor an explicit sharding (it is traced per
    device); other avals unchanged."""
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
    """`aval` sharded by `spec` over the explicit mesh of the aval `like` (unchanged without
    one)."""
    if explicit_axes_spec(like) is None:
        return aval
    return aval.update(sharding=jax.sharding.NamedSharding(like.sharding.mesh, spec))


def match_varying(*xs):
    """Cast every array to vary over the union of the mesh axes any of them varies over.

    The cast (pcast to varying) transposes to a psum, so the cotangent of a replicated operand
    comes back replicated. Outside shard_map, or with check_vma=False, nothing changes.
    """
    axes = frozenset().union(*(varying_axes(x) for x in xs))
    if not axes:
        return xs
    return tuple(
        x
        if varying_axes(x) == axes
        else jax.lax.pcast(x, tuple(sorted(axes - varying_axes(x), key=str)), to="varying")
        for x in xs
    )


def out_struct(shape, dtype, *like):
    """A ShapeDtypeStruct for a kernel output that varies over the mesh axes its inputs vary over
    (what `pallas_call` needs inside `shard_map(check_vma=True)`)."""
    axes = frozenset().union(*(varying_axes(x) for x in like))
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=core.ManualAxisType(varying=axes))


def without_internal_ref_effects(effects):
    """`effects` less the one a jax Ref created and frozen inside a function leaves in its trace
    (cv.kernel's input_output_aliases on mosaic_gpu): nothing outside sees that Ref, and a
    primitive that declared the effect could not be lowered under jit."""
    return {e for e in effects if e is not core.internal_mutable_array_effect}


def register_lowering_from_function(prim: Primitive, impl, platform: str | None = None) -> None:
    """Lower `prim` (on `platform`, or every platform) by tracing `impl(*args, **params)` per
    device.

    The primitive's avals carry the mesh axes they vary over (its abstract eval gives the output
    the inputs' common set, see `match_varying`); the implementation is traced without them.
    """
    lowered = mlir.lower_fun(impl, multiple_results=False)
    mlir.register_lowering(
        prim,
        lambda ctx, *args, **params: _lower_per_device(lowered, ctx, *args, **params),
        platform=platform,
    )


def requires_devices_during_lowering(prim: Primitive) -> None:
    """Declare that lowering `prim` needs the device assignment (its rule emits a
    custom_partitioning call, whose partitioner needs the concrete mesh)."""
    dispatch.prim_requires_devices_during_lowering.add(prim)


def _lower_per_device(lowered, ctx, *args, **params):
    """Run a `mlir.lower_fun` rule with the avals' varying axes stripped and the checks off."""
    inner = ctx.replace(
        avals_in=[strip_varying(a) for a in ctx.avals_in],
        avals_out=[strip_varying(a) for a in ctx.avals_out],
    )
    with per_device_tracing():
        out = lowered(inner, *args, **params)
    if inner.tokens_out is not None:  # effectful (interpreted) kernels thread tokens
        ctx.set_tokens_out(inner.tokens_out)
    return out


class _Hashable:
    """A function as a primitive parameter, compared by identity."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


def _per_device_abstract(*avals, fn, out_avals):
    axes = frozenset().union(*(_varying_axes_of_aval(a) for a in avals))
    mat = core.ManualAxisType(varying=axes)
    return [
        core.ShapedArray(
            a.shape, a.dtype, sharding=core.get_cur_mesh_sharding(), manual_axis_type=mat
        )
        for a in out_avals
    ]


per_device_p = Primitive("conveyor_per_device")
per_device_p.multiple_results = True
per_device_p.def_abstract_eval(_per_device_abstract)
mlir.register_lowering(
    per_device_p,
    lambda ctx, *args, fn, out_avals: _lower_per_device(
        mlir.lower_fun(fn.fn, multiple_results=True), ctx, *args
    ),
)


def per_device_call(fn, out_shapes, *args):
    """`fn(*args)` (a list of arrays of `out_shapes`), traced per device inside shard_map.

    With operands that vary over shard_map axes (check_vma=True), `fn` is staged out as one
    primitive whose outputs vary over the union of those axes, and traced at lowering time without
    varying-axes types. Elsewhere `fn` is simply called. Not differentiable (kernels over refs are
    not).
    """
    if not frozenset().union(*(varying_axes(x) for x in args)):
        return fn(*args)
    out_avals = tuple(jax.core.ShapedArray(tuple(s.shape), s.dtype) for s in out_shapes)
    return per_device_p.bind(*args, fn=_Hashable(fn), out_avals=out_avals)
