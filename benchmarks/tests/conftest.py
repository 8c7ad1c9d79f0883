"""Tests of the benchmark scripts' own logic. The scripts run as ``python benchmarks/NAME.py``,
where Python puts benchmarks/ first on sys.path and they import their siblings from there;
their tests see them the same way. Product logic is tested under tests/, never here."""

import sys
from pathlib import Path

from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

settings.register_profile("loadwise", deadline=None)
settings.load_profile("loadwise")
