"""conveyor.compile_check without the compilers: reading their reports, the verdicts, the CLI's
errors, the VMEM rule of TPU kernels. The compiles themselves run in `make compile-check`."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import conveyor as cv
from conveyor import compile_check as cc
from conveyor import ints, tpu_vmem
from conveyor.compile_check import device

from tests.test_cli import _main

# A ptxas -v log as Mosaic GPU dumps it (nvJitLink: the register split dropped, a spill).
PTXAS_LOG = """\
ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility.
ptxas warning : Registers are spilled to local memory in function 'k', 36 bytes spill stores, 24 bytes spill loads
ptxas         .     24 bytes stack frame, 36 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 17 bytes smem
"""
RESOURCES = (
    "Resources(smem_scratch_bytes=229376, tmem_scratch_cols=0, "
    "barrier_counts=Counter({Barrier(arrival_count=1, num_barriers=4, orders_tensor_core=False): "
    "2, Barrier(arrival_count=2, num_barriers=1, orders_tensor_core=False): 1, "
    "Barrier(arrival_count=2, num_barriers=4, orders_tensor_core=False): 1}))"
)
# A compiled TPU program's HLO: the kernel's metadata spans lines before its backend config.
HLO = """\
  %other = s32[] convert(%x), backend_config={"used_scoped_memory_configs":[]}
  %ring.1 = f32[8,128]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"mesh_axes":"x"
}}, backend_config={"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"8769536"}]}
  ROOT %t = f32[8,128]{1,0} copy(%ring.1)
}
"""


def test_ptxas_log_gives_registers_spills_and_the_dropped_split():
    assert device.parse_ptxas(PTXAS_LOG) == {
        "registers": 168,
        "spill_stores": 36,
        "spill_loads": 24,
        "static_smem": 17,
        "split_dropped": True,
    }


def test_dynamic_shared_memory_is_scratch_plus_eight_bytes_per_barrier():
    # 4 x 2 + 1 + 4 = 13 barriers
    assert device.dynamic_smem(RESOURCES) == 229376 + 8 * 13


def test_tpu_vmem_is_read_from_the_kernels_own_backend_config():
    target = cc.target("v5e")
    assert device.tpu_kernels(HLO, target) == [
        {"name": "ring.1", "vmem": 8769536, "vmem_default": 16 * 2**20}
    ]


# A compiled program: a fused computation before ENTRY (not counted), a kernel whose metadata
# spans lines, an exchange, a VMEM array (S(1)), scalar arithmetic and an async gather (as v5p
# runs them on its SparseCores: counted once).
PROGRAM = """\
%fused (p: bf16[64,128]) -> bf16[64,128] {
  %big = bf16[4096,4096]{1,0} broadcast(%p), dimensions={}
}

ENTRY %main (a: bf16[64,128], i: s32[64]) -> f32[64,128] {
  %a = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[64]{0:T(128)} parameter(1)
  %zeros = bf16[256,128]{1,0:T(8,128)(2,1)} broadcast(%c), dimensions={}
  %k = bf16[256,128]{1,0} custom-call(%a, %zeros), custom_call_target="tpu_custom_call", \
frontend_attributes={kernel_metadata={
"mesh_axes":"x"
}}
  %sent = bf16[256,128]{1,0} ragged-all-to-all(%a, %k, %i, %i, %i, %i)
  %n = s32[]{:T(128)S(6)} add(%x, %y)
  %staged = f32[64,128]{1,0:T(8,128)S(1)} fusion(%a), kind=kLoop, calls=%fused
  %g.start = ((), ()) call-start(), async_execution_thread="sparsecore"
  %g.update = ((bf16[64,128]{1,0}, s32[64]{0}), bf16[64,128]{1,0}) call-update(%g.start, %a, %i)
  %g = bf16[64,128]{1,0} call-done(%g.update)
  ROOT %out = f32[64,128]{1,0:T(8,128)} fusion(%sent, %staged, %i), kind=kLoop, calls=%fused
}
"""


def test_xla_op_bytes_counts_xlas_own_ops_in_device_memory():
    zeros = 256 * 128 * 2  # written
    staged = 64 * 128 * 2  # reads a; its result is in VMEM
    out = 256 * 128 * 2 + 64 * 4 + 64 * 128 * 4  # reads sent and i (staged: VMEM), writes out
    gather = 64 * 128 * 2 + 64 * 4 + 64 * 128 * 2  # reads a and i, writes g
    assert device.xla_op_bytes(PROGRAM) == zeros + staged + gather + out
    with pytest.raises(ValueError, match="no ENTRY computation"):
        device.xla_op_bytes("%f = f32[2]{0} parameter(0)")
    with pytest.raises(ValueError, match="platform: expected 'tpu' or 'cuda', got 'rocm'"):
        device.xla_op_bytes(PROGRAM, "rocm")


def test_xla_ops_are_listed_largest_first_with_the_jax_op_they_came_from():
    """The per-op list behind xla_op_bytes: each op's bytes, largest first, named by the last part
    of its JAX op_name and marked backward under a transpose (what compile-check's report names
    for the multi-chip cases)."""
    program = PROGRAM.replace(
        "kind=kLoop, calls=%fused\n}",
        'kind=kLoop, calls=%fused, metadata={op_name="jit(f)/transpose(jvp())/shard_map/add_any"}'
        "\n}",
    ).replace(
        "broadcast(%c), dimensions={}",
        'broadcast(%c), dimensions={}, metadata={op_name="jit(f)/jvp()/broadcast_in_dim"}',
    )
    ops = device.xla_ops(program)
    assert [o.name for o in ops] == ["out", "zeros", "g.update", "staged"]
    assert (
        sum(o.nbytes for o in ops) == device.xla_op_bytes(program) == device.xla_op_bytes(PROGRAM)
    )
    out, zeros = ops[:2]
    assert (out.source, out.backward, zeros.source, zeros.backward) == (
        "add_any",
        True,
        "broadcast_in_dim",
        False,
    )
    assert out.summary() == f"{out.nbytes / 1e9:.2f} GB add_any (backward)"
    assert ops[2].summary().endswith(" call-update")  # no metadata: its opcode


def test_an_async_slice_counts_its_slice_not_its_source():
    """libtpu prefetches a weight into VMEM in 4 MiB slices (`slice-start`); each slice's result
    tuple names the whole 24 MiB source, which counted once per slice made a 6-slice prefetch
    144 MiB of traffic instead of 24."""
    source = "s8[25165824]{0:T(1024)(128)(4,1)}"
    lines = [
        f"  %s{i} = (({source}), s8[4194304]{{0:T(1024)(128)(4,1)S(1)}}, s32[]{{:S(2)}}) "
        f"slice-start(%w), slice={{[{i * 4194304}:{(i + 1) * 4194304}]}}\n"
        f"  %d{i} = s8[4194304]{{0:T(1024)(128)(4,1)S(1)}} slice-done(%s{i})"
        for i in range(6)
    ]
    program = (
        "HloModule m\n\nENTRY %main (w: s8[25165824]) -> s8[4194304] {\n"
        f"  %w = {source} parameter(0)\n" + "\n".join(lines) + "\n}\n"
    )
    assert device.xla_op_bytes(program, "tpu") == 6 * 4194304
    # a slice between two arrays off device memory moves nothing through HBM
    offchip = program.replace(source, "s8[25165824]{0:T(1024)(128)(4,1)S(1)}")
    assert device.xla_op_bytes(offchip, "tpu") == 0


def test_xla_op_bytes_on_gpu_counts_its_colored_buffers_but_not_the_hosts():
    """XLA:GPU puts a collective's buffers in memory space 1 or 7, still HBM; 5 is the host."""
    program = """\
HloModule m

ENTRY %main (a: bf16[64,128]) -> bf16[64,128] {
  %a = bf16[64,128]{1,0} parameter(0)
  %recv = bf16[64,128]{1,0:S(7)} fusion(%a), kind=kLoop, calls=%zeros
  %host = bf16[64,128]{1,0:S(5)} copy(%a)
  ROOT %sum = bf16[64,128]{1,0} fusion(%recv, %host), kind=kLoop, calls=%add
}
"""
    block = 64 * 128 * 2
    # recv: reads a, writes recv; host: reads a (its result is the host's); sum: recv in, out
    assert device.xla_op_bytes(program, "cuda") == 2 * block + block + 2 * block
    # on TPU a memory space other than 0 is not HBM
    assert device.xla_op_bytes(program, "tpu") == block + block + block


def test_only_conveyors_own_errors_count_as_refusals():
    with pytest.raises(NotImplementedError) as own:
        tpu_vmem.vmem_limit("k", working=2**40, peak=2**40, remedy="r")
    with pytest.raises(TypeError) as jax_error:  # raised inside jax
        jnp.zeros((2, 3)).reshape(4)
    assert device.raised_by_conveyor(own.value)
    assert not device.raised_by_conveyor(jax_error.value)


def _row(status="compiled", **kernel):
    return {
        "target": "h100",
        "case": "c",
        "status": status,
        "seconds": 1.0,
        "error": "E: x",
        "kernels": [kernel] if kernel else [],
    }


def test_verdicts():
    ok = dict(
        registers=154,
        spill_stores=0,
        spill_loads=0,
        smem=1000,
        smem_limit=232448,
        split_dropped=True,
        split_in_ptx=True,
    )
    assert cc.verdict(_row(**ok)) == "ok"
    assert cc.verdict(_row(**{**ok, "spill_loads": 4})) == "spills"
    assert cc.verdict(_row(**{**ok, "smem": 232449})) == "smem over"
    assert cc.verdict(_row("refused")) == "refused"
    assert cc.verdict(_row("failed")) == "failed"
    assert "| h100 | c | failed | 1.0 | E: x |" in cc.markdown([_row("failed")])
    # The simulator must not count less on-chip memory than the compiler reported (2% slack).
    assert cc.verdict({**_row(**ok), "simulated_onchip": 990}) == "ok"
    assert cc.verdict({**_row(**ok), "simulated_onchip": 900}) == "sim onchip"
    vmem = dict(vmem=2 * 2**20, vmem_default=16 * 2**20)
    assert cc.verdict({**_row(**vmem), "simulated_onchip": 1.5 * 2**20}) == "sim onchip"
    assert cc.verdict({**_row(**vmem), "simulated_onchip": 4 * 2**20}) == "ok"  # over: reported
    assert "cv.sim counts 2.00 MiB" in cc.markdown([{**_row(**vmem), "simulated_onchip": 2**21}])
    # a case on several chips: its exchanges and the program's temporaries in device memory
    many = {
        **_row(**vmem),
        "collectives": {"ragged-all-to-all": 3},
        "hbm_temp": 5_505_302_016,
        "bytes_accessed": 26_212_192_256,
        "xla_op_bytes": 7_841_256_678,
    }
    assert (
        "ragged-all-to-all x3<br>temporaries 5.51 GB per chip<br>accesses 26.21 GB per chip<br>"
        "XLA's own ops move 7.84 GB per chip" in cc.markdown([many])
    )
    # the simulator's price of the XLA passes, within 25% of the compiled program's either way
    priced = {**many, "simulated_xla_op_bytes": 7_262_437_376}
    assert cc.verdict(priced) == "ok"
    assert "XLA's own ops move 7.84 GB per chip (cv.sim prices 7.26)" in cc.markdown([priced])
    assert cc.verdict({**many, "simulated_xla_op_bytes": 5_800_000_000}) == "sim passes"
    assert cc.verdict({**many, "simulated_xla_op_bytes": 9_900_000_000}) == "sim passes"
    assert cc.verdict({**_row(**ok), "lost_aliases": ["%mpmd_map.2"]}) == "alias lost"
    assert cc.verdict({**_row(**ok), "lost_aliases": []}) == "ok"


# Trimmed from XLA:GPU's compiled HLO of `vmap(cv.gmm)` for an H100 (jax 0.12.0.1) before the
# aliased outputs were fenced: the kernel's result lands in a slice of the stacked output.
_SLICE_FUSED_HLO = """
%dynamic-slice-fusion (p5: bf16[256,128], p7: f32[200,128], p8: f32[2,200,128]) -> f32[2,200,128] {
  %p7 = f32[200,128]{1,0} parameter(7)
  %mpmd_map.2 = f32[200,128]{1,0} custom-call(%p5, %p7, %p7), custom_call_target="mosaic_gpu_v2", output_to_operand_aliasing={{}: (2, {})}, api_version=API_VERSION_TYPED_FFI
  ROOT %dynamic-update-slice = f32[2,200,128]{2,1,0} dynamic-update-slice(%p8, %mpmd_map.2)
}

%plain (p0: bf16[256,128], p1: f32[200,128]) -> f32[200,128] {
  ROOT %mpmd_map.3 = f32[200,128]{1,0} custom-call(%p0, %p1, %p1), custom_call_target="mosaic_gpu_v2", output_to_operand_aliasing={{}: (2, {})}
}

ENTRY %main {
  %dynamic_slice_fusion = f32[2,200,128]{2,1,0} fusion(%a, %b, %c), kind=kCustom, calls=%dynamic-slice-fusion, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_address_computation"}}}
}
"""


# ... and of a plain gmm (G=64): the fusion only slices an operand; its result is the kernel's.
_OPERAND_SLICED_HLO = """
%dynamic-slice-fusion (p0: s32[129], p7: bf16[8192,14336]) -> bf16[8192,14336] {
  %slice.20 = s32[64]{0} slice(%p0), slice={[64:128]}
  ROOT %mpmd_map.2 = bf16[8192,14336]{1,0} custom-call(%slice.20, %p7, %p7), custom_call_target="mosaic_gpu_v2", output_to_operand_aliasing={{}: (2, {})}
}

ENTRY %main {
  ROOT %dynamic_slice_fusion = bf16[8192,14336]{1,0} fusion(%a, %b), kind=kCustom, calls=%dynamic-slice-fusion, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_address_computation"}}}
}
"""


def test_an_aliased_gpu_kernel_writing_into_a_slice_is_found():
    assert device.aliased_kernels_in_slice_fusions(_SLICE_FUSED_HLO) == ["%mpmd_map.2"]
    unaliased = _SLICE_FUSED_HLO.replace(", output_to_operand_aliasing={{}: (2, {})}", "")
    assert device.aliased_kernels_in_slice_fusions(unaliased) == []
    # a fusion slicing the kernel's operands only leaves its result buffer alone
    assert device.aliased_kernels_in_slice_fusions(_OPERAND_SLICED_HLO) == []


def test_simulated_onchip_is_the_simulators_count_of_single_kernel_cases():
    gmm = cc.case("gmm", m=8192, k=4096, n=14336, groups=8)
    tgmm = cc.case("tgmm", m=8192, k=4096, n=14336, groups=8)
    # the default (256, 1024, 1024) tiles' buffers and Mosaic's lhs copy (tgmm, called without
    # existing_out, takes no existing_out block); libtpu reported 8.49 and, for tgmm on v5e,
    # 10.46 MiB (benchmarks/results/compile-check-2026-11-29-7.md)
    assert cc.cases.simulated_onchip(gmm, "v5e") == 8.5 * 2**20
    assert cc.cases.simulated_onchip(tgmm, "v6e") == 10.5 * 2**20
    assert cc.cases.simulated_onchip(gmm, "h100") == 229376  # ptxas: 229489 with the barriers
    grad = cc.case("gmm", m=8192, k=4096, n=14336, groups=8, grad=True)
    assert cc.cases.simulated_onchip(grad, "v5e") is None


def test_simulated_passes_are_priced_for_forward_moe_layers_on_modelled_chips():
    fwd = cc.case("moe_ep", devices=8, tokens=32768, d=7168, f=2048, experts=64, top_k=8)
    grad = cc.case("moe_ep", devices=8, tokens=8192, d=7168, f=2048, experts=64, top_k=8, grad=True)
    shape = cv.sim.MoeShape(name="s", tokens=4096, d=7168, f=2048, experts=64, top_k=8)
    passes = cv.sim.moe.xla_passes(shape, "exact", devices=4, hw=cv.sim.hardware.get("v5e"))
    assert cc.cases.simulated_xla_op_bytes(fwd, "v6e") == sum(passes.values())
    assert cc.cases.simulated_xla_op_bytes(grad, "v5e") is None
    assert (
        cc.cases.simulated_xla_op_bytes(cc.case("gmm", **dict(m=64, k=64, n=64, groups=2)), "h100")
        is None
    )


def test_production_cases_have_unique_names_and_rings_only_on_tpu():
    cases = cc.production()
    assert len({c.name for c in cases}) == len(cases)
    rings = [c for c in cases if c.kind == "ring"]
    assert rings and not any(cc.cases.applies(c, "cuda") for c in rings)
    assert all(cc.cases.applies(c, "tpu") for c in rings)
    with pytest.raises(ValueError, match="case: expected one of gmm, tgmm"):
        cc.case("gemm")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "x100"], "unknown target 'x100'; known: h100, v5e, v6e, v5p"),
        ([], "--target: required"),
        (["--target", "h100", "--m", "64"], "argument --k, --n: required by 'gmm'"),
        (
            ["--target", "h100", "--m", "8", "--k", "8", "--n", "8", "--shard", "2"],
            "--shard not used by 'compile-check gmm'",
        ),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, _, err = _main(capsys, "compile-check", "gmm", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(device.installed("jax_cuda12_plugin"), reason="the CUDA compiler is here")
def test_cli_names_the_missing_toolchain(capsys):
    code, _, err = _main(
        capsys, "compile-check", "gmm", "--target", "h100", "--m", "64", "--k", "64", "--n", "64"
    )
    assert code == 2 and "scripts/compile_env.sh cuda" in err


def test_cli_refuses_a_ring_on_the_gpu(capsys):
    code, _, err = _main(capsys, "compile-check", "all-gather-matmul", "--target", "h100")
    assert code == 2 and "has a kernel on TPU only, got h100" in err


def test_kernel_integer_division_matches_python():
    for a in (0, 5, 127, 128, 1000):
        for b in (1, 7, 128):
            traced = jax.jit(lambda x, b=b: (ints.floordiv(x, b), ints.mod(x, b)))(a)
            assert (
                (int(traced[0]), int(traced[1]))
                == (a // b, a % b)
                == (ints.floordiv(a, b), ints.mod(a, b))
            )
    assert ints.cdiv(129, 128) == 2 and ints.cdiv(128, 128) == 1


def _on(kind: str):
    return jax.sharding.use_abstract_mesh(
        AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice(kind, 1, "tpu"))
    )


def test_vmem_limit_follows_the_chip():
    MiB = 2**20
    with _on("TPU v5 lite"):
        assert tpu_vmem.vmem_limit("k", working=8 * MiB, peak=12 * MiB, remedy="r") is None
        assert tpu_vmem.vmem_limit("k", working=8 * MiB, peak=20 * MiB, remedy="r") == 20 * MiB
        assert tpu_vmem.vmem_limit("k", working=8 * MiB, peak=900 * MiB, remedy="r") == 128 * MiB
        with pytest.raises(
            NotImplementedError,
            match=r"k: mosaic_tpu needs 256.0 MiB of VMEM .* 128 MiB of TPU_V5E; r$",
        ):
            tpu_vmem.vmem_limit("k", working=256 * MiB, peak=300 * MiB, remedy="r")
    with _on("TPU v6 lite"):  # v6e's default scoped limit is 32 MiB
        assert tpu_vmem.vmem_limit("k", working=8 * MiB, peak=20 * MiB, remedy="r") is None
    # No TPU in view (a plain CPU trace): the least VMEM of the supported chips is assumed.
    assert tpu_vmem.chip_vmem() == tpu_vmem.UNKNOWN_CHIP


def test_gmm_backward_lowers_for_cuda_under_an_explicit_mesh():
    """Integer division inside the Mosaic GPU kernels used to become `reshard` equations under
    an explicit mesh, which the Mosaic GPU lowering could not take (AssertionError)."""
    import conveyor as cv

    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",), axis_types=(AxisType.Explicit,))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    bf16 = jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((256, 128), bf16, sharding=spec),
        jax.ShapeDtypeStruct((4, 128, 128), bf16, sharding=spec),
        jax.ShapeDtypeStruct((4,), jnp.int32, sharding=spec),
    )

    def loss(x, w, s):
        out = cv.gmm(x, w, s, backend="mosaic_gpu", preferred_element_type=bf16)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh):
        exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"])(
            *args
        )
    assert exported.mlir_module().count("mosaic_gpu") >= 2  # gmm (d lhs) and tgmm (d rhs)


def test_a_gmm_tiling_over_the_chips_vmem_is_refused_and_a_large_one_gets_a_limit():
    import conveyor as cv

    bf16 = jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((8192, 4096), bf16),
        jax.ShapeDtypeStruct((8, 4096, 8192), bf16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
    )

    def export(tiling):
        fn = jax.jit(
            lambda x, w, s: cv.gmm(
                x, w, s, backend="mosaic_tpu", tiling=tiling, preferred_element_type=bf16
            )
        )
        with _on("TPU v5 lite"):
            return jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()

    # (2048, 4096, 4096): 2 x (16 + 32 + 16) MiB of input blocks, 2 x 16 of output, 32 of sums,
    # 16 of Mosaic's copy of the lhs block.
    with pytest.raises(
        NotImplementedError,
        match=r"gmm: mosaic_tpu needs 208.0 MiB of VMEM .*"
        r"128 MiB of TPU_V5E; pass a smaller tiling",
    ):
        export((2048, 4096, 4096))
    # (1024, 2048, 2048): 48 MiB of buffers and 4 of the lhs copy, 68 with the products: over
    # v5e's default 16 MiB, so the kernel asks for 68 MiB of scoped VMEM (128 x 512 x 512 tiles
    # ask for nothing).
    limit = re.compile(r"scoped_memory_configs\\22: \[\{[^]]*\\22size\\22: (\d+)")
    assert limit.findall(export((1024, 2048, 2048))) == [str(68 * 2**20)]
    assert limit.findall(export((128, 512, 512))) == []


def test_a_gathered_gmm_counts_its_packed_row_slots_and_gets_a_limit():
    """The gathered gmm's 16-bit row slots take twice their nominal bytes and their operand 16
    bytes an element in libtpu's VMEM; with (256, 1024, 1024) tiles that is 19 MiB (libtpu on v5e:
    18.82), over v5e's 16 MiB default, so the kernel asks for more (it asked for nothing and
    failed `CompileTimeScopedVmemOom` while the slots were counted at their nominal bytes)."""
    import conveyor as cv
    from conveyor.ops.gmm.mosaic_tpu_rows import packed_rows_vmem

    MiB = 2**20
    assert packed_rows_vmem(256, 1024, 4096, jnp.bfloat16) == 4 * MiB + 4 * MiB
    bf16 = jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((8192, 4096), bf16),
        jax.ShapeDtypeStruct((8, 4096, 14336), bf16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((16384,), jnp.int32),
    )

    def export(tiling):
        fn = jax.jit(
            lambda x, w, s, idx: cv.gmm(
                x,
                w,
                s,
                lhs_indices=idx,
                backend="mosaic_tpu",
                tiling=tiling,
                preferred_element_type=bf16,
            )
        )
        with _on("TPU v5 lite"):
            return jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()

    limit = re.compile(r"scoped_memory_configs\\22: \[\{[^]]*\\22size\\22: (\d+)")
    # 19 MiB counted, plus two float32 products of the [256, 1024] output block
    assert limit.findall(export((256, 1024, 1024))) == [str(21 * MiB)]
    assert limit.findall(export((128, 512, 512))) == []  # 6.75 MiB counted (libtpu: 6.63)
