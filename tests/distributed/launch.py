"""Launch N local processes that form one JAX distributed job (CPU collectives over gloo): the
test harness of tests/distributed, not part of the package.

Every process runs `python -m <module> --process-id I --num-processes N --port P --devices D`
from the repository root (so `tests.distributed.ring_check` imports).
The launcher waits with a deadline: when a process dies or the deadline passes, every other
process is killed and `ProcessFailed` says which process did what, with the tail of its output.
Nothing waits forever.

On a GPU/TPU cluster the same worker code runs with `jax.distributed.initialize()` given the
cluster's coordinator address, process count and id (or none at all on TPU pods and SLURM, where
JAX detects them); only the CPU-specific XLA_FLAGS and the gloo setting are left out.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time


ROOT = pathlib.Path(__file__).resolve().parents[2]


class ProcessFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(
    module: str,
    num_processes: int,
    *,
    devices_per_process: int = 4,
    timeout: float = 120.0,
    start: list[int] | None = None,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """Run `module` as `num_processes` processes; returns their stdouts when all exit 0.

    `start` picks which process ids actually start (the others never arrive): used to test that a
    missing peer makes the others fail within the timeout instead of hanging.
    """
    port = free_port()
    ids = list(range(num_processes)) if start is None else list(start)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = {}
    for i in ids:
        cmd = [
            sys.executable,
            "-m",
            module,
            "--process-id",
            str(i),
            "--num-processes",
            str(num_processes),
            "--port",
            str(port),
            "--devices",
            str(devices_per_process),
            "--timeout",
            str(int(timeout)),
            *extra_args,
        ]
        procs[i] = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    deadline = time.monotonic() + timeout + 10
    outputs: dict[int, str] = {}
    try:
        while len(outputs) < len(procs):
            for i, p in procs.items():
                if i in outputs or p.poll() is None:
                    continue
                outputs[i] = p.stdout.read()
                if p.returncode != 0:
                    raise ProcessFailed(
                        f"process {i} of {num_processes} exited with code {p.returncode}; its "
                        f"output ends with:\n{outputs[i][-2000:]}"
                    )
            if time.monotonic() > deadline:
                waiting = [i for i in procs if i not in outputs]
                raise ProcessFailed(
                    f"processes {waiting} of {num_processes} still running after "
                    f"{timeout + 10:.0f} s (never-started processes: "
                    f"{sorted(set(range(num_processes)) - set(ids))})"
                )
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return [outputs[i] for i in sorted(outputs)]
