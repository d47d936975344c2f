from pathlib import Path

import pytest

from torchpipedream.profiles import reference_profile_path


@pytest.fixture(scope="session")
def reference_profiles() -> Path:
    """The folder of PipeDream's reference profiles that ships inside the package."""
    return reference_profile_path("vgg16").parent.parent
