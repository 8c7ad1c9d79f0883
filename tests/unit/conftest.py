"""Hypothesis settings: these machines are shared and noisy, so no per-example deadline (a slow
example is not a failure); the example counts stay as each test sets them."""

import pytest
from hypothesis import settings

settings.register_profile("loadwise", deadline=None)
settings.load_profile("loadwise")


@pytest.fixture
def model_stub(tmp_path):
    """A directory that passes EngineSpec's model check (a config.json), for tests that never
    start an engine."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path

