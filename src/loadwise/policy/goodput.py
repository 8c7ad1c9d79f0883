"""Goodput model: which draft length k yields the most useful tokens per second at batch size b.

    E(k)          = 1 + draft_rate * sum_{i=1..k} u_i        expected tokens per request per step
    T(b, k)       = measured step time with b decoding requests each verifying k drafts
    goodput(b, k) = b * E(k) / T(b, k)

``u_i`` is the probability that the first i drafted tokens are all accepted (so u is
non-increasing), ``draft_rate`` the share of request-steps that receive a draft at all (prompt
lookup proposes nothing when it finds no match; a draft model always drafts: rate 1).
A request-step without a draft verifies nothing, so the step costs T at the *effective* draft
length ``draft_rate * k``, interpolated between the measured points.

Step times are measured on a grid of batch sizes; between grid points T is interpolated
linearly in b, beyond the grid it is extrapolated from the last two points (never below 0).
This module is pure Python: the tuner, the live vLLM plugin and replays share it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loadwise.errors import LoadwiseError


class ModelError(LoadwiseError, ValueError):
    """Measurements that cannot feed the goodput model; the message says which."""


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Prefix acceptance: ``prefix_accept[i-1]`` = u_i = P(first i drafts all accepted | the
    draft reached position i); ``reach[i-1]`` = P(a draft reaches position i)."""

    prefix_accept: tuple[float, ...]
    draft_rate: float = 1.0
    # reach[i-1] = P(a draft has a token at position i); prompt lookup near the end of the
    # context proposes fewer than k. None: every draft is full length.
    reach: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.draft_rate <= 1.0:
            raise ModelError(f"draft_rate must be in [0, 1], got {self.draft_rate}")
        if self.reach is not None and (
            len(self.reach) != len(self.prefix_accept) or any(not 0 <= r <= 1 for r in self.reach)
        ):
            raise ModelError(f"reach {self.reach} must be probabilities, one per position")
        prev = 1.0
        for i, u in enumerate(self.prefix_accept, start=1):
            if not 0.0 <= u <= 1.0 or math.isnan(u):
                raise ModelError(f"u_{i}={u} is not a probability")
            if u > prev + 1e-9:
                raise ModelError(f"u_{i}={u} exceeds u_{i - 1}={prev}: prefix acceptance must not grow")
            prev = u

    @classmethod
    def from_position_counts(
        cls,
        num_drafts: float,
        drafted_per_pos: Sequence[float],
        accepted_per_pos: Sequence[float],
        request_steps: float | None = None,
        min_position_drafts: float = 0.0,
        offered_per_pos: Sequence[float] | None = None,
    ) -> Acceptance:
        """From vLLM's counters (plain or decayed): drafts, draft tokens and accepted tokens at
        each position. The one estimator behind ``loadwise tune`` and the live plugin.

        Acceptance is a prefix (position i is accepted only if 0..i-1 were), so
        u_i = accepted at i / drafts that reached i (a draft shorter than i says nothing about
        position i), kept non-increasing. A position with no more than ``min_position_drafts``
        drafts reaching it (the live table stopped drafting there) extrapolates the last
        observed conditional acceptance and reach. ``request_steps`` (decode request-steps
        taken while speculating) gives the draft rate; None means every step drafted.
        ``offered_per_pos[i]``: drafts proposed while the table allowed position i (default: all
        of them); reach is measured against it, so a table that asks for fewer tokens is not
        mistaken for a drafter that finds fewer.
        """
        offered = list(offered_per_pos) if offered_per_pos is not None else \
            [float(num_drafts)] * len(drafted_per_pos)
        if num_drafts <= 0 or not drafted_per_pos or drafted_per_pos[0] <= 0:
            raise ModelError("no drafts were counted: cannot estimate acceptance")
        if len(drafted_per_pos) != len(accepted_per_pos):
            raise ModelError("drafted and accepted counts must cover the same positions")
        if any(a > d + 1e-9 for a, d in zip(accepted_per_pos, drafted_per_pos)):
            raise ModelError(f"accepted counts {list(accepted_per_pos)} exceed drafted "
                             f"{list(drafted_per_pos)}")
        u: list[float] = []
        reach: list[float] = []
        prev_u, cond_u = 1.0, 1.0
        prev_r, cond_r = 1.0, 1.0
        for acc, dr, off in zip(accepted_per_pos, drafted_per_pos, offered):
            if dr > 0 and dr >= min_position_drafts and off > 0:
                value = min(prev_u, acc / dr)
                cond_u = value / prev_u if prev_u > 0 else 0.0
                r = min(prev_r, dr / off)
                cond_r = r / prev_r if prev_r > 0 else 0.0
            else:
                value = prev_u * cond_u
                r = prev_r * cond_r
            u.append(value)
            reach.append(r)
            prev_u, prev_r = value, r
        rate = min(1.0, num_drafts / request_steps) if request_steps else 1.0
        return cls(tuple(u), rate, tuple(reach))

    @property
    def max_k(self) -> int:
        return len(self.prefix_accept)

    def expected_tokens(self, k: int) -> float:
        if k > self.max_k:
            raise ModelError(f"acceptance known for k <= {self.max_k}, asked for k={k}")
        reach = self.reach if self.reach is not None else (1.0,) * self.max_k
        # A token at position i is accepted only if the draft reached i and 1..i were accepted.
        return 1.0 + self.draft_rate * sum(r * u for r, u in zip(reach[:k], self.prefix_accept[:k]))

    def expected_drafts(self, k: int) -> float:
        """Draft tokens a request verifies per step at draft length k (what the step pays for)."""
        if k > self.max_k:
            raise ModelError(f"acceptance known for k <= {self.max_k}, asked for k={k}")
        reach = self.reach if self.reach is not None else (1.0,) * self.max_k
        return self.draft_rate * sum(reach[:k])

    def conditional(self) -> tuple[float, ...]:
        """Per-position acceptance: accepted at i / drafts that reached i."""
        out = []
        prev = 1.0
        for u in self.prefix_accept:
            out.append(u / prev if prev > 0 else 0.0)
            prev = u
        return tuple(out)


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Median step time ``step_time_s[(b, k)]`` on a full grid of batch sizes x 0..max_k.

    ``drafts_per_req[(b, k)]`` is how many drafts each request really verified in the timed
    steps (a drafter may propose fewer than k). T is interpolated in that *effective* draft
    count, so a step that verifies x drafts per request costs T(b, x) whatever k was asked.
    """

    step_time_s: Mapping[tuple[int, int], float]
    drafts_per_req: Mapping[tuple[int, int], float] | None = None
    # Relative standard error of each measured T (its median's uncertainty / the median);
    # None: unknown. Decides which differences between choices of k are ties (best_table).
    rel_se: Mapping[tuple[int, int], float] | None = None
    batch_sizes: tuple[int, ...] = field(init=False)
    max_k: int = field(init=False)
    _curves: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.step_time_s:
            raise ModelError("no step times measured")
        bs = sorted({b for b, _ in self.step_time_s})
        ks = sorted({k for _, k in self.step_time_s})
        if ks != list(range(ks[-1] + 1)):
            raise ModelError(f"draft lengths {ks} must be 0..max_k without gaps")
        curves = {}
        for b in bs:
            xs: list[float] = []
            ts: list[float] = []
            for k in ks:
                t = self.step_time_s.get((b, k))
                if t is None:
                    raise ModelError(f"step time missing for batch size {b}, k={k}")
                if not t > 0 or math.isinf(t):
                    raise ModelError(f"step time for batch size {b}, k={k} is {t}: must be > 0")
                x = float(k) if self.drafts_per_req is None else self.drafts_per_req.get((b, k), k)
                x = 0.0 if k == 0 else max(x, xs[-1] + 1e-6 if xs else 0.0)
                xs.append(x)
                ts.append(t)
            curves[b] = (tuple(xs), tuple(ts))
        for key, se in (self.rel_se or {}).items():
            if key not in self.step_time_s:
                raise ModelError(f"standard error given for unmeasured point {key}")
            if not 0.0 <= se < math.inf:
                raise ModelError(f"standard error for {key} is {se}: must be finite and >= 0")
        object.__setattr__(self, "batch_sizes", tuple(bs))
        object.__setattr__(self, "max_k", ks[-1])
        object.__setattr__(self, "_curves", curves)

    def at(self, batch_size: float, drafts: float) -> float:
        """T for any b >= 1 and 0 <= drafts per request <= max_k (see module docstring)."""
        if not 0 <= drafts <= self.max_k + 1e-9:
            raise ModelError(f"{drafts} drafts per request outside measured 0..{self.max_k}")
        bs = self.batch_sizes
        i = bisect.bisect_left(bs, batch_size)
        if i < len(bs) and bs[i] == batch_size:
            return self._at_drafts(bs[i], drafts)
        if i == 0 or len(bs) == 1:
            # Outside a single point there is no slope to follow; below the smallest measured
            # batch a step cannot get cheaper than the smallest one measured.
            return self._at_drafts(bs[0] if i == 0 else bs[-1], drafts)
        beyond = i == len(bs)
        b0, b1 = (bs[-2], bs[-1]) if beyond else (bs[i - 1], bs[i])
        t0, t1 = self._at_drafts(b0, drafts), self._at_drafts(b1, drafts)
        t = t0 + (batch_size - b0) * (t1 - t0) / (b1 - b0)
        # Past the grid a step never gets faster than the largest batch measured.
        return max(t, t1) if beyond else t

    def _at_drafts(self, b: int, x: float) -> float:
        xs, ts = self._curves[b]
        j = bisect.bisect_right(xs, x)
        if j == 0:
            return ts[0]
        if j == len(xs):
            # Drafters fill fewer than k on average: extend the last segment to reach max k.
            j = len(xs) - 1
        x0, x1, t0, t1 = xs[j - 1], xs[j], ts[j - 1], ts[j]
        t = t0 + (x - x0) * (t1 - t0) / (x1 - x0)
        return max(t, t1) if x > x1 else t


    def scaled(self, factor: float) -> StepTimes:
        """The same grid with every step time multiplied by ``factor`` (a machine that runs
        ``factor`` times slower); draft counts and relative errors unchanged."""
        return StepTimes({key: t * factor for key, t in self.step_time_s.items()},
                         self.drafts_per_req, self.rel_se)

    def with_batch_size(self, batch_size: int, step_time_s: Mapping[int, float],
                        drafts_per_req: Mapping[int, float]) -> StepTimes:
        """The grid with ``batch_size`` replaced (or added) by T(batch_size, k) for every
        k = 0..max_k; a k missing from ``drafts_per_req`` verified k drafts per request."""
        if set(step_time_s) != set(range(self.max_k + 1)):
            raise ModelError(f"step times at batch size {batch_size} must cover "
                             f"k = 0..{self.max_k}")
        step = {key: t for key, t in self.step_time_s.items() if key[0] != batch_size}
        drafts = {key: d for key, d in (self.drafts_per_req or {}).items()
                  if key[0] != batch_size}
        for k, t in step_time_s.items():
            step[(batch_size, k)] = t
            drafts[(batch_size, k)] = drafts_per_req.get(k, float(k))
        return StepTimes(step, drafts)

    def monotone(self) -> StepTimes:
        """The same grid fitted so a step never gets cheaper with more drafts or a bigger batch
        (``monotone_step_times``); effective draft counts unchanged."""
        return StepTimes(monotone_step_times(self.step_time_s), self.drafts_per_req, self.rel_se)

    def tie_tolerance(self, batch_size: float) -> float:
        """The relative goodput difference between two draft lengths at ``batch_size`` that
        the step-time measurements cannot tell apart: one standard error of a difference of
        two step times (sqrt(2) x the largest relative standard error of any k at the measured
        batch sizes either side of ``batch_size``); 0 when no standard errors are known."""
        if not self.rel_se:
            return 0.0
        bs = self.batch_sizes
        i = bisect.bisect_left(bs, batch_size)
        if i < len(bs) and bs[i] == batch_size:
            near = {bs[i]}
        else:  # the measured neighbours; beyond either end of the grid, its end alone
            near = {bs[max(i - 1, 0)], bs[min(i, len(bs) - 1)]}
        se = max(self.rel_se.get((b, k), 0.0) for b in near for k in range(self.max_k + 1))
        return math.sqrt(2.0) * se


def _nondecreasing(ys: Sequence[float]) -> list[float]:
    """Least-squares nondecreasing fit of ``ys`` (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    out: list[float] = []
    for m, n in blocks:
        out += [m] * int(n)
    return out


def monotone_step_times(step_time_s: Mapping[tuple[int, int], float], max_rounds: int = 1000,
                        tol_s: float = 1e-12) -> dict[tuple[int, int], float]:
    """Least-squares fit of measured step times on a full (b, k) grid that is nondecreasing in
    k at every b and in b at every k.

    Why: verifying more drafts, or decoding more requests, is never less work, yet medians
    of a noisy machine sometimes say so (a tune with T(4, 3) = 60 ms and T(4, 4) = 57 ms chose
    k = 3 at b = 4 and k = 4 on both sides of it). Fitting the physics in removes such blips
    without moving a curve that already obeys it; where two points are inverted they meet at
    their mean. Computed by Dykstra's alternating projections onto the two monotone cones
    (exact 2-D isotonic regression in the limit); every constant grid lies in both cones, so
    the fit keeps the grid's mean."""
    if not step_time_s:
        raise ModelError("no step times measured")
    bs = sorted({b for b, _ in step_time_s})
    ks = sorted({k for _, k in step_time_s})
    if len(step_time_s) != len(bs) * len(ks):
        raise ModelError("monotone fit needs a full grid of batch sizes x draft lengths")
    rows = [[(b, k) for k in ks] for b in bs]  # each nondecreasing in k
    cols = [[(b, k) for b in bs] for k in ks]  # each nondecreasing in b
    x = {key: float(t) for key, t in step_time_s.items()}
    p = dict.fromkeys(x, 0.0)
    q = dict.fromkeys(x, 0.0)
    for _ in range(max_rounds):
        y = {key: x[key] + p[key] for key in x}
        u = _fit_lines(y, rows)
        p = {key: y[key] - u[key] for key in x}
        z = {key: u[key] + q[key] for key in x}
        new = _fit_lines(z, cols)
        q = {key: z[key] - new[key] for key in x}
        change = max(abs(new[key] - x[key]) for key in x)
        x = new
        if change <= tol_s:
            break
    # The last projection is onto the columns; finish the rows exactly (a residue of the
    # order of tol_s may remain there before convergence).
    return _fit_lines(x, rows)


def _fit_lines(values: Mapping[tuple[int, int], float],
               lines: Sequence[Sequence[tuple[int, int]]]) -> dict[tuple[int, int], float]:
    """``values`` with each line (a sequence of grid keys) replaced by its nondecreasing fit."""
    out: dict[tuple[int, int], float] = {}
    for line in lines:
        out.update(zip(line, _nondecreasing([values[key] for key in line])))
    return out


def goodput(b: float, k: int, times: StepTimes, acc: Acceptance) -> float:
    return b * acc.expected_tokens(k) / times.at(b, acc.expected_drafts(k))


def closed_loop_throughput(
    b: float, k: int, times: StepTimes, acc: Acceptance, prefill_s_per_token: float,
    prompt_per_output: float,
) -> float:
    """Output tokens/s of b clients in closed loop, prefill included: every output token brings
    ``prompt_per_output`` prompt tokens to prefill at ``prefill_s_per_token`` each, on top of
    decode steps of T(b, drafts) producing b * E(k) tokens."""
    tokens = b * acc.expected_tokens(k)
    step_s = times.at(b, acc.expected_drafts(k))
    return tokens / (step_s + prefill_s_per_token * tokens * prompt_per_output)
