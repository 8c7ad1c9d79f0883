"""measure_step_times' sampling logic against a scripted engine (the real one is covered by the
integration tests): every (b, k) is timed, and a point hit by a noise burst is re-timed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from loadwise.measure.records import StepRecord
from loadwise.measure.stats import summarize
from loadwise.measure.workloads import timing_prompts
from loadwise.policy.table import DraftLengthTable
from loadwise.tune import TuneConfig, measure_step_times, noisy_points


def true_step_s(b: int, k: int) -> float:
    return 0.05 + 0.002 * b * (1 + k)


class ScriptedEngine:
    """Steps take true_step_s(b, k), except while ``burst`` says a noise burst is on; a new
    request's first step is its prefill."""

    def __init__(self, burst: Any = lambda b, k, n: False) -> None:
        self.spec = SimpleNamespace(max_k=3, max_num_seqs=8)  # what the timing loop reads
        self.table = DraftLengthTable.fixed(3, 3, 8)
        self.active: list[bool] = []  # per request: prefilled yet?
        self.records: list[StepRecord] = []
        self.burst = burst
        self.steps_at: dict[tuple[int, int], int] = {}

    def set_table(self, table: DraftLengthTable) -> None:
        self.table = table

    def add(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
        self.active.append(False)
        return str(len(self.active))

    def step(self) -> list[Any]:
        b = len(self.active)
        prefill = sum(not p for p in self.active)
        k = self.table.lookup(b)
        n = self.steps_at.get((b, k), 0)
        self.steps_at[(b, k)] = n + 1
        t = true_step_s(b, k) * (5.0 if self.burst(b, k, n) else 1.0)
        decode = b - prefill
        self.records.append(StepRecord(len(self.records), t, b, decode, 100 * prefill,
                                       decode * k, decode if k else 0, k,
                                       tuple([0] * 3), tuple([decode if k else 0] * 3)))
        self.active = [True] * b
        return []

    def abort_all(self) -> None:
        self.active = []

    def num_records(self) -> int:
        return len(self.records)

    def records_since(self, index: int) -> list[StepRecord]:
        return self.records[index:]


def test_every_point_is_timed_at_its_true_step_time() -> None:
    engine = ScriptedEngine()
    cfg = TuneConfig(batch_sizes=(1, 4), rounds=2, steps_per_point=3)
    retimed: list[tuple[int, int]] = []
    samples, drafts = measure_step_times(engine, cfg, timing_prompts(), lambda _: None, retimed)
    assert set(samples) == {(b, k) for b in (1, 4) for k in range(4)}
    for (b, k), v in samples.items():
        assert len(v) == 2 * 3 and summarize(v).median == true_step_s(b, k)
        assert drafts[(b, k)] == k
    assert retimed == []


def test_a_noise_burst_is_retimed_until_the_median_is_the_step_time() -> None:
    # The first 4 timed steps at (4, 2) come out 5x slow: with 2 rounds x 3 steps (plus the
    # switch steps) the median is polluted, and the spread flags it.
    def burst(b: int, k: int, n: int) -> bool:
        return (b, k) == (4, 2) and 3 <= n < 8

    engine = ScriptedEngine(burst)
    cfg = TuneConfig(batch_sizes=(1, 4), rounds=2, steps_per_point=3, extra_rounds=2)
    retimed: list[tuple[int, int]] = []
    samples, _ = measure_step_times(engine, cfg, timing_prompts(), lambda _: None, retimed)
    assert retimed and set(retimed) == {(4, 2)}
    assert summarize(samples[(4, 2)]).median == true_step_s(4, 2)
    # Without extra rounds the burst decides the median.
    plain, _ = measure_step_times(ScriptedEngine(burst), TuneConfig(
        batch_sizes=(1, 4), rounds=2, steps_per_point=3, extra_rounds=0), timing_prompts(),
        lambda _: None)
    assert summarize(plain[(4, 2)]).median > true_step_s(4, 2)
    assert noisy_points(plain, cfg.max_spread) == [(4, 2)]
