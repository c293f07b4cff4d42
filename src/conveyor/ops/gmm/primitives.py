"""gmm_p and tgmm_p: JAX primitives with JVP, transpose and batching rules.

Design notes: docs/internals/gmm.md, section `ops/gmm/primitives.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from conveyor._compat import Primitive, Zero, ad, batching, is_undefined_primal

from conveyor.spmd import (
    explicit_axes_spec,
    match_varying,
    per_device_tracing,
    register_lowering_from_function,
    requires_devices_during_lowering,
    with_explicit_spec,
    without_internal_ref_effects,
)
from conveyor.ops.gmm import backend_impls, partitioning
from conveyor.ops.gmm.metadata import local_row_mask

gmm_p = Primitive("conveyor_gmm")
tgmm_p = Primitive("conveyor_tgmm")


# ---- evaluation -------------------------------------------------------------------------------


def _gmm_impl(lhs, rhs, group_sizes, group_offset, existing_out, platform="cpu", **params):
    return backend_impls.run_gmm(
        lhs, rhs, group_sizes, group_offset, existing_out, platform=platform, **params
    )


def _tgmm_impl(lhs, rhs, group_sizes, group_offset, existing_out, platform="cpu", **params):
    return backend_impls.run_tgmm(
        lhs, rhs, group_sizes, group_offset, existing_out, platform=platform, **params
    )


@functools.lru_cache(maxsize=256)
def _jitted(prim, params):
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def _eager(prim):
    def run(*args, **params):
        return _jitted(prim, tuple(sorted(params.items())))(*args)

    return run


gmm_p.def_impl(_eager(gmm_p))
tgmm_p.def_impl(_eager(tgmm_p))
# One lowering per platform: with backend="auto" (the user named none) the backend is chosen for
# the platform being lowered for, so one traced function exports each platform's own kernel.
# Under a sharded jit each is lowered through its sharding rule (`partitioning`), so XLA
# partitions it by rows instead of gathering the operands.
for _platform in ("cpu", "cuda", "rocm", "tpu"):
    register_lowering_from_function(
        gmm_p,
        functools.partial(partitioning.gmm, functools.partial(_gmm_impl, platform=_platform)),
        _platform,
    )
    register_lowering_from_function(
        tgmm_p,
        functools.partial(partitioning.tgmm, functools.partial(_tgmm_impl, platform=_platform)),
        _platform,
    )
requires_devices_during_lowering(gmm_p)
requires_devices_during_lowering(tgmm_p)


@functools.lru_cache(maxsize=256)
def _effects(impl, avals, params):
    """Effects of the backend's implementation (the Pallas interpreter's callbacks are ordered
    IO)."""
    fn = functools.partial(impl, **dict(params))
    # as the lowering traces it (see spmd.register_lowering_from_function)
    with per_device_tracing():
        effects = jax.make_jaxpr(fn)(
            *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        ).effects
    return without_internal_ref_effects(effects)


def _abstract(impl, out_spec):
    def rule(*avals, **params):
        # Same shape as existing_out, and (inside shard_map) the mesh axes all operands vary over:
        # `bind_gmm` / `bind_tgmm` cast the operands to a common set first.
        out = avals[4].update(dtype=jnp.dtype(params["out_dtype"]), weak_type=False)
        # With a mesh of Explicit axes the output's sharding is part of its type: the sharding
        # rule's.
        if explicit_axes_spec(avals[0]) is not None:
            out = with_explicit_spec(out, avals[0], out_spec([a.sharding for a in avals], params))
        # Only interpreted kernels carry effects; skip the trace for the common case.
        effects = (
            _effects(impl, avals, tuple(sorted(params.items())))
            if params.get("interpret")
            else set()
        )
        return out, effects

    return rule


gmm_p.def_effectful_abstract_eval(_abstract(_gmm_impl, partitioning.gmm_out_spec))
tgmm_p.def_effectful_abstract_eval(_abstract(_tgmm_impl, partitioning.tgmm_out_spec))


def bind_gmm(lhs, rhs, group_sizes, group_offset, existing_out, **params):
    """gmm_p on operands cast to vary over the same mesh axes (see `spmd.match_varying`). With
    `fill_unwritten=False` (default True) rows outside the local groups may hold anything and
    `existing_out` gives only the output's shape: the Mosaic kernels take no such operand (no
    fill to write and read back), the others leave zeros there."""
    params.setdefault("fill_unwritten", True)
    return gmm_p.bind(*match_varying(lhs, rhs, group_sizes, group_offset, existing_out), **params)


def bind_tgmm(lhs, rhs, group_sizes, group_offset, existing_out, **params):
    """tgmm_p on operands cast to vary over the same mesh axes. With `from_zeros=True` the sums
    start from zeros and `existing_out` gives only the output's shape and dtype: every backend
    ignores its values, and the mosaic_tpu kernel takes no such operand (no zero fill to write and
    read back; it visits empty groups to write their zeros)."""
    return tgmm_p.bind(*match_varying(lhs, rhs, group_sizes, group_offset, existing_out), **params)


# ---- differentiation --------------------------------------------------------------------------


def _sum_tangents(terms, like):
    terms = [t for t in terms if t is not None]
    if not terms:
        return ad.Zero.from_primal_value(like)
    return functools.reduce(jnp.add, terms)


def _gmm_jvp(primals, tangents, **params):
    lhs, rhs, gs, go, ex = primals
    t_lhs, t_rhs, _, _, t_ex = tangents
    out = bind_gmm(lhs, rhs, gs, go, ex, **params)
    zeros = jnp.zeros(ex.shape, params["out_dtype"])
    terms = []
    if type(t_lhs) is not Zero:
        terms.append(bind_gmm(t_lhs, rhs, gs, go, zeros, **params))
    if type(t_rhs) is not Zero:
        terms.append(bind_gmm(lhs, t_rhs, gs, go, zeros, **params))
    if type(t_ex) is not Zero and params["fill_unwritten"]:
        keep = ~local_row_mask(gs, go, rhs.shape[0], lhs.shape[0])
        terms.append(jnp.where(keep[:, None], t_ex.astype(params["out_dtype"]), 0))
    return out, _sum_tangents(terms, out)


def _tgmm_jvp(primals, tangents, **params):
    lhs, rhs, gs, go, ex = primals
    t_lhs, t_rhs, _, _, t_ex = tangents
    out = bind_tgmm(lhs, rhs, gs, go, ex, **params)
    zeros = jnp.zeros(ex.shape, params["out_dtype"])
    product = dict(params, from_zeros=True)
    terms = []
    if type(t_lhs) is not Zero:
        terms.append(bind_tgmm(t_lhs, rhs, gs, go, zeros, **product))
    if type(t_rhs) is not Zero:
        terms.append(bind_tgmm(lhs, t_rhs, gs, go, zeros, **product))
    if type(t_ex) is not Zero and not params["from_zeros"]:
        terms.append(t_ex.astype(params["out_dtype"]))
    return out, _sum_tangents(terms, out)


def _aval(x):
    return x.aval if is_undefined_primal(x) else x


def _backend_params(params):
    """Backend params for the ops a derivative is built from.

    A tiling callable's table of answers (`tiling.TilingTable`, built at the call for every
    ordering of (m, k, n)) is passed on, so derived ops get the callable's tiles for their shapes;
    a fixed tuple was chosen for the primal's shapes, so derived ops use their backend's default.
    """
    tiling = params["tiling"] if callable(params["tiling"]) else None
    return dict(backend=params["backend"], interpret=params["interpret"], tiling=tiling)


def _gmm_transpose(ct, lhs, rhs, gs, go, ex, *, transpose_rhs, out_dtype, fill_unwritten, **params):
    bp = _backend_params(params)
    if type(ct) is Zero:
        return [
            None if not is_undefined_primal(x) else Zero(x.aval) for x in (lhs, rhs, gs, go, ex)
        ]
    m = _aval(lhs).shape[0]
    num_groups = _aval(rhs).shape[0]
    ct_lhs = ct_rhs = ct_ex = None
    if is_undefined_primal(lhs):
        k = lhs.aval.shape[1]
        # d lhs[rows_i] = ct[rows_i] @ rhs[i]^T; rows outside local groups get exactly 0.
        ct_lhs = bind_gmm(
            ct,
            rhs,
            gs,
            go,
            jnp.zeros((m, k), lhs.aval.dtype),
            transpose_rhs=not transpose_rhs,
            out_dtype=lhs.aval.dtype,
            **bp,
        )
    if is_undefined_primal(rhs):
        a, b = (ct.T, lhs) if transpose_rhs else (lhs.T, ct)
        ct_rhs = bind_tgmm(
            a,
            b,
            gs,
            go,
            jnp.zeros(rhs.aval.shape, rhs.aval.dtype),
            num_groups=num_groups,
            out_dtype=rhs.aval.dtype,
            from_zeros=True,
            **bp,
        )
    if is_undefined_primal(ex):  # (not read without fill_unwritten)
        keep = ~local_row_mask(gs, go, num_groups, m)
        ct_ex = jnp.where(keep[:, None], ct, 0).astype(ex.aval.dtype)
        ct_ex = ct_ex if fill_unwritten else Zero(ex.aval)
    return [ct_lhs, ct_rhs, None, None, ct_ex]


def _tgmm_transpose(ct, lhs, rhs, gs, go, ex, *, num_groups, out_dtype, from_zeros, **params):
    bp = _backend_params(params)
    if type(ct) is Zero:
        return [
            None if not is_undefined_primal(x) else Zero(x.aval) for x in (lhs, rhs, gs, go, ex)
        ]
    ct_lhs = ct_rhs = ct_ex = None
    if is_undefined_primal(lhs):
        k, m = lhs.aval.shape
        # d lhs[:, rows_i] = (rhs[rows_i] @ ct[i]^T)^T
        ct_lhs = bind_gmm(
            rhs,
            ct,
            gs,
            go,
            jnp.zeros((m, k), lhs.aval.dtype),
            transpose_rhs=True,
            out_dtype=lhs.aval.dtype,
            **bp,
        ).T
    if is_undefined_primal(rhs):
        m, n = rhs.aval.shape
        # d rhs[rows_i] = lhs[:, rows_i]^T @ ct[i]
        ct_rhs = bind_gmm(
            lhs.T,
            ct,
            gs,
            go,
            jnp.zeros((m, n), rhs.aval.dtype),
            transpose_rhs=False,
            out_dtype=rhs.aval.dtype,
            **bp,
        )
    if is_undefined_primal(ex):  # (not read with from_zeros)
        ct_ex = Zero(ex.aval) if from_zeros else ct.astype(ex.aval.dtype)
    return [ct_lhs, ct_rhs, None, None, ct_ex]


ad.primitive_jvps[gmm_p] = _gmm_jvp
ad.primitive_jvps[tgmm_p] = _tgmm_jvp
ad.primitive_transposes[gmm_p] = _gmm_transpose
ad.primitive_transposes[tgmm_p] = _tgmm_transpose


# ---- vmap: one op per batch element, run sequentially with lax.map ---------------------------


def _batch_rule(prim):
    def rule(args, dims, **params):
        mapped = [jnp.moveaxis(a, d, 0) if d is not None else None for a, d in zip(args, dims)]

        def one(xs):
            full = [x if x is not None else a for x, a in zip(xs, args)]
            return prim.bind(*full, **params)

        return lax.map(one, mapped), 0

    return rule


batching.primitive_batchers[gmm_p] = _batch_rule(gmm_p)
batching.primitive_batchers[tgmm_p] = _batch_rule(tgmm_p)
