"""The default backend follows the platform an op is lowered for, not the host's device.

One traced function exported for tpu carries the Pallas TPU kernel (a Mosaic custom call), for
cpu and cuda the xla loop; a multi-platform export holds both; an explicit `backend=` wins.
"""
import jax
import jax.numpy as jnp
import pytest

import conveyor as cv

ARGS = (jax.ShapeDtypeStruct((256, 128), jnp.float32), jax.ShapeDtypeStruct((4, 128, 128), jnp.float32),
        jax.ShapeDtypeStruct((4,), jnp.int32))


def _module(fn, platforms):
    return jax.export.export(jax.jit(fn), platforms=platforms)(*ARGS).mlir_module()


def _gmm_and_grad(backend=None):
    def fn(x, w, s):
        out = cv.gmm(x, w, s, backend=backend)
        return out, jax.grad(lambda x, w: jnp.sum(cv.gmm(x, w, s, backend=backend) ** 2), argnums=(0, 1))(x, w)
    return fn


@pytest.mark.parametrize("platforms, mosaic_tpu", [(["tpu"], True), (["cpu"], False), (["cuda"], False),
                                                   (["cpu", "tpu"], True)])
def test_default_backend_follows_the_export_platform(platforms, mosaic_tpu):
    text = _module(_gmm_and_grad(), platforms)
    assert ("tpu_custom_call" in text) == mosaic_tpu
    if platforms != ["tpu"]:
        assert "stablehlo.while" in text  # the xla loop of row tiles


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
