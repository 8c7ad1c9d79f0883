"""Ordering by predicted remaining work (loadwise.sched.order): the cost unit, the conditional
remaining output, priorities, aging and SRPT's preemptions, with fake requests; and the aging
bound over a simulated engine whose predictions are adversarial."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadwise.config.schedule import ScheduleConfig, ScheduleConfigError
from loadwise.sched.order import (
    AGED_OFFSET,
    RequestView,
    expected_remaining_output,
    preemptions,
    priority,
    remaining_work,
)

SRPT = ScheduleConfig("srpt", oracle_file="/dev/null")
SJF = ScheduleConfig("sjf", oracle_file="/dev/null")


def view(rid: str, mu: float, *, arrival_s: float = 0.0, out: int = 0, prompt: int = 10,
         computed: int | None = None, max_tokens: int = 512, sigma: float = 0.5,
         preempted: int = 0) -> RequestView:
    done = prompt + out if computed is None else computed
    return RequestView(rid, arrival_s, prompt, max_tokens, mu, sigma, done, out, preempted)


# --- the cost unit --------------------------------------------------------------------------
def test_remaining_work_counts_prefill_in_decode_steps() -> None:
    cfg = replace(SRPT, prefill_token_cost=0.5)
    fresh = view("a", math.log(100), sigma=1e-6, computed=0, prompt=40)
    assert remaining_work(fresh, cfg) == pytest.approx(40 * 0.5 + 100, rel=1e-3)
    # After a preemption the generated tokens are prefilled again too.
    back = view("b", math.log(100), sigma=1e-6, out=30, computed=0, prompt=40)
    assert back.prefill_left == 70


@given(mu=st.floats(0.0, 7.0), sigma=st.floats(0.01, 2.0), max_tokens=st.integers(2, 2048),
       g1=st.integers(0, 2048), g2=st.integers(0, 2048))
def test_expected_total_grows_with_what_was_generated(mu: float, sigma: float, max_tokens: int,
                                                      g1: int, g2: int) -> None:
    """E[L | L > g] is non-decreasing in g; the remaining output is capped by max_tokens."""
    lo, hi = sorted((g1, g2))
    r_lo = expected_remaining_output(mu, sigma, lo, max_tokens)
    r_hi = expected_remaining_output(mu, sigma, hi, max_tokens)
    assert 0 <= r_lo <= max(max_tokens - lo, 0)
    assert 0 <= r_hi <= max(max_tokens - hi, 0)
    if hi < max_tokens and r_lo < max_tokens - lo and r_hi < max_tokens - hi:
        assert lo + r_lo <= hi + r_hi + 1e-6 * (hi + r_hi) + 1.0


def test_remaining_output_at_arrival_is_the_lognormal_mean() -> None:
    assert expected_remaining_output(math.log(50), 0.4, 0, 512) == pytest.approx(
        50 * math.exp(0.08), rel=1e-9)
    assert expected_remaining_output(math.log(5000), 0.4, 0, 512) == 512
    assert expected_remaining_output(2.0, 0.4, 512, 512) == 0.0


def test_a_request_past_its_prediction_is_expected_to_run_on() -> None:
    # Predicted ~20 tokens, already 200 generated: not "about to finish".
    assert expected_remaining_output(math.log(20), 0.5, 200, 4096) > 20


# --- priorities -----------------------------------------------------------------------------
def test_fcfs_priorities_are_all_equal() -> None:
    cfg = ScheduleConfig()
    assert {priority(view(str(i), i), 0.0, cfg) for i in range(5)} == {0.0}


def test_srpt_orders_by_remaining_work_and_sjf_by_work_at_arrival() -> None:
    short, long = view("s", math.log(20)), view("l", math.log(400))
    assert priority(short, 1.0, SRPT) < priority(long, 1.0, SRPT)
    assert priority(short, 1.0, SJF) < priority(long, 1.0, SJF)
    # The long one has nearly finished (and the output is capped): SRPT now puts it first,
    # SJF keeps the key it had at arrival.
    long.num_output_tokens = long.num_computed_tokens = 0
    sjf_key = priority(long, 1.0, SJF)
    capped = replace(long, max_tokens=405, num_output_tokens=400, num_computed_tokens=410)
    capped.arrival_cost = long.arrival_cost
    assert priority(capped, 1.0, SRPT) < priority(short, 1.0, SRPT)
    assert priority(capped, 1.0, SJF) == sjf_key


@given(arrivals=st.lists(st.floats(0, 100), min_size=2, max_size=20),
       mus=st.lists(st.floats(0, 8), min_size=20, max_size=20), now=st.floats(100, 300))
def test_aged_requests_go_first_in_arrival_order(arrivals: list[float], mus: list[float],
                                                 now: float) -> None:
    cfg = replace(SRPT, max_wait_s=50.0, aging_steps_per_s=1.0)
    views = [view(str(i), mus[i], arrival_s=a) for i, a in enumerate(arrivals)]
    # vLLM's order: priority, then arrival time.
    keyed = sorted(views, key=lambda v: (priority(v, now, cfg), v.arrival_s))
    aged = [v for v in keyed if now - v.arrival_s > cfg.max_wait_s]
    assert keyed[:len(aged)] == aged
    assert [v.arrival_s for v in aged] == sorted(v.arrival_s for v in aged)
    assert all(priority(v, now, cfg) < -AGED_OFFSET / 2 for v in aged)
    assert all(priority(v, now, cfg) >= -AGED_OFFSET / 2 for v in keyed[len(aged):])


# --- preemption -----------------------------------------------------------------------------
def test_srpt_preempts_the_longest_for_a_much_shorter_waiting_request() -> None:
    running = [view("r1", math.log(400), out=10), view("r2", math.log(300), out=10)]
    waiting = [view("w", math.log(10), computed=0)]
    got = preemptions(running, waiting, 0, 1.0, SRPT)
    assert [(p.victim, p.for_request) for p in got] == [("r1", "w")]
    # A free slot: the waiting request just runs.
    assert preemptions(running, waiting, 1, 1.0, SRPT) == []
    # Not preemptive, or not far enough apart: nothing.
    assert preemptions(running, waiting, 0, 1.0, SJF) == []
    close = [view("w", math.log(150), computed=0)]
    assert preemptions(running, close, 0, 1.0, SRPT) == []
    gap = replace(SRPT, preempt_min_gap_steps=1000.0)
    assert preemptions(running, waiting, 0, 1.0, gap) == []


def test_preemption_spares_aged_and_already_preempted_requests() -> None:
    cfg = replace(SRPT, max_wait_s=5.0)
    waiting = [view("w", math.log(10), arrival_s=9.0, computed=0)]
    aged = view("old", math.log(400), arrival_s=0.0, out=5)
    spent = view("spent", math.log(400), arrival_s=8.0, out=5, preempted=1)
    assert preemptions([aged, spent], waiting, 0, 10.0, cfg) == []
    fresh = view("fresh", math.log(400), arrival_s=8.0, out=5)
    assert [p.victim for p in preemptions([aged, fresh], waiting, 0, 10.0, cfg)] == ["fresh"]


def test_an_aged_waiting_request_takes_a_slot_from_any_unaged_one_with_more_work() -> None:
    cfg = replace(SRPT, max_wait_s=5.0)
    waiting = [view("aged", math.log(300), arrival_s=0.0, computed=0)]
    running = [view("young", math.log(310), arrival_s=8.0, out=1)]
    assert [p.victim for p in preemptions(running, waiting, 0, 10.0, cfg)] == ["young"]
    smaller = [view("young", math.log(30), arrival_s=8.0, out=1)]
    assert preemptions(smaller, waiting, 0, 10.0, cfg) == []


# --- the aging bound over a simulated engine ------------------------------------------------
def simulate(lengths: list[int], arrivals: list[float], mus: list[float], slots: int,
             cfg: ScheduleConfig) -> list[float]:
    """A step-by-step engine with ``slots`` running requests (one token per request per step of
    1 s, prefill free), ordered by ``priority`` and preempted by ``preemptions``. Returns each
    request's start time (first step scheduled after its last wait)."""
    views = [view(str(i), mus[i], arrival_s=a, out=0, computed=0, max_tokens=lengths[i] + 10_000)
             for i, a in enumerate(arrivals)]
    left = dict(enumerate(lengths))
    running: list[int] = []
    started: dict[int, float] = {}
    t = 0.0
    while left:
        waiting = [i for i in left if i not in running and arrivals[i] <= t]
        for p in preemptions([views[i] for i in running], [views[i] for i in waiting],
                             slots - len(running), t, cfg):
            i = int(p.victim)
            running.remove(i)
            views[i].num_preemptions += 1
            views[i].num_computed_tokens = 0
            started.pop(i, None)
            waiting.append(i)
        waiting.sort(key=lambda i: priority(views[i], t, cfg))
        for i in waiting[:slots - len(running)]:
            running.append(i)
            started[i] = t
        t += 1.0
        for i in list(running):
            views[i].num_output_tokens += 1
            views[i].num_computed_tokens = views[i].num_prompt_tokens + views[i].num_output_tokens
            left[i] -= 1
            if left[i] == 0:
                running.remove(i)
                del left[i]
    return [started[i] for i in range(len(lengths))]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(1, 3), n=st.integers(2, 25))
def test_every_request_starts_within_the_aging_bound(seed: int, slots: int, n: int) -> None:
    """Predictions that invert the true order (the worst case for starvation): a request still
    starts, and then runs uninterrupted, within max_wait_s plus, per slot, one longest request
    for each request that arrived before it."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(n)]
    arrivals = sorted(rng.uniform(0, 30) for _ in range(n))
    mus = [math.log(1000 / length) for length in lengths]  # long looks short, short looks long
    cfg = replace(SRPT, max_wait_s=20.0, preempt_min_gap_steps=2.0, preempt_ratio=2.0,
                  max_preemptions=3)
    starts = simulate(lengths, arrivals, mus, slots, cfg)
    longest = max(lengths)
    for i, (a, s) in enumerate(zip(arrivals, starts, strict=True)):
        ahead = sum(1 for j in range(n) if arrivals[j] < a or (arrivals[j] == a and j < i))
        bound = cfg.max_wait_s + longest * (math.ceil((ahead + 1) / slots) + 1) + 1
        assert s - a <= bound, (i, s - a, bound)


def test_the_bound_is_what_holds_the_long_requests_back() -> None:
    """Without aging (a bound longer than the run) the same adversarial predictions starve the
    request predicted longest (the shortest) far beyond the bound the aged run keeps: the property test above can fail."""
    rng = random.Random(3)
    n, slots = 25, 1
    lengths = [rng.randint(1, 40) for _ in range(n)]
    arrivals = sorted(rng.uniform(0, 30) for _ in range(n))
    arrivals += [arrivals[-1] + 2.0 * k for k in range(1, 600)]
    lengths += [2] * 599
    mus = [math.log(1000 / length) for length in lengths]
    aged = replace(SRPT, max_wait_s=20.0, preempt_min_gap_steps=2.0, preempt_ratio=2.0)
    never = replace(aged, max_wait_s=1e9)
    victim = min(range(n), key=lambda i: lengths[i])
    wait_aged = simulate(lengths, arrivals, mus, slots, aged)[victim] - arrivals[victim]
    wait_never = simulate(lengths, arrivals, mus, slots, never)[victim] - arrivals[victim]
    ahead = sum(1 for a in arrivals if a < arrivals[victim])
    assert wait_aged <= aged.max_wait_s + max(lengths) * (ahead + 2) + 1
    assert wait_never > 3 * wait_aged, (wait_never, wait_aged)


# --- config ---------------------------------------------------------------------------------
def test_schedule_config_refuses_bad_settings(tmp_path: object) -> None:
    with pytest.raises(ScheduleConfigError, match="unknown --schedule"):
        ScheduleConfig("lifo")
    with pytest.raises(ScheduleConfigError, match="exactly one"):
        ScheduleConfig("srpt")
    with pytest.raises(ScheduleConfigError, match="need --schedule"):
        ScheduleConfig("fcfs", oracle_file="/dev/null")
    with pytest.raises(ScheduleConfigError, match="no such file"):
        ScheduleConfig("sjf", predictor_dir="/nonexistent/predictor")
    with pytest.raises(ScheduleConfigError, match="preempt_ratio"):
        ScheduleConfig("srpt", oracle_file="/dev/null", preempt_ratio=0.5)
    with pytest.raises(ScheduleConfigError, match="unknown schedule settings"):
        ScheduleConfig.from_json({"policy": "fcfs", "speed": 3})
    assert ScheduleConfig().env() == {}
    env = SRPT.env()
    assert ScheduleConfig.from_json(__import__("json").loads(env["LOADWISE_SCHEDULE"])) == \
        SRPT.resolved()


@pytest.mark.parametrize(("spec_method", "cls"), [(None, "OrderingScheduler"),
                                                  ("ngram", "OrderingScheduler"),
                                                  ("eagle", "OrderingAsyncScheduler")])
def test_ordering_runs_on_the_scheduler_vllm_runs_the_drafter_with(
        tmp_path: Path, spec_method: str | None, cls: str) -> None:
    """Sync scheduling without speculation or with prompt lookup, async with EAGLE and draft
    models: the ordering is mixed over loadwise's adapter of either, never refused."""
    import importlib

    from loadwise.config.engine import EngineSpec

    (tmp_path / "config.json").write_text("{}")
    spec = EngineSpec(model=str(tmp_path), spec_method=spec_method, extensions=(SRPT,),
                      draft_model=str(tmp_path) if spec_method == "eagle" else None)
    module, _, name = spec.scheduler_cls().rpartition(".")
    assert name == cls
    ordering = getattr(importlib.import_module(module), name)
    bases = [c.__name__ for c in ordering.__mro__]
    want = "AsyncScheduler" if spec_method == "eagle" else "Scheduler"
    assert bases[:3] == [cls, "_OrderingMixin", f"Loadwise{want}"] and want in bases
