"""The default backend follows the platform an op is lowered for, not the host's device.

One traced function exported for tpu carries the Pallas TPU kernel (a Mosaic custom call), for cpu
and cuda the xla loop (mosaic_gpu joins CUDA's default order once it has run on a GPU); a
multi-platform export holds both; an explicit `backend=` wins. Each implementation's `check` lets
backend=None pass by what it cannot run.
"""

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import conveyor as cv
from conveyor import backends

ARGS = (
    jax.ShapeDtypeStruct((256, 128), jnp.float32),
    jax.ShapeDtypeStruct((4, 128, 128), jnp.float32),
    jax.ShapeDtypeStruct((4,), jnp.int32),
)


def _module(fn, platforms, args=ARGS):
    return jax.export.export(jax.jit(fn), platforms=platforms)(*args).mlir_module()


def _bf16_args(m=256, k=128, n=128, groups=4):
    return (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    )


def _mosaic_gpu_calls(text):
    return text.count("custom_call @mosaic_gpu")


def _gmm_and_grad(backend=None):
    def fn(x, w, s):
        out = cv.gmm(x, w, s, backend=backend)
        return out, jax.grad(
            lambda x, w: jnp.sum(cv.gmm(x, w, s, backend=backend) ** 2), argnums=(0, 1)
        )(x, w)

    return fn


@pytest.mark.parametrize(
    "platforms, mosaic_tpu",
    [(["tpu"], True), (["cpu"], False), (["cuda"], False), (["cpu", "tpu"], True)],
)
def test_default_backend_follows_the_export_platform(platforms, mosaic_tpu):
    text = _module(_gmm_and_grad(), platforms)  # float32 operands: mosaic_gpu does not take them
    assert ("tpu_custom_call" in text) == mosaic_tpu
    assert _mosaic_gpu_calls(text) == 0
    if platforms != ["tpu"]:
        assert "stablehlo.while" in text  # the xla loop of row tiles


def test_cuda_default_is_xla_until_mosaic_gpu_has_run_on_a_gpu():
    """A bf16 training step exported for cuda runs the xla loop by default (mosaic_gpu has not yet
    passed `make gpu-check` on a GPU: see conveyor.backends); named, it runs the three grouped
    matmuls (forward gmm, the backward's gmm for lhs and tgmm for rhs) as Mosaic GPU kernels."""

    def grad(backend=None):
        return lambda x, w, s: jax.grad(
            lambda x, w: jnp.sum(cv.gmm(x, w, s, backend=backend) ** 2), argnums=(0, 1)
        )(x, w)

    assert backends.PLATFORM_DEFAULTS["cuda"] == ("xla",)
    default = _module(grad(), ["cuda"], _bf16_args())
    assert _mosaic_gpu_calls(default) == 0 and "stablehlo.while" in default
    assert _mosaic_gpu_calls(_module(grad("mosaic_gpu"), ["cuda"], _bf16_args())) == 3


@pytest.fixture
def mosaic_gpu_in_cudas_default(monkeypatch):
    """CUDA's default order as it will be once mosaic_gpu has passed on a GPU. JAX caches the
    lowerings of the ops' inner jitted functions, made under the real order: cleared around it."""
    jax.clear_caches()
    monkeypatch.setattr(
        backends, "PLATFORM_DEFAULTS", {**backends.PLATFORM_DEFAULTS, "cuda": ("mosaic_gpu", "xla")}
    )
    yield
    jax.clear_caches()


def test_a_default_order_with_mosaic_gpu_takes_it_for_16_bit_operands(mosaic_gpu_in_cudas_default):
    grad = lambda x, w, s: jax.grad(lambda x, w: jnp.sum(cv.gmm(x, w, s) ** 2), argnums=(0, 1))(
        x, w
    )
    assert _mosaic_gpu_calls(_module(grad, ["cuda"], _bf16_args())) == 3
    assert _mosaic_gpu_calls(_module(grad, ["cpu"], _bf16_args())) == 0
    assert _mosaic_gpu_calls(_module(grad, ["cpu", "cuda"], _bf16_args())) == 3


@pytest.mark.parametrize(
    "case, args, kwargs",
    [
        ("an upstream TPU tiling", _bf16_args(), dict(tiling=(512, 128, 128))),
        (
            "a float32 output is fine, float32 operands are not",
            (jax.ShapeDtypeStruct((256, 128), jnp.float32),) + _bf16_args()[1:],
            {},
        ),
    ],
)
def test_a_default_order_passes_by_what_mosaic_gpu_cannot_run(
    mosaic_gpu_in_cudas_default, case, args, kwargs
):
    """Each implementation's `check` decides, so backend=None falls through to xla; named
    explicitly, the same call is refused, not redirected."""
    fwd = lambda x, w, s: cv.gmm(
        x.astype(jnp.float32) if case.startswith("a float32") else x, w, s, **kwargs
    )
    text = _module(fwd, ["cuda"], args)
    if case.startswith("a float32"):
        # float32 lhs beside bf16 weights is the documented rounding rule: mosaic_gpu takes it
        assert _mosaic_gpu_calls(text) == 1
    else:
        assert _mosaic_gpu_calls(text) == 0 and "stablehlo.while" in text, case
        with pytest.raises(ValueError):
            _module(lambda x, w, s: cv.gmm(x, w, s, backend="mosaic_gpu", **kwargs), ["cuda"], args)


def test_a_default_order_takes_mosaic_gpu_for_k_and_n_off_its_tiles(mosaic_gpu_in_cudas_default):
    # k=120 and n=200 are padded to the kernel's 16-element rows, not sent to xla
    for args in (_bf16_args(n=200), _bf16_args(k=120)):
        assert _mosaic_gpu_calls(_module(lambda x, w, s: cv.gmm(x, w, s), ["cuda"], args)) == 1


def test_a_default_order_takes_tgmm_on_mosaic_gpu_for_16_bit_operands_only(
    mosaic_gpu_in_cudas_default,
):
    x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    y = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    s = jax.ShapeDtypeStruct((4,), jnp.int32)
    # a fresh function: no lowering cached under the usual default order
    tgmm = lambda *a: cv.tgmm(*a)
    assert _mosaic_gpu_calls(_module(tgmm, ["cuda"], (x, y, s))) == 0
    xb, yb = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in (x, y))
    assert _mosaic_gpu_calls(_module(tgmm, ["cuda"], (xb, yb, s))) == 1


def test_when_no_implementation_runs_the_error_lists_every_reason(monkeypatch):
    jax.clear_caches()
    monkeypatch.setattr(
        backends, "PLATFORM_DEFAULTS", {**backends.PLATFORM_DEFAULTS, "cuda": ("mosaic_gpu",)}
    )
    with pytest.raises(
        NotImplementedError,
        match=r"gmm lowered for cuda: no implementation in its default order "
        r"runs these arguments \(mosaic_gpu: .*float32.*\); name one "
        r"with backend=",
    ):
        _module(lambda x, w, s: cv.gmm(x, w, s), ["cuda"])


def test_rocm_and_cpu_default_to_xla():
    assert backends.PLATFORM_DEFAULTS["rocm"] == backends.PLATFORM_DEFAULTS["cpu"] == ("xla",)
    assert backends.PLATFORM_DEFAULTS["tpu"] == ("mosaic_tpu", "xla")


def test_explicit_backend_wins_over_the_platform():
    assert "tpu_custom_call" not in _module(_gmm_and_grad("xla"), ["tpu"])
    assert "tpu_custom_call" in _module(_gmm_and_grad("mosaic_tpu"), ["tpu"])


def test_tgmm_default_backend_follows_the_export_platform():
    fn = lambda x, w, s: cv.tgmm(x.T, x[:, :128], s)
    assert "tpu_custom_call" in _module(fn, ["tpu"])
    assert "tpu_custom_call" not in _module(fn, ["cpu"])


def test_default_backend_runs_on_the_host():
    x = jnp.ones((256, 128))
    w = jnp.ones((4, 128, 128))
    s = jnp.asarray([10, 20, 30, 40], jnp.int32)
    out = cv.gmm(x, w, s)
    assert float(out[:100].min()) == 128.0 and float(jnp.abs(out[100:]).max()) == 0.0


def test_cv_kernel_default_is_chosen_for_the_platform_lowered_for():
    """cv.kernel(backend=None) traces its body for both defaults and keeps, per lowering, the one
    of the platform lowered for: the Pallas TPU kernel exported for tpu from this CPU host, the xla
    loop for cpu and cuda. A named backend='xla' exports the loop anywhere."""
    spec = cv.BlockSpec((8, 128), lambda i: (i, 0))

    def body(x_ref, o_ref):
        def double(idx, xb, ob):
            ob[...] = 2.0 * xb[...]

        cv.emit_pipeline(double, grid=(4,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    default = jax.jit(cv.kernel(body, x))
    assert "tpu_custom_call" in _module(default, ["tpu"], (x,))
    assert "tpu_custom_call" not in _module(default, ["cpu", "cuda"], (x,))
    ones = jnp.ones((32, 128))
    np.testing.assert_array_equal(default(ones), 2.0 * ones)  # this CPU host runs the loop
    assert "tpu_custom_call" not in _module(
        jax.jit(cv.kernel(body, x, backend="xla")), ["tpu"], (x,)
    )


def test_cv_kernel_default_refused_by_tpu_fails_only_a_tpu_lowering():
    """A kernel mosaic_tpu cannot build (threads: a TPU core has no warpgroups) still runs and
    exports for cpu; lowered for tpu it fails with mosaic_tpu's reason, not with the loop."""

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    default = jax.jit(cv.kernel(body, x, num_threads=2, thread_name="t"))
    assert "stablehlo" in _module(default, ["cpu"], (x,))
    with pytest.raises(
        NotImplementedError,
        match=r"cv.kernel\(backend=None\) lowered for tpu: its default there, mosaic_tpu, "
        r"refused these arguments \(NotImplementedError: cv.kernel: num_threads is not "
        r"supported on mosaic_tpu",
    ):
        _module(default, ["tpu"], (x,))


def test_collective_default_is_chosen_per_lowering_platform():
    """The collective matmuls with backend=None choose when lowered: for tpu the Mosaic ring
    kernel, for cpu the xla ring (its ppermutes, no kernel); backend='xla' exports the ring for
    tpu on purpose."""
    import numpy as np
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, PartitionSpec as P

    cpu = Mesh(np.array(jax.devices()[:4]), ("x",))
    tpu = AbstractMesh(
        (4,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice("TPU v5 lite", 4, "tpu")
    )

    def ring(backend, mesh):
        def local(a, b):
            return cv.all_gather_matmul(a, b, axis_name="x", gather_dim=0, backend=backend)

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))

    args = (
        jax.ShapeDtypeStruct((32, 128), jnp.float32),
        jax.ShapeDtypeStruct((128, 128), jnp.float32),
    )
    on_cpu = _module(ring(None, cpu), ["cpu"], args)
    assert "tpu_custom_call" not in on_cpu and "collective_permute" in on_cpu
    assert "tpu_custom_call" in _module(ring(None, tpu), ["tpu"], args)
    assert "tpu_custom_call" not in _module(ring("xla", tpu), ["tpu"], args)


def test_collective_default_refused_on_one_platform_fails_only_its_lowering():
    """blocks= is honoured by the Mosaic ring only: with backend=None the TPU lowering takes them,
    a CPU one (here: an eager call) fails naming the xla ring's reason."""
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    fn = jax.shard_map(
        lambda a, b: cv.all_gather_matmul(
            a, b, axis_name="x", gather_dim=0, blocks=cv.RingBlocks(rows=8)
        ),
        mesh=mesh,
        in_specs=(P("x"), P()),
        out_specs=P("x"),
    )
    with pytest.raises(
        NotImplementedError,
        match=r"all_gather_matmul\(backend=None\) lowered for cpu: its default there, xla, "
        r"refused these arguments \(ValueError: blocks: only the mosaic_tpu ring kernels",
    ):
        fn(jnp.ones((32, 128)), jnp.ones((128, 128)))


def test_cv_kernel_default_refused_by_xla_fails_only_a_cpu_lowering():
    """The other way round: a kernel only mosaic_tpu can build (a DMA semaphore scratch) exports
    for tpu; lowered for cpu it fails naming xla's reason, before any of the Pallas kernel that
    stands in for the branch's types is lowered."""
    from jax.experimental.pallas import tpu as pltpu

    def body(x_ref, o_ref, sem):
        del sem
        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline(
            lambda idx, xb, ob: ob.__setitem__(..., xb[...]),
            grid=(1,),
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    default = jax.jit(cv.kernel(body, x, scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]))
    assert "tpu_custom_call" in _module(default, ["tpu"], (x,))
    with pytest.raises(
        NotImplementedError,
        match=r"cv.kernel\(backend=None\) lowered for cpu: its default there, xla, refused",
    ):
        _module(default, ["cpu"], (x,))
