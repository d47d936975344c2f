from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE_PROFILES = REPO.parent / "shared" / "reference_profiles"


@pytest.fixture(scope="session")
def reference_profiles() -> Path:
    if not REFERENCE_PROFILES.is_dir():
        pytest.skip(f"reference profiles not found at {REFERENCE_PROFILES}")
    return REFERENCE_PROFILES
