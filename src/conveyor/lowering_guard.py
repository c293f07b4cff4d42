"""Values that may only be lowered for some platforms, with a message for the others.

The collective matmuls with `backend=None` pick their backend when called, from this process's
platform; lowered for another platform (`jax.export(..., platforms=["tpu"])` from a CPU host) they
would hold the xla ring where the user expects the Mosaic ring kernel, so `only_for` marks their
outputs and such a lowering fails naming the backend to pass. `cv.kernel(backend=None)` uses it
for a default backend that refused the kernel: that branch fails the lowering for its platform.
"""

from __future__ import annotations

from conveyor._compat import Primitive, ad, batching, mlir

lowered_for_p = Primitive("conveyor_lowered_for")
# run eagerly: on this process's platform
lowered_for_p.def_impl(lambda x, *, platforms, message: x)
lowered_for_p.def_abstract_eval(lambda aval, *, platforms, message: aval)


def _lowering(ctx, x, *, platforms, message):
    others = [p for p in ctx.module_context.platforms if p not in platforms]
    if others:
        raise NotImplementedError(message.format(platform=others[0]))
    return [x]


mlir.register_lowering(lowered_for_p, _lowering)
batching.primitive_batchers[lowered_for_p] = lambda args, dims, **params: (
    lowered_for_p.bind(*args, **params),
    dims[0],
)
ad.primitive_jvps[lowered_for_p] = lambda primals, tangents, **params: (
    lowered_for_p.bind(*primals, **params),
    tangents[0],
)


def only_for(x, platforms: tuple[str, ...], message: str):
    """`x`, refusing to be lowered for a platform outside `platforms` with `message` (which may
    name `{platform}`)."""
    return lowered_for_p.bind(x, platforms=tuple(platforms), message=message)
