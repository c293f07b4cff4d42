"""The expert-parallel layer's exact exchange: `conveyor.moe.exchange.ragged_all_to_all` has
`jax.lax.ragged_all_to_all`'s semantics on CPU (where it is emulated), and the layer lowers to
the real ragged collective for TPU and GPU, with no dense all_to_all left."""

import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, PartitionSpec as P

import conveyor as cv
from conveyor.moe.exchange import ragged_all_to_all
from tests.moe.test_expert_parallel import SPECS, params

DEVICES, ROWS, OUT_ROWS = 4, 12, 20


def _model(operands, outputs, input_offsets, send_sizes, output_offsets):
    """The docstring's pseudocode of jax.lax.ragged_all_to_all (one slice per peer), in numpy:
    device s sends operands[s][input_offsets[s, j]:+send_sizes[s, j]] to device j, which writes it
    at rows output_offsets[s, j]:... of its output."""
    results = [o.copy() for o in outputs]
    for s in range(DEVICES):
        for j in range(DEVICES):
            n, src, dst = send_sizes[s, j], input_offsets[s, j], output_offsets[s, j]
            results[j][dst : dst + n] = operands[s][src : src + n]
    return np.stack(results)


def _case(seed):
    """Random ragged slices with gaps between them on both sides: sizes[s, j] rows from s to j."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, (DEVICES, DEVICES))
    input_offsets = np.zeros_like(sizes)
    output_offsets = np.zeros_like(sizes)
    for s in range(DEVICES):  # each sender's slices in a shuffled order, with a gap after each
        at = 0
        for j in rng.permutation(DEVICES):
            input_offsets[s, j], at = at, at + sizes[s, j] + rng.integers(0, 2)
    for j in range(DEVICES):  # each receiver's slices in a shuffled order of senders, with gaps
        at = 0
        for s in rng.permutation(DEVICES):
            output_offsets[s, j], at = at, at + sizes[s, j] + rng.integers(0, 2)
    assert input_offsets.max() + 3 <= ROWS and output_offsets.max() + 3 <= OUT_ROWS
    operands = rng.standard_normal((DEVICES, ROWS, 3)).astype(np.float32)
    outputs = np.full((DEVICES, OUT_ROWS, 3), -7.0, np.float32)  # rows nobody writes keep this
    return operands, outputs, input_offsets, sizes, output_offsets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cpu_exchange_has_ragged_all_to_all_semantics(seed):
    operands, outputs, input_offsets, sizes, output_offsets = _case(seed)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("x",))

    def local(operand, output, in_off, send, out_off, recv):
        return ragged_all_to_all(
            operand[0], output[0], in_off[0], send[0], out_off[0], recv[0], axis_name="x"
        )[None]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    recv_sizes = sizes.T  # device j receives sizes[s, j] from each s
    got = fn(
        operands,
        outputs,
        *(jnp.asarray(a, jnp.int32) for a in (input_offsets, sizes, output_offsets, recv_sizes)),
    )
    np.testing.assert_array_equal(
        np.asarray(got), _model(operands, outputs, input_offsets, sizes, output_offsets)
    )


def _expert_parallel(platform_mesh, **options):
    def layer(p):
        return cv.moe.moe_ffn_expert_parallel(
            **p, top_k=2, axis_name="expert", loss_axes=("data", "expert"), **options
        )[0]

    return jax.shard_map(
        layer, mesh=platform_mesh, in_specs=(SPECS,), out_specs=P(("data", "expert"))
    )


def _lowered_text(platform: str, grad: bool, dtype=jnp.float32, **options) -> str:
    kind = {"tpu": "TPU v5 lite", "cuda": "NVIDIA H100 80GB HBM3"}.get(platform, "cpu")
    mesh = AbstractMesh(
        (2, 4),
        ("data", "expert"),
        (AxisType.Auto,) * 2,
        abstract_device=AbstractDevice(kind, 8, platform),
    )
    f = _expert_parallel(mesh, **options)
    fn = jax.grad(lambda p: jnp.sum(f(p))) if grad else f
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params(0))
    avals = {
        k: jax.ShapeDtypeStruct(a.shape, dtype if k != "router_w" else a.dtype)
        for k, a in avals.items()
    }
    # XLA's ragged_all_to_all custom call has no export compatibility guarantee yet: exporting it
    # needs this opt-in (docs/moe.md says so); compiling it (make compile-check) does not.
    unchecked = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=unchecked)(
            avals
        ).mlir_module()


@pytest.mark.parametrize("grad", [False, True])
def test_the_layer_lowers_to_the_ragged_collective_for_tpu(grad):
    text = _lowered_text("tpu", grad)
    # forward: rows and ids out, results back; backward: the transposes of the two row exchanges
    assert text.count("custom_call @ragged_all_to_all") == (5 if grad else 3)
    # The dense exchange is gone: the only all_to_alls left move offsets (one int per device),
    # which the ragged collective's transpose exchanges.
    dense = re.findall(r'"stablehlo.all_to_all"\(.*?\) : \((tensor<[^>]*>)\)', text)
    assert set(dense) <= {"tensor<4xi32>"}, dense


def _row_exchanges(text: str) -> list[str]:
    """The operand types of the program's ragged exchanges of 2-d or more arrays (rows)."""
    types = re.findall(r"custom_call @ragged_all_to_all\(.*?\) .*?: \((tensor<[^>]*>)", text)
    return [t for t in types if t.count("x") >= 2]


@pytest.mark.parametrize("backend", [None, "mosaic_tpu", "xla"])
def test_16bit_rows_travel_as_row_tiles_unless_differentiated(backend):
    """On TPU the exact exchange moves bfloat16 rows as [rows, 1, d], the layout the row-moving
    gmm kernels read and write (libtpu then copies neither side: docs/internals/moe.md), both
    ways; not when the layer is differentiated (that view cost the training step memory), and
    not for the xla backend, whose gmm reads plain rows."""
    forward = _row_exchanges(_lowered_text("tpu", False, jnp.bfloat16, backend=backend))
    viewed = [t for t in forward if "x1x" in t]
    assert len(forward) == 2 and len(viewed) == (0 if backend == "xla" else 2), forward
    backward = _row_exchanges(_lowered_text("tpu", True, jnp.bfloat16, backend=backend))
    assert len(backward) == 4 and not [t for t in backward if "x1x" in t], backward


def test_the_cpu_lowering_has_no_ragged_collective():
    text = (
        jax.jit(
            _expert_parallel(Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert")))
        )
        .lower(params(0))
        .as_text()
    )
    assert "ragged_all_to_all" not in text and "all_to_all" in text
