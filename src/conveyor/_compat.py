"""Private JAX names Conveyor uses, imported here and nowhere else, and probes of the installed jax.

Design notes: docs/internals/core.md, section `_compat.py`.
"""

from __future__ import annotations

import inspect

from jax._src import api_util, core, dispatch  # noqa: F401  (re-exported)
from jax._src import config as _config
from jax._src.lax import control_flow, parallel  # noqa: F401
from jax._src.pallas import core as pallas_core  # noqa: F401
from jax._src.pallas import primitives as pallas_primitives  # noqa: F401
from jax._src.pjit import jit_p  # noqa: F401
from jax._src.state import primitives as state_primitives  # noqa: F401
from jax._src.state.discharge import initial_style_jaxpr  # noqa: F401

# (no public alias)
from jax._src.state.discharge import run_state_reference as run_state  # noqa: F401
from jax._src.state.indexing import NDIndexer, Slice  # noqa: F401
from jax._src.state.types import AbstractRef, TransformedRef, WriteEffect  # noqa: F401
from jax.extend.core import Primitive  # noqa: F401
from jax.interpreters import ad, batching, mlir  # noqa: F401
from jax._src.interpreters.batching import BatchTracer  # noqa: F401  (no public alias)

is_undefined_primal = ad.is_undefined_primal
Zero = ad.Zero
check_vma = _config._check_vma  # the switch of shard_map's varying-axes checks


# ---- loaded on first use: `import conveyor` does not load Mosaic GPU nor the interpreters --------


def pallas_gpu_core():
    """jax._src.pallas.mosaic_gpu.core (plgpu.Barrier's class)."""
    from jax._src.pallas.mosaic_gpu import core as gpu_core

    return gpu_core


def tpu_interpreter_shared_memory():
    """The Pallas TPU interpreter's shared state (semaphores, their waits and its failure check)."""
    from jax._src.pallas.mosaic.interpret import shared_memory

    return shared_memory


def tpu_interpreter_race_state():
    """The Pallas TPU (and GPU) interpreters' race-detection state."""
    from jax._src.pallas.mosaic.interpret import race_detection_state

    return race_detection_state


def gpu_interpreter_shared_memory():
    """The Mosaic GPU interpreter's shared state (barriers)."""
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    return shared_memory


def gpu_interpreter_callbacks():
    """The Mosaic GPU interpreter's callbacks (its end-of-kernel barrier check, its state reset)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return gpu_callbacks


def cuda_toolkit_path() -> str | None:
    """The folder of the nvidia-cuda-nvcc wheel jaxlib found (bin/ptxas), or None."""
    try:
        from jax._src.lib import cuda_path
    except ImportError:
        return None
    return cuda_path


# ---- what the installed jax can do ---------------------------------------------------------------


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def gpu_kernel_takes_cost_estimate() -> bool:
    """plgpu.kernel has `cost_estimate` (jax >= 0.12)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return _accepts(plgpu.kernel, "cost_estimate")


def interpreter_raises_on_race() -> bool:
    """The Pallas interpreters raise on a detected race by themselves (jax >= 0.12: `on_race`)."""
    import dataclasses

    cls = tpu_interpreter_race_state().RaceDetectionState
    return "on_race" in {f.name for f in dataclasses.fields(cls)}


def gpu_kernel_options(*, cost_estimate=None, kernel_name: str | None = None) -> dict:
    """Keyword arguments for `plgpu.kernel`: `cost_estimate` exists from jax 0.12 on; on older jax
    a given one is refused by name rather than dropped."""
    import jax

    options = {"kernel_name": kernel_name} if kernel_name else {}
    if cost_estimate is not None:
        if not gpu_kernel_takes_cost_estimate():
            raise NotImplementedError(
                "cost_estimate on mosaic_gpu needs jax >= 0.12 (plgpu.kernel of jax "
                f"{jax.__version__} has no cost_estimate); leave it out on this jax"
            )
        options["cost_estimate"] = cost_estimate
    return options
