"""Compile one case for one target in this process, through the vendor's compiler, and read
back what it reports (GPU: registers, spills, shared memory; TPU: scoped VMEM).

Run in a process of its own per case (`compile_check.run`): the GPU dump folder is read from
the environment when the first kernel compiles, and an LLVM fatal error ends the process.
"""

from __future__ import annotations

import dataclasses

import math
import os
import re
import shutil
import subprocess
import time
from typing import Any

from conveyor.compile_check.cases import Case
from conveyor.compile_check.targets import Target


class MissingToolchain(RuntimeError):
    """The compiler for a target is not installed in this Python environment."""


TOOLCHAINS = {
    "cuda": (
        "jax_cuda12_plugin",
        "jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12, nvidia-nvjitlink-cu12",
        "scripts/compile_env.sh cuda",
    ),
    "tpu": ("libtpu", "libtpu (jax[tpu])", "scripts/compile_env.sh tpu"),
}


def installed(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def require_toolchain(target: Target) -> None:
    """A MissingToolchain naming what to install unless `target`'s compiler is importable."""
    module, packages, script = TOOLCHAINS[target.platform]
    if not installed(module):
        raise MissingToolchain(
            f"target {target.name} needs {packages} at this jax's version, not installed in this "
            f"Python; `{script}` makes that environment (make compile-check uses it)"
        )


class _Context:
    """The compile-only devices of one topology (see `cases.Context`)."""

    def __init__(self, target: Target, devices: int):
        import jax
        from jax.experimental import topologies

        from conveyor.compile_check.targets import H100_SXM_CONFIG

        if devices not in target.topologies:
            raise ValueError(
                f"devices: {target.name} is compiled for {sorted(target.topologies)} chips, got "
                f"{devices}"
            )
        topology = target.topologies[devices]
        if target.platform == "cuda":
            desc = topologies.get_topology_desc(
                platform="cuda", target_config=H100_SXM_CONFIG, topology=topology
            )
        else:
            desc = topologies.get_topology_desc(topology, "tpu")
        self.platform, self.backend = target.platform, target.backend
        self.devices = list(desc.devices)
        self.case_mesh = None  # the last mesh the case asked for: compiled under it
        self._jax = jax

    def mesh(self, shape, names, explicit=False):
        import numpy as np

        sharding = self._jax.sharding
        grid = np.array(self.devices[: int(np.prod(shape))]).reshape(shape)
        kinds = (sharding.AxisType.Explicit if explicit else sharding.AxisType.Auto,) * len(shape)
        self.case_mesh = sharding.Mesh(grid, names, axis_types=kinds)
        return self.case_mesh

    def array(self, shape, dtype, spec=None, mesh=None):
        jax = self._jax
        if spec is None:
            sharding = jax.sharding.SingleDeviceSharding(self.devices[0])
        else:
            sharding = jax.sharding.NamedSharding(mesh or self.mesh((1,), ("x",)), spec)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compile_case(case: Case, target: Target, dump_dir: str) -> dict[str, Any]:
    """Lower and compile `case` for `target`. Returns {"status": "compiled" | "refused" |
    "failed", "error", "seconds", "kernels": [per-kernel report]}. "refused" is Conveyor's own
    error (a ValueError or NotImplementedError raised while tracing); "failed" is the
    compiler's (or any other) error."""
    import jax

    require_toolchain(target)
    t0 = time.perf_counter()
    ctx = _Context(target, case.devices)
    fn, args = case.build(ctx)
    mesh = ctx.case_mesh or ctx.mesh((len(ctx.devices),), ("chips",))
    result: dict[str, Any] = {"kernels": []}
    try:
        with jax.set_mesh(mesh):  # Pallas' TPU lowering asks the mesh for the chip
            lowered = jax.jit(fn).lower(*args)
    except (ValueError, NotImplementedError) as e:
        status = "refused" if raised_by_conveyor(e) else "failed"
        result.update(status=status, error=f"{type(e).__name__}: {e}")
    else:
        try:
            compiled = lowered.compile()
        except Exception as e:  # the compiler's verdict is the point: record it
            result.update(status="failed", error=f"{type(e).__name__}: {e}")
        else:
            result["status"] = "compiled"
            hlo = compiled.as_text()
            if case.devices > 1:
                result["collectives"] = collectives(hlo)
                result["hbm_temp"] = temporaries(compiled)
                result["bytes_accessed"] = bytes_accessed(compiled)
                ops = xla_ops(hlo, target.platform)
                result["xla_op_bytes"] = sum(o.nbytes for o in ops)
                result["largest_xla_ops"] = [o.summary() for o in ops[:LARGEST_OPS]]
            if target.platform == "tpu":
                result["kernels"] = tpu_kernels(hlo, target)
            if target.platform == "cuda":
                result["lost_aliases"] = aliased_kernels_in_slice_fusions(hlo)
    if target.platform == "cuda":
        result["kernels"] = gpu_kernels(dump_dir, target)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def aliased_kernels_in_slice_fusions(hlo: str) -> list[str]:
    """The Mosaic GPU calls (by HLO name) that alias an operand to their result inside an XLA:GPU
    dynamic-slice fusion that writes that result into a slice of a larger buffer (a
    dynamic-update-slice). Such a fusion hands the kernel a result buffer (the slice of a stacked
    output) apart from the aliased operand, and the kernel's writes are lost: a gmm under lax.map
    returned zeros on an H200 (jax 0.11.2). A fusion that only slices the kernel's operands (its
    result is the fusion's) is not one: plain gmm calls compile so and ran right on the H200.
    `aliasing.call_with_aliases(fence_aliased=True)` keeps Conveyor's kernels out of them; this
    finds any that slip in."""
    fused = set(
        re.findall(r"calls=(%[\w.-]+)[^\n]*\"custom_fusion_config\":\{\"name\":\"dynamic", hlo)
    )
    found = []
    for comp in hlo.split("\n\n"):
        lines = comp.strip().splitlines()
        if not lines or lines[0].split(" ")[0] not in fused:
            continue
        # a kernel's result (through bitcasts) is written into a slice of the fusion's result
        if not any("dynamic-update-slice(" in ln for ln in lines):
            continue
        for line in lines:
            if 'custom_call_target="mosaic_gpu' in line and "output_to_operand_aliasing" in line:
                name = line.split("=")[0].strip()
                if not name.startswith("ROOT"):
                    found.append(name)
    return found


def bytes_accessed(compiled) -> int | None:
    """Bytes of device memory the compiled program reads and writes (XLA's cost analysis: its
    own ops as compiled, each Pallas kernel at the `cost_estimate` the kernel passes)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) and analysis else analysis
    value = (analysis or {}).get("bytes accessed")
    return None if value is None else int(value)


def temporaries(compiled) -> int | None:
    """Bytes of device memory the compiled program allocates beyond its arguments and outputs
    (the compiler's memory analysis; None where the backend gives none)."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


COLLECTIVES = {
    "ragged-all-to-all": r"\bragged-all-to-all(?:-start)?\(",
    "all-to-all": r"(?<!ragged-)\ball-to-all(?:-start)?\(",
}


def collectives(hlo: str) -> dict[str, int]:
    """How many exchanges of each kind the compiled program holds (the exact MoE exchange is
    ragged-all-to-all; all-to-all is a dense one)."""
    return {
        name: n for name, pattern in COLLECTIVES.items() if (n := len(re.findall(pattern, hlo)))
    }


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]\{([^}]*)\}")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(([^)]*)\)")
# ops that move no array of their own (views, scalars, the program's arguments)
_NOT_PASSES = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "after-all"}
_NOT_PASSES |= {"partition-id", "replica-id", "copy-start", "copy-done"}


# Memory spaces (a layout's `S(n)`) that are not device memory: on TPU every one but the
# default (VMEM, SMEM, semaphores, host); on GPU only the host's (5): XLA:GPU colours buffers
# in device memory too (1: collective buffers, 2: temporaries, and the like).
_HOST_MEMORY_SPACE = 5
# How many of a multi-chip case's largest XLA ops its report names (what to look at first).
LARGEST_OPS = 3


def _device_memory_bytes(shape: str, platform: str = "tpu") -> int:
    """Bytes of the arrays in an HLO shape that live in device memory (HBM) on `platform`."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout)
        space = int(space.group(1)) if space else 0
        off_device = space != 0 if platform == "tpu" else space == _HOST_MEMORY_SPACE
        if dtype in _BYTES and not off_device:
            total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _sliced_bytes(shape: str, platform: str) -> int:
    """The bytes an async slice (`slice-start`, libtpu's sliced prefetch into VMEM) moves through
    device memory: its slice, once, read from or written to HBM (its result's tuple also names the
    whole source, which it does not read)."""
    arrays = _ARRAY.findall(shape)
    if len(arrays) < 2:
        raise ValueError(
            f"slice-start: expected ((source), slice, ...) in its shape, got {shape!r}"
        )
    source, sliced = (_device_memory_bytes("{}[{}]{{{}}}".format(*a), platform) for a in arrays[:2])
    if source or sliced:
        dtype, dims, _ = arrays[1]
        return _BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
    return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaOp:
    """One of XLA's own ops in a compiled program: the device-memory bytes it reads and writes
    (`xla_op_bytes`' count), its HLO opcode and name, and the JAX operation it came from (the
    last part of its `op_name` metadata; `backward` when that sits under a transpose)."""

    nbytes: int
    opcode: str
    name: str
    source: str
    backward: bool

    def summary(self) -> str:
        return f"{self.nbytes / 1e9:.2f} GB {self.source or self.opcode}" + (
            " (backward)" if self.backward else ""
        )


def xla_ops(hlo: str, platform: str = "tpu") -> list[XlaOp]:
    """XLA's own ops in a compiled program's entry computation on `platform` ("tpu" or "cuda")
    that move device memory, largest first, each with the bytes of device memory it reads and
    writes: its operands and result, whole (an async op, such as v5p's gathers on its
    SparseCores, once; an async slice, its slice). Not counted: the Pallas kernels (custom
    calls), the collectives and views. An upper bound on what the ops move (an op reading a slice
    of an operand counts all of it, but for async slices)."""
    if platform not in ("tpu", "cuda"):
        raise ValueError(f"platform: expected 'tpu' or 'cuda', got {platform!r}")
    start = hlo.find("\nENTRY ")
    if start < 0:
        raise ValueError("hlo: no ENTRY computation in the compiled program's text")
    end = re.compile(r"\n}(?:\n|$)").search(hlo, start)  # a kernel's metadata spans lines
    shapes: dict[str, str] = {}
    ops = []
    for line in hlo[start : end.start() if end else None].splitlines()[1:]:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op, operands = m.groups()
        shapes[name] = shape
        if op in _NOT_PASSES or op == "custom-call" or _is_collective(op):
            continue
        if op.endswith("-done"):  # an async op's result: counted with its start or update
            continue
        if op == "slice-start":  # ((source), slice, context): the slice moves, not its source
            nbytes = _sliced_bytes(shape, platform)
        else:
            nbytes = _device_memory_bytes(shape, platform)
            if not op.endswith(("-start", "-update")):  # their results hold their operands
                names = re.findall(r"%([\w.\-]+)", operands)
                nbytes += sum(_device_memory_bytes(shapes.get(n, ""), platform) for n in names)
        op_name = re.search(r'op_name="([^"]*)"', line)
        op_name = op_name.group(1) if op_name else ""
        ops.append(
            XlaOp(
                nbytes=nbytes,
                opcode=op,
                name=name,
                source=op_name.rsplit("/", 1)[-1],
                backward="transpose(" in op_name,
            )
        )
    return sorted((o for o in ops if o.nbytes), key=lambda o: -o.nbytes)


def xla_op_bytes(hlo: str, platform: str = "tpu") -> int:
    """The bytes of device memory XLA's own ops read and write in a compiled program, summed over
    `xla_ops`."""
    return sum(o.nbytes for o in xla_ops(hlo, platform))


def _is_collective(op: str) -> bool:
    return op.startswith(("all-", "ragged-all-to-all", "collective-", "reduce-scatter"))


def raised_by_conveyor(error: BaseException) -> bool:
    """Whether `error` was raised in Conveyor's own code (a refusal it states), not in JAX's
    lowering (Pallas or Mosaic refusing a kernel Conveyor let through)."""
    import traceback

    import conveyor

    frames = traceback.extract_tb(error.__traceback__)
    package = os.path.dirname(os.path.abspath(conveyor.__file__))
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(package + os.sep)


def tpu_kernels(hlo: str, target: Target) -> list[dict]:
    """Scoped VMEM of every Mosaic kernel in a compiled TPU program's HLO text."""
    kernels = []
    call = re.compile(r'%([\w.\-]+) = [^\n]*custom_call_target="tpu_custom_call"')
    next_instruction = re.compile(r"\n\s+(?:ROOT )?%|\n}(?:\n|$)")  # metadata spans lines
    for m in call.finditer(hlo):
        end = next_instruction.search(hlo, m.end())
        body = hlo[m.end() : end.start() if end else None]
        used = re.search(r'"used_scoped_memory_configs":\[\{[^}]*"size":"(\d+)"', body)
        vmem = int(used.group(1)) if used else 0
        kernels.append({"name": m.group(1), "vmem": vmem, "vmem_default": target.onchip_default})
    return kernels


def gpu_kernels(dump_dir: str, target: Target) -> list[dict]:
    """Per kernel from Mosaic GPU's dumps: registers, spills, shared memory and whether the
    warpgroups' register split (`setmaxnreg`) survived assembly; plus the same PTX assembled
    by a standalone ptxas (which keeps the split) when one is installed."""
    names = sorted(f[: -len(".ptxas")] for f in os.listdir(dump_dir) if f.endswith(".ptxas"))
    ptxas = _standalone_ptxas()
    kernels = []
    for name in names:
        path = os.path.join(dump_dir, name)
        ptx = _read(path + ".ptx")
        k = {"name": name, **parse_ptxas(_read(path + ".ptxas"))}
        k["smem"] = dynamic_smem(_read(path + ".resources.txt")) + k.pop("static_smem", 0)
        k["smem_limit"] = target.onchip_default
        k["split_in_ptx"] = bool(re.search(r"setmaxnreg\.", ptx))
        if ptxas and ptx:
            k["standalone"] = _assemble(ptxas, path + ".ptx")
        kernels.append(k)
    return kernels


def parse_ptxas(log: str) -> dict:
    """Registers, spill bytes, static shared memory and the C7504 note from a `ptxas -v` log."""
    out = {"registers": None, "spill_stores": 0, "spill_loads": 0, "static_smem": 0}
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        out.update(spill_stores=int(m[1]), spill_loads=int(m[2]))
    m = re.search(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?", log)
    if m:
        out.update(registers=int(m[1]), static_smem=int(m[2] or 0))
    out["split_dropped"] = "C7504" in log  # ptxas: 'setmaxnreg' ignored
    return out


def dynamic_smem(resources: str) -> int:
    """Dynamic shared memory of a Mosaic GPU kernel from its resources dump: the scratch plus
    8 bytes per mbarrier."""
    scratch = re.search(r"smem_scratch_bytes=(\d+)", resources)
    barriers = re.findall(r"num_barriers=(\d+)[^)]*\): (\d+)", resources)
    count = sum(int(n) * int(times) for n, times in barriers)
    return (int(scratch.group(1)) if scratch else 0) + 8 * count


def _standalone_ptxas() -> str | None:
    from conveyor._compat import cuda_toolkit_path

    toolkit = cuda_toolkit_path() or ""
    return shutil.which("ptxas", path=os.path.join(toolkit, "bin")) or shutil.which("ptxas")


def _assemble(ptxas: str, ptx_path: str) -> dict:
    cubin = ptx_path[: -len(".ptx")] + ".standalone.cubin"
    cmd = [ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", cubin]
    run = subprocess.run(cmd, capture_output=True, text=True)
    out = parse_ptxas(run.stdout + run.stderr)
    if run.returncode:
        out["error"] = (run.stdout + run.stderr).strip()[-500:]
    return out


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else ""
