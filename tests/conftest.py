import os
from pathlib import Path

import pytest

from torchpipedream.model.profiles import reference_profile_path


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (README's test command runs two test processes on this two-core
    machine), torch in each test process on one thread: two processes of two threads each
    oversubscribe the cores, and OpenMP's spinning threads then burn the time the other needs."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def reference_profiles() -> Path:
    """The folder of PipeDream's reference profiles that ships inside the package."""
    return reference_profile_path("vgg16").parent.parent


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (timings and profiles as the workers see them), restored after."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
