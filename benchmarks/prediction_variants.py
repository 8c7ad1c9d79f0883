"""Where the goodput model's error comes from: its prediction of each evaluation window,
fed more and more of what the window itself measured.

`loadwise evaluate` reports the profile's prediction (tune's T and acceptance), the same with T
re-timed before each load, and the relative prediction. This study adds, per configuration and
load, computed from an evaluation *record* (the engine steps of every window):
- observed mix: the profile's model fed the batch sizes and prefills that really ran;
- re-timed T with each window's own acceptance, then also its own prefill price and
  prompt/output ratio (every input from the window: what is left is the model's form);
- window speed: the profile's T scaled by the window's own pure-decode speed, every other input
  from the window;
- prior speed: the profile at the speed measured in the window before (a forecast);
- anchored on k=0: the profile's speed-up over no speculation, times k=0 as measured.

Usage: python benchmarks/prediction_variants.py RECORD.record.jsonl [...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from results_io import write_result

from loadwise.evaluate import analyze, load_record
from loadwise.evaluate.analyze import ProfileModel, RetimedLoad, prediction_summary, profile_model
from loadwise.evaluate.record import EvalRecord, WindowRecord
from loadwise.evaluate.windows import step_time_ratio, window_acceptance
from loadwise.measure.records import StepRecord
from loadwise.measure.stats import prefill_s_per_token, summarize
from loadwise.policy.goodput import Acceptance, StepTimes, closed_loop_throughput
from loadwise.policy.table import DraftLengthTable, lookup_vllm
from loadwise.provenance import provenance

VARIANTS = ("predicted_observed_mix_tok_s", "predicted_retimed_window_acceptance_tok_s",
            "predicted_retimed_window_inputs_tok_s", "predicted_window_speed_tok_s",
            "predicted_prior_speed_tok_s", "predicted_anchored_k0_tok_s")


def mix_prediction(records: Sequence[StepRecord], table: DraftLengthTable, times: StepTimes,
                   acc: Acceptance, prefill_s_per_token: float | None) -> float:
    """Output tokens/s the model predicts for the steps that really ran: each step's decode
    batch b gets b * E(k(b)) tokens in T(b, drafts) plus its prefill tokens' price."""
    tokens = secs = 0.0
    for r in records:
        b = r.num_decode_reqs
        step_s = (prefill_s_per_token or 0.0) * r.num_prefill_tokens
        if b > 0:
            k = table.lookup(max(r.batch_size, 1))  # vLLM looks k up by all scheduled requests
            tokens += b * acc.expected_tokens(k)
            step_s += times.at(b, acc.expected_drafts(k))
        elif r.num_prefill_tokens > 0:
            step_s += times.at(1, 0.0)  # a pure prefill step still pays a step's fixed cost
        secs += step_s
    return tokens / secs if secs else 0.0


def window_prefill_price(records: Sequence[StepRecord], times: StepTimes,
                         output_tokens: int) -> tuple[float | None, float | None]:
    """The window's own prefill price (seconds per prompt token in its mixed steps, fitted
    against ``times`` as the tune fits it) and its prompt tokens per output token; None where
    the window had no prefill or no output."""
    prompt = sum(r.num_prefill_tokens for r in records)
    ratio = prompt / output_tokens if output_tokens > 0 else None
    return prefill_s_per_token(records, times), ratio


def _median(xs: Sequence[float | None]) -> float | None:
    finite = [x for x in xs if x is not None]
    return summarize(finite).median if finite else None


def _throughput(m: ProfileModel, c: int, k: int, times: StepTimes, acc: Acceptance | None,
                prefill: float | None, ratio: float | None) -> float:
    return closed_loop_throughput(c, k, times, acc or m.acc,
                                  (m.prefill_s_per_token or 0.0) if prefill is None else prefill,
                                  m.prompt_per_output if ratio is None else ratio)


def load_variants(record: EvalRecord, wname: str, c: int, m: ProfileModel,
                  results_entry: dict[str, Any]) -> None:
    """Add every variant to one load's configurations in ``results_entry`` (in place)."""
    profile = record.header.profile
    assert profile is not None
    tables = record.tables()[wname]
    rt = record.retime(wname, c)
    retimed = None if rt is None else RetimedLoad.merge(m.times, c, dict(rt.samples_s),
                                                        dict(rt.drafts_per_req))
    windows = [w for w in record.windows(wname, c) if w.config in results_entry["configs"]]
    # The speed last measured before each window: the previous window's, whatever it ran;
    # the re-timing's before the load's first window.
    last = None if retimed is None else retimed.speed_ratio
    prior: dict[int, float | None] = {}
    speed: dict[int, float | None] = {}
    for i, w in enumerate(windows):
        assert w.steps is not None
        prior[i] = last
        speed[i] = step_time_ratio(w.steps, m.times)
        last = speed[i] if speed[i] is not None else last
    k0 = results_entry["configs"]["k=0"]["median_tok_s"]
    for name, cfg in results_entry["configs"].items():
        k = lookup_vllm(tables[name], c)
        table = DraftLengthTable.parse(tables[name], profile.max_k)
        mine = [(i, w) for i, w in enumerate(windows) if w.config == name]
        out: dict[str, Any] = {}
        out["predicted_observed_mix_tok_s"] = _median([
            mix_prediction(_steps(w), table, m.times, m.acc, m.prefill_s_per_token)
            for _, w in mine])
        accs = [window_acceptance(_steps(w), profile.max_k) for _, w in mine]
        if retimed is not None:
            prefill_rt = (m.prefill_s_per_token or 0.0) * retimed.speed_ratio
            out["predicted_retimed_window_acceptance_tok_s"] = _median([
                _throughput(m, c, k, retimed.times, a, prefill_rt, None) for a in accs])
            out["predicted_retimed_window_inputs_tok_s"] = _median([
                _throughput(m, c, k, retimed.times, a,
                            *_prefill(w, retimed.times, prefill_rt)) for a, (_, w) in zip(accs, mine)])
        out["predicted_window_speed_tok_s"] = _median([
            _throughput(m, c, k, m.times.scaled(sp), a,
                        *_prefill(w, m.times.scaled(sp), (m.prefill_s_per_token or 0.0) * sp))
            for a, (i, w) in zip(accs, mine) if (sp := speed[i]) is not None])
        out["predicted_prior_speed_tok_s"] = _median([
            m.predict(c, k, m.times.scaled(sp), sp) for i, _ in mine
            if (sp := prior[i]) is not None])
        out["predicted_anchored_k0_tok_s"] = (None if name == "k=0" else
                                              k0 * m.predict(c, k) / m.predict(c, 0))
        cfg.update(out)


def _steps(w: WindowRecord) -> tuple[StepRecord, ...]:
    assert w.steps is not None
    return w.steps


def _prefill(w: WindowRecord, times: StepTimes,
             fallback: float) -> tuple[float | None, float | None]:
    price, ratio = window_prefill_price(_steps(w), times, w.num_tokens or 0)
    return (fallback if price is None else price), ratio


def score(record: EvalRecord) -> dict[str, Any]:
    """The record's results with every variant added, and their error summary."""
    results = analyze(record)
    for wname, res in results["workloads"].items():
        m = profile_model(record.header, wname)
        if m is None:
            continue
        for entry in res["loads"]:
            load_variants(record, wname, entry["load"], m, entry)
    return prediction_summary(results, tuple((v, "median_tok_s") for v in VARIANTS)
                              + (("predicted_tok_s", "median_tok_s"),
                                 ("predicted_relative", "measured_relative")))


def main(argv: Sequence[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    report: dict[str, Any] = {**provenance(), "files": {}}
    for arg in argv:
        record = load_record(Path(arg))
        if any(isinstance(e, WindowRecord) and e.steps is None for e in record.events):
            print(f"{arg}: no engine steps recorded (an older results file), skipped")
            continue
        summary = score(record)
        # Step times hold only at the binding they ran at: each file says which it was.
        report["files"][Path(arg).name] = {"cpu_binding": record.header.meta.get("cpu_binding"),
                                          "git_sha": record.header.meta.get("git_sha"),
                                          "prediction": summary}
        for key, s in summary.items():
            print(f"{Path(arg).name}: {key}: median |error| {s['median_abs_rel_error']:.1%} "
                  f"(n={s['n']})")
    if report["files"]:
        print("wrote", write_result("prediction-variants", report))


if __name__ == "__main__":
    main(sys.argv[1:])
