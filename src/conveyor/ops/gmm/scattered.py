"""scatter_gmm_p: gmm whose result rows are added into the output rows an index array names.

Design notes: docs/internals/gmm.md, section `ops/gmm/scattered.py`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from conveyor._compat import Primitive, Zero, ad, batching, is_undefined_primal
from conveyor.ops.gmm import backend_impls
from conveyor.ops.gmm.gathered import (
    bind_gathered_gmm,
    bind_gathered_tgmm,
    clamp_indices,
    rows_of_groups,
)
from conveyor.ops.gmm.metadata import local_group_bounds
from conveyor.ops.gmm.primitives import (
    _backend_params,
    _batch_rule,
    _eager,
    _effects,
    _sum_tangents,
)
from conveyor.spmd import explicit_axes_spec, match_varying, register_lowering_from_function

scatter_gmm_p = Primitive("conveyor_scatter_gmm")


def repeats_within_a_group(group_sizes, group_offset, out_indices, num_groups: int, num_rows: int):
    """Whether two rows of one local group name the same output row (a scalar bool): sorted by
    (group, index), equal neighbours. Rows of no local group never count."""
    m = out_indices.shape[0]
    starts, ends = local_group_bounds(group_sizes, group_offset, num_groups, m)
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    safe = jnp.minimum(group, num_groups - 1)
    local = (group < num_groups) & (rows >= starts[safe])
    group = jnp.where(local, group, -1 - rows)  # a key no other row shares
    idx = clamp_indices(out_indices, num_rows)
    g, i = lax.sort((group, idx), num_keys=2)
    same = (g[1:] == g[:-1]) & (i[1:] == i[:-1]) & (g[1:] >= 0)
    return jnp.any(same)


def _impl(lhs, rhs, group_sizes, group_offset, out_indices, row_weights, platform="cpu", **p):
    return backend_impls.run_scatter_gmm(
        lhs, rhs, group_sizes, group_offset, out_indices, row_weights, platform=platform, **p
    )


def _abstract(*avals, num_rows, transpose_rhs, out_dtype, **params):
    if explicit_axes_spec(avals[0]) is not None:
        raise NotImplementedError(
            "gmm_scatter_add on a mesh with Explicit axes has no sharding rule yet; call it "
            "inside jax.shard_map (each device adds into its own output)"
        )
    rhs = avals[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out = avals[0].update(shape=(num_rows, n), dtype=jnp.dtype(out_dtype), weak_type=False)
    all_params = dict(params, num_rows=num_rows, transpose_rhs=transpose_rhs, out_dtype=out_dtype)
    effects = (
        _effects(_impl, avals, tuple(sorted(all_params.items())))
        if params.get("interpret")
        else set()
    )
    return out, effects


scatter_gmm_p.def_impl(_eager(scatter_gmm_p))
scatter_gmm_p.def_effectful_abstract_eval(_abstract)
for _platform in ("cpu", "cuda", "rocm", "tpu"):
    register_lowering_from_function(
        scatter_gmm_p, functools.partial(_impl, platform=_platform), _platform
    )


def bind_scatter_gmm(lhs, rhs, group_sizes, group_offset, out_indices, row_weights, **params):
    """scatter_gmm_p on operands cast to vary over the same mesh axes."""
    args = match_varying(lhs, rhs, group_sizes, group_offset, out_indices, row_weights)
    return scatter_gmm_p.bind(*args, **params)


def _jvp(primals, tangents, **params):
    lhs, rhs, gs, go, idx, wts = primals
    t_lhs, t_rhs, _, _, _, t_wts = tangents
    out = bind_scatter_gmm(lhs, rhs, gs, go, idx, wts, **params)
    terms = []
    if type(t_lhs) is not Zero:
        terms.append(bind_scatter_gmm(t_lhs, rhs, gs, go, idx, wts, **params))
    if type(t_rhs) is not Zero:
        terms.append(bind_scatter_gmm(lhs, t_rhs, gs, go, idx, wts, **params))
    if type(t_wts) is not Zero:
        terms.append(bind_scatter_gmm(lhs, rhs, gs, go, idx, t_wts, **params))
    return out, _sum_tangents(terms, out)


def _aval(x):
    return x.aval if is_undefined_primal(x) else x


def _transpose(ct, lhs, rhs, gs, go, idx, wts, *, transpose_rhs, num_rows, out_dtype, **params):
    operands = (lhs, rhs, gs, go, idx, wts)
    if type(ct) is Zero:
        return [Zero(x.aval) if is_undefined_primal(x) else None for x in operands]
    bp = _backend_params(params)
    m, k = _aval(lhs).shape
    num_groups = _aval(rhs).shape[0]

    def per_row_grad():
        # ct[idx[i]] @ rhs[group(i)]^T for the local rows, 0 elsewhere: [m, k] float32
        product = bind_gathered_gmm(
            ct,
            rhs,
            gs,
            go,
            jnp.zeros((m, k), jnp.float32),  # (its shape: see rows_of_groups)
            idx,
            transpose_rhs=not transpose_rhs,
            out_dtype=jnp.float32,
            fill_unwritten=False,
            **bp,
        )
        return rows_of_groups(product, gs, go, num_groups)

    ct_lhs = ct_rhs = ct_wts = None
    if is_undefined_primal(lhs):
        ct_lhs = (wts.astype(jnp.float32)[:, None] * per_row_grad()).astype(lhs.aval.dtype)
    if is_undefined_primal(wts):
        dots = jnp.sum(lhs.astype(jnp.float32) * per_row_grad(), axis=1)
        ct_wts = dots.astype(wts.aval.dtype)
    if is_undefined_primal(rhs):
        # d rhs[g] = lhs[rows of g]^T @ (w ct[idx])[rows of g] ([k, n]), or its transpose with
        # transpose_rhs: the cotangent's rows gathered and weighted in the kernel's loads
        a, b, side = (ct, lhs, "lhs") if transpose_rhs else (lhs, ct, "rhs")
        ct_rhs = bind_gathered_tgmm(
            a,
            b,
            gs,
            go,
            jnp.zeros(rhs.aval.shape, rhs.aval.dtype),
            idx,
            wts,
            gathered_side=side,
            num_groups=num_groups,
            out_dtype=rhs.aval.dtype,
            from_zeros=True,
            **bp,
        )
    return [ct_lhs, ct_rhs, None, None, None, ct_wts]


ad.primitive_jvps[scatter_gmm_p] = _jvp
ad.primitive_transposes[scatter_gmm_p] = _transpose
batching.primitive_batchers[scatter_gmm_p] = _batch_rule(scatter_gmm_p)
