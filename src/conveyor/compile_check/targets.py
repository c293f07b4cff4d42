"""The chips `conveyor compile-check` compiles for, and what each one allows."""

from __future__ import annotations

import dataclasses

MiB = 2**20

# An H100 SXM as XLA's GpuTargetConfigProto (text form), cut to the fields the 0.12 CUDA plugin's
# proto knows. Values are the vendor's (XLA's h100_sxm spec); Mosaic GPU reads the compute
# capability from it, ptxas the rest of the chip from the cubin's target (sm_90a).
H100_SXM_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  cuda_compute_capability { major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation" platform_version: "Compute Capability 9.0a"
  device_address_bits: 64 name: "NVIDIA H100 80GB HBM3"
  runtime_version: "12.9.0" compile_time_toolkit_version: "12.9.0" dnn_version: "9.10.0"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One chip: its JAX platform, compile-only topologies by device count, on-chip limits.

    Attributes:
      name: the name users pass (`--target`).
      platform: "cuda" or "tpu".
      topologies: device count -> topology name for `get_topology_desc`.
      onchip_default: bytes a kernel may use without asking (TPU: the default scoped VMEM
        limit; GPU: the shared memory one block may opt into).
      onchip_physical: bytes there are (TPU: physical VMEM, the most `vmem_limit_bytes` buys).
    """

    name: str
    platform: str
    topologies: dict[int, str]
    onchip_default: int
    onchip_physical: int

    @property
    def backend(self) -> str:
        return {"cuda": "mosaic_gpu", "tpu": "mosaic_tpu"}[self.platform]


# TPU VMEM: default scoped limits and physical sizes as libtpu 0.0.50 enforces them (measured by
# compiling over them; docs/compile-check.md). GPU: the H100's per-block shared-memory opt-in.
TARGETS = {
    t.name: t
    for t in (
        Target(
            name="h100",
            platform="cuda",
            topologies={1: "1x1x1", 8: "1x1x8"},
            onchip_default=232448,
            onchip_physical=232448,
        ),
        Target(
            name="v5e",
            platform="tpu",
            topologies={1: "v5e:1x1", 4: "v5e:2x2", 8: "v5e:2x4"},
            onchip_default=16 * MiB,
            onchip_physical=128 * MiB,
        ),
        Target(
            name="v6e",
            platform="tpu",
            topologies={1: "v6e:1x1", 4: "v6e:2x2", 8: "v6e:2x4"},
            onchip_default=32 * MiB,
            onchip_physical=128 * MiB,
        ),
        Target(
            name="v5p",
            platform="tpu",
            topologies={1: "v5p:1x1x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2"},
            onchip_default=16 * MiB,
            onchip_physical=64 * MiB,
        ),
    )
}


def target(name: str) -> Target:
    """The target called `name`; a ValueError listing the known ones otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {name!r}") from None
