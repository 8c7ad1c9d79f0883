"""Everything `loadwise evaluate` reports, computed from its raw record alone (pure: the same
record always gives the same results, offline or right after the run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadwise.evaluate.config import MEASURED
from loadwise.evaluate.record import ConfirmRound, EvalRecord, RecordHeader, config_to_json
from loadwise.evaluate.verdict import (
    add_verdicts,
    confirmation_summary,
    geometric_shares,
    relative_to_repeat,
    strongest_rival,
)
from loadwise.evaluate.windows import (
    acceptance_json,
    mean_decode_batch,
    step_time_ratio,
    window_acceptance,
)
from loadwise.measure.stats import summarize
from loadwise.policy.goodput import Acceptance, StepTimes, closed_loop_throughput, goodput
from loadwise.policy.table import lookup_vllm


@dataclass(frozen=True, slots=True)
class ProfileModel:
    """The profile's model of closed-loop throughput for one workload."""

    times: StepTimes
    acc: Acceptance
    prefill_s_per_token: float | None
    prompt_per_output: float

    def predict(self, c: int, k: int, times: StepTimes | None = None,
                prefill_scale: float = 1.0) -> float:
        """Output tok/s at load c and draft length k (decode only when the tune measured no
        prefill price); ``times`` replaces the profile's T, and the prefill price is scaled
        with it."""
        t = times or self.times
        if self.prefill_s_per_token is None:
            return goodput(c, k, t, self.acc)
        return closed_loop_throughput(c, k, t, self.acc, self.prefill_s_per_token * prefill_scale,
                                      self.prompt_per_output)


@dataclass(frozen=True, slots=True)
class RetimedLoad:
    """T(c, 0..max_k) measured again right before load level c, merged into the profile's grid.
    ``speed_ratio`` = median over k of re-timed / profile T at c: how much faster (< 1) or
    slower the machine runs now; the prefill price is scaled by it (prefill runs on the same
    cores, and re-timing it too would need a prefill-heavy run)."""

    times: StepTimes
    step_time_s: dict[int, float]
    speed_ratio: float

    @classmethod
    def merge(cls, times: StepTimes, c: int, samples_s: dict[int, tuple[float, ...]],
              drafts_per_req: dict[int, float]) -> RetimedLoad:
        medians = {k: summarize(v).median for k, v in samples_s.items()}
        merged = times.with_batch_size(c, medians, drafts_per_req)
        ratios = [t / times.at(c, drafts_per_req.get(k, float(k))) for k, t in medians.items()]
        return cls(merged, medians, summarize(ratios).median)

    def to_json(self, profile_times: StepTimes, c: int) -> dict[str, Any]:
        drafts = self.times.drafts_per_req or {}
        return {"speed_ratio": self.speed_ratio,
                "step_time_s": {str(k): t for k, t in self.step_time_s.items()},
                "profile_step_time_s": {str(k): profile_times.at(c, drafts.get((c, k), k))
                                        for k in self.step_time_s}}


def profile_model(header: RecordHeader, workload: str) -> ProfileModel | None:
    p = header.profile
    if p is None or workload not in p.acceptance:
        return None
    return ProfileModel(p.step_times(), p.acceptance_for(workload), p.prefill_s_per_token,
                        p.acceptance[workload].prompt_per_output)


def analyze(record: EvalRecord) -> dict[str, Any]:
    """The evaluation's results: per workload and load, every configuration's throughput,
    its loss against the fastest fixed k, the confirmation, the verdict, the predictions."""
    cfg = record.header.config
    workloads: dict[str, Any] = {}
    for wname, tables in record.tables().items():
        model = profile_model(record.header, wname)
        loads = [e for c in record.loads(wname)
                 if (e := _load_entry(record, wname, c, tables, model)) is not None]
        out: dict[str, Any] = {"measured_table": tables[MEASURED], "loads": loads}
        if model is not None:
            out.update(acceptance=list(model.acc.prefix_accept), draft_rate=model.acc.draft_rate,
                       prompt_per_output=model.prompt_per_output,
                       prefill_s_per_token=model.prefill_s_per_token)
        workloads[wname] = out
    results: dict[str, Any] = {**record.header.meta, "config": config_to_json(cfg),
                               "docs_table": record.header.docs_table, "workloads": workloads,
                               "complete": record.complete}
    if record.end is not None:
        results.update(record.end)
    add_equivalence(results)
    add_verdicts(results, cfg.target_loss, cfg.verdict_confidence)
    results["prediction"] = prediction_summary(results)
    return results


def _load_entry(record: EvalRecord, wname: str, c: int, tables: dict[str, list[list[int]]],
                model: ProfileModel | None) -> dict[str, Any] | None:
    """One load's entry over its complete repeats (every configuration has its window);
    None when no repeat completed."""
    windows = record.windows(wname, c)
    names = list(tables)
    by_repeat: dict[int, dict[str, Any]] = {}
    order: dict[int, list[str]] = {}
    for w in windows:
        by_repeat.setdefault(w.repeat, {})[w.config] = w
        order.setdefault(w.repeat, []).append(w.config)
    repeats = [r for r in sorted(by_repeat) if set(by_repeat[r]) >= set(names)]
    if not repeats:
        return None
    win = {n: [by_repeat[r][n] for r in repeats] for n in names}
    samples = {n: [w.tok_s for w in win[n]] for n in names}
    rt_rec = record.retime(wname, c)
    retimed = (RetimedLoad.merge(model.times, c, dict(rt_rec.samples_s), dict(rt_rec.drafts_per_req))
               if rt_rec is not None and model is not None else None)
    rel = relative_to_repeat(samples)
    rel_median = {n: summarize(v).median for n, v in rel.items()}
    best = max((n for n in names if n.startswith("k=")), key=lambda n: rel_median[n])
    best_median = summarize(samples[best]).median
    entry: dict[str, Any] = {
        "load": c, "window_order": [order[r] for r in repeats], "best_fixed": best,
        "best_fixed_tok_s": best_median,
        "noise_rel": (max(rel[best]) - min(rel[best])) / rel_median[best],
        "unpaired_noise_rel": (max(samples[best]) - min(samples[best])) / best_median,
        "configs": {},
    }
    max_k = record.header.profile.max_k if record.header.profile is not None else None
    for name in names:
        s = samples[name]
        loss = 1.0 - rel_median[name] / rel_median[best]
        # Paired by repeat: both ran on the same prompts, minutes apart at most.
        paired = [1.0 - x / y for x, y in zip(s, samples[best])]
        med = summarize(s).median
        cfg_out: dict[str, Any] = {
            "table": tables[name], "samples_tok_s": s, "relative_samples": rel[name],
            "median_tok_s": med, "min_tok_s": min(s), "max_tok_s": max(s),
            "loss_vs_best_fixed": loss,
            "paired_loss": {"median": summarize(paired).median, "min": min(paired),
                            "max": max(paired), "samples": paired},
            # A tie: the repeats disagree on the sign, or the loss is inside the spread.
            "within_noise": abs(loss) <= entry["noise_rel"] or min(paired) <= 0.0 <= max(paired),
        }
        steps = [w.steps for w in win[name] if w.steps is not None]
        if steps and model is not None and max_k is not None:
            ratios = [x for st in steps if (x := step_time_ratio(st, model.times)) is not None]
            cfg_out.update(
                mean_decode_batch=summarize([mean_decode_batch(st) for st in steps]).median,
                # This load's pure-decode step times over the profile's T: the machine's drift
                # since the tune.
                step_time_vs_profile=summarize(ratios).median if ratios else None,
                window_acceptance=[acceptance_json(window_acceptance(st, max_k)) for st in steps])
        if model is not None:
            k = lookup_vllm(tables[name], c)
            predicted = model.predict(c, k)
            cfg_out.update(predicted_tok_s=predicted,
                           predicted_decode_only_tok_s=goodput(c, k, model.times, model.acc),
                           prediction_rel_error=predicted / med - 1.0 if med else None)
            if retimed is not None:
                cfg_out["predicted_retimed_tok_s"] = model.predict(
                    c, k, retimed.times, retimed.speed_ratio)
        entry["configs"][name] = cfg_out
    if model is not None:
        add_relative_prediction(entry)
    if retimed is not None and model is not None:
        entry["retimed"] = retimed.to_json(model.times, c)
    confirmation = _confirmation(record, wname, c, tables, samples)
    if confirmation is not None:
        entry["confirmation"] = confirmation
    return entry


def _confirmation(record: EvalRecord, wname: str, c: int, tables: dict[str, list[list[int]]],
                  samples: dict[str, list[float]]) -> dict[str, Any] | None:
    cfg = record.header.config
    rounds: list[ConfirmRound] = record.confirm_rounds(wname, c)
    table_k = lookup_vllm(tables[MEASURED], c)
    if not rounds:
        if cfg.confirm_rounds and strongest_rival(samples, table_k) is None:
            return {"table_k": table_k, "rival": None}
        return None
    windows = [{"table": list(r.table_tok_s), "rival": list(r.rival_tok_s)} for r in rounds]
    out = confirmation_summary(rounds[0].table_k, rounds[0].rival, windows)
    if cfg.looks:
        out.update(looks=list(cfg.looks), confidence_per_look=cfg.confidence_per_look)
    return out


def add_relative_prediction(entry: dict[str, Any]) -> None:
    """Add to each configuration of one load's entry the profile's throughput relative to the
    others at this load (``predicted_relative``: its predicted tok/s over the geometric mean of
    all configurations') and the measured relative throughput (``measured_relative``: the
    median over repeats of each window over its repeat's geometric mean). One level per load
    comes from the measurement, so machine speed that moved every configuration alike divides
    out, and every input of the shape is the profile's: this is what the table's choice of k
    rests on."""
    configs = entry["configs"]
    shares = geometric_shares({name: c["predicted_tok_s"] for name, c in configs.items()})
    for name, c in configs.items():
        c["predicted_relative"] = shares[name]
        c["measured_relative"] = summarize(c["relative_samples"]).median


# (prediction, what it is scored against): the profile's absolute predictions against the
# measured median throughput, the relative one against the measured relative throughput.
SCORED = (("predicted_tok_s", "median_tok_s"), ("predicted_retimed_tok_s", "median_tok_s"),
          ("predicted_relative", "measured_relative"))


def prediction_summary(results: dict[str, Any],
                       scored: tuple[tuple[str, str], ...] = SCORED) -> dict[str, Any]:
    """Median |predicted / measured - 1| over every configuration and load, for each kind of
    prediction present: overall and per workload."""
    out: dict[str, Any] = {}
    for field_name, measured in scored:
        per: dict[str, float] = {}
        every: list[float] = []
        for wname, res in results["workloads"].items():
            errs = [abs(c[field_name] / c[measured] - 1.0)
                    for e in res["loads"] for c in e["configs"].values()
                    if c.get(field_name) is not None and c.get(measured)]
            if errs:
                per[wname] = summarize(errs).median
                every += errs
        if every:
            out[field_name] = {"median_abs_rel_error": summarize(every).median,
                               "per_workload": per, "n": len(every)}
    return out


def add_equivalence(results: dict[str, Any]) -> dict[str, Any]:
    """For each table at each load: the fixed k it applies at that batch size. Where a table
    runs the same k as a fixed configuration, the two are one configuration and their measured
    difference is the noise floor; the table's loss is then the loss of that fixed k (pooled
    over both sets of samples). Adds ``k_at_load``, ``equivalent_fixed``,
    ``equivalent_loss`` and ``identical_config_gap`` (median paired gap between the two runs
    of the same configuration)."""
    for res in results["workloads"].values():
        for e in res["loads"]:
            c = e["load"]
            cfgs = e["configs"]
            best = cfgs[e["best_fixed"]]
            for name, entry in cfgs.items():
                k = lookup_vllm(entry["table"], c)
                entry["k_at_load"] = k
                if name.startswith("k="):
                    continue
                twin = cfgs.get(f"k={k}")
                if twin is None:
                    continue
                pooled_median = summarize(twin["relative_samples"]
                                          + entry["relative_samples"]).median
                entry["equivalent_fixed"] = f"k={k}"
                entry["equivalent_loss"] = (
                    0.0 if f"k={k}" == e["best_fixed"] else
                    1.0 - pooled_median / summarize(best["relative_samples"]).median)
                gaps = [1.0 - x / y for x, y in zip(entry["samples_tok_s"], twin["samples_tok_s"])]
                entry["identical_config_gap"] = {"median": summarize(gaps).median,
                                                 "min": min(gaps), "max": max(gaps)}
    return results
