"""Records of a batch-invariance check: what each request produced, which differ bitwise from
the same request run alone, and the counts per condition.

Pure Python (no torch or vLLM): the checker fills these from a real engine; tests and reports
read them back with ``from_json``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's greedy output: its token ids and each sampled token's logprob."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def logprob_bits(self) -> tuple[bytes, ...]:
        # Bitwise: -0.0 and 0.0 differ, and a NaN equals only the same NaN.
        return tuple(struct.pack("<d", x) for x in self.logprobs)

    def to_json(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids), "logprobs": list(self.logprobs)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Sample:
        return cls(tuple(int(t) for t in d["token_ids"]), tuple(float(x) for x in d["logprobs"]))


def difference(reference: Sample, got: Sample) -> str | None:
    """None if ``got`` is bit-identical to ``reference``; else "tokens" (some token id differs,
    or the lengths do) or "logprobs" (same tokens, some logprob's bits differ)."""
    if reference.token_ids != got.token_ids:
        return "tokens"
    if reference.logprob_bits() != got.logprob_bits():
        return "logprobs"
    return None


@dataclass(frozen=True, slots=True)
class Condition:
    """How a pass ran: the engine's mode and threads, chunked prefill, requests in flight,
    whether the prompts' prefixes were cached, and whether the engine is a restarted one."""

    mode: str  # "default" | "invariant"
    threads: int
    chunked_prefill: bool
    concurrency: int
    prefix_cache: str  # "miss" | "hit"
    restarted: bool = True


@dataclass(frozen=True, slots=True)
class PassResult:
    condition: Condition
    num_requests: int
    token_diffs: int  # requests whose token ids differ from the reference
    logprob_diffs: int  # requests with equal tokens whose logprobs differ bitwise
    wall_s: float
    output_tokens: int
    differing: tuple[int, ...] = ()  # prompt indices, for a look at what differed
    cached_prompt_tokens: int = 0  # prompt tokens served from vLLM's prefix cache in the pass

    @property
    def num_differ(self) -> int:
        return self.token_diffs + self.logprob_diffs

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["differing"] = list(self.differing)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PassResult:
        return cls(condition=Condition(**d["condition"]), num_requests=int(d["num_requests"]),
                   token_diffs=int(d["token_diffs"]), logprob_diffs=int(d["logprob_diffs"]),
                   wall_s=float(d["wall_s"]), output_tokens=int(d["output_tokens"]),
                   differing=tuple(d.get("differing", ())),
                   cached_prompt_tokens=int(d.get("cached_prompt_tokens", 0)))


def compare_pass(condition: Condition, reference: Sequence[Sample], got: Sequence[Sample],
                 wall_s: float, cached_prompt_tokens: int = 0) -> PassResult:
    """Each request of a pass against the same prompt's reference (same order)."""
    if len(reference) != len(got):
        raise ValueError(f"{len(got)} outputs for {len(reference)} reference requests")
    kinds = [difference(r, g) for r, g in zip(reference, got)]
    return PassResult(condition, len(got), kinds.count("tokens"), kinds.count("logprobs"),
                      wall_s, sum(len(g.token_ids) for g in got),
                      tuple(i for i, k in enumerate(kinds) if k is not None),
                      cached_prompt_tokens)


@dataclass(frozen=True, slots=True)
class InvarianceReport:
    config: dict[str, Any]
    passes: tuple[PassResult, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def totals(self) -> dict[str, dict[str, int]]:
        """Per mode: requests checked and requests that differ (any bit)."""
        out: dict[str, dict[str, int]] = {}
        for p in self.passes:
            t = out.setdefault(p.condition.mode, {"requests": 0, "differ": 0, "token_diffs": 0})
            t["requests"] += p.num_requests
            t["differ"] += p.num_differ
            t["token_diffs"] += p.token_diffs
        return out

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "meta": self.meta, "totals": self.totals(),
                "passes": [p.to_json() for p in self.passes]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> InvarianceReport:
        return cls(config=dict(d["config"]), meta=dict(d.get("meta", {})),
                   passes=tuple(PassResult.from_json(p) for p in d["passes"]))


def rows(passes: Iterable[PassResult]) -> list[tuple[str, ...]]:
    """Table rows for printing: mode, threads, chunked, concurrency, cache (with the prompt
    tokens it served), differ/requests, token diffs, output tokens per second."""
    return [(p.condition.mode, str(p.condition.threads),
             "on" if p.condition.chunked_prefill else "off", str(p.condition.concurrency),
             f"{p.condition.prefix_cache} ({p.cached_prompt_tokens})",
             f"{p.num_differ}/{p.num_requests}",
             str(p.token_diffs), f"{p.output_tokens / p.wall_s:.1f}" if p.wall_s > 0 else "-")
            for p in passes]
