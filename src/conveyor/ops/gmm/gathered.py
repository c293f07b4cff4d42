"""gathered_gmm_p: gmm whose lhs rows are gathered by an index array in the kernel's loads.

Design notes: docs/internals/gmm.md, section `ops/gmm/gathered.py`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from conveyor._compat import Primitive, Zero, ad, batching, is_undefined_primal
from conveyor.ops.gmm import backend_impls
from conveyor.ops.gmm.metadata import local_row_mask
from conveyor.ops.gmm.primitives import (
    _abstract,
    _backend_params,
    _batch_rule,
    _eager,
    _sum_tangents,
    bind_gmm,
    bind_tgmm,
)
from conveyor.spmd import match_varying, register_lowering_from_function

gathered_gmm_p = Primitive("conveyor_gathered_gmm")


def clamp_indices(lhs_indices, num_rows: int):
    """The rows every backend reads: `lhs_indices` clamped to [0, num_rows)."""
    return jnp.clip(lhs_indices.astype(jnp.int32), 0, num_rows - 1)


def _define(prim: Primitive, run, refusal: str) -> None:
    """Evaluation, abstract evaluation and one lowering per platform (as gmm's) for `prim`, whose
    operands `run` (a `backend_impls` runner) computes. No sharding rule: under a sharded jit
    (outside shard_map) XLA gives the kernel whole operands; with Explicit axes `refusal`."""

    def impl(*args, platform="cpu", **params):
        return run(*args, platform=platform, **params)

    def out_spec(arg_shardings, params):
        raise NotImplementedError(refusal)

    prim.def_impl(_eager(prim))
    prim.def_effectful_abstract_eval(_abstract(impl, out_spec))
    for platform in ("cpu", "cuda", "rocm", "tpu"):
        register_lowering_from_function(prim, functools.partial(impl, platform=platform), platform)


_define(
    gathered_gmm_p,
    backend_impls.run_gathered_gmm,
    "gmm with lhs_indices on a mesh with Explicit axes has no sharding rule yet; call it inside "
    "jax.shard_map (each device gathers from its own lhs)",
)

# tgmm of the gathered rows: `out[g] = existing_out[g] + lhs[lhs_indices[rows of g]]^T @ rhs[rows
# of g]`, the weight gradient of the gathered gmm (mosaic_tpu gathers in the kernel's loads).
gathered_tgmm_p = Primitive("conveyor_gathered_tgmm")
_define(
    gathered_tgmm_p,
    backend_impls.run_gathered_tgmm,
    "the weight gradient of gmm with lhs_indices on a mesh with Explicit axes has no sharding "
    "rule yet; call it inside jax.shard_map",
)


def bind_gathered_tgmm(lhs, rhs, group_sizes, group_offset, existing_out, lhs_indices, **params):
    """gathered_tgmm_p on operands cast to vary over the same mesh axes."""
    args = match_varying(lhs, rhs, group_sizes, group_offset, existing_out, lhs_indices)
    return gathered_tgmm_p.bind(*args, **params)


def _tgmm_jvp(primals, tangents, **params):
    lhs, rhs, gs, go, ex, idx = primals
    t_lhs, t_rhs, _, _, t_ex, _ = tangents
    out = bind_gathered_tgmm(lhs, rhs, gs, go, ex, idx, **params)
    zeros = jnp.zeros(ex.shape, params["out_dtype"])
    terms = []
    if type(t_lhs) is not Zero:
        terms.append(bind_gathered_tgmm(t_lhs, rhs, gs, go, zeros, idx, **params))
    if type(t_rhs) is not Zero:
        terms.append(bind_gathered_tgmm(lhs, t_rhs, gs, go, zeros, idx, **params))
    if type(t_ex) is not Zero:
        terms.append(t_ex.astype(params["out_dtype"]))
    return out, _sum_tangents(terms, out)


def _tgmm_transpose(ct, lhs, rhs, gs, go, ex, idx, *, num_groups, out_dtype, **params):
    operands = (lhs, rhs, gs, go, ex, idx)
    if type(ct) is Zero:
        return [Zero(x.aval) if is_undefined_primal(x) else None for x in operands]
    bp = _backend_params(params)
    ct_lhs = ct_rhs = ct_ex = None
    m = idx.shape[0]
    if is_undefined_primal(lhs):
        num_rows, k = lhs.aval.shape
        # d lhs[idx[i]] += rhs[i] @ ct[group(i)]^T; rows outside local groups contribute 0.
        per_row = bind_gmm(
            rhs,
            ct,
            gs,
            go,
            jnp.zeros((m, k), jnp.float32),
            transpose_rhs=True,
            out_dtype=jnp.float32,
            **bp,
        )
        rows = clamp_indices(idx, num_rows)
        ct_lhs = jnp.zeros((num_rows, k), jnp.float32).at[rows].add(per_row)
        ct_lhs = ct_lhs.astype(lhs.aval.dtype)
    if is_undefined_primal(rhs):
        # d rhs[i] = lhs[idx[i]] @ ct[group(i)]: the gathered gmm
        ct_rhs = bind_gathered_gmm(
            lhs,
            ct,
            gs,
            go,
            jnp.zeros(rhs.aval.shape, rhs.aval.dtype),
            idx,
            transpose_rhs=False,
            out_dtype=rhs.aval.dtype,
            **bp,
        )
    if is_undefined_primal(ex):
        ct_ex = ct.astype(ex.aval.dtype)
    return [ct_lhs, ct_rhs, None, None, ct_ex, None]


def bind_gathered_gmm(lhs, rhs, group_sizes, group_offset, existing_out, lhs_indices, **params):
    """gathered_gmm_p on operands cast to vary over the same mesh axes."""
    args = match_varying(lhs, rhs, group_sizes, group_offset, existing_out, lhs_indices)
    return gathered_gmm_p.bind(*args, **params)


def _jvp(primals, tangents, **params):
    lhs, rhs, gs, go, ex, idx = primals
    t_lhs, t_rhs, _, _, t_ex, _ = tangents
    out = bind_gathered_gmm(lhs, rhs, gs, go, ex, idx, **params)
    zeros = jnp.zeros(ex.shape, params["out_dtype"])
    terms = []
    if type(t_lhs) is not Zero:
        terms.append(bind_gathered_gmm(t_lhs, rhs, gs, go, zeros, idx, **params))
    if type(t_rhs) is not Zero:
        terms.append(bind_gathered_gmm(lhs, t_rhs, gs, go, zeros, idx, **params))
    if type(t_ex) is not Zero:
        keep = ~local_row_mask(gs, go, rhs.shape[0], idx.shape[0])
        terms.append(jnp.where(keep[:, None], t_ex.astype(params["out_dtype"]), 0))
    return out, _sum_tangents(terms, out)


def _aval(x):
    return x.aval if is_undefined_primal(x) else x


def _transpose(ct, lhs, rhs, gs, go, ex, idx, *, transpose_rhs, out_dtype, **params):
    operands = (lhs, rhs, gs, go, ex, idx)
    if type(ct) is Zero:
        return [Zero(x.aval) if is_undefined_primal(x) else None for x in operands]
    bp = _backend_params(params)
    num_rows, k = _aval(lhs).shape
    m = idx.shape[0]
    num_groups = _aval(rhs).shape[0]
    rows = clamp_indices(idx, num_rows)
    ct_lhs = ct_rhs = ct_ex = None
    if is_undefined_primal(lhs):
        # d lhs[idx[i]] += ct[i] @ rhs[group(i)]^T; rows outside local groups contribute 0.
        per_row = bind_gmm(
            ct,
            rhs,
            gs,
            go,
            jnp.zeros((m, k), jnp.float32),
            transpose_rhs=not transpose_rhs,
            out_dtype=jnp.float32,
            **bp,
        )
        ct_lhs = jnp.zeros((num_rows, k), jnp.float32).at[rows].add(per_row)
        ct_lhs = ct_lhs.astype(lhs.aval.dtype)
    if is_undefined_primal(rhs) and not transpose_rhs:
        # d rhs[g] = lhs[idx[rows of g]]^T @ ct[rows of g]: gathered in the kernel's loads
        ct_rhs = bind_gathered_tgmm(
            lhs,
            ct,
            gs,
            go,
            jnp.zeros(rhs.aval.shape, rhs.aval.dtype),
            idx,
            num_groups=num_groups,
            out_dtype=rhs.aval.dtype,
            **bp,
        )
    elif is_undefined_primal(rhs):  # d rhs[g] = ct^T @ gathered rows: gathered in XLA
        ct_rhs = bind_tgmm(
            ct.T,
            jnp.take(lhs, rows, axis=0),
            gs,
            go,
            jnp.zeros(rhs.aval.shape, rhs.aval.dtype),
            num_groups=num_groups,
            out_dtype=rhs.aval.dtype,
            **bp,
        )
    if is_undefined_primal(ex):
        keep = ~local_row_mask(gs, go, num_groups, m)
        ct_ex = jnp.where(keep[:, None], ct, 0).astype(ex.aval.dtype)
    return [ct_lhs, ct_rhs, None, None, ct_ex, None]


ad.primitive_jvps[gathered_gmm_p] = _jvp
ad.primitive_transposes[gathered_gmm_p] = _transpose
batching.primitive_batchers[gathered_gmm_p] = _batch_rule(gathered_gmm_p)
ad.primitive_jvps[gathered_tgmm_p] = _tgmm_jvp
ad.primitive_transposes[gathered_tgmm_p] = _tgmm_transpose
batching.primitive_batchers[gathered_tgmm_p] = _batch_rule(gathered_tgmm_p)
