"""Compile, load and register Conveyor's native CPU kernels (XLA FFI handlers) on first use.

The C++ source ships with the package; the first call that needs it compiles it with the host's
C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`) against the FFI headers of the installed
jaxlib, into a cache directory (`$CONVEYOR_CACHE_DIR`, else `$XDG_CACHE_HOME/conveyor`, else
`~/.cache/conveyor`) keyed by the source, the flags, the compiler and jaxlib versions: a few seconds
once per machine and version. The kernels need AVX-512 with bfloat16 dot products (checked at run
time). Without a compiler or such a CPU, or with `CONVEYOR_NATIVE=0`, `status()` says why and
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
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC",
         "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma")
# FFI target names, registered for the CPU platform.
GMM_TARGET = "conveyor_gmm_cpu"
TGMM_TARGET = "conveyor_tgmm_cpu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NativeStatus:
    """Whether the native kernels are registered in this process, and if not, why."""
    available: bool
    reason: str = ""
    library: str = ""


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


def host_should_build() -> bool:
    """Whether this host has what the kernels need (a C++ compiler, and AVX-512 F/BW/VL/BF16 as
    Linux's /proc/cpuinfo lists them): where it does, `status()` must be available, and the tests
    and the wheel check fail instead of falling back to xla."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return find_compiler() is not None and all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))


def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout


def library_path(cxx: str) -> Path:
    """Where the library built from this source with `cxx` lives in the cache."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), _compiler_version(cxx).encode(),
                 jaxlib.__version__.encode()):
        key.update(part)
    return cache_dir() / f"conveyor_native_{key.hexdigest()[:16]}.so"


def compile_library(cxx: str, out: Path) -> None:
    """Compile SOURCE into `out` (atomically: concurrent processes each write a temporary file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def status() -> NativeStatus:
    """Build (once per machine), load and register the kernels; never raises."""
    if os.environ.get("CONVEYOR_NATIVE", "1") == "0":
        return NativeStatus(available=False, reason="disabled by CONVEYOR_NATIVE=0")
    cxx = find_compiler()
    if cxx is None:
        return NativeStatus(available=False, reason="no C++ compiler found ($CXX, c++, g++, clang++)")
    path = library_path(cxx)
    try:
        if not path.exists():
            compile_library(cxx, path)
        lib = ctypes.CDLL(str(path))
        supported, gmm, tgmm = lib.conveyor_native_cpu_supported, lib.ConveyorGmm, lib.ConveyorTgmm
    except (OSError, RuntimeError, AttributeError) as e:
        return NativeStatus(available=False, reason=f"building the native kernels failed: {e}")
    if not supported():
        return NativeStatus(available=False, library=str(path),
                            reason="this CPU lacks AVX-512 (F, BW, VL and BF16), which the native kernels use")
    jax.ffi.register_ffi_target(GMM_TARGET, jax.ffi.pycapsule(gmm), platform="cpu")
    jax.ffi.register_ffi_target(TGMM_TARGET, jax.ffi.pycapsule(tgmm), platform="cpu")
    return NativeStatus(available=True, library=str(path))
