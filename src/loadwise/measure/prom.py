"""Read vLLM's spec-decode counters from a Prometheus `/metrics` page."""

from __future__ import annotations

from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class SpecCounters:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(a - b for a, b in zip(self.accepted_per_pos, earlier.accepted_per_pos)),
        )

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def parse_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def totals(text: str, prefix: str) -> dict[str, float]:
    """Every sample whose name starts with ``prefix``, summed over its labels."""
    out: dict[str, float] = {}
    for name, samples in parse_samples(text).items():
        if name.startswith(prefix):
            out[name] = sum(v for _, v in samples)
    return out


def spec_counters(text: str) -> SpecCounters:
    samples = parse_samples(text)

    def total(name: str) -> int:
        return int(sum(v for _, v in samples.get(name, [])))

    per_pos: dict[int, float] = {}
    for labels, value in samples.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", []):
        pos = int(labels["position"])
        per_pos[pos] = per_pos.get(pos, 0.0) + value
    return SpecCounters(
        num_drafts=total("vllm:spec_decode_num_drafts_total"),
        num_draft_tokens=total("vllm:spec_decode_num_draft_tokens_total"),
        num_accepted_tokens=total("vllm:spec_decode_num_accepted_tokens_total"),
        accepted_per_pos=tuple(int(per_pos[p]) for p in sorted(per_pos)),
    )


def fetch_metrics(url: str, timeout_s: float = 5.0) -> str:
    resp = requests.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return resp.text
