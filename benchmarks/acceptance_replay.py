"""Replay of a trained EAGLE head's greedy drafts: the online acceptance estimator's held-out
AUC and calibration, and what per-request trimming would verify, against the table alone.

Held-out text: the target's own greedy answers (vLLM, no speculation) to prompts of the
built-in `sharegpt` workload, which no head trained on. Greedy verification accepts a draft iff
it equals the target's greedy token, so on this text the head's drafts (computed exactly as
vLLM drafts: step 1 from the target's hidden state, later steps from the head's own output)
are accepted iff they equal the next tokens of the answer. Every answer position where the
target produced a token is a possible drafting step of k = MAX_K drafts; an engine drafts at
only some of them: after a step that accepted a drafts, its next step starts a + 1 tokens on,
so the positions inside an accepted run are never drafted from. ``--slots engine`` (default)
keeps the steps an engine takes; ``--slots every`` keeps every position, which over-weights
easy stretches (a run of accepted drafts is counted at each of its positions) and so reads
higher acceptance and AUC than an engine sees. Results before this option used every position.

* Estimator: requests arrive in order; each drafting step is predicted before its outcome is
  observed (prequential), so every prediction is held out. Features: the head's draft
  distribution's largest probability at each position, known before the token is drawn, and
  the request's recent acceptance (``--history-alpha``). Run three times: loadwise's model
  and refits (the last 2,048 labelled drafts); the draft distribution alone with the same
  refits; vLLM's model and refits (one Newton step on the last 100 requests).
* What the features allow: batch logistic fits on the first half of the steps, AUC on the
  second, for the max probability alone and with the top-2 margin, the entropy, the history.
* Trimming: drafting steps grouped into batches of b; `policy.trim` keeps a prefix of each
  request's drafts with the estimator's survival and the verification cost T(b, drafts) of a
  tuned profile's step times (default: the newest ngram tune, whose drafter costs ~nothing),
  and with ``--min-survival`` a floor below which no draft is verified. Also what a floor
  alone cuts (``floor_frontier``). Rejected drafts count as vLLM counts them (every verified
  draft not accepted); results before the floor existed counted one per step.
* Prompt lookup: vLLM's ngram proposer on the same answers and engine steps, per
  (prompt_lookup_min, prompt_lookup_max), for the accepted drafts per decode step.

Writes benchmarks/results/acceptance-replay-<time>.json and a calibration PNG beside it.
Usage: python benchmarks/acceptance_replay.py --head DIR [--prompts 96] [--profile PATH]
       python benchmarks/acceptance_replay.py --steps-from RESULT.json [--profile PATH]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
from results_io import write_result
from torch.nn import functional as F

from loadwise.config.binding import ALL, CpuBinding
from loadwise.config.engine import EngineSpec
from loadwise.drafter.data import Example, generated_examples
from loadwise.drafter.head import load_head
from loadwise.drafter.run import read_meta
from loadwise.drafter.target import hidden_states, load_target
from loadwise.drafter.train import collate, draft_index
from loadwise.measure.profile import Profile, ProfileError
from loadwise.measure.workloads import resolve
from loadwise.model import prepare
from loadwise.policy.acceptance import (
    DEFAULT_HISTORY_ALPHA,
    AcceptanceEstimator,
    auc,
    calibration,
    logit_feature,
)
from loadwise.policy.trim import trim
from loadwise.provenance import provenance
from loadwise.vllm.local import LocalEngine

MAX_K = 3
BATCH_SIZES = (1, 8, 32)
# Prompt lookup's (prompt_lookup_min, prompt_lookup_max): vLLM's default first, then shorter
# matches, which draft more often and less surely.
LOOKUP_SETTINGS = ((5, 5), (3, 5), (2, 5), (1, 5), (2, 3))


BINDING = CpuBinding.parse(ALL)


def greedy_examples(model: str, prompts: list[str], max_tokens: int) -> list[Example]:
    engine = LocalEngine(EngineSpec(model=model, spec_method=None, max_num_seqs=32,
                                    kv_cache_space_gib=2, cpu_binding=BINDING))
    try:
        return generated_examples(engine, prompts, max_tokens)
    finally:
        engine.shutdown()


@torch.no_grad()
def drafting_steps(head: Any, examples: list[Example], hidden: list[torch.Tensor],
                   extras: list[list[tuple[float, float]]] | None = None,
                   owners: list[int] | None = None) -> list[tuple[list[float], int]]:
    """Per drafting step: the draft distribution's max probability at positions 1..MAX_K and
    how many drafts greedy verification accepts. ``extras``, when given, gets per step the
    second-largest probability and the entropy of each position's distribution; ``owners``
    the index of the example (request) the step belongs to."""
    to_draft = draft_index(head)
    steps: list[tuple[list[float], int]] = []
    for i, ex in enumerate(examples):
        batch = collate(examples, hidden, [i])
        outs = head.unrolled(batch.tokens, batch.hidden, batch.key_mask, MAX_K)
        n = len(ex.token_ids)
        start = len(ex.prompt_ids)
        probs = [F.softmax(head.lm_head(o[0]), dim=-1) for o in outs]  # [L, draft vocab]
        qmax = [p.max(-1) for p in probs]
        second = [p.topk(2, dim=-1).values[:, 1] for p in probs]
        entropy = [-(p * torch.log(p.clamp_min(1e-12))).sum(-1) for p in probs]
        for t in range(start - 1, n - 2):  # token t + 1 is an answer token, t + 2 exists
            feats, accepted, alive = [], 0, True
            more: list[tuple[float, float]] = []
            for s in range(MAX_K):
                label_pos = t + s + 2
                if label_pos >= n:
                    break
                feats.append(float(qmax[s].values[t]))
                more.append((float(second[s][t]), float(entropy[s][t])))
                want = int(to_draft[ex.token_ids[label_pos]])
                right = want >= 0 and int(qmax[s].indices[t]) == want
                if alive and right:
                    accepted += 1
                else:
                    alive = False
            steps.append((feats, accepted))
            if extras is not None:
                extras.append(more)
            if owners is not None:
                owners.append(i)
    return steps


def lookup_steps(examples: list[Example], min_n: int, max_n: int
                 ) -> tuple[list[tuple[list[float], int]], list[int]]:
    """Prompt lookup's drafting steps at the positions ``drafting_steps`` walks, drafted by
    vLLM's own ngram proposer function over the prompt and the answer so far: (1.0 per draft,
    as prompt lookup has no draft distribution, and the drafts accepted); a position where it
    finds no match is a step with no drafts."""
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as propose,
    )

    steps: list[tuple[list[float], int]] = []
    owners: list[int] = []
    for i, ex in enumerate(examples):
        ids = np.asarray(ex.token_ids, dtype=np.int32)
        n = len(ids)
        for t in range(len(ex.prompt_ids) - 1, n - 2):
            drafts = propose(ids[:t + 2], min_n, max_n, n + MAX_K, MAX_K)[:n - t - 2]
            accepted = 0
            for s, d in enumerate(drafts):
                if int(d) != int(ids[t + 2 + s]):
                    break
                accepted += 1
            steps.append(([1.0] * len(drafts), accepted))
            owners.append(i)
    return steps, owners


def lookup_accepted(examples: list[Example]) -> dict[str, dict[str, float]]:
    """Per prompt-lookup setting "min,max": accepted drafts per decode step over the steps an
    engine takes, and the share of those steps that drafted at all."""
    out: dict[str, dict[str, float]] = {}
    for min_n, max_n in LOOKUP_SETTINGS:
        steps, owners = lookup_steps(examples, min_n, max_n)
        walked = engine_walk(steps, owners)[0]
        drafted = sum(1 for feats, _ in walked if feats) / max(1, len(walked))
        out[f"{min_n},{max_n}"] = {**mean_accepted(walked), "drafted_share": round(drafted, 4)}
    return out


FEATURE_SETS = {"max_prob": (), "max_prob+margin": ("margin",),
                "max_prob+entropy": ("entropy",), "max_prob+margin+entropy": ("margin", "entropy"),
                "max_prob+history": ("history",)}


def feature_ceiling(steps: list[tuple[list[float], int]],
                    extras: list[list[tuple[float, float]]] | None, owners: list[int],
                    history_alpha: float) -> dict[str, Any]:
    """What the features allow, fitting aside: a logistic model (per-position intercepts) fitted
    to convergence on the first half of the steps' labelled drafts, AUC on the second half.
    Features: logit of the max probability; log(max / second) (margin); entropy; logit of the
    request's recent acceptance (the estimator's history feature, as the engine's gate keeps
    it)."""
    import numpy as np

    hist = request_histories(steps, owners, history_alpha)
    rows: list[tuple[int, int, float, float, float, int, float]] = []
    for idx, (feats, accepted) in enumerate(steps):
        for j in range(1, min(accepted + 1, len(feats)) + 1):
            q2, ent = extras[idx][j - 1] if extras is not None else (math.nan, math.nan)
            rows.append((idx, j, feats[j - 1], q2, ent, int(j <= accepted), hist[idx]))
    y = np.array([r[5] for r in rows], dtype=float)
    train = np.array([r[0] < len(steps) // 2 for r in rows])
    out: dict[str, Any] = {}
    for name, extra in FEATURE_SETS.items():
        if extras is None and ("margin" in extra or "entropy" in extra):
            continue  # recorded steps carry the max probability only
        cols = [[logit_feature(r[2]) for r in rows]]
        if "margin" in extra:
            cols.append([math.log(max(r[2], 1e-6) / max(r[3], 1e-6)) for r in rows])
        if "entropy" in extra:
            cols.append([r[4] for r in rows])
        if "history" in extra:
            cols.append([logit_feature(r[6]) for r in rows])
        cols += [[float(r[1] == j) for r in rows] for j in range(1, MAX_K + 1)]
        x = np.array(cols).T
        w = np.zeros(x.shape[1])
        for _ in range(30):  # Newton's method, a small ridge for the rare position
            p = 1 / (1 + np.exp(-x[train] @ w))
            hess = (x[train] * (p * (1 - p))[:, None]).T @ x[train] + 1e-2 * np.eye(x.shape[1])
            w += np.linalg.solve(hess, x[train].T @ (y[train] - p))
        pred = (1 / (1 + np.exp(-x[~train] @ w))).tolist()
        out[name] = {"auc_second_half": auc(list(zip(pred, y[~train].astype(int).tolist()))),
                     "weights": [round(v, 4) for v in w.tolist()]}
    return out


def engine_walk(steps: list[tuple[list[float], int]], owners: list[int],
                extras: list[list[tuple[float, float]]] | None = None
                ) -> tuple[list[tuple[list[float], int]], list[int],
                           list[list[tuple[float, float]]] | None]:
    """The steps an engine drafts from, out of every position's (in answer order per
    request): each request's first position, then a + 1 positions on after a step that
    accepted a drafts."""
    keep: list[int] = []
    skip_to: dict[int, int] = {}  # owner -> index of the next position it drafts from
    seen: dict[int, int] = {}  # owner -> positions passed so far
    for i, ((_, accepted), owner) in enumerate(zip(steps, owners)):
        pos = seen.get(owner, 0)
        seen[owner] = pos + 1
        if pos == skip_to.get(owner, 0):
            keep.append(i)
            skip_to[owner] = pos + accepted + 1
    return ([steps[i] for i in keep], [owners[i] for i in keep],
            None if extras is None else [extras[i] for i in keep])


def mean_accepted(steps: list[tuple[list[float], int]]) -> dict[str, float]:
    """Drafts greedy verification accepts per drafting step, and per target decode step (a
    step yields one target token plus the drafts accepted)."""
    accepted = sum(a for _, a in steps)
    return {"per_drafting_step": round(accepted / max(1, len(steps)), 4),
            "num_drafting_steps": len(steps), "num_accepted": accepted}


def request_histories(steps: list[tuple[list[float], int]], owners: list[int],
                      alpha: float) -> list[float]:
    """Per step, its request's recent acceptance before the step (as the gate keeps it, from a
    fixed prior of the steps' mean acceptance; for the batch fits only)."""
    est = AcceptanceEstimator.create(MAX_K, history_alpha=alpha)
    prior = sum(a for _, a in steps) / max(1, sum(min(a + 1, len(f)) for f, a in steps))
    state: dict[int, float] = {}
    out = []
    for (feats, accepted), owner in zip(steps, owners):
        h = state.get(owner, prior)
        out.append(h)
        state[owner] = est.next_history(h, min(accepted + 1, len(feats)), accepted)
    return out


def replay_estimator(steps: list[tuple[list[float], int]], owners: list[int],
                     **config: Any) -> tuple[dict[str, Any], Any]:
    """The estimator online, requests one after another as in the engine: every prediction is
    made before its outcome is observed; with ``history_alpha`` each request's recent
    acceptance is kept as the gate keeps it."""
    est = AcceptanceEstimator.create(MAX_K, **config)
    preds: list[tuple[float, int, int, int]] = []  # (p, label, position, step index)
    history: dict[int, float | None] = {}
    for idx, ((feats, accepted), owner) in enumerate(zip(steps, owners)):
        h = history.get(owner)  # None: a new request, given the prior
        for j in range(1, min(accepted + 1, len(feats)) + 1):
            preds.append((est.probability(j, feats[j - 1], h), int(j <= accepted), j, idx))
        history[owner] = est.observe(feats, accepted, h)
    half = len(steps) // 2
    late = [(p, y) for p, y, _, i in preds if i >= half]
    out = {"config": {"history_alpha": est.config.history_alpha,
                      "fit_window": est.config.fit_window},
           "num_steps": len(steps), "num_labels": len(preds), "num_refits": est.num_refits,
           "auc_pooled": auc([(p, y) for p, y, _, _ in preds]),
           "auc_pooled_second_half": auc(late),
           "auc_per_position": {j: auc([(p, y) for p, y, jj, _ in preds if jj == j])
                                for j in range(1, MAX_K + 1)},
           "acceptance_per_position": {
               j: sum(y for _, y, jj, _ in preds if jj == j)
               / max(1, sum(1 for _, _, jj, _ in preds if jj == j)) for j in range(1, MAX_K + 1)},
           "calibration": [vars_bin(b) for b in calibration([(p, y) for p, y, _, _ in preds])],
           "final_model": {"slope": est.slope, "history_slope": est.history_slope,
                           "bias": est.bias}}
    return out, est


def vars_bin(b: Any) -> dict[str, float]:
    return {"lo": b.lo, "hi": b.hi, "mean_predicted": round(b.mean_predicted, 4),
            "accepted_share": round(b.accepted_share, 4), "count": b.count}


def replay_trimming(steps: list[tuple[list[float], int]], owners: list[int],
                    profile: Profile | None, history_alpha: float, min_survival: float = 0.0,
                    batch_sizes: tuple[int, ...] = BATCH_SIZES) -> dict[str, Any]:
    """Table (every draft verified) against trimming, per batch size, on the same steps; the
    estimator runs online as it would in the engine (a batch is b consecutive drafting steps;
    a request's history moves on after each batch). Without a profile drafts cost nothing
    and only ``min_survival`` cuts. Rejected drafts count as vLLM counts them: every verified
    draft not accepted, those after the first rejection included."""
    times = profile.step_times() if profile is not None else None
    out: dict[str, Any] = {}
    for b in batch_sizes:
        est = AcceptanceEstimator.create(MAX_K, history_alpha=history_alpha)
        history: dict[int, float | None] = {}
        table = {"accepted": 0, "rejected_verified": 0, "verified": 0}
        trimmed = {"accepted": 0, "rejected_verified": 0, "verified": 0}

        def cost(n: int, b: int = b) -> float:
            return times.at(b, min(n / b, times.max_k)) if times is not None else 1.0

        for g in range(0, len(steps) - b + 1, b):
            group = list(zip(steps[g:g + b], owners[g:g + b]))
            hs = [history.get(o, est.prior_history() if est.uses_history else None)
                  for _, o in group]
            surv = [est.survival(f, h) for ((f, _), _), h in zip(group, hs)]
            d = trim(surv, cost, min_survival)
            for ((feats, acc), owner), keep, h in zip(group, d.keep, hs):
                for tally, k in ((table, len(feats)), (trimmed, keep)):
                    got = min(acc, k)
                    tally["accepted"] += got
                    tally["verified"] += k
                    tally["rejected_verified"] += k - got
                history[owner] = est.observe(feats, acc, h)
        out[str(b)] = {"table": table, "trimmed": trimmed,
                       "rejected_verified_cut": 1 - trimmed["rejected_verified"]
                       / max(1, table["rejected_verified"]),
                       "accepted_kept": trimmed["accepted"] / max(1, table["accepted"])}
    return out


FLOORS = (0.01, 0.02, 0.03, 0.05, 0.1, 0.2)


def floor_frontier(steps: list[tuple[list[float], int]], owners: list[int],
                   history_alpha: float) -> dict[str, Any]:
    """What a survival floor alone cuts, with verification free (one request at a time):
    rejected drafts cut against accepted drafts kept, per floor."""
    return {str(f): replay_trimming(steps, owners, None, history_alpha, f, (1,))["1"]
            for f in FLOORS}


def plot(calib: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
    ax.scatter([c["mean_predicted"] for c in calib], [c["accepted_share"] for c in calib],
               s=[max(8, c["count"] / 20) for c in calib])
    ax.set_xlabel("predicted P(accept)")
    ax.set_ylabel("accepted share")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def newest_ngram_profile() -> Path | None:
    for d in sorted(Path("benchmarks/results").glob("tune-*/profile.json"), reverse=True):
        try:
            if Profile.load(d).spec_method == "ngram":
                return d
        except ProfileError as exc:
            print(f"skipping {d}: {exc}")
    return None


def computed_steps(args: argparse.Namespace) -> tuple[Any, Any, list[int], dict[str, Any]]:
    """The head's drafting steps on the target's greedy answers, computed here."""
    model = str(prepare().path)
    prompts = list(resolve("sharegpt").prompts[:args.prompts])
    examples = greedy_examples(model, prompts, args.max_tokens)
    target_cfg, weights, lm = load_target(model)
    torch.set_num_threads(2)
    embed = weights["model.embed_tokens.weight"]
    states: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def hidden_for(head: Any) -> list[torch.Tensor]:
        """The target's states each head reads: its last hidden state or its aux layers."""
        if head.aux_layers not in states:
            states[head.aux_layers] = hidden_states(
                lm, examples, Path(f"/tmp/acceptance-replay-{time.time_ns()}"), lambda n: None,
                head.aux_layers)
        return states[head.aux_layers]

    head = load_head(Path(args.head), target_cfg, embed)
    extras: list[list[tuple[float, float]]] = []
    owners: list[int] = []
    steps = drafting_steps(head, examples, hidden_for(head), extras, owners)
    heads = {"head": accepted_both_ways(steps, owners)}
    if args.compare_head:
        other = load_head(Path(args.compare_head), target_cfg, embed)
        other_owners: list[int] = []
        other_steps = drafting_steps(other, examples, hidden_for(other), None, other_owners)
        heads["compare_head"] = accepted_both_ways(other_steps, other_owners)
    heads["prompt_lookup"] = lookup_accepted(examples)
    return steps, extras, owners, heads


def accepted_both_ways(steps: list[tuple[list[float], int]], owners: list[int]
                       ) -> dict[str, dict[str, float]]:
    """Accepted drafts per drafting step over the steps an engine takes and over every
    position."""
    return {"engine": mean_accepted(engine_walk(steps, owners)[0]),
            "every": mean_accepted(steps)}


def recorded_steps(path: str) -> tuple[Any, None, list[int], dict[str, Any]]:
    """The drafting steps an earlier run of this script recorded (``raw_steps``). Results
    written before steps carried their request: an answer's last drafting step is the only
    one with a single draft (its next token is the answer's last), so it ends a request."""
    import json

    raw = json.loads(Path(path).read_text())["raw_steps"]
    steps = [(list(r[0]), int(r[1])) for r in raw]
    if all(len(r) == 3 for r in raw):
        owners = [int(r[2]) for r in raw]
    else:
        owners, current = [], 0
        for feats, _ in steps:
            owners.append(current)
            current += len(feats) == 1
    return steps, None, owners, {"head": accepted_both_ways(steps, owners)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--head", help="the EAGLE head whose drafts are replayed")
    src.add_argument("--steps-from", metavar="JSON",
                     help="an earlier acceptance-replay result: replay the estimator and "
                          "trimming on its recorded drafting steps (no head, no engine)")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--history-alpha", type=float, default=DEFAULT_HISTORY_ALPHA,
                    help="the estimator's history feature (0: the draft distribution alone)")
    ap.add_argument("--slots", choices=("engine", "every"), default="engine",
                    help="replay the steps an engine drafts from (default), or every answer "
                         "position (what results before this option did)")
    ap.add_argument("--min-survival", type=float, default=0.0,
                    help="trimming's survival floor (policy.trim), besides its cost model")
    ap.add_argument("--compare-head", default=None,
                    help="another head (e.g. trained on human answers): its accepted drafts per "
                         "drafting step on the same text")
    args = ap.parse_args()
    made_by = provenance()
    t0 = time.perf_counter()
    if args.steps_from:
        steps, extras, owners, heads = recorded_steps(args.steps_from)
    else:
        steps, extras, owners, heads = computed_steps(args)
    all_steps, all_owners = steps, owners  # every position, recorded for later replays
    if args.slots == "engine":
        steps, owners, extras = engine_walk(steps, owners, extras)
    print(f"{len(steps)} drafting steps ({args.slots}) of {len(set(owners))} requests")
    print("accepted drafts per drafting step:", heads)
    alpha = args.history_alpha
    estimator, _ = replay_estimator(steps, owners, history_alpha=alpha)
    print({k: v for k, v in estimator.items() if k != "calibration"})
    # The draft distribution alone (vLLM's model), loadwise's refits.
    draft_only, _ = replay_estimator(steps, owners)
    print("draft only:", {k: v for k, v in draft_only.items() if k != "calibration"})
    # vLLM's model and fitting scheme (one Newton step on the last 100 requests, then clear).
    one_step, _ = replay_estimator(steps, owners, fit_window=0)
    print("one-step refits:", {k: v for k, v in one_step.items() if k != "calibration"})
    ceiling = feature_ceiling(steps, extras, owners, alpha or DEFAULT_HISTORY_ALPHA)
    print("batch fits, AUC on the second half:",
          {n: round(v["auc_second_half"], 4) for n, v in ceiling.items()})
    profile_path = Path(args.profile) if args.profile else newest_ngram_profile()
    trimming = None
    if profile_path is not None:
        trimming = replay_trimming(steps, owners, Profile.load(profile_path), alpha,
                                   args.min_survival)
        for b, row in trimming.items():
            print(f"b={b}: rejected-verified cut {row['rejected_verified_cut']:.1%}, accepted "
                  f"kept {row['accepted_kept']:.1%}")
    floors = floor_frontier(steps, owners, alpha)
    for f, row in floors.items():
        print(f"floor {f} alone: rejected cut {row['rejected_verified_cut']:.1%}, accepted kept "
              f"{row['accepted_kept']:.1%}")
    path = write_result("acceptance-replay", {
        **made_by, "binding": BINDING.to_json(), "config": {**vars(args), "max_k": MAX_K, "batch_sizes": BATCH_SIZES,
                              "workload": "sharegpt (held out)",
                              "verification_profile": str(profile_path)},
        # Each head's own record: training data, held-out figures, stage times.
        "head_meta": read_meta(args.head) if args.head else None,
        "compare_head_meta": read_meta(args.compare_head) if args.compare_head else None,
        "accepted_per_drafting_step": heads, "estimator": estimator,
        "estimator_draft_only": draft_only, "estimator_one_step_refits": one_step,
        "feature_ceiling": ceiling, "trimming": trimming, "floor_frontier": floors,
        "raw_steps": [[[round(q, 5) for q in f], a, o]
                      for (f, a), o in zip(all_steps, all_owners)],
        "wall_s": round(time.perf_counter() - t0, 1)})
    plot(estimator["calibration"], path.with_suffix(".png"),
         f"online estimator, held-out drafts (AUC {estimator['auc_pooled']:.3f})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
