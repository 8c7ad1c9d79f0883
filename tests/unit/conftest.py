"""Hypothesis settings: these machines are shared and noisy, so no per-example deadline (a slow
example is not a failure); the example counts stay as each test sets them."""

from hypothesis import settings

settings.register_profile("loadwise", deadline=None)
settings.load_profile("loadwise")
