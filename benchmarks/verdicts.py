"""The figures that judge the targets in benchmarks/targets/: each a named function of one
result file's JSON (keyword arguments from the target's ``args``), returning the samples its
rule judges and a line on how they were read. A figure raises ``NotApplicable`` for a file
that does not carry it (another configuration, an older format): the next older file is
tried. Figures recompute from raw samples where a result holds them, never read a verdict a
script wrote. `loadwise report verdicts` loads ``FIGURES``; tests run each on committed
results (benchmarks/tests/test_verdicts.py)."""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sched_figures import longest_decile, percentile, tied_at_cut

from loadwise.verdicts.compute import NotApplicable
from loadwise.verdicts.rules import Figure

FIGURES: dict[str, Callable[..., Figure]] = {}
Result = dict[str, Any]


def figure(fn: Callable[..., Figure]) -> Callable[..., Figure]:
    FIGURES[fn.__name__] = fn
    return fn


def need(result: Result, *keys: str) -> Any:
    """``result[k1][k2]…``, or NotApplicable where the file lacks it."""
    cur: Any = result
    for k in keys:
        if not isinstance(cur, dict) or k not in cur:
            raise NotApplicable(".".join(keys))
        cur = cur[k]
    return cur


# --- the main job and the tune ------------------------------------------------------------------

@figure
def main_job_total_s(result: Result) -> Figure:
    """Wall time of `bash scripts/demo.sh` from a fresh clone; a run that failed has none."""
    if need(result, "returncode") != 0:
        raise NotApplicable("the main job failed")
    p = result.get("phases") or {}
    return Figure((float(result["wall_s"]),),
                  f"setup {p.get('setup_s')} s, model and head {p.get('model_and_head_s')} s, "
                  f"tune {p.get('tune_s')} s; {result['machine']['cpu_model']} "
                  f"({result['machine']['isa']}); pip cache {result['config']['pip_cache']}")


@figure
def test_command_wall_s(result: Result, isa: str | None = None) -> Figure:
    """Wall time of `.ci/run` from a fresh clone; a run that failed did not pass in any time
    (inf). ``isa``: only a run on a CPU of that label (AVX2, AVX-512+BF16, AMX) counts."""
    machine = need(result, "machine")
    if isa is not None and machine.get("isa") != isa:
        raise NotApplicable(f"measured on {machine.get('isa')}, not {isa}")
    if result.get("jobs"):  # scripts/test.sh's jobs, each with its wall time
        stages = "jobs " + ", ".join(
            f"{j['job']} {j['seconds']} s" + ("" if j["exit"] == 0 else f" (exit {j['exit']})")
            for j in result["jobs"])
    else:  # results from before the jobs: each pytest stage
        stages = "; ".join(", ".join(f"{n} {kind}" for kind, n in s["counts"].items()
                                     if kind != "warnings") + f" in {s['seconds']:.0f} s"
                           for s in result.get("stages", []))
    code = need(result, "returncode")
    failed = "" if code == 0 else f"exit {code}; "
    return Figure((float(result["wall_s"]) if code == 0 else float("inf"),),
                  f"{failed}{stages}; {machine['cpu_model']} ({machine['isa']}); pip cache "
                  f"{result['config']['pip_cache']}")


@figure
def evaluate_round_losses(result: Result, workload: str, load: int) -> Figure:
    """Per round, 1 - the table's tok/s / the strongest other fixed k's, from the load's
    confirmation (else the repeats' paired losses against the best fixed k)."""
    loads = need(result, "workloads", workload, "loads")
    entry = next((e for e in loads if e["load"] == load), None)
    if entry is None:
        raise NotApplicable(f"no load {load}")
    cf = entry.get("confirmation")
    if cf and cf.get("round_losses"):
        losses, rival = cf["round_losses"], cf["rival"]
    else:
        losses = entry["configs"]["measured table"]["paired_loss"]["samples"]
        rival = entry["best_fixed"]
    lost = sum(x > 0 for x in losses)
    return Figure(tuple(losses), f"the table lost to {rival} in {lost} of {len(losses)} rounds "
                                 f"(median loss {statistics.median(losses):.1%})")


@figure
def settings_deployed_gain(result: Result) -> Figure:
    """The deployed serving settings over vLLM's defaults: per load, the median over rounds of
    the round's tok/s ratio; the figure is their geometric mean over loads (the sweep's rule,
    ``policy.settings.choose_settings``)."""
    decision = need(result, "meta", "settings_sweep", "decision")
    deploy = decision["deploy"]
    if deploy == decision["reference"]:
        return Figure((1.0,), "vLLM's defaults deployed")
    meds = [statistics.median(p["ratios"][deploy]) for p in decision["per_load"]]
    return Figure((statistics.geometric_mean(meds),),
                  f"{deploy} per load " + ", ".join(f"{m:.2f}x" for m in meds))


@figure
def first_request_ratios(result: Result) -> Figure:
    """Per configuration: the first request after ready over the same request again (median
    over rounds)."""
    summary = need(result, "summary")
    names = sorted(summary)
    return Figure(tuple(summary[n]["first_ratio_median"] for n in names),
                  ", ".join(f"{n} {summary[n]['first_ratio_median']:.2f}x" for n in names))


# --- the drafter --------------------------------------------------------------------------------

@figure
def drafter_accepted_over_ngram(result: Result, head: str = "eagle-self") -> Figure:
    s = need(result, "summary")
    a, b = s[head]["accepted_per_decode_step"], s["ngram"]["accepted_per_decode_step"]
    return Figure((a / b,), f"{a:.3f} against prompt lookup's {b:.3f} per decode step")


@figure
def drafter_speed_over_off(result: Result, head: str = "eagle-self") -> Figure:
    rounds = need(result, "summary", head, "tok_s_over_off_per_round")
    return Figure(tuple(rounds), "per round: " + ", ".join(f"{x:.2f}x" for x in rounds))


@figure
def head_retrain_difference(result: Result) -> Figure:
    """Largest difference in held-out accuracy per draft step between a head retrained with
    the defaults (the result's) and the shipped head's record."""
    from loadwise.heads import RECORD, shipped_dir

    earlier = need(result, "head")
    shipped = json.loads((shipped_dir() / RECORD).read_text())
    a = shipped["held_out"]["step_accuracy_every_label"]
    b = earlier["held_out"]["step_accuracy_every_label"]
    if len(a) != len(b) or shipped["config"] | {"model": None} != earlier["config"] | {
            "model": None}:
        raise NotApplicable("trained with other settings")
    return Figure((max(abs(x - y) for x, y in zip(a, b, strict=True)),),
                  f"shipped {[round(x, 3) for x in a]}, retrained {[round(x, 3) for x in b]}")


# --- the KV store and agent sessions ------------------------------------------------------------

def _agent_runs(result: Result, config: str) -> dict[int, Result]:
    runs = {r["level"]: r for r in need(result, "results") if r["config"] == config}
    if not runs:
        raise NotApplicable(f"no {config} runs")
    return runs


@figure
def kv_agent_read_back(result: Result, config: str = "flat") -> Figure:
    runs = _agent_runs(result, config)
    vals = [runs[lv]["summary"]["agent"]["read_back_of_reusable"] for lv in sorted(runs)]
    return Figure(tuple(vals), f"{config} at {sorted(runs)} agents: "
                               + ", ".join(f"{v:.1%}" for v in vals))


def _agents_at_top(result: Result, config: str, other: str, key: str) -> tuple[int, float,
                                                                            float]:
    """The highest level both configurations ran: their agent steps' ``key``."""
    mine, theirs = _agent_runs(result, config), _agent_runs(result, other)
    top = max(set(mine) & set(theirs))
    return top, mine[top]["summary"]["agent"][key], theirs[top]["summary"]["agent"][key]


@figure
def kv_agent_flat_lead_at_top(result: Result) -> Figure:
    top, f, t = _agents_at_top(result, "flat", "tiered", "read_back_of_reusable")
    return Figure((f - t,), f"at {top} agents: flat {f:.1%}, tiered {t:.1%}")


@figure
def kv_agent_ttft_over_alone_at_top(result: Result) -> Figure:
    top, f, a = _agents_at_top(result, "flat", "none", "ttft_p50_s")
    return Figure((f / a,), f"agent TTFT p50 at {top} agents: flat {f:.2f} s, vLLM alone {a:.2f} s")


@figure
def kv_agent_chat_ttft_over_tiered(result: Result) -> Figure:
    """Per level with chat turns under both: flat's chat TTFT p50 over tiered's."""
    flat, tiered = _agent_runs(result, "flat"), _agent_runs(result, "tiered")
    levels = [lv for lv in sorted(set(flat) & set(tiered))
              if flat[lv]["summary"]["chat"]["requests"]
              and tiered[lv]["summary"]["chat"]["requests"]]
    vals = [flat[lv]["summary"]["chat"]["ttft_p50_s"] / tiered[lv]["summary"]["chat"]["ttft_p50_s"]
            for lv in levels]
    return Figure(tuple(vals), ", ".join(
        f"{lv} agents {v:.2f}x ({flat[lv]['summary']['chat']['requests']} chats)"
        for lv, v in zip(levels, vals, strict=True)))


@figure
def kv_agent_reads_over_disk(result: Result, config: str = "flat") -> Figure:
    """Per level: the session extents' pooled read throughput through the connector's read
    path over the disk's own sequential O_DIRECT read of a 1 GiB file measured in the same run
    (the rate the target names; the plain re-read of each extent was added after the first
    run and is not the judge)."""
    disk = need(result, "disk", "seq_read_bytes_s")
    runs = _agent_runs(result, config)
    vals = [runs[lv]["session_reads"]["bytes_s"] / disk for lv in sorted(runs)]
    return Figure(tuple(vals), f"disk {disk / 1e9:.2f} GB/s; sessions "
                               + ", ".join(f"{runs[lv]['session_reads']['bytes_s'] / 1e9:.2f}"
                                           for lv in sorted(runs)) + " GB/s")


@figure
def kv_multiturn_evicted_ttft(result: Result, config: str = "files",
                              reference: str = "none") -> Figure:
    """Per arrival rate: TTFT p50 of later turns whose prefix the reference's vLLM cache had
    evicted, the configuration's over the reference's (the same turns, the same run)."""
    if need(result, "greedy_identity_reference") != reference:
        raise NotApplicable(f"reference is not {reference}")
    rows = need(result, "later_turns_by_reference_eviction")
    mine = {k.split("@")[1]: v for k, v in rows.items()
            if k.startswith(f"{config}@") and k.endswith(":evicted") and v["requests"]}
    if not mine:
        raise NotApplicable(f"no evicted later turns under {config}")
    rates = sorted(mine)
    return Figure(tuple(mine[r]["ratio_to_reference"] for r in rates), ", ".join(
        f"{r.split(':')[0]} sessions/s: {mine[r]['ratio_to_reference']:.2f} "
        f"({mine[r]['requests']} turns)" for r in rates))


@figure
def kv_agent_restart_read_back(result: Result) -> Figure:
    kr = need(result, "kill_restart")
    return Figure((kr["read_back_after_restart"],),
                  f"{kr['steps_after']} steps after kill -9, {kr['reusable_tokens_after']:,} "
                  "reusable tokens")


@figure
def identical_share(result: Result, key: str = "greedy_identity") -> Figure:
    """Per configuration: the share of requests whose greedy output equals the reference's."""
    ident = need(result, key)
    vals = [v["identical"] / v["same_prompt"] for v in ident.values() if v["same_prompt"]]
    same = sum(v["identical"] for v in ident.values())
    total = sum(v["same_prompt"] for v in ident.values())
    return Figure(tuple(vals), f"{same} / {total} identical")


# --- P/D and batch invariance -------------------------------------------------------------------

@figure
def disagg_fault_differ(result: Result) -> Figure:
    n = need(result, "differ_from_reference")
    return Figure((float(n),), f"{result['completed']:,} of {result['requests']:,} requests "
                               f"completed under faults; {n} differ from the reference")


@figure
def disagg_fault_errors_without_message(result: Result) -> Figure:
    n = need(result, "num_errors_without_message")
    crashes = result.get("engine_crashes")
    return Figure((float(n + (crashes or 0)),), f"{n} errors without a message, "
                                               f"{crashes} engine crashes")


@figure
def invariance_differ(result: Result, mode: str = "invariant") -> Figure:
    t = need(result, "totals", mode)
    return Figure((float(t["differ"]),), f"{t['differ']} of {t['requests']} requests differ "
                                         "bitwise alone vs inside batches")


@figure
def invariance_throughput_ratio(result: Result, load: int) -> Figure:
    """Per interleaved round: --batch-invariant's output tok/s over the default mode's."""
    rounds = need(result, "summary", str(load), "ratio_per_round")
    return Figure(tuple(rounds), "per round: " + ", ".join(f"{x:.3f}" for x in rounds))


# --- scheduling -----------------------------------------------------------------------------------

def _cells(result: Result) -> list[Result]:
    if need(result, "benchmark") != "sched_latency":
        raise NotApplicable("not a latency run")
    return list(result["cells"])


@figure
def sched_mean_latency_ratio(result: Result, policy: str, rate: float) -> Figure:
    """Per round: fcfs's mean latency over the policy's at that rate."""
    row = need(result, "ratios", str(rate), policy)
    return Figure(tuple(row["per_round"]), "per round: " + ", ".join(
        f"{x:.2f}x" for x in row["per_round"]))


@figure
def sched_oracle_share(result: Result, rate: float) -> Figure:
    share = need(result, "oracle_share", str(rate))
    return Figure((share,), f"the predictor's share of the oracle's reduction at rate {rate}")


@figure
def predictor_tau(result: Result, stage: str = "arrival") -> Figure:
    held = need(result, "predictor", "held_out")
    return Figure((held[stage]["kendall_tau"],), f"{stage}, held out")


@figure
def predictor_tau_gain(result: Result) -> Figure:
    held = need(result, "predictor", "held_out")
    return Figure((held["tau_gain"],), f"{held['arrival']['kendall_tau']:.3f} at arrival, "
                                       f"{held['refined']['kendall_tau']:.3f} refined")


def true_lengths(result: Result, rate_index: int, fcfs_cell: Result) -> list[int]:
    """The oracle's output lengths of a cell's requests: the capacity burst answered every
    prompt in rate order (a block per rate); without it, fcfs's own (greedy outputs are the same
    under every policy)."""
    n = len(fcfs_cell["requests"])
    burst = result.get("burst")
    if burst:
        return [r["output_tokens"] for r in burst[n * rate_index:n * (rate_index + 1)]]
    return [r["output_tokens"] for r in fcfs_cell["requests"]]


def _starvation(result: Result, policy: str, rate: float,
                tied: bool) -> tuple[list[float], list[int]]:
    cells = _cells(result)
    rates = [float(r) for r in str(result["config"]["rates"]).split(",")]
    ri = rates.index(rate)
    out, sizes = [], []
    for rnd in sorted({c["round"] for c in cells}):
        by = {c["policy"]: c for c in cells if c["round"] == rnd and c["rate_frac"] == rate}
        if "fcfs" not in by or policy not in by:
            continue
        lengths = true_lengths(result, ri, by["fcfs"])
        chosen = (tied_at_cut(lengths) if tied
                  else longest_decile(lengths, random.Random(1000 * rnd + ri)))

        def p99(cell: Result, idx: list[int] = chosen) -> float:
            return percentile([cell["requests"][i]["latency_s"] for i in idx], 99)

        out.append(p99(by[policy]) / p99(by["fcfs"]))
        sizes.append(len(chosen))
    if not out:
        raise NotApplicable(f"no {policy} cells at {rate}")
    return out, sizes


@figure
def sched_starvation(result: Result, policy: str, rate: float) -> Figure:
    """Per round: the policy's p99 latency over the longest decile by true length (ties at the
    cap drawn at random, seeded by round and rate) over fcfs's on the same requests."""
    vals, sizes = _starvation(result, policy, rate, tied=False)
    return Figure(tuple(vals), f"{sizes[0]} requests per cell; per round: "
                               + ", ".join(f"{x:.2f}x" for x in vals))


@figure
def sched_starvation_tied(result: Result, policy: str, rate: float) -> Figure:
    """The same over the decile with all its ties (every request at the token cap)."""
    vals, sizes = _starvation(result, policy, rate, tied=True)
    return Figure(tuple(vals), f"{', '.join(map(str, sizes))} requests per cell with the ties; "
                               "per round: " + ", ".join(f"{x:.2f}x" for x in vals))


@figure
def sched_identical(result: Result) -> Figure:
    same = need(result, "identical_to_fcfs")
    return Figure(tuple(a / b for a, b in same.values()),
                  ", ".join(f"{k} {a}/{b}" for k, (a, b) in same.items()))


@figure
def sched_overhead_share(result: Result, policy: str = "srpt") -> Figure:
    """Per cell of the policy: the ordering's and refinement's share of engine step time, as
    the engine's state file recorded it."""
    vals = [c["engine_state"]["overhead_share"] for c in _cells(result)
            if c["policy"] == policy and c.get("engine_state")
            and c["engine_state"].get("overhead_share") is not None]
    if not vals:
        raise NotApplicable(f"no {policy} state")
    return Figure(tuple(vals), f"{len(vals)} cells")


# --- quantization ---------------------------------------------------------------------------------

FORMATS = ("int4-channel", "mxfp4", "nvfp4")


@figure
def quant_dualquant_beats_smoothquant(result: Result, text: str = "ptb",
                                      bits: str = "W4A4") -> Figure:
    """How many of the three 4-bit formats give DualQuant a perplexity at or below
    SmoothQuant's."""
    table = need(result, "summary", "table")
    rows = [table[f"{text} {bits} {f}"] for f in FORMATS]
    wins = sum(r["dualquant"]["ppl"] <= r["smoothquant"]["ppl"] for r in rows)
    return Figure((float(wins),), ", ".join(
        f"{f}: {r['dualquant']['ppl']:,.0f} vs {r['smoothquant']['ppl']:,.0f}"
        for f, r in zip(FORMATS, rows, strict=True)))


@figure
def quant_dualquant_increase_cut(result: Result, text: str = "ptb", bits: str = "W4A4") -> Figure:
    """Per format: 1 - DualQuant's perplexity increase over fp32 / round-to-nearest's."""
    table = need(result, "summary", "table")
    vals = [1 - table[f"{text} {bits} {f}"]["dualquant"]["increase"]
            / table[f"{text} {bits} {f}"]["rtn"]["increase"] for f in FORMATS]
    return Figure(tuple(vals), ", ".join(f"{f} {v:+.0%}" for f, v in
                                         zip(FORMATS, vals, strict=True)))


@figure
def quant_served_over_fp32(result: Result, checkpoint: str) -> Figure:
    """|the checkpoint's perplexity through the engine / the fp32 engine's - 1|."""
    row = need(result, "summary", checkpoint)
    return Figure((abs(row["engine_over_fp32_engine"] - 1),),
                  f"{row['engine_ppl']:.2f} against fp32's "
                  f"{row['engine_ppl'] / row['engine_over_fp32_engine']:.2f}")


@figure
def quant_hessian_reduction(result: Result) -> Figure:
    """Per format and text: 1 - the hessian method's perplexity / the best baseline's."""
    s = need(result, "summary")
    rows = {k: v for k, v in s.items() if "reduction" in v}
    return Figure(tuple(v["reduction"] for v in rows.values()), ", ".join(
        f"{k} {v['reduction']:+.1%} vs {v['best_baseline']}" for k, v in rows.items()))


@figure
def quant_sensitivity_gain_dnll(result: Result, fmt: str = "nvfp4", units: str = "all") -> Figure:
    """Spearman correlation with the perplexity change (each unit's mean NLL change, which no
    estimate's weights are fitted to) of the sensitivity-weighted error minus the plain error's.
    The study's own gain is judged against the final KL the weights estimate."""
    c = need(result, "studies", fmt, "correlations", units)
    gain = c["weighted_vs_dnll"] - c["mse_vs_dnll"]
    return Figure((gain,), f"{c['units']} units: weighted {c['weighted_vs_dnll']:.3f}, plain "
                           f"{c['mse_vs_dnll']:.3f} (against KL: +{c['gain_kl']:.2f})")


@figure
def quant_kernel_parity(result: Result, isa: str, machine: str | None = None) -> Figure:
    """Per W8A8 export served on the ISA's kernels: |engine perplexity / the harness's - 1|,
    the harness summing as that kernel does. ``machine``: only a run on a CPU of that label
    (AVX2, AVX-512+BF16, AMX) counts."""
    label = need(result, "machine").get("isa")
    if machine is not None and label != machine:
        raise NotApplicable(f"measured on {label}, not {machine}")
    rows = [r for r in need(result, "rows") if r["isa"] == isa]
    if not rows:
        raise NotApplicable(f"no {isa} rows")
    return Figure(tuple(abs(r["ratio"] - 1) for r in rows), ", ".join(
        f"{r['method']} {r['ratio']:.4f}" for r in rows) + f"; libraries "
        f"{sorted({lib for r in rows for lib in r['libraries']})}")
