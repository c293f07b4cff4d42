"""Hijax types (a value JAX lowers to several arrays) in mpmd_map: refused by name, as inputs and
closed over, where JAX itself crashed lowering the call (upstream's test_closed_over_hijax_refs,
in Conveyor's spelling). hijax has no public API in jax 0.12: the pair type below is built on
`jax._src.hijax`, as upstream's own tests build theirs."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax._src import hijax, state

import conveyor as cv


@dataclasses.dataclass(frozen=True)
class Pair:
    a: jax.Array
    b: jax.Array


@dataclasses.dataclass(frozen=True)
class PairTy(hijax.HiType):
    a_aval: jax.core.ShapedArray
    b_aval: jax.core.ShapedArray

    @property
    def shape(self):
        return self.a_aval.shape

    @property
    def dtype(self):
        return self.a_aval.dtype

    def lo_ty(self):
        return [self.a_aval, self.b_aval]

    def lower_val(self, v):
        return [v.a, v.b]

    def raise_val(self, a, b):
        return Pair(a, b)

    def get_ref_aval(self):
        return state.AbstractRef(self)


hijax.register_hitype(Pair, lambda p: PairTy(jax.typeof(p.a), jax.typeof(p.b)))

PAIR = Pair(jnp.ones((8, 8), jnp.int32), jnp.zeros((8,), jnp.int32))
OUT = jax.ShapeDtypeStruct((8,), jnp.int32)


def test_a_closed_over_hijax_ref_is_refused_by_name():
    @jax.jit
    def f(pair):
        ref = jax.new_ref(pair)

        def program(o_ref):
            ref[...]  # reads the closed-over Ref
            o_ref[...] = jnp.zeros((8,), jnp.int32)

        return cv.mpmd_map([(cv.Mesh(x=1), program)], OUT)()

    with pytest.raises(NotImplementedError, match=r"program 0 closes over a jax Ref of a hijax"):
        f(PAIR)


@pytest.mark.parametrize("traced", [False, True])
def test_a_hijax_input_is_refused_by_name(traced):
    call = cv.mpmd_map([(cv.Mesh(x=1), lambda p, o: None)], OUT)
    with pytest.raises(NotImplementedError, match=r"input 0 is a value of a hijax type \(PairTy"):
        (jax.jit(call) if traced else call)(PAIR)


def test_a_fusible_dtype_in_a_program_is_refused_naming_the_primitive():
    """Upstream's test_mpmd_map_physicalize packs two arrays into a fusible dtype inside the kernel
    and physicalizes the function around it; JAX has no eager rule for the pack, so the CPU
    executor refuses it naming the primitive and the instance."""
    from jax._src.pallas.fuser import fusible_dtype

    @dataclasses.dataclass(frozen=True)
    class Packed(fusible_dtype.FusionDType):
        def abstract_unpack(self, x):
            return (x.update(dtype=jnp.float32), x.update(dtype=jnp.float32))

        def abstract_pack(self, x, y):
            return x.update(dtype=self)

        def pull_block_spec_one_step(self, aval_out, block_spec):
            return block_spec, block_spec

        def unpack_push_block_spec(self, aval_in, block_spec):
            return block_spec, block_spec

        def unpack_pull_block_spec(self, aval_in, spec1, spec2):
            return (spec1,)

    def program(x_ref, y_ref, o_ref):
        a, b = fusible_dtype.unpack(fusible_dtype.pack(x_ref[...], y_ref[...], dtype=Packed()))
        o_ref[...] = a + b

    x = jnp.ones((8, 8), jnp.float32)
    call = cv.mpmd_map([(cv.Mesh(x=1), program)], jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(NotImplementedError, match=r"program 0 .* no evaluation rule for 'pack_"):
        call(x, x)
