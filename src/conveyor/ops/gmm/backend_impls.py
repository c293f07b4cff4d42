"""Dispatch of gmm/tgmm evaluation to the chosen backend, with its tiling resolved."""
from __future__ import annotations

from conveyor import backends
from conveyor.ops.gmm import reference, tiling as tiling_lib, xla

AVAILABLE = ("xla", "mosaic_tpu", "reference")             # what backend=None chooses from
GMM_BACKENDS = AVAILABLE + ("mosaic_gpu",)                 # named explicitly (not yet run on a GPU)
TGMM_BACKENDS = GMM_BACKENDS


def _mosaic_tpu():
    from conveyor.ops.gmm import mosaic_tpu  # Pallas import is deferred: it costs ~1 s
    return mosaic_tpu


def run_gmm(lhs, rhs, group_sizes, group_offset, existing_out, *, backend, tiling, interpret,
            transpose_rhs, out_dtype, platform="cpu"):
    if backend == backends.AUTO:
        backend = backends.for_platform(platform, AVAILABLE)
    m, k = lhs.shape
    n = existing_out.shape[1]
    kw = dict(transpose_rhs=transpose_rhs, out_dtype=out_dtype)
    if backend == "reference":
        return reference.gmm_reference(lhs, rhs, group_sizes, group_offset, existing_out, **kw)
    if backend == "xla":
        t = tiling_lib.resolve(tiling, m, k, n, (xla.GMM_TM, k, n))
        return xla.gmm_xla(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t, **kw)
    if backend == "mosaic_tpu":
        mod = _mosaic_tpu()
        t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.TPU_DEFAULT)
        return mod.gmm_mosaic_tpu(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t,
                                  interpret=interpret, **kw)
    if backend == "mosaic_gpu":
        from conveyor.ops.gmm import mosaic_gpu
        t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.MOSAIC_GPU.gmm_tiles_for(k, n, transpose_rhs=transpose_rhs))
        return mosaic_gpu.gmm_mosaic_gpu(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t,
                                         interpret=interpret, **kw)
    raise AssertionError(f"unknown backend {backend!r}")  # validated at the API


def run_tgmm(lhs, rhs, group_sizes, group_offset, existing_out, *, backend, tiling, interpret,
             num_groups, out_dtype, platform="cpu"):
    if backend == backends.AUTO:
        backend = backends.for_platform(platform, AVAILABLE)
    k, m = lhs.shape
    n = rhs.shape[1]
    kw = dict(num_groups=num_groups, out_dtype=out_dtype)
    if backend == "reference":
        return reference.tgmm_reference(lhs, rhs, group_sizes, group_offset, existing_out, **kw)
    if backend == "xla":
        t = tiling_lib.resolve(tiling, m, k, n, (xla.default_tgmm_tm(m, num_groups), k, n))
        return xla.tgmm_xla(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t, **kw)
    if backend == "mosaic_tpu":
        mod = _mosaic_tpu()
        t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.TPU_DEFAULT)
        return mod.tgmm_mosaic_tpu(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t,
                                   interpret=interpret, **kw)
    if backend == "mosaic_gpu":
        from conveyor.ops.gmm import mosaic_gpu_tgmm
        t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.MOSAIC_GPU.tgmm_tiles_for(n))
        return mosaic_gpu_tgmm.tgmm_mosaic_gpu(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t,
                                               interpret=interpret, **kw)
    raise AssertionError(f"unknown backend {backend!r}")
