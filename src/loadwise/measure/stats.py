"""Pure statistics over step records: step-time samples and acceptance counts."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadwise.measure.records import StepRecord
from loadwise.policy.goodput import Acceptance, StepTimes


@dataclass(frozen=True, slots=True)
class Summary:
    median: float
    p25: float
    p75: float
    n: int

    @property
    def rel_spread(self) -> float:
        """Inter-quartile range relative to the median."""
        return (self.p75 - self.p25) / self.median if self.median else 0.0


def summarize(samples: Sequence[float]) -> Summary:
    if not samples:
        raise ValueError("no samples to summarize")
    s = sorted(samples)
    if len(s) == 1:
        return Summary(s[0], s[0], s[0], 1)
    q = statistics.quantiles(s, n=4, method="inclusive")
    return Summary(statistics.median(s), q[0], q[2], len(s))



@dataclass(frozen=True, slots=True)
class MedianInterval:
    """A distribution-free confidence interval for a median: the order statistics
    ``x_(j) <= median <= x_(n+1-j)``; ``coverage`` is the probability that such an interval
    holds the true median of any continuous distribution: 1 - 2 P(Binomial(n, 1/2) < j)."""

    low: float
    high: float
    coverage: float


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks); 0 where either side is constant."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2")
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return 0.0 if va == 0 or vb == 0 else cov / (va * vb) ** 0.5


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b (ties on either side corrected for, as for lengths cut at max_tokens);
    0 where either side is constant. O(n^2): for held-out sets of a few thousand."""
    n = len(a)
    if n != len(b) or n < 2:
        raise ValueError("kendall_tau_b needs two sequences of the same length, at least 2")
    concordant = discordant = ties_a = ties_b = 0
    for i in range(n):
        ai, bi = a[i], b[i]
        for j in range(i + 1, n):
            da, db = a[j] - ai, b[j] - bi
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return 0.0 if denom == 0 else (concordant - discordant) / denom


def sign_test_tail(n_at_least: int, n: int) -> float:
    """P(at least ``n_at_least`` of ``n`` fair coin flips come up heads): the one-sided tail of
    a sign test, where each sample lies above (or below) zero with probability 1/2."""
    if n < 0:
        raise ValueError(f"need n >= 0 samples, got {n}")
    return sum(math.comb(n, i) for i in range(max(n_at_least, 0), n + 1)) / (1 << n)


def median_interval(samples: Sequence[float], confidence: float = 0.9) -> MedianInterval:
    """The narrowest symmetric order-statistic interval whose coverage is at least
    ``confidence``. With too few samples for that (n=4 reaches 0.875 at most), the widest one,
    (min, max), with the lower coverage it really has: the caller reports it, never rounds up.
    Assumes independent samples (here: rounds of an interleaved comparison)."""
    if not samples:
        raise ValueError("no samples for a median interval")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    s = sorted(samples)
    n = len(s)

    def coverage(j: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(j)) / (1 << n)

    j = 1
    # Step inwards while the next interval still holds the confidence; j <= n + 1 - j.
    while 2 * (j + 1) <= n + 1 and coverage(j + 1) >= confidence:
        j += 1
    return MedianInterval(s[j - 1], s[n - j], coverage(j))


# Coverage of +-1 standard error of a normal estimate.
ONE_SE_COVERAGE = 0.6827


def median_rel_se(samples: Sequence[float]) -> float:
    """One standard error of a sample median, relative to it: half the width of its
    distribution-free interval (``median_interval`` at ~68 %) divided by the normal quantile of
    the coverage that interval really has (order statistics overshoot: 76-85 % at 12-19
    samples), over the median. A single sample has no spread to measure: 0. Consecutive engine
    steps are not fully independent, so this is a lower bound on the real uncertainty."""
    med = summarize(samples).median
    if len(samples) < 2 or med == 0:
        return 0.0
    iv = median_interval(samples, ONE_SE_COVERAGE)
    z = statistics.NormalDist().inv_cdf((1.0 + iv.coverage) / 2.0)
    return (iv.high - iv.low) / 2.0 / z / abs(med)


@dataclass(slots=True)
class AcceptanceCounter:
    """Sums vLLM's per-step spec-decode counts into prefix acceptance and draft rate.

    ``u_i`` is estimated as accepted at position i / drafts that reached position i: a draft
    shorter than i (prompt lookup near the end of the context) says nothing about position i.
    ``request_steps`` counts decode request-steps taken while speculation was on (k > 0 chosen
    for them), so ``draft_rate`` is the share of those that actually got a draft.
    """

    max_k: int
    num_drafts: int = 0
    request_steps: int = 0
    accepted_per_pos: list[int] | None = None
    drafted_per_pos: list[int] | None = None
    # Prompt tokens prefilled and output tokens produced while serving the workload: their ratio
    # prices prefill into closed-loop throughput predictions.
    prompt_tokens: int = 0
    output_tokens: int = 0

    def __post_init__(self) -> None:
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.max_k
        self.drafted_per_pos = self.drafted_per_pos or [0] * self.max_k

    def add(self, record: StepRecord, speculating: bool = True) -> None:
        assert self.accepted_per_pos is not None and self.drafted_per_pos is not None
        self.num_drafts += record.num_drafts
        self.prompt_tokens += record.num_prefill_tokens
        self.output_tokens += record.num_decode_reqs + record.num_accepted_tokens
        if speculating:
            self.request_steps += record.num_decode_reqs
        for i in range(min(self.max_k, len(record.accepted_per_pos))):
            self.accepted_per_pos[i] += record.accepted_per_pos[i]
            self.drafted_per_pos[i] += record.draft_tokens_per_pos[i]

    def add_all(self, records: Iterable[StepRecord], prev_k: int | None = None) -> None:
        """Add a contiguous run of records; a step counts as speculating when the previous step
        chose k > 0 for it (drafts are proposed one step ahead)."""
        for r in records:
            self.add(r, speculating=prev_k is None or prev_k > 0)
            prev_k = r.k_next

    def acceptance(self) -> Acceptance:
        assert self.accepted_per_pos is not None and self.drafted_per_pos is not None
        if self.num_drafts == 0:
            raise ValueError("no drafts were observed: cannot estimate acceptance")
        return Acceptance.from_position_counts(self.num_drafts, self.drafted_per_pos,
                                               self.accepted_per_pos, self.request_steps or None)

    @property
    def prompt_per_output(self) -> float:
        return self.prompt_tokens / self.output_tokens if self.output_tokens else 0.0

    def to_json(self) -> dict[str, object]:
        return {"max_k": self.max_k, "num_drafts": self.num_drafts,
                "request_steps": self.request_steps, "accepted_per_pos": self.accepted_per_pos,
                "drafted_per_pos": self.drafted_per_pos, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> AcceptanceCounter:
        return cls(
            max_k=int(d["max_k"]),  # type: ignore[call-overload]
            num_drafts=int(d["num_drafts"]),  # type: ignore[call-overload]
            request_steps=int(d["request_steps"]),  # type: ignore[call-overload]
            accepted_per_pos=[int(x) for x in d["accepted_per_pos"]],  # type: ignore[attr-defined]
            drafted_per_pos=[int(x) for x in d["drafted_per_pos"]],  # type: ignore[attr-defined]
            prompt_tokens=int(d.get("prompt_tokens", 0)),  # type: ignore[call-overload]
            output_tokens=int(d.get("output_tokens", 0)),  # type: ignore[call-overload]
        )


def decode_part_s(record: StepRecord, times: StepTimes) -> float:
    """T of a step's decoding part: its decoding requests, each verifying the drafts they really
    verified (a pure prefill step still pays the fixed cost of a step of one)."""
    decode = max(record.num_decode_reqs, 1)
    return times.at(decode, min(record.num_draft_tokens / decode, times.max_k))


def prefill_s_per_token(records: Iterable[StepRecord], times: StepTimes) -> float | None:
    """Extra step time per prefilled prompt token: steps that mix prefill into decoding cost
    T(b, drafts) plus this much per prompt token (least squares through the origin)."""
    num = 0.0
    den = 0.0
    for r in records:
        if r.num_prefill_tokens <= 0:
            continue
        num += (r.step_time_s - decode_part_s(r, times)) * r.num_prefill_tokens
        den += r.num_prefill_tokens**2
    return max(num / den, 0.0) if den else None
