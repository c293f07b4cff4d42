"""The backend of `backend=None` chosen when lowered, per platform (`per_platform`), and values
that may only be lowered for some platforms, with a message for the others (`only_for`).

Design notes: docs/internals/core.md, section `lowering_guard.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from conveyor import backends
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


_REFUSABLE = (NotImplementedError, ValueError, TypeError)


def per_platform(
    launch: Callable[[str], Callable[..., Any]], available: tuple[str, ...], what: str
):
    """A function whose backend is chosen when lowered: each platform's first backend in its
    default order among `available` (`backends.PLATFORM_DEFAULTS`: TPU mosaic_tpu, the others
    xla). Each such backend's function (`launch(backend)`) is built and traced at every call,
    under `lax.platform_dependent`, whose single-platform lowering keeps the selected branch
    only. A backend that refuses (a NotImplementedError, ValueError or TypeError while building
    or tracing) gets another's results behind a guard that fails the lowering for its platforms,
    naming the reason: the next backend of the order is not taken silently. When every backend
    refuses, the call raises the xla backend's error. `what` names the caller in that message."""
    chosen = {
        platform: next((b for b in order if b in available), "xla")
        for platform, order in backends.PLATFORM_DEFAULTS.items()
    }
    names = ["xla", *sorted(set(chosen.values()) - {"xla"})]
    built: dict[str, Any] = {}
    for name in names:
        try:
            built[name] = launch(name)
        except _REFUSABLE as e:
            built[name] = e
    if all(isinstance(b, Exception) for b in built.values()):
        raise built["xla"]

    def run(*inputs):
        def attempt(name, xs):
            if isinstance(built[name], Exception):
                return built[name]
            try:
                return built[name](*xs)
            except _REFUSABLE as e:
                return e

        def branch(name):
            def fn(*xs):
                out = attempt(name, xs)
                if not isinstance(out, Exception):
                    return out
                reason = f"{type(out).__name__}: {out}".replace("{", "{{").replace("}", "}}")
                message = (
                    f"{what} lowered for {{platform}}: its default there, {name}, refused "
                    f"these arguments ({reason}); name a backend"
                )
                # Another backend's results stand in for the branch's types; the guards before
                # and after them fail the lowering, with `message`, before anything of theirs
                # is lowered.
                guard = lambda tree: jax.tree_util.tree_map(
                    lambda r: only_for(r, (), message), tree
                )
                for other in names:
                    stand_in = attempt(other, guard(xs)) if other != name else out
                    if not isinstance(stand_in, Exception):
                        return guard(stand_in)
                raise out

            return fn

        per_platform = {p: branch(b) for p, b in chosen.items() if b != "xla"}
        return jax.lax.platform_dependent(*inputs, default=branch("xla"), **per_platform)

    return run
