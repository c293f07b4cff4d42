"""What `conveyor compile-check` compiles: Conveyor's kernels as named, parameterised cases.

Design notes: docs/internals/core.md, section `compile_check/cases.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


class Context(Protocol):
    """Where a case is compiled (see `compile_check.device`)."""

    platform: str  # "cuda" or "tpu"
    backend: str  # "mosaic_gpu" or "mosaic_tpu"

    def mesh(
        self, shape: tuple[int, ...], names: tuple[str, ...], explicit: bool = False
    ) -> jax.sharding.Mesh: ...

    def array(self, shape, dtype, spec: P | None = None, mesh=None) -> jax.ShapeDtypeStruct: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One kernel configuration: `kind` names a builder below, `params` its arguments."""

    kind: str
    params: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        return self.kind + "".join(f" {k}={v}" for k, v in self.params)

    @property
    def devices(self) -> int:
        return dict(self.params).get("devices", 1)

    def build(self, ctx: Context) -> tuple[Callable, tuple]:
        return KINDS[self.kind](ctx, **dict(self.params))


def case(kind: str, **params) -> Case:
    """A case of `kind` with `params` (a ValueError names an unknown kind)."""
    if kind not in KINDS:
        raise ValueError(f"case: expected one of {', '.join(KINDS)}, got {kind!r}")
    return Case(kind=kind, params=tuple(params.items()))


def _gmm(
    ctx,
    *,
    m,
    k,
    n,
    groups,
    dtype="bf16",
    transpose_rhs=False,
    grad=False,
    sharded=False,
    batch=0,
):
    """cv.gmm (and with grad=True its backward: gmm with the transposed rhs, and tgmm).
    sharded=True places the operands with a NamedSharding on an explicit-axes mesh, as a model
    under `jax.set_mesh` does. batch > 0 vmaps it over `batch` group-size vectors (a loop of
    kernels writing slices of one stacked output)."""
    import conveyor as cv

    dt = DTYPES[dtype]
    mesh = ctx.mesh((1,), ("data",), explicit=True) if sharded else None
    spec = P() if sharded else None
    rhs_shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    args = (
        ctx.array((m, k), dt, spec, mesh),
        ctx.array(rhs_shape, dt, spec, mesh),
        ctx.array((groups,), jnp.int32, spec, mesh),
    )

    def fwd(x, w, s):
        return cv.gmm(
            x, w, s, backend=ctx.backend, preferred_element_type=dt, transpose_rhs=transpose_rhs
        )

    if batch:
        args = (*args[:2], ctx.array((batch, groups), jnp.int32, spec, mesh))
        fwd = jax.vmap(fwd, in_axes=(None, None, 0))
    if not grad:
        return fwd, args

    def loss(x, w, s):
        return jnp.sum(fwd(x, w, s).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1)), args


def _tgmm(ctx, *, m, k, n, groups, dtype="bf16"):
    """cv.tgmm: the weight gradient, one [k, n] product per group."""
    import conveyor as cv

    dt = DTYPES[dtype]

    def f(xt, dy, s):
        return cv.tgmm(xt, dy, s, backend=ctx.backend, preferred_element_type=dt)

    args = (ctx.array((k, m), dt), ctx.array((m, n), dt), ctx.array((groups,), jnp.int32))
    return f, args


def _ring(ctx, *, op, devices, shard, dim, bidirectional, grad=False, dtype="bf16", mesh_2d=False):
    """A ring collective matmul inside shard_map over `devices` chips; every per-device operand
    is `shard` x `shard`. op: "all_gather_matmul" (dim = gather_dim) or "matmul_reduce_scatter"
    (dim = scatter_dim). mesh_2d: the ring runs along one axis of a 2 x devices/2 mesh."""
    import conveyor as cv

    dt = DTYPES[dtype]
    shape, names = ((2, devices // 2), ("data", "x")) if mesh_2d else ((devices,), ("x",))
    mesh = ctx.mesh(shape, names)
    ring = devices // 2 if mesh_2d else devices
    s = shard
    if op == "all_gather_matmul":  # the gathered product is whole on every device
        lhs = ((s, s * ring), P(None, "x")) if dim == 1 else ((s * ring, s), P("x"))
        operands, out_spec = (lhs, ((s * ring if dim == 1 else s, s), P())), P()
    else:  # lhs [s, K/D] and rhs [K/D, s]: each device's partial product is [s, s]
        operands = (((s, s * ring), P(None, "x")), ((s * ring, s), P("x")))
        out_spec = P("x") if dim == 0 else P(None, "x")

    def local(a, b):
        fn = getattr(cv, op)
        kw = {"gather_dim" if op == "all_gather_matmul" else "scatter_dim": dim}
        return fn(a, b, axis_name="x", bidirectional=bidirectional, backend=ctx.backend, **kw)

    specs = tuple(spec for _, spec in operands)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)
    args = tuple(ctx.array(shape, dt, spec, mesh) for shape, spec in operands)
    if not grad:
        return sharded, args

    def loss(a, b):
        return jnp.sum(sharded(a, b).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1)), args


def _example(ctx, *, fn, m, k, n):
    """A pipelined matmul of examples/pipelined_matmul.py (a source checkout only)."""
    path = pathlib.Path(__file__).resolve().parents[3] / "examples" / "pipelined_matmul.py"
    if not path.exists():
        raise NotImplementedError(f"case example: needs a source checkout with {path}")
    spec = importlib.util.spec_from_file_location("pipelined_matmul", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    matmul = getattr(module, fn)
    args = (ctx.array((m, k), jnp.bfloat16), ctx.array((k, n), jnp.bfloat16))
    return (lambda x, y: matmul(x, y, backend=ctx.backend)), args


def _moe(ctx, *, tokens, d, f, experts, top_k, grad=False):
    """cv.moe.moe_ffn (bf16): routing, three gmm kernels, the combine; grad adds tgmm."""
    import conveyor as cv

    bf16 = jnp.bfloat16
    args = (
        ctx.array((tokens, d), bf16),
        ctx.array((d, experts), bf16),
        ctx.array((experts, d, f), bf16),
        ctx.array((experts, d, f), bf16),
        ctx.array((experts, f, d), bf16),
    )

    def fwd(*a):
        return cv.moe.moe_ffn(*a, top_k=top_k, backend=ctx.backend)[0]

    if not grad:
        return fwd, args
    return jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 2, 3, 4)), args


def _moe_ep(ctx, *, devices, tokens, d, f, experts, top_k, grad=False, overlap=None):
    """cv.moe.moe_ffn_expert_parallel (bf16) on a 2 x devices/2 data x expert mesh: the exact
    exchange (ragged_all_to_all) and three gmm kernels per device, or with `overlap` the plan's
    steps: overlap="peers" on TPU is one kernel (remote DMAs, the experts' grouped matmuls inside),
    elsewhere per-peer ragged sends and three gmm kernels per chunk; grad adds the backward pass
    (the XLA plan's, with tgmm). `tokens` is the whole batch, sharded over both axes."""
    import conveyor as cv

    bf16 = jnp.bfloat16
    mesh = ctx.mesh((2, devices // 2), ("data", "expert"))
    specs = (P(("data", "expert")), P(), P("expert"), P("expert"), P("expert"))
    shapes = ((tokens, d), (d, experts), (experts, d, f), (experts, d, f), (experts, f, d))
    args = tuple(ctx.array(shape, bf16, spec, mesh) for shape, spec in zip(shapes, specs))

    def layer(*a):
        return cv.moe.moe_ffn_expert_parallel(
            *a,
            top_k=top_k,
            axis_name="expert",
            loss_axes=("data", "expert"),
            backend=ctx.backend,
            overlap=overlap,
        )[0]

    fwd = jax.shard_map(
        layer, mesh=mesh, in_specs=specs, out_specs=P(("data", "expert")), check_vma=False
    )
    if not grad:
        return fwd, args
    return jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 2, 3, 4)), args


def _mpmd(ctx, *, rows, cols):
    """cv.mpmd_map on warpgroups (mosaic_gpu): one program writes x + 1 and signals a
    semaphore, the other waits on it; a [rows, cols] float32 operand. On TPU, one program on the
    chip's TensorCores (`_mpmd_tensorcores`)."""
    if ctx.platform == "tpu":
        return _mpmd_tensorcores(ctx, rows=rows, cols=cols)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    import conveyor as cv

    def signal(x, o, sems):
        o[...] = x[...] + 1.0
        cv.fence()
        cv.semaphore_signal(sems.at[0])

    def wait(x, o, sems):
        cv.semaphore_wait(sems.at[0])

    x = ctx.array((rows, cols), jnp.float32)
    call = cv.mpmd_map(
        [(cv.Mesh(a=1), signal), (cv.Mesh(b=1), wait)],
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[plgpu.SemaphoreType.REGULAR((1,))],
        compiler_params=plgpu.CompilerParams(),
        backend="mosaic_gpu",
        name="signal_wait",
    )
    return call, (x,)


def _mpmd_tensorcores(ctx, *, rows, cols):
    """cv.mpmd_map on mosaic_tpu: one program on a mesh of the chip's TensorCores (2 on v5p's
    megacore, 1 on v5e and v6e); each core doubles its [rows, cols] block through VMEM, and
    core 0 then signals every other core's semaphore, which each waits on."""
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    import conveyor as cv

    cores = ctx.devices[0].num_cores

    def program(x, o, buf, ready):
        core = lax.axis_index("core")
        pltpu.sync_copy(x.at[core], buf)
        buf[...] = buf[...] * 2.0
        pltpu.sync_copy(buf, o.at[core])
        for other in range(1, cores):

            @pl.when(core == 0)
            def _(other=other):
                pl.semaphore_signal(ready, 1, device_id={"core": other})

        @pl.when(core > 0)
        def _():
            pl.semaphore_wait(ready, 1)

    x = ctx.array((cores, rows, cols), jnp.float32)
    call = cv.mpmd_map(
        [(cv.Mesh(core=cores), program)],
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM((rows, cols), jnp.float32), pltpu.SemaphoreType.REGULAR],
        backend="mosaic_tpu",
        name="tensorcores",
    )
    return call, (x,)


def _gathered(ctx, *, tokens, top_k, k, n, groups, dtype="bf16", grad=False):
    """cv.gmm with lhs_indices: the tokens' rows gathered by the kernel (an MoE layer's first
    projection: tokens * top_k gathered rows)."""
    import conveyor as cv

    dt = DTYPES[dtype]
    args = (
        ctx.array((tokens, k), dt),
        ctx.array((groups, k, n), dt),
        ctx.array((groups,), jnp.int32),
        ctx.array((tokens * top_k,), jnp.int32),
    )

    def fwd(x, w, s, idx):
        return cv.gmm(x, w, s, lhs_indices=idx, backend=ctx.backend, preferred_element_type=dt)

    if not grad:
        return fwd, args

    def loss(x, w, s, idx):
        return jnp.sum(fwd(x, w, s, idx).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1)), args


def _scatter(ctx, *, tokens, top_k, k, n, groups, dtype="bf16", grad=False):
    """cv.gmm_scatter_add: an MoE layer's last projection and combine (tokens * top_k rows added,
    weighted by their gates, into their tokens' rows)."""
    import conveyor as cv

    dt = DTYPES[dtype]
    m = tokens * top_k
    args = (
        ctx.array((m, k), dt),
        ctx.array((groups, k, n), dt),
        ctx.array((groups,), jnp.int32),
        ctx.array((m,), jnp.int32),
        ctx.array((m,), jnp.float32),
    )

    def fwd(h, w, s, idx, gates):
        return cv.gmm_scatter_add(
            h,
            w,
            s,
            idx,
            num_out_rows=tokens,
            row_weights=gates,
            backend=ctx.backend,
            preferred_element_type=dt,
        )

    if not grad:
        return fwd, args

    def loss(h, w, s, idx, gates):
        return jnp.sum(fwd(h, w, s, idx, gates).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 4)), args


KINDS: dict[str, Callable] = {
    "gmm": _gmm,
    "tgmm": _tgmm,
    "ring": _ring,
    "example": _example,
    "moe": _moe,
    "moe_ep": _moe_ep,
    "mpmd": _mpmd,
    "gathered": _gathered,
    "scatter": _scatter,
}

MIXTRAL = dict(m=8192, k=4096, n=14336)
# expert parallelism on 8 chips: Mixtral-like (8 experts, top-2) and DeepSeek-like (narrow
# experts, top-8; 64 of them, not 256, to keep the compile short)
MIXTRAL_EP = dict(d=4096, f=14336, experts=8, top_k=2)
DEEPSEEK_EP = dict(d=7168, f=2048, experts=64, top_k=8)


def production() -> list[Case]:
    """The kernels at the sizes they exist for, on every platform they have a kernel for."""
    cases = [
        case("gmm", **MIXTRAL, groups=8),
        case("gmm", **MIXTRAL, groups=64),
        # 256 experts of Mixtral's width hold 30 GB of weights, over a v5e's HBM: many small
        # experts are narrow (DeepSeek-V3's expert FFN is 7168 x 2048).
        case("gmm", m=8192, k=4096, n=2048, groups=256),
        case("gmm", **MIXTRAL, groups=8, transpose_rhs=True),
        # under vmap: a loop of kernels, each writing a slice of one stacked output (an aliased
        # Mosaic GPU kernel must stay out of XLA:GPU's dynamic-slice fusion: "alias lost")
        case("gmm", m=1024, k=4096, n=2048, groups=8, batch=2),
        case("tgmm", **MIXTRAL, groups=8),
        case("tgmm", **MIXTRAL, groups=64),
        # an MoE layer's first projection with the tokens gathered in the kernel (Mixtral:
        # 8192 tokens, top-2; DeepSeek-like: narrow experts, top-8)
        case("gathered", tokens=8192, top_k=2, k=4096, n=14336, groups=8),
        case("gathered", tokens=8192, top_k=8, k=7168, n=2048, groups=64),
        case("gathered", tokens=8192, top_k=2, k=4096, n=14336, groups=8, grad=True),
        # its last projection with the combine in the kernel's epilogue
        case("scatter", tokens=8192, top_k=2, k=14336, n=4096, groups=8),
        case("scatter", tokens=8192, top_k=8, k=2048, n=7168, groups=64),
        case("scatter", tokens=8192, top_k=2, k=14336, n=4096, groups=8, grad=True),
        case("gmm", **MIXTRAL, groups=8, grad=True),
        case("gmm", **MIXTRAL, groups=8, grad=True, sharded=True),
        case("moe", tokens=8192, d=4096, f=14336, experts=8, top_k=2, grad=True),
        case("moe_ep", devices=8, tokens=8192, **MIXTRAL_EP, grad=True),
        case("moe_ep", devices=8, tokens=8192, **DEEPSEEK_EP, grad=True),
        # the overlapped exchange: on TPU the exchange kernel forward (remote DMAs around its own
        # grouped matmuls), the XLA plan backward; on GPU per-peer ragged sends around per-chunk
        # expert matmuls
        case("moe_ep", devices=8, tokens=8192, **MIXTRAL_EP, grad=True, overlap="peers"),
        case("moe_ep", devices=8, tokens=8192, **DEEPSEEK_EP, overlap="peers"),
        # 4096 tokens per chip (`cv.sim`'s MoE shapes): the rows reported are the programs'
        # temporaries in HBM, exact exchange against the per-peer kernel
        case("moe_ep", devices=8, tokens=32768, **DEEPSEEK_EP),
        case("moe_ep", devices=8, tokens=32768, **DEEPSEEK_EP, overlap="peers"),
        # staged by local expert (16 per chip in 8 stages), where per-peer chunks would re-read
        # the weights: its per-stage buffers are rematerialized to fit HBM
        case("moe_ep", devices=8, tokens=8192, **DEEPSEEK_EP, grad=True, overlap="experts"),
        # ... and its forward pass, where the simulator's fitted TPU copies are checked
        case("moe_ep", devices=8, tokens=8192, **DEEPSEEK_EP, overlap="experts"),
        case("example", fn="matmul", m=4096, k=4096, n=4096),
        case("example", fn="matmul_warp_specialized", m=4096, k=4096, n=4096),
        # 4000 rows: the last 64-row block is partial (a window of 32 rows)
        case("example", fn="matmul", m=4000, k=4096, n=4096),
        case("example", fn="matmul_warp_specialized", m=4000, k=4096, n=4096),
        case("mpmd", rows=64, cols=128),
        case("mpmd", rows=1024, cols=2048),  # TPU only: 8 MiB of VMEM per core
    ]
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        for devices in (4, 8):
            for shard in (1024, 4096, 8192):
                for dim in (0, 1):
                    for bidirectional in (False, True):
                        cases.append(
                            case(
                                "ring",
                                op=op,
                                devices=devices,
                                shard=shard,
                                dim=dim,
                                bidirectional=bidirectional,
                            )
                        )
        cases.append(
            case("ring", op=op, devices=8, shard=1024, dim=0, bidirectional=True, grad=True)
        )
        cases.append(
            case("ring", op=op, devices=8, shard=1024, dim=1, bidirectional=True, mesh_2d=True)
        )
        for dim in (0, 1):  # the interpreter tests' size: halves narrower than 128 lanes
            cases.append(
                case("ring", op=op, devices=4, shard=128, dim=dim, bidirectional=True, grad=True)
            )
    return cases


# The simulator's hardware model for each target.
SIM_HARDWARE = {"h100": "h100", "v5e": "v5e", "v6e": "v6e", "v5p": "v5p"}


def simulated_onchip(c: Case, target: str) -> int | None:
    """The on-chip bytes `cv.sim` counts for a single-kernel gmm / tgmm case (the kernel's own
    configuration on that hardware), which the compiler's report must match; None for the cases
    it does not model as one kernel (gradients, the MoE layers, rings, examples)."""
    p = dict(c.params)
    if c.kind not in ("gmm", "tgmm") or p.get("grad") or target not in SIM_HARDWARE:
        return None
    import conveyor as cv

    fn = cv.sim.simulate_gmm if c.kind == "gmm" else cv.sim.simulate_tgmm
    sizes = [p["m"] // p["groups"]] * p["groups"]
    report = fn(sizes, p["k"], p["n"], dtype=p.get("dtype", "bf16"), hardware=SIM_HARDWARE[target])
    return report.onchip_bytes


def simulated_xla_op_bytes(c: Case, target: str) -> int | None:
    """The bytes `cv.sim` prices for the XLA ops between the kernels of a forward moe_ep case
    (`sim.moe.xla_passes`), which the compiled program's (`device.xla_op_bytes`) is set beside;
    None for the other cases and for gradients (the simulator prices forward passes)."""
    p = dict(c.params)
    if c.kind != "moe_ep" or p.get("grad") or target not in SIM_HARDWARE:
        return None
    from conveyor.sim.hardware import get
    from conveyor.sim.moe import MoeShape, xla_passes

    devices = p["devices"] // 2  # the expert axis of the 2 x devices/2 mesh
    shape = MoeShape(
        name=c.name,
        tokens=p["tokens"] // p["devices"],
        **{k: p[k] for k in ("d", "f", "experts", "top_k")},
    )
    exchange = {None: "exact", "peers": "peers", "experts": "experts"}[p.get("overlap")]
    passes = xla_passes(shape, exchange, devices=devices, hw=get(SIM_HARDWARE[target]))
    return sum(passes.values())


def applies(c: Case, platform: str) -> bool:
    """Whether Conveyor has a kernel for case `c` on `platform` (rings are TPU-only; the
    warp-specialized pipeline runs on GPU warpgroups)."""
    if c.kind in ("ring", "gathered", "scatter"):  # mosaic_gpu moves no rows by index yet
        return platform == "tpu"
    if c.kind == "mpmd" and platform == "cuda":  # a warpgroup holds the whole operand in registers
        return dict(c.params)["rows"] * dict(c.params)["cols"] <= 64 * 128
    if c.kind == "example" and dict(c.params)["fn"] == "matmul_warp_specialized":
        return platform == "cuda"
    return True
