"""A plain pipeline's caller-owned allocations and prefetches (`emit_pipeline(...).prefetch`):
the trace-time rules that keep a prefetch's copies from racing with, or being waited for by, the
wrong pipeline call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn

import jax


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PrefetchedBlocks:
    """What `run.prefetch(*refs, allocations=a)` issued: the first blocks of `pipeline`'s inputs,
    in flight into `a`. Hand it to that pipeline once, on the same allocations
    (`run(*refs, allocations=a, prefetched=...)`): it then waits for these copies instead of
    issuing its prologue. `claimed` records (at trace time) that it was handed over."""

    pipeline: Callable[..., Any]
    allocations: dict
    claimed: list = dataclasses.field(default_factory=list)


def _leaf_ids(allocations: Any) -> list[int]:
    return [id(leaf) for leaf in jax.tree_util.tree_leaves(allocations)]


def note_pending(ctx, allocations: Any, run: Callable[..., Any], prefetched: Any) -> None:
    """Refuse a pipeline on allocations that a prefetch is filling for a later call: its copies
    would land in slots this pipeline uses (a race). Record a new prefetch (`run` is None) or
    retire the one this call consumes."""
    stray = [
        ctx.pending_prefetches[k]
        for k in _leaf_ids(allocations)
        if k in ctx.pending_prefetches and ctx.pending_prefetches[k] is not prefetched
    ]
    if stray:
        raise ValueError(
            "allocations: a prefetch is filling these allocations for a later call of its "
            "pipeline; a pipeline (or another prefetch) on them now would race with its copies. "
            "Give the prefetched pipeline its own allocations, or consume the prefetch first"
        )
    for k in _leaf_ids(allocations):
        if run is None:
            ctx.pending_prefetches[k] = prefetched
        else:
            ctx.pending_prefetches.pop(k, None)


def claim(prefetched: Any, run: Callable[..., Any], allocations: dict | None) -> None:
    """A prefetch is consumed by the pipeline it was issued for, on its allocations, once: any
    other use would wait for copies nobody started (a hang on TPU)."""
    if not isinstance(prefetched, PrefetchedBlocks):
        raise TypeError(f"prefetched: expected what run.prefetch(...) returned, got {prefetched!r}")
    if prefetched.pipeline is not run:
        raise ValueError(
            "prefetched: these blocks were prefetched for another pipeline (run.prefetch of a "
            "different emit_pipeline); each pipeline waits only for its own prologue"
        )
    given = jax.tree_util.tree_leaves(allocations)
    issued = jax.tree_util.tree_leaves(prefetched.allocations)
    if (
        allocations is None
        or len(given) != len(issued)
        or any(a is not b for a, b in zip(given, issued))
    ):
        raise ValueError(
            "prefetched: the pipeline must run on the allocations its prefetch filled (run(*refs, "
            "allocations=a, prefetched=run.prefetch(*refs, allocations=a)))"
        )
    if prefetched.claimed:
        raise ValueError(
            "prefetched: this prefetch was already consumed by an earlier call of the pipeline; "
            "prefetch again before each call"
        )
    prefetched.claimed.append(True)


def refuse_gpu_allocations(what: str) -> NoReturn:
    raise NotImplementedError(
        f"emit_pipeline(...) {what} on mosaic_gpu: caller-owned allocations and prefetch of a "
        "plain pipeline are implemented on xla and mosaic_tpu; on GPU, chain "
        "cv.emit_pipeline_warp_specialized pipelines (pipeline_state=, allocations=)"
    )


def check_caller_allocations(ctx, allocations: Any) -> None:
    if ctx.backend == "xla" and allocations != {}:
        raise ValueError(
            "allocations: on xla a pipeline has no on-chip memory; pass what get_allocations "
            f"gives there ({{}}), got {allocations!r}"
        )
