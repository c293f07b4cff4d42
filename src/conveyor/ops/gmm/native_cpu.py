"""native_cpu backend for gmm/tgmm: one FFI call into Conveyor's own x86-64 kernels
(`conveyor/native/gmm_cpu.cc`: AMX, AVX-512 BF16 or AVX2 + FMA, built on first use by
`conveyor.native.build`).

Each group's product is one packed, tiled matrix product over exactly its rows: no windows, masks
or per-group copies of operands, and the weights of a group are packed once per column chunk.
float32 and bfloat16 operands (bf16 products summed in float32: by AMX tdpbf16ps, by vdpbf16ps, or
widened to float32 on AVX2), float32 or bfloat16 outputs. The output aliases existing_out: gmm
leaves the rows outside the local groups as they are, tgmm adds each group's sum to existing_out[g]
and rounds once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from conveyor.native import build
from conveyor.ops.gmm.metadata import local_group_boundaries

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The builds backend=None runs: AMX (bfloat16 on tiles, float32 as the AVX-512 build) and AVX-512.
# The AVX2 build runs only when named: on this project's AVX-512 BF16 machine (2026-11-25, m=4096,
# k=n=1024, medians of 5) it ran float32 gmm at 1.11-1.25x the batched floor against xla's
# 1.00-1.25x, and bfloat16 at 1.68-1.90x against xla's 1.07-1.42x (XLA's own dots there use
# AVX-512); on a CPU with AVX2 only it has not been measured against xla.
DEFAULT_ISAS = ("amx", "avx512")


def unsupported(lhs_dtype, rhs_dtype, out_dtype, tiling) -> str | None:
    """Why the native kernels cannot run this call (None when they can)."""
    st = build.status()
    if not st.available:
        return st.reason
    operands = jnp.promote_types(lhs_dtype, rhs_dtype)
    if operands not in DTYPES:
        return f"operands promote to {operands}; the native kernels take float32 or bfloat16"
    if jnp.dtype(out_dtype) not in DTYPES:
        return f"preferred_element_type={jnp.dtype(out_dtype)}; the native kernels write float32 or bfloat16"
    if tiling is not None:
        return f"tiling={tiling!r}; the native kernels have fixed register tiles and take no tiling"
    return None


def chosen_by_default(lhs_dtype, rhs_dtype, out_dtype, tiling) -> bool:
    """Whether backend=None runs native_cpu for this call on CPU: the kernels take it and the build
    loaded here is one of DEFAULT_ISAS."""
    return unsupported(lhs_dtype, rhs_dtype, out_dtype, tiling) is None and build.status().isa in DEFAULT_ISAS


def check(lhs, rhs, out_dtype, tiling) -> None:
    """Raise, naming the reason, when backend="native_cpu" cannot run this call."""
    if (why := unsupported(lhs.dtype, rhs.dtype, out_dtype, tiling)) is not None:
        raise NotImplementedError(f"backend='native_cpu': {why}")


def _call(target, lhs, rhs, bounds, existing_out, out_dtype, existing_out_zero, **attrs):
    """One FFI call. With `existing_out_zero` (the op made existing_out itself: all zeros) the kernel
    writes the whole result, zeros where no group computes, into a fresh buffer; otherwise the
    result aliases existing_out and the kernel keeps (gmm) or adds to (tgmm) what it holds. The
    first saves setting the output to zero and reading it back: at G=64, k=n=1024 f32 a tgmm
    result is 256 MiB."""
    cdt = jnp.promote_types(lhs.dtype, rhs.dtype)
    out = jax.ShapeDtypeStruct(existing_out.shape, out_dtype)
    if existing_out_zero:
        call = jax.ffi.ffi_call(target, out)
        return call(lhs.astype(cdt), rhs.astype(cdt), bounds, jnp.zeros((0,), out_dtype), zero_init=True, **attrs)
    call = jax.ffi.ffi_call(target, out, input_output_aliases={3: 0})
    return call(lhs.astype(cdt), rhs.astype(cdt), bounds, existing_out.astype(out_dtype), zero_init=False, **attrs)


def gmm_native_cpu(lhs, rhs, group_sizes, group_offset, existing_out, *, transpose_rhs, out_dtype, tiling,
                   existing_out_zero=False, **_):
    check(lhs, rhs, out_dtype, tiling)
    bounds = local_group_boundaries(group_sizes, group_offset, rhs.shape[0], lhs.shape[0])
    return _call(build.GMM_TARGET, lhs, rhs, bounds, existing_out, out_dtype, existing_out_zero,
                 transpose_rhs=bool(transpose_rhs))


def tgmm_native_cpu(lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, out_dtype, tiling,
                    existing_out_zero=False, **_):
    check(lhs, rhs, out_dtype, tiling)
    bounds = local_group_boundaries(group_sizes, group_offset, num_groups, lhs.shape[1])
    return _call(build.TGMM_TARGET, lhs, rhs, bounds, existing_out, out_dtype, existing_out_zero)
