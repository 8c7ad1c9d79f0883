"""`loadwise evaluate`: closed-loop throughput of no speculation, every fixed k, the docs' table and
the measured table, at several loads, on one engine (tables swapped live, configurations
interleaved and repeated so drift and noise hit all of them alike).

A load level c is c clients, each sending its next request when its last one finishes. The
clients keep running across all windows of a load level (staggered start, then settled until
each finished a request), so every window sees a steady-state population — prefills spread out
as in serving — and a table switch only needs a short warm-up.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadwise.measure.profile import Profile
from loadwise.measure.records import StepRecord
from loadwise.measure.stats import (
    AcceptanceCounter,
    decode_part_s,
    median_interval,
    prefill_s_per_token,
    sign_test_tail,
    summarize,
)
from loadwise.measure.workloads import Workload, timing_prompts
from loadwise.policy.goodput import (
    Acceptance,
    ModelError,
    StepTimes,
    closed_loop_throughput,
    goodput,
)
from loadwise.policy.table import DraftLengthTable, lookup_vllm
from loadwise.tune import TunableEngine, TuneConfig, measure_step_times

DOCS_TABLE = [[1, 64, 3], [65, 128, 1], [129, 512, 0]]


@dataclass(frozen=True, slots=True)
class EvalConfig:
    loads: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 3
    warmup_s: float = 2.0
    duration_s: float = 8.0
    max_tokens: int = 128
    seed: int = 0
    settle_max_s: float = 90.0
    # Rounds of T(c, 0..max_k) re-timed (tune's own timing path) just before each load level;
    # 0 turns it off. It separates the model's error from this machine's drift between the tune
    # and the evaluation: predictions are reported with the profile's T and with the re-timed T.
    retime_rounds: int = 2
    # Aligned windows: before each window the clients restart on the repeat's prompts and the
    # window ends on a token count (≈ duration_s at the measured table's speed), so every
    # configuration of a repeat decodes the same text and a paired difference is speed, not
    # content. Without it a window continues whatever requests were in flight: at low load one
    # request's acceptance decides the window (sharegpt, c=1, 10 s windows: fixed k=3 measured
    # 16-38 tok/s across repeats while k=0 measured 20-23).
    aligned: bool = True
    # Confirmation after a load's repeats: rounds of four fresh aligned windows, measured table
    # and the fastest *other* fixed k in ABBA / BAAB order (a linear drift cancels), scored
    # on new windows so the pick of the rival does not bias its score (the fastest of five
    # noisy medians is biased upward). 0 turns it off.
    confirm_rounds: int = 6
    # Sequential confirmation: when above confirm_rounds, a load whose verdict is still
    # unresolved after confirm_rounds rounds gets more, doubling up to this many (see
    # confirm_looks); a load that resolves stops early. None: exactly confirm_rounds.
    confirm_max_rounds: int | None = None
    # The target: the measured table at most this much slower than the best fixed k.
    # Judged per load on a distribution-free interval for the median round loss (see
    # add_verdicts), at this confidence.
    target_loss: float = 0.03
    verdict_confidence: float = 0.9

    def __post_init__(self) -> None:
        if not self.loads or min(self.loads) < 1:
            raise ValueError(f"loads must be >= 1, got {self.loads}")
        if self.repeats < 1 or self.duration_s <= 0:
            raise ValueError("repeats must be >= 1 and duration > 0")
        if self.retime_rounds < 0:
            raise ValueError(f"retime_rounds must be >= 0, got {self.retime_rounds}")
        if self.confirm_rounds < 0:
            raise ValueError(f"confirm_rounds must be >= 0, got {self.confirm_rounds}")
        if self.confirm_max_rounds is not None and (
                self.confirm_rounds < 1 or self.confirm_max_rounds < self.confirm_rounds):
            raise ValueError(f"confirm_max_rounds ({self.confirm_max_rounds}) needs confirm_rounds "
                             f">= 1 and at least as many rounds ({self.confirm_rounds})")
        if not 0.0 <= self.target_loss < 1.0:
            raise ValueError(f"target_loss is a fraction in [0, 1), got {self.target_loss}")
        if not 0.0 < self.verdict_confidence < 1.0:
            raise ValueError(f"verdict_confidence must be in (0, 1), got {self.verdict_confidence}")

    @property
    def looks(self) -> tuple[int, ...]:
        """Round counts after which a confirmation judges its verdict (empty: no confirmation)."""
        if not self.confirm_rounds:
            return ()
        return confirm_looks(self.confirm_rounds, self.confirm_max_rounds or self.confirm_rounds)


def configurations(profile: Profile, workload: str) -> list[tuple[str, DraftLengthTable]]:
    n = profile.max_num_seqs
    out = [(f"k={k}", DraftLengthTable.fixed(k, profile.max_k, n)) for k in range(profile.max_k + 1)]
    # The docs' example assumes k <= 3; on a smaller engine vLLM clamps it, and so do we.
    out.append(("docs table",
                DraftLengthTable.parse(DOCS_TABLE, max(3, profile.max_k)).clamped(profile.max_k)))
    out.append(("measured table", profile.table_for(workload)))
    return out


def run_evaluate(
    engine: TunableEngine,
    profile: Profile,
    workloads: Sequence[Workload],
    cfg: EvalConfig,
    advance: Callable[[str], None],
) -> dict[str, Any]:
    times = profile.step_times()
    results: dict[str, Any] = {}
    for w in workloads:
        configs = configurations(profile, w.name)
        acc = profile.acceptance_for(w.name)
        prompt_per_output = profile.acceptance[w.name].prompt_per_output
        # Per load, per configuration: one entry per measured window.
        names = [n for n, _ in configs]
        samples: dict[int, dict[str, list[float]]] = _per_window(cfg.loads, names)
        mixes: dict[int, dict[str, list[float]]] = _per_window(cfg.loads, names)
        occupancy: dict[int, dict[str, list[float]]] = _per_window(cfg.loads, names)
        drift: dict[int, dict[str, list[float]]] = _per_window(cfg.loads, names)
        # Per window: (prefill price fitted on its mixed steps, its prompt/output token ratio).
        window_prefill: dict[int, dict[str, list[tuple[float | None, float | None]]]] = (
            _per_window(cfg.loads, names))
        # Per window: (its speed: pure-decode step time / profile T, prefill price against
        # the profile's T at that speed); None without a pure decode step.
        window_speed: dict[int, dict[str, list[tuple[float, float | None] | None]]] = (
            _per_window(cfg.loads, names))
        window_acc: dict[int, dict[str, list[Acceptance | None]]] = _per_window(cfg.loads, names)
        # Per window: the machine's speed as last measured before the window started (the
        # previous window's pure-decode steps over the profile's T, whatever configuration it
        # ran; the re-timing's speed ratio before a load's first window). Nothing from the
        # window itself, so a prediction from it is out of sample.
        prior_speed: dict[int, dict[str, list[float | None]]] = _per_window(cfg.loads, names)
        retimed: dict[int, RetimedLoad] = {}
        confirmations: dict[int, dict[str, Any]] = {}
        # Per load: the configurations of each repeat in the order they ran (so a carry-over
        # from one window to the next can be checked from the file).
        window_order: dict[int, list[list[str]]] = {c: [] for c in cfg.loads}
        for c in cfg.loads:
            if cfg.retime_rounds:
                retimed[c] = retime(engine, times, c, cfg)
                advance(f"{w.name} c={c} re-timed T")
            last_speed = retimed[c].speed_ratio if c in retimed else None
            loop = engine.open_loop(w.cycle(cfg.seed + 1000), concurrency=c,
                                    max_tokens=cfg.max_tokens)
            try:
                window_tokens = settle_window_tokens(engine, loop, configs[-1][1], c, cfg)
                for r in range(cfg.repeats):
                    shift = (r * 3) % len(configs)
                    order = configs[shift:] + configs[:shift]
                    if r % 2:
                        order = order[::-1]
                    window_order[c].append([name for name, _ in order])
                    for name, table in order:
                        engine.set_table(table)
                        # Same prompt sequence for every configuration of this repeat.
                        tokens, secs, records = _window(engine, loop, cfg, w.cycle(cfg.seed + r),
                                                        window_tokens)
                        samples[c][name].append(tokens / secs)
                        mixes[c][name].append(_mix_prediction(records, table, times, acc,
                                                              profile.prefill_s_per_token))
                        occupancy[c][name].append(_mean_decode_batch(records))
                        drift[c][name].append(step_time_ratio(records, times))
                        window_acc[c][name].append(window_acceptance(records, profile.max_k))
                        window_prefill[c][name].append(window_prefill_price(
                            records, retimed[c].times if c in retimed else times, tokens))
                        speed = drift[c][name][-1]
                        window_speed[c][name].append(None if math.isnan(speed) else (
                            speed, window_prefill_price(records, scaled(times, speed), tokens)[0]))
                        prior_speed[c][name].append(last_speed)
                        last_speed = last_speed if math.isnan(speed) else speed
                        advance(f"{w.name} c={c} {name}")
                if cfg.confirm_rounds:
                    confirmations[c] = confirm(engine, loop, cfg, w, dict(configs), c,
                                               samples[c], window_tokens, advance)
            finally:
                loop.close()
        per_load = []
        for c in cfg.loads:
            stats = {name: summarize(v) for name, v in samples[c].items()}
            # Compared per repeat: what a repeat's prompts or the machine's speed then did to
            # every configuration alike cancels out.
            rel = relative_to_repeat(samples[c])
            rel_median = {name: summarize(v).median for name, v in rel.items()}
            fixed = [n for n in stats if n.startswith("k=")]
            best = max(fixed, key=lambda n: rel_median[n])
            noise = (max(rel[best]) - min(rel[best])) / rel_median[best]
            entry: dict[str, Any] = {
                "load": c, "window_order": window_order[c], "best_fixed": best, "best_fixed_tok_s": stats[best].median,
                "noise_rel": noise, "unpaired_noise_rel": (
                    max(samples[c][best]) - min(samples[c][best])) / stats[best].median,
                "configs": {},
            }

            for name, table in configs:
                s = stats[name]
                loss = 1.0 - rel_median[name] / rel_median[best]
                # Paired by repeat: both ran on the same prompts, minutes apart at most.
                paired = [1.0 - x / y for x, y in zip(samples[c][name], samples[c][best])]
                k = table.lookup(c)
                decode_only = goodput(c, k, times, acc)
                predicted = _predicted(c, k, times, acc, profile.prefill_s_per_token,
                                       prompt_per_output)
                entry["configs"][name] = {
                    "table": table.to_vllm(), "samples_tok_s": samples[c][name],
                    "relative_samples": rel[name],
                    "median_tok_s": s.median, "min_tok_s": min(samples[c][name]),
                    "max_tok_s": max(samples[c][name]),
                    "loss_vs_best_fixed": loss,
                    "paired_loss": {"median": summarize(paired).median, "min": min(paired),
                                    "max": max(paired), "samples": paired},
                    # A tie: the repeats disagree on the sign, or the loss is inside the spread.
                    "within_noise": abs(loss) <= noise or min(paired) <= 0.0 <= max(paired),
                    "predicted_tok_s": predicted,
                    # The model's speed-up over no speculation applied to k=0 as measured in
                    # this load's windows: the machine's speed now, taken from one
                    # measurement, and the model for everything the table choice rests on.
                    # None for k=0 itself (it would be its own measurement).
                    "predicted_anchored_k0_tok_s": None if name == "k=0" else (
                        stats["k=0"].median * predicted / _predicted(
                            c, 0, times, acc, profile.prefill_s_per_token, prompt_per_output)),
                    "predicted_decode_only_tok_s": decode_only,
                    # Diagnostics: the same model fed the batch sizes and prefills that really
                    # occurred in the window (separates occupancy from step-time error).
                    "predicted_observed_mix_tok_s": summarize(mixes[c][name]).median,
                    "mean_decode_batch": summarize(occupancy[c][name]).median,
                    "prediction_rel_error": predicted / s.median - 1.0 if s.median else None,
                    # Diagnostics: this window set's pure-decode step times over the profile's
                    # T (machine drift since the tune) and the acceptance its drafts really had.
                    "step_time_vs_profile": _median_or_none(drift[c][name]),
                    # Per window (NaN as None): its own speed, and the speed last measured
                    # before it (what predicted_prior_speed_tok_s scales the profile by).
                    "window_speed_ratios": [None if math.isnan(x) else x
                                            for x in drift[c][name]],
                    "prior_speed_ratios": prior_speed[c][name],
                    # The profile's model (its T, acceptance, prefill price and prompt/output
                    # ratio) at the speed the machine had in the window before this one: a
                    # forecast from what was known when the window started. Drift slower than
                    # one window cancels; drift inside a window remains as error.
                    "predicted_prior_speed_tok_s": _median_or_none([
                        _predicted(c, k, scaled(times, sp), acc,
                                   None if profile.prefill_s_per_token is None
                                   else profile.prefill_s_per_token * sp, prompt_per_output)
                        for sp in prior_speed[c][name] if sp is not None]),
                    "window_acceptance": _acc_json(window_acc[c][name]),
                    # The profile's T scaled by the speed the machine had during the window
                    # (its own pure-decode steps over the profile's T), and the window's
                    # acceptance, prefill price and prompt/output ratio: the model's form, with
                    # this machine's drift measured instead of assumed away.
                    "predicted_window_speed_tok_s": _median_or_none([
                        closed_loop_throughput(
                            c, k, scaled(times, ws[0]), a or acc,
                            ws[1] if ws[1] is not None
                            else (profile.prefill_s_per_token or 0.0) * ws[0],
                            prompt_per_output if pr[1] is None else pr[1])
                        for a, pr, ws in zip(window_acc[c][name], window_prefill[c][name],
                                             window_speed[c][name]) if ws is not None]),
                }
                if c in retimed:
                    rt = retimed[c]
                    prefill_s = rt.prefill_s_per_token(profile)
                    entry["configs"][name].update(
                        predicted_retimed_tok_s=closed_loop_throughput(
                            c, k, rt.times, acc, prefill_s, prompt_per_output),
                        # Re-timed T and each window's own acceptance (median over windows):
                        # what is left is the model's structure, not its inputs.
                        predicted_retimed_window_acceptance_tok_s=summarize([
                            closed_loop_throughput(c, k, rt.times, a or acc, prefill_s,
                                                   prompt_per_output)
                            for a in window_acc[c][name]]).median,
                        # ...and also each window's own prefill price and prompt/output ratio
                        # (fitted on its mixed steps): every input of the model taken from the
                        # window itself, so the remaining error is the model's form alone.
                        predicted_retimed_window_inputs_tok_s=_median_or_none([
                            closed_loop_throughput(c, k, rt.times, a or acc,
                                                   prefill_s if p is None else p,
                                                   prompt_per_output if r is None else r)
                            for a, (p, r) in zip(window_acc[c][name], window_prefill[c][name])]),
                        window_prefill_s_per_token=_median_or_none(
                            [p for p, _ in window_prefill[c][name] if p is not None]),
                        window_prompt_per_output=_median_or_none(
                            [r for _, r in window_prefill[c][name] if r is not None]),
                    )
            add_relative_prediction(entry)
            if c in retimed:
                entry["retimed"] = retimed[c].to_json(times, c)
            if c in confirmations:
                entry["confirmation"] = confirmations[c]
            per_load.append(entry)
        results[w.name] = {
            "measured_table": profile.table_for(w.name).to_vllm(),
            "acceptance": list(acc.prefix_accept), "draft_rate": acc.draft_rate,
            "prompt_per_output": prompt_per_output,
            "prefill_s_per_token": profile.prefill_s_per_token,
            "loads": per_load,
        }
    out = {"config": asdict(cfg), "docs_table": DOCS_TABLE, "workloads": results}
    add_equivalence(out)
    add_verdicts(out, cfg.target_loss, cfg.verdict_confidence)
    out["prediction"] = prediction_summary(out)
    return out


def settle_window_tokens(engine: TunableEngine, loop: Any, table: DraftLengthTable, c: int,
                         cfg: EvalConfig) -> int:
    """Settle the load's clients under ``table`` (the measured one) and return the token count
    an aligned window ends on: ``duration_s`` at the speed the settle ran at."""
    engine.set_table(table)
    tokens0, t0 = loop.tokens_total, time.perf_counter()
    loop.settle(cfg.settle_max_s)
    rate: float = (loop.tokens_total - tokens0) / max(time.perf_counter() - t0, 1e-9)
    return max(c, round(rate * cfg.duration_s))


def _predicted(c: int, k: int, times: StepTimes, acc: Acceptance,
               prefill_s_per_token: float | None, prompt_per_output: float) -> float:
    """The profile's closed-loop throughput at load c and draft length k (decode only when the
    tune measured no prefill price)."""
    if prefill_s_per_token is None:
        return goodput(c, k, times, acc)
    return closed_loop_throughput(c, k, times, acc, prefill_s_per_token, prompt_per_output)


def strongest_rival(samples: dict[str, list[float]], table_k: int) -> str | None:
    """The fixed k other than ``table_k`` with the highest median relative throughput."""
    rel = relative_to_repeat(samples)
    scores = {n: summarize(v).median for n, v in rel.items()
              if n.startswith("k=") and n != f"k={table_k}"}
    return max(scores, key=lambda n: scores[n]) if scores else None


def confirm(engine: TunableEngine, loop: Any, cfg: EvalConfig, w: Workload,
            tables: dict[str, DraftLengthTable], c: int, samples: dict[str, list[float]],
            window_tokens: int, advance: Callable[[str], None]) -> dict[str, Any]:
    """Head-to-head of the measured table against the strongest other fixed k (see
    EvalConfig.confirm_rounds); every window aligned on the round's prompts."""
    table = tables["measured table"]
    k = table.lookup(c)
    rival = strongest_rival(samples, k)
    if rival is None:
        return {"table_k": k, "rival": None}
    looks = cfg.looks
    confidence = per_look_confidence(cfg.verdict_confidence, len(looks))
    windows: list[dict[str, list[float]]] = []
    for r in range(looks[-1]):
        order = ["table", "rival", "rival", "table"] if r % 2 == 0 else [
            "rival", "table", "table", "rival"]
        got: dict[str, list[float]] = {"table": [], "rival": []}
        for who in order:
            engine.set_table(table if who == "table" else tables[rival])
            tokens, secs, _ = _window(engine, loop, cfg, w.cycle(cfg.seed + 500 + r),
                                      window_tokens)
            got[who].append(tokens / secs)
            advance(f"{w.name} c={c} confirm {who}")
        windows.append(got)
        if stop_confirming(round_losses(windows), looks, cfg.target_loss, confidence):
            for _ in range(4 * (looks[-1] - len(windows))):
                advance(f"{w.name} c={c} confirmed after {len(windows)} rounds")
            break
    out = confirmation_summary(k, rival, windows)
    out.update(looks=list(looks), confidence_per_look=confidence)
    return out


def confirm_looks(first_rounds: int, max_rounds: int) -> tuple[int, ...]:
    """Round counts after which a sequential confirmation judges its verdict and may stop:
    ``first_rounds``, then doubling, and ``max_rounds`` last. Fixed before any round runs, so
    each look's confidence can be set from their number (``per_look_confidence``)."""
    if first_rounds < 1 or max_rounds < first_rounds:
        raise ValueError(f"looks need 1 <= first_rounds <= max_rounds, got {first_rounds}, "
                         f"{max_rounds}")
    looks = []
    n = first_rounds
    while n < max_rounds:
        looks.append(n)
        n *= 2
    looks.append(max_rounds)
    return tuple(looks)


def per_look_confidence(confidence: float, num_looks: int) -> float:
    """Each look's interval at 1 - (1 - confidence) / looks: the chance that *any* look's
    interval misses the median is then at most 1 - confidence (union bound: no independence
    between looks is needed), so stopping at the first look that resolves keeps the stated
    confidence for the verdict it stops on. One look: ``confidence`` itself."""
    if num_looks < 1:
        raise ValueError(f"need at least one look, got {num_looks}")
    return 1.0 - (1.0 - confidence) / num_looks


def stop_confirming(losses: Sequence[float], looks: Sequence[int], target_loss: float,
                    confidence: float) -> bool:
    """Whether a sequential confirmation with these round losses stops now: at its last look
    always; at an earlier look when the verdict is met or missed on an interval that really
    has ``confidence`` (at a look with too few rounds for it, the widest interval's lower
    coverage must not end the run: the per-look guarantee would not hold)."""
    n = len(losses)
    if n >= looks[-1]:
        return True
    if n not in looks:
        return False
    v = load_verdict(losses, target_loss, confidence)
    return bool(v["status"] != "unresolved" and v["coverage"] >= confidence)


def round_losses(windows: Sequence[dict[str, list[float]]]) -> list[float]:
    """Per round: 1 - (table's tokens/s summed over its windows) / (rival's)."""
    return [1.0 - sum(g["table"]) / sum(g["rival"]) for g in windows]


def confirmation_summary(table_k: int, rival: str,
                         windows: Sequence[dict[str, list[float]]]) -> dict[str, Any]:
    """Per round: loss = 1 - (table's tokens/s summed over its two windows) / (rival's); the
    table's loss vs the best fixed k is max(0, median round loss): if the rival is slower,
    the table's own k is the fastest fixed k. ``sign_test_p``: two-sided probability of
    rounds at least this one-sided if table and rival were equally fast."""
    losses = round_losses(windows)
    # Sign test: rounds with no difference say nothing either way.
    above, below = sum(x > 0 for x in losses), sum(x < 0 for x in losses)
    tail = sign_test_tail(max(above, below), above + below)
    med = summarize(losses).median
    return {"table_k": table_k, "rival": rival, "round_losses": losses,
            "windows_tok_s": list(windows), "median_loss": med, "min_loss": min(losses),
            "max_loss": max(losses), "sign_test_p": min(1.0, 2 * tail),
            "loss_vs_best_fixed": max(0.0, med)}


# Fewer than 3 rounds give no interval that holds the median at least 3 times in 4 (2 rounds:
# 1/2, 1 round: 0): such a load is reported unresolved whatever its losses.
MIN_VERDICT_COVERAGE = 0.75


def load_verdict(losses: Sequence[float], target_loss: float,
                 confidence: float) -> dict[str, Any]:
    """The target judged on per-round losses of the measured table (1 - table / rival):
    ``met`` when the whole confidence interval of the median loss is at or below
    ``target_loss``, ``missed`` when all of it is above, ``unresolved`` when it straddles the
    target (the machine's noise is larger than the difference being asked about) or when the
    rounds are too few for any interval to mean much (below MIN_VERDICT_COVERAGE). A negative
    loss (table faster) counts as 0: the table's own k is then the fastest fixed k."""
    iv = median_interval(losses, confidence)
    status = ("unresolved" if iv.coverage < MIN_VERDICT_COVERAGE else
              "met" if iv.high <= target_loss else
              "missed" if iv.low > target_loss else "unresolved")
    return {"status": status, "target_loss": target_loss, "n": len(losses),
            "loss_median": max(0.0, summarize(losses).median),
            "interval": [max(0.0, iv.low), max(0.0, iv.high)], "coverage": iv.coverage}


def add_verdicts(results: dict[str, Any], target_loss: float = 0.03,
                 confidence: float = 0.9) -> dict[str, Any]:
    """Per load, the target verdict (``load_verdict``) on the confirmation's round losses (the
    table head-to-head with the fastest other fixed k on fresh windows), or without a
    confirmation on the repeats' paired losses against the best fixed k (biased against the
    table: that k was picked as the fastest of several noisy medians). Per workload and
    overall: how many loads were met / missed / unresolved. Works on older result files."""
    counts_all = {"met": 0, "missed": 0, "unresolved": 0}
    for res in results["workloads"].values():
        counts = {"met": 0, "missed": 0, "unresolved": 0}
        for e in res["loads"]:
            cf = e.get("confirmation")
            if cf and cf.get("rival") is None:
                v: dict[str, Any] = {"status": "met", "target_loss": target_loss,
                                     "source": "no other fixed k"}
            elif cf:
                # A sequential confirmation was judged at its per-look confidence (stricter).
                v = load_verdict(cf["round_losses"], target_loss,
                                 cf.get("confidence_per_look", confidence))
                v["source"] = f"confirmation vs {cf['rival']}"
            else:
                v = load_verdict(e["configs"]["measured table"]["paired_loss"]["samples"],
                                 target_loss, confidence)
                v["source"] = f"repeats vs {e['best_fixed']}"
            e["verdict"] = v
            counts[v["status"]] += 1
        res["verdict"] = dict(counts, target_loss=target_loss, loads=len(res["loads"]))
        for key, n in counts.items():
            counts_all[key] += n
    results["verdict"] = dict(counts_all, target_loss=target_loss, confidence=confidence)
    return results


def relative_to_repeat(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each window's throughput over the geometric mean of all configurations' windows of the
    same repeat (the i-th window of every configuration). Ratios between configurations within
    a repeat are kept; what the repeat did to all of them alike (its prompts, the machine's
    speed then) is divided out."""
    names = list(samples)
    repeats = {len(v) for v in samples.values()}
    if len(repeats) != 1 or not names:
        raise ValueError("every configuration needs the same number of windows")
    n = repeats.pop()
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        shares = geometric_shares({name: samples[name][i] for name in names})
        for name in names:
            out[name].append(shares[name])
    return out


def add_relative_prediction(entry: dict[str, Any]) -> None:
    """Add to each configuration of one load's entry the profile's throughput relative to the
    others at this load (``predicted_relative``: its predicted tok/s over the geometric mean of
    all configurations') and the measured relative throughput (``measured_relative``: the
    median over repeats of each window over its repeat's geometric mean). One level per load
    comes from the measurement, so machine speed that moved every configuration alike divides
    out, and every input of the shape (T, acceptance, prefill price, prompt/output ratio) is
    the profile's: this is what the table's choice of k rests on."""
    configs = entry["configs"]
    shares = geometric_shares({name: c["predicted_tok_s"] for name, c in configs.items()})
    for name, c in configs.items():
        c["predicted_relative"] = shares[name]
        c["measured_relative"] = summarize(c["relative_samples"]).median


def geometric_shares(values: dict[str, float]) -> dict[str, float]:
    """Each value over the geometric mean of all of them (their product is 1): ratios between
    entries are kept, their common level divided out."""
    if not values:
        raise ValueError("no values to share out")
    if any(not x > 0 for x in values.values()):  # also refuses NaN
        raise ValueError("throughput samples must be positive")
    gmean = math.exp(sum(math.log(x) for x in values.values()) / len(values))
    return {name: x / gmean for name, x in values.items()}


def _per_window(loads: Sequence[int], names: Sequence[str]) -> dict[int, dict[str, list[Any]]]:
    return {c: {n: [] for n in names} for c in loads}


@dataclass(frozen=True, slots=True)
class RetimedLoad:
    """T(c, 0..max_k) measured again right before load level c, merged into the profile's grid.
    ``speed_ratio`` = median over k of re-timed / profile T at c: how much faster (< 1) or
    slower the machine runs now; the prefill price is scaled by it (prefill runs on the same
    cores, and re-timing it too would need a prefill-heavy run)."""

    times: StepTimes
    samples_s: dict[int, list[float]]
    speed_ratio: float

    def prefill_s_per_token(self, profile: Profile) -> float:
        return (profile.prefill_s_per_token or 0.0) * self.speed_ratio

    def to_json(self, profile_times: StepTimes, c: int) -> dict[str, Any]:
        return {"speed_ratio": self.speed_ratio,
                "step_time_s": {str(k): summarize(v).median for k, v in self.samples_s.items()},
                "profile_step_time_s": {
                    str(k): profile_times.at(c, (self.times.drafts_per_req or {}).get((c, k), k))
                    for k in self.samples_s}}


def merge_retimed(times: StepTimes, c: int, samples_s: dict[int, list[float]],
                  drafts_per_req: dict[int, float]) -> RetimedLoad:
    """The profile's grid with batch size c replaced (or added) by fresh measurements."""
    if set(samples_s) != set(range(times.max_k + 1)) or any(not v for v in samples_s.values()):
        raise ModelError(f"re-timing at batch size {c} must cover k = 0..{times.max_k}")
    step = {key: t for key, t in times.step_time_s.items() if key[0] != c}
    drafts = {key: d for key, d in (times.drafts_per_req or {}).items() if key[0] != c}
    ratios = []
    for k, v in samples_s.items():
        t = summarize(v).median
        step[(c, k)] = t
        drafts[(c, k)] = drafts_per_req.get(k, float(k))
        ratios.append(t / times.at(c, drafts[(c, k)]))
    return RetimedLoad(StepTimes(step, drafts), samples_s, summarize(ratios).median)


def retime(engine: TunableEngine, times: StepTimes, c: int, cfg: EvalConfig) -> RetimedLoad:
    tc = TuneConfig(batch_sizes=(c,), rounds=cfg.retime_rounds, seed=cfg.seed)
    samples, drafts = measure_step_times(engine, tc, timing_prompts(seed=cfg.seed), lambda _: None)
    return merge_retimed(times, c, {k: v for (_, k), v in samples.items()},
                         {k: d for (_, k), d in drafts.items()})


def step_time_ratio(records: Sequence[StepRecord], times: StepTimes) -> float:
    """Median of (pure-decode step time / the profile's T for that batch and draft count):
    1.0 when the machine runs as fast as during the tune. NaN when no pure decode step ran."""
    ratios = [r.step_time_s / decode_part_s(r, times) for r in records
              if r.is_pure_decode and r.batch_size >= 1]
    return summarize(ratios).median if ratios else float("nan")


def window_acceptance(records: Sequence[StepRecord], max_k: int) -> Acceptance | None:
    """The acceptance this window's drafts really had (vLLM's counters, tune's estimator);
    None when nothing was drafted (k = 0, or a drafter that found no match)."""
    counter = AcceptanceCounter(max_k)
    counter.add_all(records)
    try:
        return counter.acceptance()
    except ValueError:  # no drafts counted (ModelError is a ValueError too)
        return None


def scaled(times: StepTimes, factor: float) -> StepTimes:
    """The same grid with every step time multiplied by ``factor``."""
    return StepTimes({key: t * factor for key, t in times.step_time_s.items()},
                     times.drafts_per_req, times.rel_se)


def window_prefill_price(records: Sequence[StepRecord], times: StepTimes,
                         output_tokens: int) -> tuple[float | None, float | None]:
    """The window's own prefill price (seconds per prompt token in its mixed steps, fitted
    against ``times`` as the tune fits it) and its prompt tokens per output token; None where
    the window had no prefill or no output."""
    prompt = sum(r.num_prefill_tokens for r in records)
    ratio = prompt / output_tokens if output_tokens > 0 else None
    return prefill_s_per_token(records, times), ratio


def _median_or_none(xs: Sequence[float]) -> float | None:
    finite = [x for x in xs if not math.isnan(x)]
    return summarize(finite).median if finite else None


def _acc_json(accs: Sequence[Acceptance | None]) -> list[dict[str, Any] | None]:
    return [None if a is None else {"prefix_accept": list(a.prefix_accept),
                                    "draft_rate": a.draft_rate} for a in accs]


PREDICTIONS = ("predicted_tok_s", "predicted_observed_mix_tok_s", "predicted_retimed_tok_s",
               "predicted_retimed_window_acceptance_tok_s", "predicted_retimed_window_inputs_tok_s",
               "predicted_window_speed_tok_s", "predicted_anchored_k0_tok_s",
               "predicted_prior_speed_tok_s")


# (prediction, what it is scored against): every absolute prediction against the measured
# median throughput, the relative one against the measured relative throughput.
SCORED = tuple((p, "median_tok_s") for p in PREDICTIONS) + (
    ("predicted_relative", "measured_relative"),)


def prediction_summary(results: dict[str, Any]) -> dict[str, Any]:
    """Median |predicted / measured - 1| over every configuration and load, for each kind of
    prediction present: overall and per workload."""
    out: dict[str, Any] = {}
    for field_name, measured in SCORED:
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
    of the same configuration). Works on results written by older versions too."""
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
                # Relative samples where the results have them (older files: raw tok/s).
                field = "relative_samples" if "relative_samples" in entry else "samples_tok_s"
                pooled_median = summarize(twin[field] + entry[field]).median
                entry["equivalent_fixed"] = f"k={k}"
                entry["equivalent_loss"] = (0.0 if f"k={k}" == e["best_fixed"] else
                                            1.0 - pooled_median / summarize(best[field]).median)
                gaps = [1.0 - x / y for x, y in zip(entry["samples_tok_s"], twin["samples_tok_s"])]
                entry["identical_config_gap"] = {"median": summarize(gaps).median,
                                                 "min": min(gaps), "max": max(gaps)}
    return results


def _window(engine: TunableEngine, loop: Any, cfg: EvalConfig, prompts: Any,
            window_tokens: int) -> tuple[int, float, list[Any]]:
    if cfg.aligned:
        loop.restart(prompts)
        before = engine.num_records()
        # A cap far above the expected duration: a stalled engine must not hang the run.
        tokens, secs = loop.run_tokens(window_tokens, max_s=10 * cfg.duration_s + 60)
    else:
        before = engine.num_records()
        tokens, secs = loop.run(cfg.duration_s, warmup_s=cfg.warmup_s, prompts=prompts)
    records = engine.records_since(before)
    # Keep the measured window's steps only (the warm-up ones come first).
    end = records[-1].end_time_s if records else 0.0
    return tokens, secs, [r for r in records if r.end_time_s >= end - secs]


def _mean_decode_batch(records: Sequence[Any]) -> float:
    steps = [r for r in records if r.num_decode_reqs > 0]
    return sum(r.num_decode_reqs for r in steps) / len(steps) if steps else 0.0


def _mix_prediction(records: Sequence[Any], table: DraftLengthTable, times: Any, acc: Any,
                    prefill_s_per_token: float | None) -> float:
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


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        loads = results["workloads"][name]["loads"]
        xs = [e["load"] for e in loads]
        for cfg_name in loads[0]["configs"]:
            ys = [e["configs"][cfg_name]["median_tok_s"] for e in loads]
            lo = [e["configs"][cfg_name]["min_tok_s"] for e in loads]
            hi = [e["configs"][cfg_name]["max_tok_s"] for e in loads]
            style = {"measured table": {"lw": 2.5, "color": "black", "marker": "o"},
                     "docs table": {"lw": 2, "color": "red", "ls": "--", "marker": "s"}}.get(
                cfg_name, {"lw": 1, "alpha": 0.8, "marker": "."})
            ax.plot(xs, ys, label=cfg_name, **style)
            ax.fill_between(xs, lo, hi, alpha=0.08, color=style.get("color"))
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("load (closed-loop clients)")
        ax.set_ylabel("output tokens/s (median, band = min..max)")
        ax.set_title(f"{name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(results: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    png_path = out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(results, indent=1))
    plot(results, png_path)
    return json_path, png_path


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
