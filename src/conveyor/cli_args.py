"""Argument types of the `conveyor` command: each parses one value or says, in one line, why not.

argparse turns the ArgumentTypeError raised here into `conveyor <cmd>: error: argument --x: <why>`
and exit status 2, so no bad value reaches the library as a traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from conveyor import dtypes


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def int_list(*, minimum: int, allow_empty: bool = False) -> Callable[[str], tuple[int, ...]]:
    """Comma-separated integers, each >= `minimum` ('' is the empty list only if `allow_empty`)."""

    def parse(text: str) -> tuple[int, ...]:
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        if not items and not allow_empty:
            raise argparse.ArgumentTypeError("expected comma-separated integers, got nothing")
        values = []
        for item in items:
            value = _int(item)
            if value < minimum:
                raise argparse.ArgumentTypeError(
                    f"every value must be >= {minimum}, got {value} in {text!r}"
                )
            values.append(value)
        return tuple(values)

    return parse


def dtype(text: str) -> str:
    """A dtype in the one vocabulary (bf16/bfloat16, f16/float16, f32/float32, ...): its long
    name."""
    try:
        return dtypes.canonical(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; known: {dtypes.known()}"
        ) from None


def measured_dtypes(text: str) -> tuple[str, ...]:
    """Comma-separated dtypes the benchmarks can measure (float32, bfloat16, float16, short names
    too)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated dtypes, got nothing")
    names = []
    for item in items:
        try:
            name = dtypes.canonical(item)
        except ValueError:
            name = None
        if name not in dtypes.MEASURED:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not benchmarked; Conveyor's matmuls take "
                f"{', '.join(dtypes.MEASURED)} (or bf16, f16, f32)"
            )
        names.append(name)
    return tuple(names)


def tiling(text: str) -> tuple[int, int, int]:
    """tm,tk,tn: cv.gmm's tiling order."""
    values = int_list(minimum=1)(text)
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected tm,tk,tn (cv.gmm's tiling order), got {text!r}")
    return values


def _names(text: str, known, what: str) -> tuple[str, ...]:
    """Comma-separated names, each one of `known`."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}s, got nothing")
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; known: {', '.join(known)}")
    return names


def gmm_backends(text: str) -> tuple[str, ...]:
    """Comma-separated cv.gmm backends."""
    from conveyor.ops.gmm.backend_impls import GMM

    return _names(text, GMM.names, "backend")


def hardware(text: str) -> str:
    """A hardware model's name (h100, h200, h800, b200, v5e, v6e, v5p; 'H100 SXM' and 'tpu-v5e'
    work too)."""
    from conveyor.sim.hardware import get

    try:
        get(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("hardware: ")) from None
    return text


def compile_targets(text: str) -> tuple[str, ...]:
    """Comma-separated compile-check targets (h100, v5e, v6e, v5p)."""
    from conveyor.compile_check.targets import TARGETS

    return _names(text, TARGETS, "target")
