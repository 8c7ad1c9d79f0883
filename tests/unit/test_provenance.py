"""What every result records about the machine: the CPU model and its instruction set."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadwise.provenance import cpu_info, describe_machine, dirty_warning, provenance

AMD_AVX2 = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx fma avx2 bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
"""
INTEL_AMX = """model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8
"""
AMD_AVX512 = """model name\t: AMD EPYC
flags\t\t: avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
"""


@pytest.mark.parametrize(("text", "model", "isa"), [
    (AMD_AVX2, "AMD EPYC 7B13", "AVX2"),
    (INTEL_AMX, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "AMX"),
    (AMD_AVX512, "AMD EPYC", "AVX-512+BF16"),
])
def test_cpu_model_and_isa_label(text: str, model: str, isa: str) -> None:
    info = cpu_info(text)
    assert info["cpu_model"] == model and info["isa"] == isa


def test_isa_flags_are_the_relevant_ones_in_a_fixed_order() -> None:
    assert cpu_info(INTEL_AMX)["isa_flags"] == [
        "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
        "amx_tile", "amx_bf16", "amx_int8"]
    assert cpu_info(AMD_AVX2)["isa_flags"] == ["avx2", "fma"]
    assert cpu_info("")["isa"] == "unknown"


def test_this_machine_is_recorded_with_its_isa() -> None:
    machine = provenance()["machine"]
    assert machine["isa"] in ("AVX2", "AVX-512", "AVX-512+BF16", "AMX", "unknown")
    assert machine["cpu_model"] and machine["cpus"] >= 1
    assert machine["isa"] in describe_machine(machine)


def test_a_dirty_tree_is_said_and_a_clean_one_is_not() -> None:
    assert dirty_warning({"git_sha": "abc123"}) is None
    assert dirty_warning({"git_sha": None}) is None
    warning = dirty_warning({"git_sha": "abc123-dirty"})
    assert warning is not None and "dirty tree (abc123-dirty)" in warning


def _repo(tmp_path: Path) -> Path:
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x")
    return tmp_path


def test_an_untracked_module_under_src_or_benchmarks_makes_the_sha_dirty(tmp_path: Path) -> None:
    """A new module or benchmark script runs without being in any commit: the sha says so.
    Results written under benchmarks/results/ and files elsewhere do not."""
    from loadwise.provenance import git_sha

    repo = _repo(tmp_path)
    clean = git_sha(repo)
    assert clean is not None and not clean.endswith("-dirty")
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "run-1.json").write_text("{}")
    (repo / "notes.txt").write_text("x")
    assert git_sha(repo) == clean
    (repo / "src" / "pkg").mkdir(parents=True)
    (repo / "src" / "pkg" / "new.py").write_text("x = 1\n")
    assert git_sha(repo) == clean + "-dirty"
    (repo / "src" / "pkg" / "new.py").unlink()
    (repo / "benchmarks" / "new_bench.py").write_text("x = 1\n")
    assert git_sha(repo) == clean + "-dirty"
