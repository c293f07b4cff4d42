"""`cv.kernel(input_output_aliases=...)`: an output that starts as an input, on every backend.

The kernel's pipeline writes only the first rows of the output; every other row must hold the
aliased input's values (without the alias they would be poison on xla and uninitialized memory
on the Mosaic backends). The mosaic backends run in their interpreters with race detection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

INTERPRET = {
    "xla": False,
    "mosaic_tpu": pltpu.InterpretParams(detect_races=True),
    "mosaic_gpu": gpu_interpret(detect_races=True),
}


def _doubled_head(rows_written):
    def k(x_ref, start_ref, o_ref):
        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))

        def body(idx, xb, ob):
            ob[...] = xb[...] * 2.0

        cv.emit_pipeline(
            body,
            grid=(rows_written // 8,),
            in_specs=[spec],
            out_specs=[spec],
            max_concurrent_steps=2,
        )(x_ref, o_ref)

    return k


@pytest.mark.parametrize("backend", list(INTERPRET))
def test_unwritten_rows_keep_the_aliased_input(backend):
    rng = np.random.default_rng(4733)
    x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
    start_values = rng.standard_normal((32, 128)).astype(np.float32)
    start = jnp.asarray(start_values)
    f = cv.kernel(
        _doubled_head(16),
        jax.ShapeDtypeStruct((32, 128), jnp.float32),
        backend=backend,
        interpret=INTERPRET[backend],
        input_output_aliases={1: 0},
    )
    out = jax.jit(f)(x, start)
    np.testing.assert_array_equal(out[:16], x[:16] * 2.0)
    np.testing.assert_array_equal(out[16:], start_values[16:])
    np.testing.assert_array_equal(start, start_values)  # the caller's array is not modified


@pytest.mark.parametrize("platform, backend", [("cuda", "mosaic_gpu"), ("tpu", "mosaic_tpu")])
def test_the_alias_is_in_place_in_the_exported_kernel(platform, backend):
    f = cv.kernel(
        _doubled_head(16),
        jax.ShapeDtypeStruct((32, 128), jnp.float32),
        backend=backend,
        input_output_aliases={1: 0},
    )
    x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    assert (
        "output_operand_alias"
        in jax.export.export(jax.jit(f), platforms=[platform])(x, x).mlir_module()
    )


def test_bad_aliases_are_refused_by_name():
    out = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    x = jnp.zeros((32, 128), jnp.float32)
    with pytest.raises(TypeError, match="cv.kernel: input_output_aliases must be a dict"):
        cv.kernel(_doubled_head(16), out, input_output_aliases=[(1, 0)])
    with pytest.raises(ValueError, match="maps inputs 0 and 1 to output 0"):
        cv.kernel(_doubled_head(16), out, input_output_aliases={0: 0, 1: 0})
    for backend in INTERPRET:
        f = cv.kernel(
            _doubled_head(16),
            out,
            backend=backend,
            interpret=INTERPRET[backend],
            input_output_aliases={2: 0},
        )
        with pytest.raises(
            ValueError,
            match=r"input_output_aliases \{2: 0\} is out of range \(2 inputs, 1 outputs\)",
        ):
            f(x, x)
        f = cv.kernel(
            _doubled_head(16),
            out,
            backend=backend,
            interpret=INTERPRET[backend],
            input_output_aliases={1: 0},
        )
        with pytest.raises(
            ValueError,
            match=r"input 1 \(float32\[32, 64\]\) cannot alias output 0 "
            r"\(float32\[32, 128\]\)",
        ):
            f(x, jnp.zeros((32, 64), jnp.float32))
