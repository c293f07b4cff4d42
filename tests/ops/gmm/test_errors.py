"""Bad input: every case raises a clear error naming the argument."""

import jax
import jax.numpy as jnp
import pytest

import conveyor as cv

L = jnp.ones((10, 4), jnp.float32)
R = jnp.ones((2, 4, 3), jnp.float32)
GS = jnp.asarray([4, 6], jnp.int32)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: cv.gmm(jnp.ones((10,)), R, GS), ValueError, r"lhs: expected 2 dimensions"),
        (lambda: cv.gmm(L, jnp.ones((4, 3)), GS), ValueError, r"rhs: expected 3 dimensions"),
        (
            lambda: cv.gmm(L, jnp.ones((2, 5, 3)), GS),
            ValueError,
            r"rhs: contraction size must match lhs's k=4",
        ),
        (
            lambda: cv.gmm(L, jnp.ones((2, 3, 5)), GS, transpose_rhs=True),
            ValueError,
            r"rhs\.shape\[2\]",
        ),
        (
            lambda: cv.gmm(L, R, jnp.asarray([4, 3, 3])),
            ValueError,
            r"group_sizes: expected 2 groups",
        ),
        (
            lambda: cv.gmm(L, R, jnp.asarray([4.0, 6.0])),
            TypeError,
            r"group_sizes: expected an integer",
        ),
        (
            lambda: cv.gmm(L, R, jnp.asarray([[4, 6]])),
            ValueError,
            r"group_sizes: expected 1 dimensions",
        ),
        (
            lambda: cv.gmm(L, R, jnp.asarray([-1, 6])),
            ValueError,
            r"group_sizes: expected non-negative sizes, got \[-1, 6\]",
        ),
        (lambda: cv.gmm(L, R, jnp.asarray([8, 6])), ValueError, r"at most m=10 rows, got sum=14"),
        (
            lambda: cv.gmm(L, R, GS, group_offset=jnp.asarray([0, 1])),
            ValueError,
            r"group_offset: expected a scalar",
        ),
        (
            lambda: cv.gmm(L, R, GS, group_offset=1.5),
            TypeError,
            r"group_offset: expected an integer",
        ),
        (
            lambda: cv.gmm(L, R, jnp.asarray([1, 2, 3]), group_offset=2),
            ValueError,
            r"group_offset: expected 0 <= group_offset",
        ),
        (lambda: cv.gmm(L.astype(jnp.int32), R, GS), TypeError, r"lhs: expected dtype float32"),
        (lambda: cv.gmm(L, R.astype(jnp.int8), GS), TypeError, r"rhs: expected dtype"),
        (
            lambda: cv.gmm(L, R, GS, preferred_element_type=jnp.int32),
            TypeError,
            r"preferred_element_type",
        ),
        (
            lambda: cv.gmm(L, R, GS, tiling=(8, 0, 128)),
            ValueError,
            r"tiling: expected positive tile sizes",
        ),
        (
            lambda: cv.gmm(L, R, GS, tiling=(8, 128)),
            TypeError,
            r"tiling: expected None, a \(tm, tk, tn\)",
        ),
        (
            lambda: cv.gmm(L, R, GS, tiling=lambda m, k, n: (8, -1, 1)),
            ValueError,
            r"tiling\(10, 4, 3\) returned",
        ),
        (
            lambda: cv.gmm(L, R, GS, existing_out=jnp.ones((10, 4))),
            ValueError,
            r"existing_out: expected shape \(10, 3\)",
        ),
        (lambda: cv.gmm(L, R, GS, backend="triton"), ValueError, r"backend: expected one of"),
        (
            lambda: cv.tgmm(L.T, L, GS, backend="mosaic_gpu"),
            NotImplementedError,
            r"mosaic_gpu tgmm: wgmma takes bfloat16",
        ),
        (
            lambda: cv.gmm(L, R, GS, backend="mosaic_gpu"),
            NotImplementedError,
            r"wgmma takes bfloat16 or float16",
        ),
        (
            lambda: cv.gmm(L, R, GS, backend="xla", interpret=True),
            ValueError,
            r"interpret: only the mosaic_tpu",
        ),
        (lambda: cv.tgmm(L.T, jnp.ones((9, 3)), GS), ValueError, r"rhs: expected 10 rows"),
        (
            lambda: cv.tgmm(L.T, jnp.ones((10, 3)), GS, num_actual_groups=3),
            ValueError,
            r"num_actual_groups: expected 1 <=",
        ),
        (
            lambda: cv.tgmm(L.T, jnp.ones((10, 3)), GS, num_actual_groups=1.0),
            TypeError,
            r"num_actual_groups: expected a static int",
        ),
        (
            lambda: cv.tgmm(L.T, jnp.ones((10, 3)), GS, existing_out=jnp.ones((2, 4, 4))),
            ValueError,
            r"existing_out: expected shape \(2, 4, 3\)",
        ),
        (lambda: cv.tgmm(L, jnp.ones((4, 3)), GS), ValueError, r"at most m=4 rows"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_traced_sizes_are_not_validated_but_defined():
    # Under jit, concrete checks cannot run: the op must still work (see
    # test_traced_sizes_clip_at_m).
    out = jax.jit(lambda gs: cv.gmm(L, R, gs))(jnp.asarray([8, 6], jnp.int32))
    assert out.shape == (10, 3)
