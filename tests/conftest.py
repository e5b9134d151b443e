import os

# 8 simulated CPU devices, before JAX's backend starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

import autoshard  # noqa: E402


@pytest.fixture(scope="session")
def mesh_1d():
    return autoshard.make_mesh((8,), ("data",))


@pytest.fixture(scope="session")
def mesh_2d():
    return autoshard.make_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="session", params=["mesh_1d", "mesh_2d"])
def mesh(request):
    return request.getfixturevalue(request.param)


def pytest_configure(config):
    assert len(jax.devices()) >= 8, "tests need 8 simulated CPU devices"
