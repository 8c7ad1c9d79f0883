"""Draft-length tables in vLLM's `num_speculative_tokens_per_batch_size` form.

A table maps every batch size 1..max_batch_size to a draft length k (0 = no speculation).
vLLM spells it as ranges ``[[start_bs, end_bs, k], ...]``.

Invariants kept by :class:`DraftLengthTable` (checked in ``__post_init__``):
  * ranges are sorted, non-empty (start <= end), contiguous (next start = previous end + 1)
    and start at batch size 1;
  * every k satisfies 0 <= k <= max_k.
Batch sizes past the last range use the last range's k: a table is a step function that
stays flat beyond what was measured (vLLM clamps the same way, see ``lookup``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadwise.errors import LoadwiseError


class TableError(LoadwiseError, ValueError):
    """A draft-length table that is malformed; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class BatchRange:
    start_bs: int
    end_bs: int
    k: int

    def __post_init__(self) -> None:
        for name in ("start_bs", "end_bs", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TableError(f"{name} must be an integer, got {value!r}")
        if self.start_bs < 1:
            raise TableError(f"batch range [{self.start_bs}, {self.end_bs}]: start must be >= 1")
        if self.start_bs > self.end_bs:
            raise TableError(
                f"batch range [{self.start_bs}, {self.end_bs}] is empty: start must be <= end"
            )
        if self.k < 0:
            raise TableError(f"batch range [{self.start_bs}, {self.end_bs}]: k={self.k} is negative")

    def to_list(self) -> list[int]:
        return [self.start_bs, self.end_bs, self.k]


@dataclass(frozen=True, slots=True)
class DraftLengthTable:
    ranges: tuple[BatchRange, ...]
    max_k: int

    def __post_init__(self) -> None:
        if isinstance(self.max_k, bool) or not isinstance(self.max_k, int) or self.max_k < 0:
            raise TableError(f"max_k must be a non-negative integer, got {self.max_k!r}")
        if not self.ranges:
            raise TableError("table is empty: give at least one [start_bs, end_bs, k] range")
        expected_start = 1
        for r in self.ranges:
            if r.start_bs != expected_start:
                if r.start_bs < expected_start:
                    raise TableError(
                        f"batch range [{r.start_bs}, {r.end_bs}] overlaps the previous range, "
                        f"which ends at {expected_start - 1}"
                    )
                raise TableError(
                    f"batch sizes {expected_start}..{r.start_bs - 1} are not covered: ranges must be "
                    f"contiguous from 1 (range [{r.start_bs}, {r.end_bs}] starts too late)"
                )
            if r.k > self.max_k:
                raise TableError(
                    f"batch range [{r.start_bs}, {r.end_bs}] asks for k={r.k}, "
                    f"above the engine's max k={self.max_k}"
                )
            expected_start = r.end_bs + 1

    # --- construction -------------------------------------------------------------------
    @classmethod
    def parse(cls, raw: Any, max_k: int) -> DraftLengthTable:
        """Build from vLLM's list form, a JSON string of it, or a dict holding it.

        Accepts ``[[1, 64, 3], ...]``, ``'[[1,64,3]]'`` and a speculative-config dict
        (``{"num_speculative_tokens_per_batch_size": [...]}``).
        """
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise TableError(f"table is not valid JSON: {exc.msg} at position {exc.pos}") from exc
        if isinstance(raw, Mapping):
            if "num_speculative_tokens_per_batch_size" not in raw:
                raise TableError(
                    "table object has no 'num_speculative_tokens_per_batch_size' key; "
                    "give [[start_bs, end_bs, k], ...]"
                )
            raw = raw["num_speculative_tokens_per_batch_size"]
        if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
            raise TableError(f"table must be a list of [start_bs, end_bs, k], got {type(raw).__name__}")
        ranges = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, Sequence) or isinstance(entry, (str, bytes)) or len(entry) != 3:
                raise TableError(f"entry {i} is {entry!r}: each entry must be [start_bs, end_bs, k]")
            ranges.append(BatchRange(*entry))
        return cls(tuple(ranges), max_k)

    @classmethod
    def load(cls, path: str | Path, max_k: int) -> DraftLengthTable:
        """Read a table file: vLLM's list, or a JSON object as written by :meth:`dump`."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise TableError(f"cannot read table file {p}: {exc.strerror}") from exc
        try:
            return cls.parse(text, max_k)
        except TableError as exc:
            raise TableError(f"{p}: {exc}") from exc

    @classmethod
    def fixed(cls, k: int, max_k: int, max_batch_size: int = 1) -> DraftLengthTable:
        return cls((BatchRange(1, max_batch_size, k),), max_k)

    @classmethod
    def from_mapping(cls, k_by_batch_size: Mapping[int, int], max_k: int) -> DraftLengthTable:
        """Compact a per-batch-size choice into the fewest ranges.

        ``k_by_batch_size`` must cover 1..max(keys) without holes; neighbouring batch sizes
        with the same k merge into one range.
        """
        if not k_by_batch_size:
            raise TableError("cannot build a table from an empty mapping")
        top = max(k_by_batch_size)
        missing = [b for b in range(1, top + 1) if b not in k_by_batch_size]
        if missing or min(k_by_batch_size) < 1:
            raise TableError(
                f"mapping must cover batch sizes 1..{top} exactly; missing {missing[:5]}"
            )
        ranges: list[BatchRange] = []
        start = 1
        for b in range(2, top + 2):
            if b == top + 1 or k_by_batch_size[b] != k_by_batch_size[start]:
                ranges.append(BatchRange(start, b - 1, k_by_batch_size[start]))
                start = b
        return cls(tuple(ranges), max_k)

    # --- use ----------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.ranges[-1].end_bs

    def lookup(self, batch_size: int) -> int:
        """k for ``batch_size``; sizes past the last range take the last range's k."""
        if batch_size < 1:
            raise TableError(f"batch size must be >= 1, got {batch_size}")
        for r in self.ranges:
            if batch_size <= r.end_bs:
                return r.k
        return self.ranges[-1].k

    def to_mapping(self, max_batch_size: int | None = None) -> dict[int, int]:
        top = self.max_batch_size if max_batch_size is None else max_batch_size
        return {b: self.lookup(b) for b in range(1, top + 1)}

    def to_vllm(self) -> list[list[int]]:
        return [r.to_list() for r in self.ranges]

    def to_json(self) -> str:
        return json.dumps(self.to_vllm())

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps({"max_k": self.max_k, "num_speculative_tokens_per_batch_size": self.to_vllm()},
                       indent=2) + "\n"
        )

    def clamped(self, max_k: int) -> DraftLengthTable:
        """The same ranges with every k capped at ``max_k`` (for docs tables on smaller engines)."""
        merged = {b: min(k, max_k) for b, k in self.to_mapping().items()}
        return DraftLengthTable.from_mapping(merged, max_k)

    def __str__(self) -> str:
        return self.to_json()


def lookup_vllm(vllm_table: list[list[int]], batch_size: int) -> int:
    """k of a table in vLLM's JSON form (``[[start_bs, end_bs, k], ...]``, as stored in result
    files); sizes past the last range take its k, as in :meth:`DraftLengthTable.lookup`."""
    for _, end_bs, k in vllm_table:
        if batch_size <= end_bs:
            return int(k)
    return int(vllm_table[-1][2])
