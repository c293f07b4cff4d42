"""Dispatch of gmm/tgmm evaluation to the chosen backend, with its tiling resolved."""
from __future__ import annotations

from conveyor import backends
from conveyor.ops.gmm import reference, tiling as tiling_lib, xla

GMM_BACKENDS = ("xla", "mosaic_tpu", "mosaic_gpu", "reference")
TGMM_BACKENDS = GMM_BACKENDS


def auto_backend(platform: str, mosaic_gpu_takes) -> str:
    """backend=None, for the platform being lowered for: mosaic_tpu on TPU; on CUDA (Hopper, or a
    host exporting for cuda) mosaic_gpu when `mosaic_gpu_takes()` says the kernel runs these
    operands (16-bit, or float32 beside 16-bit; shapes and tiling within its limits), else xla;
    xla on CPU. The fallback is the documented rule of `cv.gmm`'s `backend` argument, not an
    error: the xla backend computes the same result for every input."""
    backend = backends.for_platform(platform, GMM_BACKENDS)
    if backend == "mosaic_gpu" and not mosaic_gpu_takes():
        return "xla"
    return backend


def _accepted(check) -> bool:
    """Whether `check()` passes the kernel's argument checks (their ValueError and
    NotImplementedError are its refusals)."""
    try:
        check()
    except (ValueError, NotImplementedError):
        return False
    return True


def _mosaic_gpu_gmm_tile(tiling, m, k, n, transpose_rhs):
    return tiling_lib.resolve(tiling, m, k, n, tiling_lib.MOSAIC_GPU.gmm_tiles_for(k, n, transpose_rhs=transpose_rhs))


def _mosaic_gpu_tgmm_tile(tiling, m, k, n):
    return tiling_lib.resolve(tiling, m, k, n, tiling_lib.MOSAIC_GPU.tgmm_tiles_for(n))


def _mosaic_tpu():
    from conveyor.ops.gmm import mosaic_tpu  # Pallas import is deferred: it costs ~1 s
    return mosaic_tpu


def run_gmm(lhs, rhs, group_sizes, group_offset, existing_out, *, backend, tiling, interpret,
            transpose_rhs, out_dtype, platform="cpu"):
    m, k = lhs.shape
    n = existing_out.shape[1]
    if backend == backends.AUTO:
        def mosaic_gpu_takes():
            from conveyor.ops.gmm import mosaic_gpu
            return _accepted(lambda: mosaic_gpu.check_gmm_args(
                *mosaic_gpu.wgmma_operands("gmm", lhs, rhs), _mosaic_gpu_gmm_tile(tiling, m, k, n, transpose_rhs),
                transpose_rhs))
        backend = auto_backend(platform, mosaic_gpu_takes)
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
        t = _mosaic_gpu_gmm_tile(tiling, m, k, n, transpose_rhs)
        return mosaic_gpu.gmm_mosaic_gpu(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t,
                                         interpret=interpret, **kw)
    raise AssertionError(f"unknown backend {backend!r}")  # validated at the API


def run_tgmm(lhs, rhs, group_sizes, group_offset, existing_out, *, backend, tiling, interpret,
             num_groups, out_dtype, platform="cpu"):
    k, m = lhs.shape
    n = rhs.shape[1]
    if backend == backends.AUTO:
        def mosaic_gpu_takes():
            from conveyor.ops.gmm import mosaic_gpu, mosaic_gpu_tgmm
            return _accepted(lambda: mosaic_gpu_tgmm.check_tgmm_args(
                *mosaic_gpu.wgmma_operands("tgmm", lhs, rhs), _mosaic_gpu_tgmm_tile(tiling, m, k, n)))
        backend = auto_backend(platform, mosaic_gpu_takes)
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
        t = _mosaic_gpu_tgmm_tile(tiling, m, k, n)
        return mosaic_gpu_tgmm.tgmm_mosaic_gpu(lhs, rhs, group_sizes, group_offset, existing_out, tiling=t,
                                               interpret=interpret, **kw)
    raise AssertionError(f"unknown backend {backend!r}")
