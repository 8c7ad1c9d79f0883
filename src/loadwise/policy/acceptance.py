"""Online acceptance estimator: P(draft at position k is accepted | the drafts before it were).

The model is vLLM's (``v1/worker/gpu/spec_decode/acceptance_estimator.py``):
``p_k = sigmoid(slope * f + bias_k)`` with one feature ``f = logit(q)``, ``q`` the draft
distribution's largest probability at that position, one shared slope and one intercept per
position. ``q`` is known before the drafted token is drawn and does not depend on which token is
drawn, so trimming drafts by it keeps rejection sampling exact.

Optionally (``history_alpha`` > 0) a second feature ``logit(h)`` with its own slope: ``h`` the
request's recent acceptance, an exponential average of the labels of its earlier verified drafts
(:func:`next_history`). It is known before the step's drafts are drawn and does not depend on
them either, so exactness holds; it carries what the draft distribution does not (a request in
boilerplate or code stays easy to draft for many steps). The caller keeps ``h`` per request.

Labels come from verification alone: the accepted positions are 1, the first rejected position
0, and the positions after it are censored (never verified on their own, so not used).
Statistics for a Newton step (IRLS) accumulate over observations; every ``refit_every``
observed requests one damped, ridge-regularized Newton step is taken and the statistics are
cleared, so each refit costs O(K^2) whatever the traffic and old traffic fades out (vLLM's
scheme). With ``fit_window`` > 0 a refit instead takes ``newton_iters`` Newton steps on the
last ``fit_window`` labelled drafts, each step's statistics computed at the current
parameters: a fit to recent traffic rather than one step from the last 100 requests, at
O(fit_window) per refit.

Pure Python: the same object runs in the engine, in replays and in tests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadwise.errors import LoadwiseError

Q_EPS = 1e-4  # q is clamped to [Q_EPS, 1 - Q_EPS] before the logit
MAX_NEWTON_STEP = 2.0  # largest change of any parameter in one refit
# The engine gate's weight of a new label in a request's recent acceptance (docs/drafter.md).
DEFAULT_HISTORY_ALPHA = 0.2


class EstimatorError(LoadwiseError, ValueError):
    pass


def logit_feature(max_prob: float) -> float:
    q = min(max(max_prob, Q_EPS), 1.0 - Q_EPS)
    return math.log(q / (1.0 - q))


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    num_positions: int
    init_slope: float = 0.5
    init_bias: float = -0.2
    refit_every: int = 100  # observed requests between refits
    ridge: float = 1e-2
    damping: float = 1.0  # Newton step multiplier
    window: int = 4096  # (prediction, label) pairs kept for the live AUC and calibration
    fit_window: int = 2048  # labelled drafts a refit fits (0: vLLM's one step, then clear)
    newton_iters: int = 1  # Newton steps per refit with fit_window
    # Weight of each new label in a request's recent acceptance h (0: no history feature,
    # vLLM's one-feature model).
    history_alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.num_positions < 1:
            raise EstimatorError(f"num_positions must be >= 1, got {self.num_positions}")
        if self.refit_every < 1 or self.window < 1:
            raise EstimatorError("refit_every and window must be >= 1")
        if self.fit_window < 0 or self.newton_iters < 1:
            raise EstimatorError("fit_window must be >= 0 and newton_iters >= 1")
        if not 0 < self.damping <= 1 or self.ridge < 0:
            raise EstimatorError("damping must be in (0, 1] and ridge >= 0")
        if not 0 <= self.history_alpha < 1:
            raise EstimatorError(f"history_alpha must be in [0, 1), got {self.history_alpha}")


@dataclass(slots=True)
class AcceptanceEstimator:
    config: EstimatorConfig
    slope: float = 0.0
    bias: list[float] = field(default_factory=list)
    history_slope: float = 0.0  # stays 0 unless observations carry a history
    num_refits: int = 0
    num_observed: int = 0
    # IRLS statistics over parameters [slope, history_slope, bias_1..bias_K]: gradient and
    # Hessian of the log-likelihood (the Hessian as its negative, positive semi-definite).
    _grad: list[float] = field(default_factory=list)
    _hess: list[list[float]] = field(default_factory=list)
    _since_refit: int = 0
    # (probability predicted before the outcome was known, label, position) for live metrics.
    recent: deque[tuple[float, int, int]] = field(default_factory=deque)
    # (feature, history feature, label, position) of the last fit_window labelled drafts.
    _rows: deque[tuple[float, float, int, int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        k = self.config.num_positions
        if not self.bias:
            self.slope = self.config.init_slope
            self.bias = [self.config.init_bias] * k
        if len(self.bias) != k:
            raise EstimatorError(f"{len(self.bias)} intercepts for {k} positions")
        self.recent = deque(self.recent, maxlen=self.config.window)
        self._rows = deque(self._rows, maxlen=max(self.config.fit_window, 1))
        self._clear()

    @classmethod
    def create(cls, num_positions: int, **kwargs: float) -> AcceptanceEstimator:
        return cls(EstimatorConfig(num_positions, **kwargs))  # type: ignore[arg-type]

    def _clear(self) -> None:
        n = self.config.num_positions + 2
        self._grad = [0.0] * n
        self._hess = [[0.0] * n for _ in range(n)]
        self._since_refit = 0

    @property
    def uses_history(self) -> bool:
        return self.config.history_alpha > 0

    def prior_history(self) -> float:
        """A new request's recent acceptance: the share accepted over the live window."""
        if not self.recent:
            return 0.5
        return sum(y for _, y, _ in self.recent) / len(self.recent)

    def _logit(self, position: int, f: float, hf: float) -> float:
        b = self.bias[min(position, self.config.num_positions) - 1]
        return self.slope * f + self.history_slope * hf + b

    def _history_feature(self, history: float | None) -> float:
        """logit(h); a request without a history yet gets the prior."""
        if not self.uses_history:
            return 0.0
        return logit_feature(self.prior_history() if history is None else history)

    def probability(self, position: int, max_prob: float, history: float | None = None) -> float:
        """P(accepted) of the draft at ``position`` (1-based) given the drafts before it were;
        ``history`` is the request's recent acceptance, None for a new request (ignored
        without ``history_alpha``)."""
        return sigmoid(self._logit(position, logit_feature(max_prob),
                                   self._history_feature(history)))

    def survival(self, max_probs: Sequence[float], history: float | None = None) -> list[float]:
        """P(drafts 1..j all accepted) for j = 1..len(max_probs)."""
        out: list[float] = []
        s = 1.0
        for j, q in enumerate(max_probs, start=1):
            s *= self.probability(j, q, history)
            out.append(s)
        return out

    def observe(self, max_probs: Sequence[float], num_accepted: int,
                history: float | None = None) -> float | None:
        """One request's verification: drafts with these max-probabilities, of which the first
        ``num_accepted`` were accepted; ``history`` as it was when they were drafted (None: a
        new request, given the prior). Refits when ``refit_every`` requests have been seen.
        Returns the request's history after this verification (None without
        ``history_alpha``)."""
        if not 0 <= num_accepted <= len(max_probs):
            raise EstimatorError(f"{num_accepted} accepted of {len(max_probs)} drafts")
        if self.uses_history and history is None:
            history = self.prior_history()  # before this verification's labels join the window
        hf = self._history_feature(history)
        verified = min(num_accepted + 1, len(max_probs))  # positions with a label
        for j in range(1, verified + 1):
            f = logit_feature(max_probs[j - 1])
            label = 1 if j <= num_accepted else 0
            p = sigmoid(self._logit(j, f, hf))
            self.recent.append((p, label, j))
            position = min(j, self.config.num_positions)
            if self.config.fit_window:
                self._rows.append((f, hf, label, position))
            else:
                self._accumulate(position, f, hf, label, p)
        self.num_observed += 1
        self._since_refit += 1
        if self._since_refit >= self.config.refit_every:
            self.refit()
        if not self.uses_history:
            return None
        return self.next_history(history, verified, num_accepted)

    def next_history(self, history: float | None, num_verified: int,
                     num_accepted: int) -> float:
        """The request's recent acceptance after a verification of ``num_verified`` drafts,
        ``num_accepted`` of them accepted (its labels: that many 1s, then a 0 if one was
        rejected); ``None`` is a new request."""
        h = self.prior_history() if history is None else history
        a = self.config.history_alpha
        labels = [1] * num_accepted + ([0] if num_accepted < num_verified else [])
        for y in labels:
            h = (1.0 - a) * h + a * y
        return h

    def _accumulate(self, position: int, f: float, hf: float, label: int, p: float) -> None:
        idx = (0, 1, position + 1)
        x = (f, hf, 1.0)
        w = p * (1.0 - p)
        for a in range(3):
            self._grad[idx[a]] += (label - p) * x[a]
            for b in range(3):
                self._hess[idx[a]][idx[b]] += w * x[a] * x[b]

    def refit(self) -> None:
        """Damped Newton steps (a ridge on the Hessian keeps it defined when a position has no
        data, and leaves that position where it was); the slope stays >= 0 (a more confident
        drafter is never modelled as less likely to be accepted, nor a request that has been
        accepted more); statistics are cleared. Without history features the history slope
        has no gradient and stays 0."""
        if self.config.fit_window:
            for _ in range(self.config.newton_iters):
                self._clear()
                for f, hf, label, position in self._rows:
                    p = sigmoid(self._logit(position, f, hf))
                    self._accumulate(position, f, hf, label, p)
                self._newton_step()
        else:
            self._newton_step()
        self.num_refits += 1
        self._clear()

    def _newton_step(self) -> None:
        n = self.config.num_positions + 2
        params = [self.slope, self.history_slope, *self.bias]
        hess = [[self._hess[i][j] + (self.config.ridge if i == j else 0.0) for j in range(n)]
                for i in range(n)]
        step = _solve(hess, self._grad)
        if step is not None:
            step = [max(-MAX_NEWTON_STEP, min(MAX_NEWTON_STEP, self.config.damping * s))
                    for s in step]
            new = [p + s for p, s in zip(params, step)]
            if all(math.isfinite(v) for v in new):
                self.slope = max(new[0], 0.0)
                self.history_slope = max(new[1], 0.0)
                self.bias = new[2:]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def auc(pairs: Sequence[tuple[float, int]]) -> float | None:
    """Area under the ROC curve of (score, label) pairs (Mann-Whitney, ties count half);
    None without both labels."""
    ordered = sorted(pairs, key=lambda p: p[0])
    num_pos = sum(1 for _, y in ordered if y)
    num_neg = len(ordered) - num_pos
    if num_pos == 0 or num_neg == 0:
        return None
    rank_sum = 0.0
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1][0] == ordered[i][0]:
            j += 1
        mid_rank = (i + j) / 2 + 1  # 1-based average rank of the tie group
        rank_sum += mid_rank * sum(1 for _, y in ordered[i:j + 1] if y)
        i = j + 1
    return (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


@dataclass(frozen=True, slots=True)
class CalibrationBin:
    lo: float
    hi: float
    mean_predicted: float
    accepted_share: float
    count: int


def calibration(pairs: Sequence[tuple[float, int]], num_bins: int = 10) -> list[CalibrationBin]:
    """Predictions binned in equal-width probability bins: mean prediction against the share
    accepted, per non-empty bin."""
    sums: list[list[float]] = [[0.0, 0.0, 0.0] for _ in range(num_bins)]
    for p, y in pairs:
        b = min(int(p * num_bins), num_bins - 1)
        sums[b][0] += p
        sums[b][1] += y
        sums[b][2] += 1
    return [CalibrationBin(i / num_bins, (i + 1) / num_bins, s[0] / s[2], s[1] / s[2], int(s[2]))
            for i, s in enumerate(sums) if s[2]]
