"""The environment the suite relies on."""
import jax


def test_eight_simulated_cpu_devices():
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 8


def test_public_api():
    import conveyor as cv
    for name in ("gmm", "tgmm", "make_group_metadata"):
        assert callable(getattr(cv, name))
