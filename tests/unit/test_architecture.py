"""The architecture checks CI runs before the tests (import-linter's contracts in .importlinter,
scripts/deadcode.py), and proof that each catches what it checks for: a violation planted in a
copy of the source fails it, naming the offending import or name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH first: the copy's loadwise shadows the installed one; scripts/ holds the
    # contract type .importlinter names.
    path = f"{root / 'src'}:{ROOT / 'scripts'}"
    return subprocess.run([str(LINT), "--config", str(root / ".importlinter"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=300, check=False,
                          env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"})


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "src" / "loadwise", tmp_path / "src" / "loadwise",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    for d in ("tests", "benchmarks"):
        (tmp_path / d).mkdir()
    return tmp_path


def plant(copy: Path, module: str, line: str) -> None:
    path = copy / "src" / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_contracts_hold_on_this_tree() -> None:
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_pure_module_importing_torch_breaks_a_contract(copy: Path) -> None:
    plant(copy, "loadwise.policy.table", "import torch  # noqa")
    out = lint(copy)
    assert out.returncode != 0
    assert "loadwise.policy.table -> torch" in out.stdout


def test_a_new_capabilitys_config_is_pure_by_pattern_without_editing_a_list(copy: Path) -> None:
    """A capability package that did not exist when the contract was written: its config and
    extension modules are covered by the ``loadwise.*.config`` / ``*.extension`` patterns."""
    pkg = copy / "src" / "loadwise" / "newcap"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("import torch  # noqa\n")
    out = lint(copy)
    assert out.returncode != 0
    assert "loadwise.newcap.config -> torch" in out.stdout


def test_a_new_module_of_a_capability_is_pure_unless_its_name_says_glue(copy: Path) -> None:
    """Modules that did not exist when the contract was written: one in a capability package
    breaks the contract when it imports torch; one whose name says glue (``*_worker``) may."""
    media = copy / "src" / "loadwise" / "kvstore" / "media"
    (media / "newmedium.py").write_text("import torch  # noqa\n")
    (copy / "src" / "loadwise" / "kvstore" / "handoff" / "nixl_worker.py").write_text(
        "import torch  # noqa\n")
    out = lint(copy)
    assert out.returncode != 0
    assert "loadwise.kvstore.media.newmedium -> torch" in out.stdout
    assert "nixl_worker" not in out.stdout


def test_what_the_contract_calls_glue() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from lint_contracts import is_glue
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    glue = {"engine", "worker", "train"}
    for name in ("engine", "worker", "handoff.pull_worker", "train_data", "connector.x.engine"):
        assert is_glue(name, glue), name
    for name in ("", "plan", "handoff.pull", "workers", "retrain", "media.extents.store",
                 "engine2", "trained"):
        assert not is_glue(name, glue), name


def test_an_upward_import_and_the_cycle_it_makes_break_the_contracts(copy: Path) -> None:
    plant(copy, "loadwise.config.platform", "from loadwise.cli import common  # noqa")
    out = lint(copy)
    assert out.returncode != 0
    assert "loadwise.config is not allowed to import loadwise.cli" in out.stdout
    assert "No import cycle between sibling packages BROKEN" in out.stdout


def test_deadcode_passes_here_and_names_a_planted_unused_function(copy: Path) -> None:
    script = ROOT / "scripts" / "deadcode.py"
    here = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False,
                          timeout=300)
    assert here.returncode == 0, here.stdout
    plant(copy, "loadwise.policy.table", "def never_called_anywhere() -> None:\n    return")
    out = subprocess.run([sys.executable, str(script), str(copy)], capture_output=True, check=False,
                         text=True, timeout=300)
    assert out.returncode == 1
    assert "unused function 'never_called_anywhere'" in out.stdout


def test_no_function_in_src_is_longer_than_80_lines() -> None:
    """Small functions: one longer than 80 lines (decorators and docstring included) is split
    where its steps are."""
    import ast

    src = Path(__file__).resolve().parents[2] / "src"
    long = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(src)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


# Where catching every exception is the behaviour itself, not a guard against loadwise's bugs:
# the KV connector reports a failed lookup, load or handoff to vLLM as a miss or as load errors
# (vLLM recomputes those blocks), a store's writer thread outlives any one block (the drop is
# counted), a metrics report never costs a step, the tokenizer probe's failure means "no tool
# header"; the ISA site hook must never stop an interpreter; an in-process engine's shutdown is
# best effort. Everywhere else inside vLLM, config.extension.FailOpen is the one guard.
FAILURE_IS_THE_RESULT = {
    "loadwise/config/extension.py",  # the guard itself
    "loadwise/kvstore/connector/__init__.py", "loadwise/kvstore/connector/markers.py",
    "loadwise/kvstore/connector/scheduler_side.py", "loadwise/kvstore/connector/worker_side.py",
    "loadwise/kvstore/media/writer.py",
    "loadwise/kvstore/handoff/pull_worker.py", "loadwise/kvstore/handoff/pull_transport.py",
    "loadwise/kvstore/handoff/worker.py", "loadwise/vllm/isa_site/sitecustomize.py",
    "loadwise/vllm/local.py",
}


def test_every_catch_all_is_the_fail_open_guard_or_a_reported_result() -> None:
    import ast

    src = ROOT / "src"
    found = set()
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and isinstance(node.type, ast.Name) \
                    and node.type.id == "Exception":
                found.add(str(path.relative_to(src)))
    assert found <= FAILURE_IS_THE_RESULT, sorted(found - FAILURE_IS_THE_RESULT)
