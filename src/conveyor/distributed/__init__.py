"""Running Conveyor across processes with JAX's own distributed engine (jax.distributed)."""

from conveyor.distributed.launch import ProcessFailed, launch_local

__all__ = ["launch_local", "ProcessFailed"]
