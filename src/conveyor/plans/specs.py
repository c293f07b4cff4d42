"""Pallas block specs read in the plan's terms: `cv.BlockSpec`, upstream's `pl.BlockSpec` and
`plgpu.BlockSpec`, their block-dimension kinds (`pl.Element`, `pl.BoundedSlice`, squeezed) and the
fields Conveyor honours (`pallas_options`) or refuses by name. `plans.pipeline.plan` reads its
specs through this module; nothing here decides a schedule."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import pallas as pl

from conveyor import _compat
from conveyor.plans.grid import Int


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """A block of an array visited by a pipeline: `block_shape` and `index_map(*grid_indices)`.

    `index_map` returns block indices (array offset = block index * block size per dimension);
    None means block 0 in every dimension, as upstream. A `None` in `block_shape` squeezes that
    dimension (block size 1, dropped from the block ref); a `pl.Element(n)` entry is a window of n
    whose index-map entry is an element offset, not a block index (ragged windows; see
    `conveyor.pipeline.lowering` for its bounds); a `pl.BoundedSlice(n)` entry is a window whose
    index-map entry is `pl.ds(start, size)`, size <= n (`PipelinePlan.window`);
    `block_shape=None` is the whole array as one block (fetched or written once).
    `transforms`: the block's shared-memory layout on mosaic_gpu (`plgpu.TilingTransform`,
    `plgpu.SwizzleTransform`, ...), as `plgpu.BlockSpec(transforms=...)`; see `OperandPlan`.
    """

    block_shape: tuple[int | None, ...] | None
    index_map: Callable[..., tuple[Int, ...]] | None = None
    transforms: tuple[Any, ...] = ()


def as_block_spec(spec: Any, name: str) -> BlockSpec:
    """Accept a cv.BlockSpec or a Pallas BlockSpec (anything with block_shape and index_map).

    Fields of Pallas BlockSpecs beyond those two are honoured or refused (`pallas_options`)."""
    if not (hasattr(spec, "block_shape") and hasattr(spec, "index_map")):
        raise TypeError(
            f"{name}: expected a cv.BlockSpec or pl.BlockSpec with block_shape and index_map, got "
            f"{spec!r}"
        )
    shape, imap = spec.block_shape, spec.index_map
    transforms = tuple(spec.transforms) if isinstance(spec, BlockSpec) else ()
    if shape is None:  # the whole array: its shape is known when the pipeline is called
        return BlockSpec(WHOLE_ARRAY, imap, transforms)
    return BlockSpec(tuple(shape), zeros_map(len(shape)) if imap is None else imap, transforms)


def _positive_int(dim: Any) -> bool:
    """A positive integer of any integer type (NumPy's too), not a bool."""
    try:
        return not isinstance(dim, bool) and operator.index(dim) > 0
    except TypeError:
        return False


def block_dimensions(
    shape: Sequence[Any], name: str
) -> tuple[tuple[int | None, ...], tuple[int, ...], tuple[int, ...]]:
    """A block shape's sizes (None: squeezed), the dimensions whose index-map entry is an element
    offset (`pl.Element(n)`) rather than a block index, and those whose entry is a `pl.ds(start,
    size)` window of at most n elements (`pl.BoundedSlice(n)`). Refused by name: `pl.Element` with
    padding (upstream's TPU pipeline refuses it too) and upstream's other kinds (`pl.Indirect`)."""
    sizes, elements, bounded = [], [], []
    for d, dim in enumerate(shape):
        if dim is None or isinstance(dim, pl.Squeezed):
            sizes.append(None)
        elif isinstance(dim, pl.Element):
            if tuple(dim.padding) != (0, 0):
                raise NotImplementedError(
                    f"{name}: block dimension {d} is {dim}: pl.Element with padding is not "
                    "supported; pad the array instead"
                )
            sizes.append(int(dim.block_size))
            elements.append(d)
        elif isinstance(dim, pl.Blocked):
            sizes.append(int(dim.block_size))
        elif isinstance(dim, pl.BoundedSlice):
            sizes.append(int(dim.block_size))
            bounded.append(d)
        elif _positive_int(dim):
            sizes.append(int(dim))
        elif isinstance(dim, pl.Indirect):
            raise NotImplementedError(
                f"{name}: block dimension {d} is {dim}: pl.Indirect (a gather / scatter window) is "
                "not supported; gather the rows into a contiguous array first"
            )
        else:
            raise ValueError(
                f"{name}: block dimension {d} is {dim!r}: expected a positive int, None / "
                "pl.squeezed, pl.Element(n) or pl.BoundedSlice(n)"
            )
    return tuple(sizes), tuple(elements), tuple(bounded)


WHOLE_ARRAY = ()  # `BlockSpec.block_shape` of a whole-array spec before its array's shape is known


def zeros_map(rank: int) -> Callable[..., tuple[int, ...]]:
    """Upstream's index map when a spec gives none: block 0 in every dimension."""
    return lambda *indices: (0,) * rank


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
    """What a Pallas BlockSpec asks of the pipeline beyond its block: its release delay (inputs),
    the buffer count of its `pipeline_mode` (None: not asked) and its GPU layout transforms."""

    delay_release: int = 0
    buffer_count: int | None = None
    use_lookahead: bool = False
    prefetched_count: int = 0
    transforms: tuple[Any, ...] = ()


def _is_default(value: Any, field: dataclasses.Field) -> bool:
    if field.default is not dataclasses.MISSING:
        return value == field.default
    if field.default_factory is not dataclasses.MISSING:
        return value == field.default_factory()
    return False


def pallas_options(spec: Any, name: str, is_input: bool) -> PallasOptions:
    """Read the fields of a Pallas BlockSpec (pl.BlockSpec, plgpu.BlockSpec) Conveyor honours and
    refuse, by name, every other field that is set: none is silently ignored.

    Honoured: an input's `delay_release` (the pipeline takes the largest asked);
    `pipeline_mode=pl.Buffered(n, use_lookahead=..., prefetched_count=...)`; `oob_fill_mode`
    ZEROS, PROMISE_IN_BOUNDS and UNDEFINED (Conveyor's zeros satisfy all three); `transforms`;
    `memory_space` naming a backend's on-chip memory (`pltpu.VMEM`, `plgpu.SMEM`). Refused: other
    memory spaces, `collective_axes`, other Buffered options, fields this version does not know."""
    if isinstance(spec, BlockSpec):
        return PallasOptions(transforms=tuple(spec.transforms))
    if not dataclasses.is_dataclass(spec):
        return PallasOptions()
    delay, count, lookahead, prefetched, transforms = 0, None, False, 0, ()
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name in ("block_shape", "index_map") or value is None or _is_default(value, field):
            continue
        where = f"{name}: {type(spec).__name__}.{field.name}={value!r}"
        if field.name == "delay_release":
            if not is_input:
                raise ValueError(
                    f"{where}: delay_release applies to inputs (it delays refilling an input "
                    "slot); an output has nothing to release"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: expected an int >= 0")
            delay = value
        elif field.name == "pipeline_mode":
            count, lookahead, prefetched = _buffering(value, where, is_input)
        elif field.name == "oob_fill_mode" and getattr(value, "name", None) in _OOB_MODES:
            continue
        elif field.name == "transforms":
            transforms = tuple(value)
        elif field.name == "memory_space":
            if onchip_backend(value) is None:
                raise ValueError(
                    f"{where} is not supported: Conveyor pipelines copy every block into the "
                    "backend's on-chip memory (pltpu.VMEM on TPU, plgpu.SMEM on GPU); name that "
                    "space or leave memory_space unset"
                )
        else:
            raise ValueError(
                f"{where} is not supported by Conveyor pipelines (it would be ignored); leave it "
                "unset"
            )
    return PallasOptions(
        delay_release=delay,
        buffer_count=count,
        use_lookahead=lookahead,
        prefetched_count=prefetched,
        transforms=transforms,
    )


# plgpu.OOBFillMode values the zero rule honours: ZEROS is it, PROMISE_IN_BOUNDS promises no
# out-of-bounds block, UNDEFINED leaves the padding unspecified.
_OOB_MODES = ("ZEROS", "PROMISE_IN_BOUNDS", "UNDEFINED")


def onchip_backend(memory_space: Any) -> str | None:
    """The Mosaic backend whose on-chip memory `memory_space` names (`pltpu.VMEM`: mosaic_tpu,
    `plgpu.SMEM`: mosaic_gpu), or None."""
    from jax.experimental.pallas import tpu as pltpu

    if memory_space is pltpu.VMEM:
        return "mosaic_tpu"
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if memory_space is plgpu.SMEM:
        return "mosaic_gpu"
    return None


def _buffering(mode: Any, where: str, is_input: bool) -> tuple[int, bool, int]:
    """`pl.Buffered(buffer_count, use_lookahead=..., prefetched_count=...)`: the slot count, whether
    the input fetches with lookahead (`conveyor.plans.fetch`) and how many of its first blocks the
    caller has already put in its slots (`OperandPlan.prefetched`); any other Buffered option is
    refused by name."""
    count = getattr(mode, "buffer_count", None)
    if not isinstance(count, int) or isinstance(count, bool):
        raise ValueError(
            f"{where} is not supported: only pl.Buffered(buffer_count) pipeline modes are"
        )
    lookahead = bool(getattr(mode, "use_lookahead", False))
    if lookahead and not is_input:
        raise ValueError(
            f"{where}: use_lookahead applies to inputs (it fetches future blocks early); an output "
            "has nothing to fetch"
        )
    prefetched = getattr(mode, "prefetched_count", 0)
    if isinstance(prefetched, bool) or not isinstance(prefetched, int) or prefetched < 0:
        raise ValueError(f"{where}: prefetched_count must be an int >= 0, got {prefetched!r}")
    if prefetched and not is_input:
        raise ValueError(
            f"{where}: prefetched_count applies to inputs (slots the caller filled before the "
            "pipeline); an output has nothing to fetch"
        )
    if prefetched > count:
        raise ValueError(
            f"{where}: prefetched_count={prefetched} must be at most buffer_count={count} (the "
            "prefetched blocks sit in the input's first slots)"
        )
    known = ("buffer_count", "use_lookahead", "prefetched_count")
    extra = (
        [
            f.name
            for f in dataclasses.fields(mode)
            if f.name not in known and not _is_default(getattr(mode, f.name), f)
        ]
        if dataclasses.is_dataclass(mode)
        else []
    )
    if extra:
        raise ValueError(
            f"{where}: Buffered options {extra} are not supported; only buffer_count, "
            "use_lookahead and prefetched_count are"
        )
    return count, lookahead, prefetched


def _is_spec(x: Any) -> bool:
    return isinstance(x, BlockSpec) or (hasattr(x, "block_shape") and hasattr(x, "index_map"))


def _is_no_block_spec(x: Any) -> bool:
    """Pallas's `pl.no_block_spec` (its class is private: read through conveyor._compat)."""
    return isinstance(x, _compat.pallas_core.NoBlockSpec)


def _unwindowed(spec: Any, name: str) -> bool:
    """Whether `spec` passes its operand to the body as it is, unwindowed: None,
    `pl.no_block_spec`, or a Pallas BlockSpec with a memory space and no block shape
    (e.g. `pl.BlockSpec(memory_space=pl.ANY)`)."""
    if spec is None or _is_no_block_spec(spec):
        return True
    if isinstance(spec, BlockSpec) or getattr(spec, "block_shape", ()) is not None:
        return False
    if getattr(spec, "memory_space", None) is None:
        return False  # a whole-array spec: one block, the array's shape
    if (
        getattr(spec, "index_map", None) is not None
        or getattr(spec, "pipeline_mode", None) is not None
    ):
        raise ValueError(
            f"{name}: an unwindowed spec (memory_space={spec.memory_space}, no block_shape) takes "
            "no index_map or pipeline_mode: the body gets the whole ref as it is"
        )
    return True


def flatten_specs(
    specs: Any, side: str
) -> tuple[tuple[Any, ...], tuple[str, ...], tuple[Any, ...]]:
    """Pytree specs, as upstream Pallas takes them: a sequence with one entry per operand (a
    single spec or pytree counts as one operand), each entry a pytree of block specs. Returns the
    flat specs (None for an unwindowed leaf: see `_unwindowed`), their names (`in[1]['w']`:
    operand index, then the pytree path) and each operand's tree structure."""
    operands = tuple(specs) if isinstance(specs, (list, tuple)) else (specs,)
    flat, names, trees = [], [], []
    for i, tree in enumerate(operands):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: x is None or _is_spec(x) or _is_no_block_spec(x)
        )
        for path, leaf in leaves:
            name = f"{side}[{i}]{jax.tree_util.keystr(path)}"
            flat.append(None if _unwindowed(leaf, name) else leaf)
            names.append(name)
        trees.append(treedef)
    return tuple(flat), tuple(names), tuple(trees)
