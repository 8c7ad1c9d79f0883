"""The verdict table: on the console, as markdown, and inside the docs' generated blocks
(``<!-- verdicts GROUP -->`` … ``<!-- /verdicts -->``: written only by ``loadwise report
verdicts --write-docs``, never by hand). Pure."""

from __future__ import annotations

import re
from collections.abc import Sequence

from loadwise.verdicts.compute import Verdict

DECLARED = {"before": "before the run", "changed": "CHANGED since the run",
            "after": "after the run", "unknown": "unknown (no commit)"}
RULE_WORDS = {"value": "the value", "median": "median of samples",
              "all": "every sample", "median_interval": "median's interval"}
BLOCK = re.compile(r"(<!-- verdicts (\S+) -->\n)(.*?)(<!-- /verdicts -->)", re.DOTALL)


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    if x == 0 or 0.01 <= abs(x) < 1e5:
        return f"{x:.4g}" if abs(x) < 10 else f"{x:,.1f}".removesuffix(".0")
    return f"{x:.3g}"


def measured_text(v: Verdict) -> str:
    out = fmt(v.measured) + (f" {v.unit}" if v.unit and v.measured is not None else "")
    if v.interval is not None:
        out += f" [{fmt(v.interval[0])}, {fmt(v.interval[1])}]"
    return out


def bound_text(v: Verdict) -> str:
    return ("≤ " if v.direction == "at_most" else "≥ ") + fmt(v.bound) + \
        (f" {v.unit}" if v.unit else "")


def result_text(v: Verdict) -> str:
    if v.file is None:
        return "no result yet"
    name = v.file.removeprefix("benchmarks/results/")
    return f"`{name}` @ {(v.git_sha or '?')[:10]}"


def rows(verdicts: Sequence[Verdict]) -> list[list[str]]:
    return [[v.id, measured_text(v), bound_text(v), v.verdict, RULE_WORDS[v.rule],
             result_text(v), declared_text(v)] for v in verdicts]


def declared_text(v: Verdict) -> str:
    out = DECLARED[v.declared]
    if v.fixed_changed:
        out += "; " + ", ".join(f"`{p}`" for p in v.fixed_changed) + \
            " changed after the first result"
    return out


HEADER = ["target", "measured", "bound", "verdict", "rule", "result", "target declared"]


def markdown(verdicts: Sequence[Verdict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(verdicts)]
    details = [f"- `{v.id}`: {v.claim}" + (f". Read: {v.detail}" if v.detail else "")
               for v in verdicts]
    return "\n".join(lines + [""] + details) + "\n"


def text(verdicts: Sequence[Verdict]) -> str:
    table = [HEADER] + rows(verdicts)
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
           for r in table]
    counts = {s: sum(v.verdict == s for v in verdicts) for s in ("met", "missed", "unresolved")}
    flagged = sum(v.target_changed for v in verdicts)
    out.append(f"{len(verdicts)} targets: {counts['met']} met, {counts['missed']} missed, "
               f"{counts['unresolved']} unresolved; {flagged} judged by a result measured "
               "before its target was committed as it is now")
    return "\n".join(out) + "\n"


def fill_blocks(doc: str, verdicts: Sequence[Verdict]) -> tuple[str, list[str]]:
    """The doc with every generated block rewritten from the verdicts of its group; the groups
    its blocks name that no target has (an error for the caller to report)."""
    unknown: list[str] = []

    def repl(m: re.Match[str]) -> str:
        group = m.group(2)
        mine = [v for v in verdicts if v.group == group]
        if not mine:
            unknown.append(group)
            return m.group(0)
        return m.group(1) + markdown(mine) + m.group(4)

    return BLOCK.sub(repl, doc), unknown
