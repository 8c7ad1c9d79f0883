"""The engine side of ordering by predicted remaining work: vLLM's scheduler (loadwise's
adapter) with requests ordered by ``loadwise.sched.order``.

Selected with ``scheduler_cls="loadwise.sched.engine.OrderingScheduler"`` (sync scheduling:
no speculation or prompt lookup) or ``OrderingAsyncScheduler`` (async scheduling: EAGLE and
draft models) and vLLM's ``priority`` policy (``loadwise serve --schedule sjf|srpt`` sets both and
``LOADWISE_SCHEDULE``). vLLM keeps doing all of the scheduling; this class only

* predicts each request's output length when it arrives (from its prompt ids),
* before each ``schedule()``: sets every waiting and running request's ``priority`` to its
  predicted remaining work (vLLM's priority queue serves the lowest first; under KV pressure
  vLLM preempts the running request with the highest) and, for ``srpt``, preempts running
  requests that ``order.preemptions`` names, as vLLM preempts when KV blocks run out,
* after each step: takes the worker's refined predictions (``loadwise.sched.worker``).

The time spent in each of these, the worker's refinement time and the engine's step time are
counted and written to ``state_file``.

Invariant: never raises into vLLM. Any failure switches ordering off (logged once): every
priority goes back to 0, so vLLM's priority queue serves by arrival time (first come, first
served) and nothing more is preempted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from loadwise.config.extension import FailOpen
from loadwise.config.schedule import ScheduleConfig
from loadwise.sched.order import RequestView, preemptions, priority
from loadwise.sched.predictor import LengthPredictor, OracleLengths, load_predictor
from loadwise.sched.worker import PREDS_ATTR, TIME_ATTR
from loadwise.vllm import compat
from loadwise.vllm.scheduler import LoadwiseAsyncScheduler, LoadwiseScheduler, mixed
from loadwise.vllm.state_file import write_state_file

logger = logging.getLogger("loadwise.sched")
STATE_EVERY_STEPS = 20


class Ordering:
    """The ordering's state in one scheduler: a view per live request, counters, timers."""

    def __init__(self, cfg: ScheduleConfig, predictor: LengthPredictor | OracleLengths) -> None:
        self.cfg = cfg
        self.predictor = predictor
        self.refine_sigma = (predictor.refine.sigma if isinstance(predictor, LengthPredictor)
                             and predictor.refine is not None else None)
        self.views: dict[str, RequestView] = {}
        self.counts = {"arrivals": 0, "refined": 0, "preemptions": 0, "steps": 0}
        self.ordering_s = 0.0  # arrival predictions + priorities + preemption decisions
        self.refine_s = 0.0  # worker-side refinement, as the worker timed it
        self.engine_step_s = 0.0  # schedule() start to update_from_output() end, summed
        self.step_start_s: float | None = None

    def arrive(self, request: Any) -> None:
        t0 = time.perf_counter()
        mu, sigma = self.predictor.predict_arrival(list(request.prompt_token_ids or ()))
        view = RequestView(request.request_id, float(request.arrival_time),
                           len(request.prompt_token_ids or ()), int(request.max_tokens), mu,
                           sigma)
        self.views[request.request_id] = view
        request.priority = priority(view, time.time(), self.cfg)
        self.counts["arrivals"] += 1
        self.ordering_s += time.perf_counter() - t0

    def before_schedule(self, scheduler: Any) -> None:
        t0 = time.perf_counter()
        self.step_start_s = t0
        now = time.time()
        live = scheduler.requests
        for rid in [r for r in self.views if r not in live]:
            del self.views[rid]
        waiting = compat.waiting_requests(scheduler)
        running = list(scheduler.running)
        for req in waiting + running:
            self._sync(req)
        if self.cfg.preemptive and waiting:
            wv = [self.views[r.request_id] for r in waiting if r.request_id in self.views]
            rv = [self.views[r.request_id] for r in running if r.request_id in self.views]
            free = compat.max_num_seqs(scheduler) - len(running)
            for p in preemptions(rv, wv, free, now, self.cfg):
                victim = live[p.victim]
                if compat.preempt_running(scheduler, victim):
                    self.counts["preemptions"] += 1
                    self._sync(victim)
            waiting = compat.waiting_requests(scheduler)
            running = list(scheduler.running)
        for req in waiting + running:
            view = self.views.get(req.request_id)
            if view is not None:
                req.priority = priority(view, now, self.cfg)
        compat.reorder_waiting(scheduler)
        self.ordering_s += time.perf_counter() - t0

    def _sync(self, request: Any) -> None:
        """The request's view from vLLM's own counts (after a step, or after a preemption)."""
        view = self.views.get(request.request_id)
        if view is not None:
            (view.num_computed_tokens, view.num_output_tokens,
             view.num_preemptions) = compat.request_progress(request)

    def after_output(self, model_runner_output: Any) -> None:
        if self.step_start_s is not None:
            self.engine_step_s += time.perf_counter() - self.step_start_s
            self.step_start_s = None
        self.counts["steps"] += 1
        self.refine_s += float(getattr(model_runner_output, TIME_ATTR, 0.0) or 0.0)
        preds = getattr(model_runner_output, PREDS_ATTR, None)
        if not preds or self.refine_sigma is None:
            return
        for rid, mu in preds.items():
            view = self.views.get(rid)
            if view is not None and not view.refined:
                view.mu, view.sigma, view.refined = float(mu), self.refine_sigma, True
                self.counts["refined"] += 1

    def state(self, status: str) -> dict[str, Any]:
        return {"status": status, "policy": self.cfg.policy, "updated_s": time.time(),
                **self.counts, "ordering_s": self.ordering_s, "refine_s": self.refine_s,
                "engine_step_s": self.engine_step_s,
                "overhead_share": ((self.ordering_s + self.refine_s) / self.engine_step_s
                                   if self.engine_step_s > 0 else None)}


class _OrderingMixin:
    """Ordering over either of loadwise's schedulers (mixed in before it: ``super()`` is the
    adapter, then vLLM's sync or async scheduler, whose preemption also handles the output of
    a step still in flight)."""

    loadwise_ordering: Ordering | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loadwise_ordering: Ordering | None = None
        # Off: no ordering (the undo drops it first), every priority back to 0, first come,
        # first served from then on.
        self._lw_ordering_guard = FailOpen("ordering", logger, on_off=self._lw_unorder)
        self.loadwise_ordering = self._lw_ordering_guard.call("starting", self._lw_start)

    def _lw_start(self) -> Ordering | None:
        cfg = ScheduleConfig.from_env()
        if cfg is None or not cfg.ordered:
            logger.warning("loadwise: OrderingScheduler without an ordered LOADWISE_SCHEDULE: "
                           "first come, first served")
            return None
        if compat.scheduling_policy(self) != "priority":
            logger.error("loadwise: --schedule %s needs vLLM's priority policy "
                         "(--scheduling-policy priority); first come, first served", cfg.policy)
            return None
        logger.info("loadwise: requests ordered by predicted remaining work (%s, %s)",
                    cfg.policy, cfg.predictor_dir or cfg.oracle_file)
        return Ordering(cfg, load_predictor(cfg))

    def add_request(self, request: Any) -> None:
        if (ordering := self.loadwise_ordering) is not None:
            with self._lw_ordering_guard("predicting a request's length"):
                ordering.arrive(request)
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if (ordering := self.loadwise_ordering) is not None:
            with self._lw_ordering_guard("ordering the queue"):
                ordering.before_schedule(self)
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output)
        if (ordering := self.loadwise_ordering) is not None:
            with self._lw_ordering_guard("taking a step's output"):
                ordering.after_output(model_runner_output)
                if ordering.cfg.state_file and ordering.counts["steps"] % STATE_EVERY_STEPS == 0:
                    write_state_file(ordering.cfg.state_file, ordering.state("ordering"))
        return result

    def _lw_unorder(self) -> None:
        ordering, self.loadwise_ordering = self.loadwise_ordering, None
        running = list(self.running)  # type: ignore[attr-defined]
        for req in compat.waiting_requests(self) + running:
            req.priority = 0
        compat.reorder_waiting(self)
        if ordering is not None and ordering.cfg.state_file:
            write_state_file(ordering.cfg.state_file, ordering.state("failed"))


OrderingScheduler = mixed(_OrderingMixin, LoadwiseScheduler, "OrderingScheduler", __name__)
OrderingAsyncScheduler = mixed(_OrderingMixin, LoadwiseAsyncScheduler, "OrderingAsyncScheduler",
                               __name__)
