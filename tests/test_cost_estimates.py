"""Every Mosaic kernel hands XLA a cost estimate computed from its shapes (without one XLA costs
a Pallas kernel at about 0 flops): read back from the exported program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P

import conveyor as cv
from conveyor._compat import gpu_kernel_takes_cost_estimate

BF16 = jnp.bfloat16
PLATFORM = {"mosaic_tpu": "tpu", "mosaic_gpu": "cuda"}


def _flops(fn, *args, platform):
    text = jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
    return [int(f) for f in re.findall(r"\\22flops\\22: ?(\d+)", text)]


def _struct(*shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(params=["mosaic_tpu", "mosaic_gpu"])
def backend(request):
    if request.param == "mosaic_gpu" and not gpu_kernel_takes_cost_estimate():
        pytest.skip("plgpu.kernel takes cost_estimate from jax 0.12 on")
    return request.param


def test_gmm_and_tgmm(backend):
    m, k, n, groups = 256, 128, 256, 4
    sizes = _struct(groups, dtype=jnp.int32)
    gmm = _flops(
        lambda x, w, s: cv.gmm(x, w, s, backend=backend),
        _struct(m, k),
        _struct(groups, k, n),
        sizes,
        platform=PLATFORM[backend],
    )
    tgmm = _flops(
        lambda xt, dy, s: cv.tgmm(xt, dy, s, backend=backend),
        _struct(k, m),
        _struct(m, n),
        sizes,
        platform=PLATFORM[backend],
    )
    assert gmm == [2 * m * k * n] and tgmm == [2 * k * m * n]


@pytest.mark.parametrize(
    "op, dim",
    [
        ("all_gather_matmul", 1),
        ("all_gather_matmul", 0),
        ("matmul_reduce_scatter", 0),
        ("matmul_reduce_scatter", 1),
    ],
)
def test_rings_count_one_devices_work(op, dim):
    devices = 4
    s = 512 if (op, dim) == ("matmul_reduce_scatter", 1) else 256  # 128-lane column blocks
    mesh = AbstractMesh(
        (devices,),
        ("x",),
        (AxisType.Auto,),
        abstract_device=AbstractDevice("TPU v5 lite", devices, "tpu"),
    )
    dim_arg = "gather_dim" if op == "all_gather_matmul" else "scatter_dim"
    local = lambda a, b: getattr(cv, op)(
        a, b, axis_name="x", backend="mosaic_tpu", **{dim_arg: dim}
    )
    if op == "all_gather_matmul":
        lhs = (
            (_struct(s, s * devices), P(None, "x"))
            if dim == 1
            else (_struct(s * devices, s), P("x"))
        )
        rhs = (_struct(s * devices if dim == 1 else s, s), P())
        out = P()
    else:
        lhs, rhs = (_struct(s, s * devices), P(None, "x")), (_struct(s * devices, s), P("x"))
        out = P("x") if dim == 0 else P(None, "x")
    fn = jax.shard_map(local, mesh=mesh, in_specs=(lhs[1], rhs[1]), out_specs=out, check_vma=False)
    # A gather multiplies every device's [s, s] shard on each device; a reduce-scatter computes
    # each device's own [s, s] x [s, s] partial products.
    products = devices if op == "all_gather_matmul" else 1
    assert _flops(fn, lhs[0], rhs[0], platform="tpu") == [products * 2 * s * s * s]


def test_kernel_takes_a_cost_estimate_and_refuses_other_types():
    estimate = jax.experimental.pallas.CostEstimate(flops=7, transcendentals=0, bytes_accessed=8)

    def body(x_ref, o_ref):
        def step(indices, x_block, o_block):
            o_block[...] = x_block[...]

        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline(step, grid=(1,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    call = cv.kernel(body, out, backend="mosaic_tpu", cost_estimate=estimate)
    assert _flops(call, out, platform="tpu") == [7]
    with pytest.raises(TypeError, match="cost_estimate must be a pl.CostEstimate or None, got 7"):
        cv.kernel(body, out, backend="xla", cost_estimate=7)
    # The documented rule on xla: the estimate is accepted and leaves the loop as it is.
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    with_estimate = cv.kernel(body, out, backend="xla", cost_estimate=estimate)
    np.testing.assert_array_equal(with_estimate(x), cv.kernel(body, out, backend="xla")(x))
