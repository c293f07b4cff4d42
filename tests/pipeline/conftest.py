"""Pipeline tests run the xla backend in its checked mode: the plan's slots are real buffers,
filled on its fetch schedule and poisoned on release, so a schedule bug fails these tests with
wrong values on CPU (tests/pipeline/test_checked_schedule.py holds the fast path to the same
answers). Mosaic backends are unaffected."""
import pytest

import conveyor as cv


@pytest.fixture(autouse=True)
def _checked_xla_schedule():
    with cv.pipeline.checked_schedule():
        yield
