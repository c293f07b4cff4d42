"""Compile, load and register Conveyor's native CPU kernels (XLA FFI handlers) on first use.

The C++ source ships with the package; the first call that needs it compiles it with the host's
C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`) against the FFI headers of the installed
jaxlib, into a cache directory (`$CONVEYOR_CACHE_DIR`, else `$XDG_CACHE_HOME/conveyor`, else
`~/.cache/conveyor`) keyed by the sources, the flags, the compiler and jaxlib versions: a few seconds
once per machine and version. Three builds of one source, the best the CPU runs first (checked at
run time): `amx` (the AVX-512 build with bfloat16 products on Intel AMX tiles, where the CPU has
AMX-BF16 and Linux lets the process use it), `avx512` (AVX-512 F/BW/VL/BF16: bfloat16 dot products
by vdpbf16ps), `avx2` (AVX2 and FMA; bfloat16 widened to float32). `CONVEYOR_NATIVE_ISA=avx512`
or `=avx2` picks a lesser build on any CPU that runs it (how the tests check them on an AMX host).
Without a compiler or such a CPU, or with `CONVEYOR_NATIVE=0`, `status()` says why and
`backend=None` keeps the xla backend; asking for `backend="native_cpu"` then raises with that reason.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

SOURCE = Path(__file__).with_name("gmm_cpu.cc")
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
# Instruction sets, best first: the flags each build adds.
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
ISA_FLAGS = {
    "amx": (*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-DCONVEYOR_ISA_AMX"),
    "avx512": _AVX512_FLAGS,
    "avx2": ("-mavx2", "-mfma", "-DCONVEYOR_ISA_AVX2"),
}
_AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
ISA_CPU_FLAGS = {"amx": (*_AVX512_CPU_FLAGS, "amx_tile", "amx_bf16"), "avx512": _AVX512_CPU_FLAGS,
                 "avx2": ("avx2", "fma")}
# The driver and the instruction-set parts it includes (all part of the cache key).
SOURCES = (SOURCE, *(SOURCE.with_name(f"gmm_cpu_{isa}.h") for isa in ISA_FLAGS))
# FFI target names, registered for the CPU platform.
GMM_TARGET = "conveyor_gmm_cpu"
TGMM_TARGET = "conveyor_tgmm_cpu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NativeStatus:
    """Whether the native kernels are registered in this process, and if not, why."""
    available: bool
    reason: str = ""
    library: str = ""
    isa: str = ""   # "amx", "avx512" or "avx2" where available


def cache_dir() -> Path:
    if os.environ.get("CONVEYOR_CACHE_DIR"):
        return Path(os.environ["CONVEYOR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "conveyor"


def find_compiler() -> str | None:
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    for name in ("c++", "g++", "clang++"):
        if path := shutil.which(name):
            return path
    return None


def host_isas() -> tuple[str, ...]:
    """The instruction sets of ISA_FLAGS this CPU has, best first, as Linux's /proc/cpuinfo lists them."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return tuple(isa for isa, need in ISA_CPU_FLAGS.items() if flags.issuperset(need))


def host_should_build() -> bool:
    """Whether this host has what the kernels need (a C++ compiler, and AVX2 + FMA at least): where it
    does, `status()` must be available, and the tests and the wheel check fail instead of falling
    back to xla."""
    return find_compiler() is not None and bool(host_isas())


def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


def library_path(cxx: str, isa: str = "avx512") -> Path:
    """Where the library built from the sources for `isa` with `cxx` lives in the cache."""
    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES), " ".join(COMMON_FLAGS + ISA_FLAGS[isa]).encode(),
                 _compiler_version(cxx).encode(), jaxlib.__version__.encode()):
        key.update(part)
    return cache_dir() / f"conveyor_native_{isa}_{key.hexdigest()[:16]}.so"


def compile_library(cxx: str, out: Path, isa: str = "avx512") -> None:
    """Compile SOURCE for `isa` into `out` (atomically: concurrent processes each write a temporary file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *COMMON_FLAGS, *ISA_FLAGS[isa], "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def status() -> NativeStatus:
    """Build (once per machine), load and register the kernels for the best instruction set this CPU
    runs (or `$CONVEYOR_NATIVE_ISA`); never raises."""
    if os.environ.get("CONVEYOR_NATIVE", "1") == "0":
        return NativeStatus(available=False, reason="disabled by CONVEYOR_NATIVE=0")
    forced = os.environ.get("CONVEYOR_NATIVE_ISA", "")
    if forced and forced not in ISA_FLAGS:
        return NativeStatus(available=False, reason=f"CONVEYOR_NATIVE_ISA={forced!r}: expected one of {sorted(ISA_FLAGS)}")
    cxx = find_compiler()
    if cxx is None:
        return NativeStatus(available=False, reason="no C++ compiler found ($CXX, c++, g++, clang++)")
    # Only builds this CPU runs are loaded (a library compiled for AVX-512 may use it as it loads); where
    # /proc/cpuinfo is missing each build is loaded and asked.
    candidates = [forced] if forced else list(ISA_FLAGS)
    if Path("/proc/cpuinfo").exists():
        runs_here = host_isas()
        candidates = [isa for isa in candidates if isa in runs_here]
    failures = []   # a build that fails (e.g. a compiler without -mavx512bf16) leaves the next one to try
    for isa in candidates:
        path = library_path(cxx, isa)
        try:
            if not path.exists():
                compile_library(cxx, path, isa)
            lib = ctypes.CDLL(str(path))
            supported, gmm, tgmm = lib.conveyor_native_cpu_supported, lib.ConveyorGmm, lib.ConveyorTgmm
        except (OSError, RuntimeError, AttributeError) as e:
            failures.append(f"building the native kernels ({isa}) failed: {e}")
            continue
        if supported():
            jax.ffi.register_ffi_target(GMM_TARGET, jax.ffi.pycapsule(gmm), platform="cpu")
            jax.ffi.register_ffi_target(TGMM_TARGET, jax.ffi.pycapsule(tgmm), platform="cpu")
            return NativeStatus(available=True, library=str(path), isa=isa)
    if failures:
        return NativeStatus(available=False, reason="; ".join(failures))
    wanted = " or ".join("/".join(ISA_CPU_FLAGS[i]) for i in ([forced] if forced else ISA_FLAGS))
    return NativeStatus(available=False, reason=f"this CPU lacks {wanted}, which the native kernels use")
