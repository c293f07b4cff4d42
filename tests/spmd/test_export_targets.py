"""The default backend follows the platform an op is lowered for, not the host's device.

One traced function exported for tpu carries the Pallas TPU kernel (a Mosaic custom call), for
cpu the xla loop, for cuda the Mosaic GPU kernel where it runs the call (16-bit operands within its
limits) and the xla loop otherwise; a multi-platform export holds both; an explicit `backend=` wins.
"""
import jax
import jax.numpy as jnp
import pytest

import conveyor as cv

ARGS = (jax.ShapeDtypeStruct((256, 128), jnp.float32), jax.ShapeDtypeStruct((4, 128, 128), jnp.float32),
        jax.ShapeDtypeStruct((4,), jnp.int32))


def _module(fn, platforms, args=ARGS):
    return jax.export.export(jax.jit(fn), platforms=platforms)(*args).mlir_module()


def _bf16_args(m=256, k=128, n=128, groups=4):
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups,), jnp.int32))


def _mosaic_gpu_calls(text):
    return text.count("custom_call @mosaic_gpu")


def _gmm_and_grad(backend=None):
    def fn(x, w, s):
        out = cv.gmm(x, w, s, backend=backend)
        return out, jax.grad(lambda x, w: jnp.sum(cv.gmm(x, w, s, backend=backend) ** 2), argnums=(0, 1))(x, w)
    return fn


@pytest.mark.parametrize("platforms, mosaic_tpu", [(["tpu"], True), (["cpu"], False), (["cuda"], False),
                                                   (["cpu", "tpu"], True)])
def test_default_backend_follows_the_export_platform(platforms, mosaic_tpu):
    text = _module(_gmm_and_grad(), platforms)   # float32 operands: mosaic_gpu does not take them
    assert ("tpu_custom_call" in text) == mosaic_tpu
    assert _mosaic_gpu_calls(text) == 0
    if platforms != ["tpu"]:
        assert "stablehlo.while" in text  # the xla loop of row tiles


def test_cuda_default_is_the_mosaic_gpu_kernel_for_16_bit_operands():
    """A bf16 training step exported for cuda runs the three grouped matmuls (forward gmm, the
    backward's gmm for lhs and tgmm for rhs, whose float32 cotangent is rounded to bf16) as Mosaic
    GPU kernels; the same exported for cpu has none."""
    grad = lambda x, w, s: jax.grad(lambda x, w: jnp.sum(cv.gmm(x, w, s) ** 2), argnums=(0, 1))(x, w)
    assert _mosaic_gpu_calls(_module(grad, ["cuda"], _bf16_args())) == 3
    assert _mosaic_gpu_calls(_module(grad, ["cpu"], _bf16_args())) == 0
    assert _mosaic_gpu_calls(_module(grad, ["cpu", "cuda"], _bf16_args())) == 3


@pytest.mark.parametrize("case, args, kwargs", [
    ("n off the kernel's multiples", _bf16_args(n=200), {}),
    ("k off the kernel's multiples", _bf16_args(k=120), {}),
    ("an upstream TPU tiling", _bf16_args(), dict(tiling=(512, 128, 128))),
    ("a float32 output is fine, float32 operands are not",
     (jax.ShapeDtypeStruct((256, 128), jnp.float32),) + _bf16_args()[1:], {}),
])
def test_cuda_default_falls_back_to_xla_where_mosaic_gpu_cannot_run(case, args, kwargs):
    fwd = lambda x, w, s: cv.gmm(x.astype(jnp.float32) if case.startswith("a float32") else x, w, s, **kwargs)
    text = _module(fwd, ["cuda"], args)
    if case.startswith("a float32"):
        # float32 lhs beside bf16 weights is the documented rounding rule: mosaic_gpu takes it
        assert _mosaic_gpu_calls(text) == 1
    else:
        assert _mosaic_gpu_calls(text) == 0 and "stablehlo.while" in text, case
        with pytest.raises(ValueError):   # named explicitly, the same call is refused, not redirected
            _module(lambda x, w, s: cv.gmm(x, w, s, backend="mosaic_gpu", **kwargs), ["cuda"], args)


def test_cuda_default_is_xla_for_float32_operands_of_tgmm():
    x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    y = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    s = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert _mosaic_gpu_calls(jax.export.export(jax.jit(cv.tgmm), platforms=["cuda"])(x, y, s).mlir_module()) == 0
    xb, yb = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in (x, y))
    assert _mosaic_gpu_calls(jax.export.export(jax.jit(cv.tgmm), platforms=["cuda"])(xb, yb, s).mlir_module()) == 1


class _FakeGpu:
    def __init__(self, capability):
        self.compute_capability = capability


@pytest.mark.parametrize("capabilities, runs", [(["9.0"], True), (["9.0", "9.0"], True), (["8.0"], False),
                                                (["9.0", "8.6"], False), (["10.0"], False)])
def test_cuda_default_needs_hopper_gpus(monkeypatch, capabilities, runs):
    """wgmma and TMA exist on compute capability 9.x only: a process that sees an A100 (8.0) or a
    Blackwell (10.0) lowers backend=None for cuda to xla."""
    from conveyor import backends
    monkeypatch.setattr(jax, "devices", lambda platform=None: [_FakeGpu(c) for c in capabilities])
    assert backends.local_gpus_run_wgmma() is runs
    assert backends.for_platform("cuda", ("xla", "mosaic_gpu")) == ("mosaic_gpu" if runs else "xla")
    assert backends.for_platform("rocm", ("xla", "mosaic_gpu")) == "xla"


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
