"""Every pipeline test that can run the xla backend runs it twice: with the default executor
(what users get) and in checked mode, where the plan's slots are real buffers filled on its fetch
schedule and poisoned on release, so a schedule bug fails with wrong values on CPU. A test
parametrized over backends runs the checked variant for backend="xla" only (the Mosaic backends
have no such mode): the other combinations are deselected, not skipped."""

import pytest

import conveyor as cv

EXECUTORS = ("default", "checked")


def pytest_generate_tests(metafunc):
    metafunc.parametrize("xla_executor", EXECUTORS, indirect=True)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        mosaic_only = params.get("backend", "xla") != "xla"
        (drop if params.get("xla_executor") == "checked" and mosaic_only else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def xla_executor(request):
    if getattr(request, "param", "default") == "checked":
        with cv.pipeline.checked_schedule():
            yield "checked"
    else:
        yield "default"
