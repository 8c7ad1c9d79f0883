"""Dead code in src/: what vulture finds unused anywhere in src/, tests/ and benchmarks/ (a
function only a benchmark calls is public API, not dead), less the names in
scripts/vulture_whitelist.py and the hooks capabilities name by ``module:function`` in their
``extension.py`` (the plugin loads them by path; a unit test imports each one). Prints each finding and exits 1 when there is any.

    .venv/bin/python scripts/deadcode.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import vulture

MIN_CONFIDENCE = 60


def registered_hooks(src: Path) -> set[tuple[Path, str]]:
    """(file, function) of every ``"loadwise.module:function"`` string in an extension.py."""
    hooks = set()
    for ext in src.glob("loadwise/**/extension.py"):
        for node in ast.walk(ast.parse(ext.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("loadwise.") and ":" in node.value:
                module, _, name = node.value.partition(":")
                hooks.add(((src / module.replace(".", "/")).with_suffix(".py").resolve(), name))
    return hooks


def findings(root: Path) -> list[str]:
    v = vulture.Vulture()
    v.scavenge([str(root / d) for d in ("src", "tests", "benchmarks") if (root / d).is_dir()]
               + [str(Path(__file__).with_name("vulture_whitelist.py"))])
    src = (root / "src").resolve()
    hooks = registered_hooks(src)
    out = []
    for item in v.get_unused_code(min_confidence=MIN_CONFIDENCE):
        path = Path(item.filename).resolve()
        if path.is_relative_to(src) and (path, item.name) not in hooks:
            out.append(f"{path.relative_to(root.resolve())}:{item.first_lineno}: unused "
                       f"{item.typ} {item.name!r} ({item.confidence}% confidence)")
    return out


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    found = findings(root)
    for line in found:
        print(line)
    print(f"deadcode: {len(found)} finding(s) in {root / 'src'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
