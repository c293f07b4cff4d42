"""Public collective matmuls (inside shard_map): validation, backend choice, autodiff.

The VJP of each is built from the other: the gradient of an all-gather matmul is a matmul
reduce-scatter (and an all-gather matmul for the stationary operand), and vice versa.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.backends import Implementation, Registry
from conveyor.lowering_guard import per_platform
from conveyor.ops.collective_matmul import reference, xla
from conveyor.plans.ring import RingBlocks, RingPlan, ring_plan
from conveyor.spmd import varying_axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingConfig:
    """One collective matmul call's configuration, validated by the public functions before it is
    built. Hashable: it is the static argument of the custom VJPs, and the backward pass derives
    its own (another dim and dtype, the same ring) with `derived`."""

    axis_name: Any
    size: int  # devices on the ring
    dim: int  # gather_dim or scatter_dim
    bidirectional: bool  # as requested; `plan` decides whether two directions are used
    buffering: int  # receive slots per stream (kernel backends)
    out_dtype: Any
    backend: str
    interpret: Any = None  # mosaic_tpu: None, or the interpreter's parameters
    blocks: RingBlocks = RingBlocks()  # mosaic_tpu: the VMEM blocks of each step's pipelines

    def plan(self, collective: str) -> RingPlan:
        """The ring plan every backend of this call follows."""
        return ring_plan(
            collective=collective,
            num_devices=self.size,
            bidirectional=self.bidirectional,
            buffering=self.buffering,
        )

    def derived(self, dim: int, dtype) -> RingConfig:
        """The same ring (backend included) for a derived op: another dim and output dtype."""
        return dataclasses.replace(self, dim=dim, out_dtype=jnp.dtype(dtype))


def _axis_size(axis_name) -> int:
    try:
        return lax.axis_size(axis_name)
    except (NameError, KeyError, ValueError) as e:
        raise ValueError(
            f"axis_name: {axis_name!r} is not a mesh axis of the enclosing shard_map ({e})"
        ) from e


def _choose(backend, interpret, registry: Registry) -> str | None:
    """The backend named (`interpret` implies mosaic_tpu), or None: chosen when lowered, per
    platform (`_run`). Every gather/scatter dimension and direction runs on every backend."""
    if backend is None and interpret:
        backend = "mosaic_tpu"
    if backend is None:
        return None
    impl = registry.get(backend)
    if interpret and not impl.interprets:
        raise ValueError(
            f"interpret: only the mosaic_tpu backend has an interpreter, got backend={impl.name!r}"
        )
    return impl.name


def _run(op, cfg, backend: str | None, registry: Registry, what: str, lhs, rhs):
    """`op(cfg(backend), lhs, rhs)`; with backend None, each lowering platform's default
    (`lowering_guard.per_platform`: TPU the Mosaic ring kernel, the others the xla ring)."""
    if backend is not None:
        return op(cfg(backend), lhs, rhs)
    launch = lambda name: functools.partial(op, cfg(name))  # noqa: E731
    return per_platform(launch, registry.names, f"{what}(backend=None)")(lhs, rhs)


def _check_blocks(blocks, backend: str) -> RingBlocks:
    """`blocks` (None: the default) for the backend that honours it, mosaic_tpu."""
    if blocks is None:
        return RingBlocks()
    if not isinstance(blocks, RingBlocks):
        raise TypeError(f"blocks: expected a cv.RingBlocks or None, got {blocks!r}")
    if backend != "mosaic_tpu":
        raise ValueError(
            f"blocks: only the mosaic_tpu ring kernels have VMEM blocks; backend={backend!r} would "
            f"ignore blocks={blocks!r}"
        )
    return blocks


def _check_common(lhs, rhs, buffering, op):
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not hasattr(x, "ndim") or x.ndim != 2:
            raise ValueError(
                f"{name}: expected a 2-D array, got shape {getattr(x, 'shape', type(x).__name__)}"
            )
    if isinstance(buffering, bool) or not isinstance(buffering, int) or buffering < 1:
        raise ValueError(
            f"buffering: expected an int >= 1 (receive buffers per direction), got {buffering!r}"
        )


def _out_dtype(lhs, rhs, preferred_element_type):
    return (
        jnp.dtype(preferred_element_type)
        if preferred_element_type is not None
        else jnp.result_type(lhs, rhs)
    )


def all_gather_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    axis_name,
    gather_dim: int = 1,
    bidirectional: bool = True,
    buffering: int = 2,
    preferred_element_type=None,
    backend: str | None = None,
    interpret=False,
    blocks: RingBlocks | None = None,
) -> jax.Array:
    """`jnp.dot(lax.all_gather(lhs, axis_name, axis=gather_dim, tiled=True), rhs)` as a ring.

    Call inside `shard_map` over `axis_name` (other mesh axes give independent rings).
      gather_dim=1: lhs [n, K/D] shards of the contraction, rhs [K, m] stationary -> [n, m].
      gather_dim=0: lhs [M/D, K] row shards, rhs [K, n] -> [M, n].
    `bidirectional` sends shards both ways (floor(D/2) steps; any ring size, odd included).
    `buffering` (>= 1) is the receive-buffer depth of kernel backends; the xla ring holds one
    shard in flight per direction whatever its value.
    `blocks` (mosaic_tpu only): the largest VMEM blocks of each step's matmul pipeline
    (`cv.RingBlocks`, 512 x 512 x 512 by default); operands, output and slots stay in HBM.
    """
    _check_common(lhs, rhs, buffering, "all_gather_matmul")
    if gather_dim not in (0, 1):
        raise ValueError(f"gather_dim: expected 0 or 1, got {gather_dim!r}")
    backend = _choose(backend, interpret, AGM)
    size = _axis_size(axis_name)
    want = size * lhs.shape[1] if gather_dim == 1 else lhs.shape[1]
    if rhs.shape[0] != want:
        what = (
            f"{size} devices x lhs.shape[1]={lhs.shape[1]}"
            if gather_dim == 1
            else f"lhs.shape[1]={lhs.shape[1]}"
        )
        raise ValueError(
            f"rhs: contraction size rhs.shape[0] must be {want} ({what}), got rhs shape "
            f"{tuple(rhs.shape)}"
        )
    cfg = lambda name: RingConfig(  # noqa: E731
        axis_name=axis_name,
        size=size,
        dim=gather_dim,
        bidirectional=bool(bidirectional),
        buffering=buffering,
        out_dtype=_out_dtype(lhs, rhs, preferred_element_type),
        backend=name,
        interpret=interpret or None,
        blocks=_check_blocks(blocks, name),
    )
    return _run(_agm, cfg, backend, AGM, "all_gather_matmul", lhs, rhs)


def matmul_reduce_scatter(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    axis_name,
    scatter_dim: int = 0,
    bidirectional: bool = True,
    buffering: int = 2,
    preferred_element_type=None,
    backend: str | None = None,
    interpret=False,
    blocks: RingBlocks | None = None,
) -> jax.Array:
    """`lax.psum_scatter(lhs @ rhs, axis_name, scatter_dimension=scatter_dim, tiled=True)` as a
    ring.

    Partial sums travel the ring: each device adds its partial for the block passing by. With
    `bidirectional`, the other output dimension is split in two halves travelling opposite ways
    (one direction when that dimension has a single element). `buffering` and `blocks`: as
    `all_gather_matmul`'s.
    """
    _check_common(lhs, rhs, buffering, "matmul_reduce_scatter")
    if scatter_dim not in (0, 1):
        raise ValueError(f"scatter_dim: expected 0 or 1, got {scatter_dim!r}")
    backend = _choose(backend, interpret, MRS)
    if lhs.shape[1] != rhs.shape[0]:
        raise ValueError(
            f"rhs: contraction size rhs.shape[0] must match lhs.shape[1]={lhs.shape[1]}, got rhs "
            f"shape {tuple(rhs.shape)}"
        )
    size = _axis_size(axis_name)
    dim = (lhs.shape[0], rhs.shape[1])[scatter_dim]
    if dim % size:
        raise ValueError(
            f"scatter_dim: the scattered dimension ({dim}) must be divisible by the ring size "
            f"{size}"
        )
    cfg = lambda name: RingConfig(  # noqa: E731
        axis_name=axis_name,
        size=size,
        dim=scatter_dim,
        bidirectional=bool(bidirectional),
        buffering=buffering,
        out_dtype=_out_dtype(lhs, rhs, preferred_element_type),
        backend=name,
        interpret=interpret or None,
        blocks=_check_blocks(blocks, name),
    )
    return _run(_mrs, cfg, backend, MRS, "matmul_reduce_scatter", lhs, rhs)


def _agm_mosaic_tpu(cfg: RingConfig, lhs, rhs):
    from conveyor.ops.collective_matmul import mosaic_tpu

    return mosaic_tpu.all_gather_matmul_mosaic_tpu(
        lhs,
        rhs,
        axis_name=cfg.axis_name,
        plan=cfg.plan("gather"),
        out_dtype=cfg.out_dtype,
        interpret=cfg.interpret,
        gather_dim=cfg.dim,
        blocks=cfg.blocks,
    )


def _mrs_mosaic_tpu(cfg: RingConfig, lhs, rhs):
    from conveyor.ops.collective_matmul import mosaic_tpu

    return mosaic_tpu.matmul_reduce_scatter_mosaic_tpu(
        lhs,
        rhs,
        axis_name=cfg.axis_name,
        plan=cfg.plan("scatter"),
        out_dtype=cfg.out_dtype,
        interpret=cfg.interpret,
        scatter_dim=cfg.dim,
        blocks=cfg.blocks,
    )


AGM = Registry(
    "all_gather_matmul",
    (
        Implementation(
            name="xla",
            run=lambda cfg, lhs, rhs: xla.all_gather_matmul_xla(
                lhs,
                rhs,
                axis_name=cfg.axis_name,
                size=cfg.size,
                gather_dim=cfg.dim,
                plan=cfg.plan("gather"),
                out_dtype=cfg.out_dtype,
            ),
        ),
        Implementation(name="mosaic_tpu", run=_agm_mosaic_tpu, interprets=True),
        Implementation(
            name="reference",
            run=lambda cfg, lhs, rhs: reference.all_gather_matmul_reference(
                lhs, rhs, axis_name=cfg.axis_name, gather_dim=cfg.dim, out_dtype=cfg.out_dtype
            ),
        ),
    ),
)
MRS = Registry(
    "matmul_reduce_scatter",
    (
        Implementation(
            name="xla",
            run=lambda cfg, lhs, rhs: xla.matmul_reduce_scatter_xla(
                lhs,
                rhs,
                axis_name=cfg.axis_name,
                size=cfg.size,
                scatter_dim=cfg.dim,
                plan=cfg.plan("scatter"),
                out_dtype=cfg.out_dtype,
            ),
        ),
        Implementation(name="mosaic_tpu", run=_mrs_mosaic_tpu, interprets=True),
        Implementation(
            name="reference",
            run=lambda cfg, lhs, rhs: reference.matmul_reduce_scatter_reference(
                lhs, rhs, axis_name=cfg.axis_name, scatter_dim=cfg.dim, out_dtype=cfg.out_dtype
            ),
        ),
    ),
)


def _run_agm(cfg: RingConfig, lhs, rhs):
    return AGM.get(cfg.backend).run(cfg, lhs, rhs)


def _run_mrs(cfg: RingConfig, lhs, rhs):
    return MRS.get(cfg.backend).run(cfg, lhs, rhs)


def _match_vma(ct, primal):
    """An operand that is the same on every device of an axis (e.g. a replicated rhs) gets the sum
    of all devices' cotangents, as JAX's own collectives do; otherwise its cotangent is local."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return lax.psum(ct, extra) if extra else ct


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _agm(cfg, lhs, rhs):
    return _run_agm(cfg, lhs, rhs)


def _agm_fwd(cfg, lhs, rhs):
    return _run_agm(cfg, lhs, rhs), (lhs, rhs)


def _agm_bwd(cfg, res, ct):
    lhs, rhs = res
    gather_dim = cfg.dim  # out = AG_gather_dim(lhs) @ rhs
    d_lhs = _mrs(cfg.derived(gather_dim, lhs.dtype), ct, rhs.T)
    d_rhs = _agm(cfg.derived(1 - gather_dim, rhs.dtype), lhs.T, ct)
    return _match_vma(d_lhs, lhs), _match_vma(d_rhs, rhs)


_agm.defvjp(_agm_fwd, _agm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mrs(cfg, lhs, rhs):
    return _run_mrs(cfg, lhs, rhs)


def _mrs_fwd(cfg, lhs, rhs):
    return _run_mrs(cfg, lhs, rhs), (lhs, rhs)


def _mrs_bwd(cfg, res, ct):
    lhs, rhs = res
    scatter_dim = cfg.dim
    # d partial = all_gather(ct) along scatter_dim; both gradients are all-gather matmuls.
    d_lhs = _agm(cfg.derived(scatter_dim, lhs.dtype), ct, rhs.T)
    d_rhs = _agm(cfg.derived(1 - scatter_dim, rhs.dtype), ct.T, lhs).T
    return _match_vma(d_lhs, lhs), _match_vma(d_rhs, rhs)


_mrs.defvjp(_mrs_fwd, _mrs_bwd)
