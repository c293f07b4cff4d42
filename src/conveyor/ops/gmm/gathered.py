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
)
from conveyor.spmd import match_varying, register_lowering_from_function

gathered_gmm_p = Primitive("conveyor_gathered_gmm")


def rows_of_groups(per_row, gs, go, num_groups: int):
    """`per_row` (a gmm's output with `fill_unwritten=False`: rows outside the local groups hold
    anything) with those rows set to 0: a select for XLA to fuse into the elementwise ops that
    read it, where a zero-filled start would be written, then read back by the kernel. (Feeding
    a gather, libtpu wrote it out instead: `put_rows(keep=...)` masks after the gather.)"""
    keep = local_row_mask(gs, go, num_groups, per_row.shape[0])
    return jnp.where(keep[:, None], per_row, jnp.zeros((), per_row.dtype))


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

# tgmm with one side's rows gathered (and optionally weighted): per group g,
# `out[g] = existing_out[g] + A[rows of g]^T @ B[rows of g]` where, with `gathered_side="lhs"`,
# A = w * lhs[indices] and B = rhs, and with "rhs", A = lhs and B = w * rhs[indices] (w: the
# `weights` when `weighted`, else 1; a weighted row is rounded to its operand's dtype). The
# weight gradients of the gathered gmm and of gmm_scatter_add (mosaic_tpu gathers in the
# kernel's loads).
gathered_tgmm_p = Primitive("conveyor_gathered_tgmm")
_define(
    gathered_tgmm_p,
    backend_impls.run_gathered_tgmm,
    "the weight gradient of gmm with lhs_indices (or of gmm_scatter_add) on a mesh with Explicit "
    "axes has no sharding rule yet; call it inside jax.shard_map",
)


def bind_gathered_tgmm(
    lhs, rhs, group_sizes, group_offset, existing_out, indices, weights=None, **params
):
    """gathered_tgmm_p on operands cast to vary over the same mesh axes; `weights=None` is
    unweighted; `from_zeros` as `bind_tgmm`'s."""
    params["weighted"] = weights is not None
    if weights is None:
        weights = jnp.zeros(indices.shape, jnp.float32)  # not read
    args = match_varying(lhs, rhs, group_sizes, group_offset, existing_out, indices, weights)
    return gathered_tgmm_p.bind(*args, **params)


def _tgmm_jvp(primals, tangents, *, weighted, **params):
    lhs, rhs, gs, go, ex, idx, w = primals
    t_lhs, t_rhs, _, _, t_ex, _, t_w = tangents
    weights = w if weighted else None
    out = bind_gathered_tgmm(lhs, rhs, gs, go, ex, idx, weights, **params)
    zeros = jnp.zeros(ex.shape, params["out_dtype"])
    product = dict(params, from_zeros=True)
    terms = []
    if type(t_lhs) is not Zero:
        terms.append(bind_gathered_tgmm(t_lhs, rhs, gs, go, zeros, idx, weights, **product))
    if type(t_rhs) is not Zero:
        terms.append(bind_gathered_tgmm(lhs, t_rhs, gs, go, zeros, idx, weights, **product))
    if weighted and type(t_w) is not Zero:
        terms.append(bind_gathered_tgmm(lhs, rhs, gs, go, zeros, idx, t_w, **product))
    if type(t_ex) is not Zero and not params["from_zeros"]:
        terms.append(t_ex.astype(params["out_dtype"]))
    return out, _sum_tangents(terms, out)


def _tgmm_transpose(
    ct,
    lhs,
    rhs,
    gs,
    go,
    ex,
    idx,
    w,
    *,
    gathered_side,
    weighted,
    num_groups,
    out_dtype,
    from_zeros,
    **params,
):
    operands = (lhs, rhs, gs, go, ex, idx, w)
    if type(ct) is Zero:
        return [Zero(x.aval) if is_undefined_primal(x) else None for x in operands]
    bp = _backend_params(params)
    m = idx.shape[0]
    # Row r of group g adds A[r] (x) B[r] to out[g]: dA[r] = ct[g] @ B[r], dB[r] = A[r] @ ct[g].
    a, b = _aval(lhs), _aval(rhs)
    k, n = a.shape[1], b.shape[1]

    def per_row(rows, width, transposed):  # rows[r] @ ct[g(r)] (^T), 0 outside the groups
        zeros = jnp.zeros((m, width), jnp.float32)
        return bind_gmm(
            rows, ct, gs, go, zeros, transpose_rhs=transposed, out_dtype=jnp.float32, **bp
        )

    def per_row_a(b_rows):  # [m, n] -> [m, k] float32: b_rows[r] @ ct[g(r)]^T
        return per_row(b_rows, k, True)

    def per_row_b(a_rows):  # [m, k] -> [m, n] float32: a_rows[r] @ ct[g(r)]
        return per_row(a_rows, n, False)

    def scale():  # read only when w is not the operand being transposed
        return w.astype(jnp.float32)[:, None] if weighted else 1.0

    src, other = (lhs, rhs) if gathered_side == "lhs" else (rhs, lhs)
    ct_src = ct_other = ct_w = None
    if is_undefined_primal(src) or (weighted and is_undefined_primal(w)):
        # d src rows: ct against the other side's own rows
        per_row = per_row_a(other) if gathered_side == "lhs" else per_row_b(other)
        if is_undefined_primal(src):
            num_rows = src.aval.shape[0]
            ct_src = jnp.zeros(src.aval.shape, jnp.float32)
            ct_src = ct_src.at[clamp_indices(idx, num_rows)].add(scale() * per_row)
            ct_src = ct_src.astype(src.aval.dtype)
        if weighted and is_undefined_primal(w):
            rows = jnp.take(src, clamp_indices(idx, src.shape[0]), axis=0)
            ct_w = jnp.sum(rows.astype(jnp.float32) * per_row, axis=1).astype(w.aval.dtype)
    if is_undefined_primal(other):
        # d other rows: ct against the gathered (weighted) rows, gathered in the gmm's loads
        weighted_rows = bind_gathered_gmm(
            src,
            ct,
            gs,
            go,
            jnp.zeros((m, other.aval.shape[1]), jnp.float32),
            idx,
            transpose_rhs=gathered_side == "rhs",
            out_dtype=jnp.float32,
            **bp,
        )
        ct_other = (scale() * weighted_rows).astype(other.aval.dtype)
    ct_ex = None
    if is_undefined_primal(ex):  # (not read with from_zeros)
        ct_ex = Zero(ex.aval) if from_zeros else ct.astype(ex.aval.dtype)
    ct_lhs, ct_rhs = (ct_src, ct_other) if gathered_side == "lhs" else (ct_other, ct_src)
    return [ct_lhs, ct_rhs, None, None, ct_ex, None, ct_w]


def bind_gathered_gmm(lhs, rhs, group_sizes, group_offset, existing_out, lhs_indices, **params):
    """gathered_gmm_p on operands cast to vary over the same mesh axes; `fill_unwritten` as
    `bind_gmm`'s."""
    params.setdefault("fill_unwritten", True)
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
    if type(t_ex) is not Zero and params["fill_unwritten"]:
        keep = ~local_row_mask(gs, go, rhs.shape[0], idx.shape[0])
        terms.append(jnp.where(keep[:, None], t_ex.astype(params["out_dtype"]), 0))
    return out, _sum_tangents(terms, out)


def _aval(x):
    return x.aval if is_undefined_primal(x) else x


def _transpose(
    ct,
    lhs,
    rhs,
    gs,
    go,
    ex,
    idx,
    *,
    transpose_rhs,
    out_dtype,
    fill_unwritten,
    unique_indices=False,
    **params,
):
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
        # d lhs[idx[i]] += ct[i] @ rhs[group(i)]^T; rows outside local groups contribute 0. Rows
        # named twice add in float32; unique rows are set, so the kernel rounds each to lhs's
        # dtype itself (the same value: float32 accumulation, one rounding) and writes half the
        # bytes a float32 product would.
        per_row_dtype = lhs.aval.dtype if unique_indices else jnp.float32
        per_row = bind_gmm(
            ct,
            rhs,
            gs,
            go,
            jnp.zeros((m, k), per_row_dtype),  # (its shape only: see put_rows below)
            transpose_rhs=not transpose_rhs,
            out_dtype=per_row_dtype,
            fill_unwritten=False,
            **bp,
        )
        # its rows outside the groups are dropped by index or selected away after the gather
        keep = local_row_mask(gs, go, num_groups, m)
        ct_lhs = backend_impls.put_rows(
            per_row, rows, num_rows, unique_indices, lhs.aval.dtype, keep=keep
        )
    if is_undefined_primal(rhs):
        # d rhs[g] = lhs[idx[rows of g]]^T @ ct[rows of g] ([k, n]), or its transpose with
        # transpose_rhs ([n, k]: ct's rows against the gathered rows); gathered in the kernel
        a, b, side = (ct, lhs, "rhs") if transpose_rhs else (lhs, ct, "lhs")
        ct_rhs = bind_gathered_tgmm(
            a,
            b,
            gs,
            go,
            jnp.zeros(rhs.aval.shape, rhs.aval.dtype),
            idx,
            gathered_side=side,
            num_groups=num_groups,
            out_dtype=rhs.aval.dtype,
            from_zeros=True,
            **bp,
        )
    if is_undefined_primal(ex):  # (not read without fill_unwritten)
        keep = ~local_row_mask(gs, go, num_groups, m)
        ct_ex = jnp.where(keep[:, None], ct, 0).astype(ex.aval.dtype)
        ct_ex = ct_ex if fill_unwritten else Zero(ex.aval)
    return [ct_lhs, ct_rhs, None, None, ct_ex, None]


ad.primitive_jvps[gathered_gmm_p] = _jvp
ad.primitive_transposes[gathered_gmm_p] = _transpose
batching.primitive_batchers[gathered_gmm_p] = _batch_rule(gathered_gmm_p)
ad.primitive_jvps[gathered_tgmm_p] = _tgmm_jvp
ad.primitive_transposes[gathered_tgmm_p] = _tgmm_transpose
batching.primitive_batchers[gathered_tgmm_p] = _batch_rule(gathered_tgmm_p)
