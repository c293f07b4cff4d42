"""The suite's one rule for comparing two float evaluations of the same sums.

Two evaluations of an n-term sum (a dot product of length n, a reduction) in the same precision
but different summation orders differ by their rounding errors. Each rounding is at most eps/2
relative; independent roundings add like a random walk, so one evaluation's error stays within
a few standard deviations of eps/2 * sqrt(n) * scale, where `scale` is the largest magnitude the
partial sums reach (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., sec. 2.8 and
4.2). FACTOR = 16 = 2 (both sides round) x 2 (a dot rounds its product and its sum) x 4 (standard
deviations of margin, with eps/2 rounded up to eps). A result rounded to a narrower `out_dtype`
adds its own rounding, up to eps_out relative to the value, per side.
"""

import jax.numpy as jnp
import numpy as np

FACTOR = 16


def sum_tolerance(n: int, scale, acc_dtype=np.float32, expected=None, out_dtype=None):
    """Bound on |a - b| for two evaluations of n-term sums accumulated in `acc_dtype`; with
    `expected` and `out_dtype`, plus both sides' rounding of the result to `out_dtype`."""
    bound = (
        FACTOR
        * float(jnp.finfo(acc_dtype).eps)
        * np.sqrt(max(n, 1))
        * np.asarray(scale, np.float64)
    )
    if out_dtype is not None:
        bound = bound + 2 * float(jnp.finfo(out_dtype).eps) * np.abs(
            np.asarray(expected, np.float64)
        )
    return bound


def matmul_tolerance(a, b, acc_dtype=np.float32):
    """`sum_tolerance` for a @ b computed in another order: n is the contraction length and
    `scale` the largest magnitude a partial sum of the exact (float64) products reaches."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    partial = np.cumsum(a[:, :, None] * b[None, :, :], axis=1)
    return sum_tolerance(a.shape[1], np.abs(partial).max(), acc_dtype)
