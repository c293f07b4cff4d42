"""Worker: both collective matmuls over every device of a multi-process CPU job, checked against
NumPy.

    python -m tests.distributed.ring_check --process-id 0 --num-processes 2 --port 12345
    --devices 4
Prints "OK <process> <devices>" on success; raises (non-zero exit) on a wrong shard.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=60)
    ap.add_argument(
        "--crash-process",
        type=int,
        default=-1,
        help="this process exits right after joining (tests)",
    )
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.timeout,
    )
    if args.process_id == args.crash_process:
        os._exit(3)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import conveyor as cv

    devices = np.array(jax.devices())
    d = devices.size
    mesh = Mesh(devices, ("x",))
    rng = np.random.default_rng(0)  # same data in every process
    x = rng.standard_normal((16, 8 * d)).astype(np.float32)
    w = rng.standard_normal((8 * d, 12)).astype(np.float32)
    b = rng.standard_normal((8 * d, 4 * d)).astype(np.float32)

    def global_array(host, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def per_device(fn, specs, *hosts):
        f = jax.jit(
            jax.shard_map(lambda *a: fn(*a)[None], mesh=mesh, in_specs=specs, out_specs=P("x"))
        )
        return f(*[global_array(h, s) for h, s in zip(hosts, specs)])

    agm = per_device(
        lambda l, r: cv.all_gather_matmul(l, r, axis_name="x"), (P(None, "x"), P()), x, w
    )
    expect = x @ w
    for shard in agm.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data)[0], expect, rtol=1e-4, atol=1e-4)
    mrs = per_device(
        lambda l, r: cv.matmul_reduce_scatter(l, r, axis_name="x", scatter_dim=1),
        (P(None, "x"), P("x", None)),
        x,
        b,
    )
    blocks = np.split(x @ b, d, axis=1)
    for shard in mrs.addressable_shards:
        i = shard.index[0].start
        np.testing.assert_allclose(np.asarray(shard.data)[0], blocks[i], rtol=1e-4, atol=1e-4)
    print(f"OK {args.process_id} {d}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
