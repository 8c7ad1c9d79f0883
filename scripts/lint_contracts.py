"""loadwise's own import-linter contract type (``.importlinter`` names it; lint-imports runs with
``scripts/`` on PYTHONPATH).

``pure_by_name``: every module of each capability package is pure (never imports torch, vLLM or
transformers, directly or not) unless its name says it is glue: a name part that is one of
``glue`` (``engine``, ``worker``, ...), starts with ``<glue>_`` or ends with ``_<glue>``. So a new
module of a capability is covered the moment it exists, and glue is visible in its path."""

from __future__ import annotations

from typing import Any

from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.domain import fields
from importlinter.domain.imports import ModuleExpression


def is_glue(relative: str, glue: set[str]) -> bool:
    """Whether a module's name below its capability package (``handoff.pull_worker``) says glue."""
    # A part without "_" is its own first and last word.
    return any(part.partition("_")[0] in glue or part.rpartition("_")[2] in glue
               for part in relative.split("."))


class PureByName(ForbiddenContract):
    type_name = "pure_by_name"

    capability_packages = fields.ListField(subfield=fields.StringField())
    glue = fields.ListField(subfield=fields.StringField())
    source_modules = fields.SetField(subfield=fields.ModuleExpressionField(), required=False)

    def check(self, graph: Any, verbose: bool) -> Any:
        glue = set(self.glue)  # type: ignore[arg-type]
        names = []
        for package in self.capability_packages:  # type: ignore[attr-defined]
            for module in sorted({package, *graph.find_descendants(package)}):
                if not is_glue(module.removeprefix(package).lstrip("."), glue):
                    names.append(module)
        self.source_modules = {ModuleExpression(n) for n in names}  # type: ignore[assignment]
        self.as_packages = False  # type: ignore[assignment]
        return super().check(graph, verbose)
