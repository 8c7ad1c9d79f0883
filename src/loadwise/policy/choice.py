"""Which draft length to run at each batch size: the goodput of every k, the argmax with its
margin, and the table (non-increasing in batch size, ties resolved by the step times' own
noise). Pure Python, like the model it rests on (``goodput``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadwise.policy.goodput import Acceptance, ModelError, StepTimes, goodput
from loadwise.policy.table import DraftLengthTable


@dataclass(frozen=True, slots=True)
class Choice:
    batch_size: int
    k: int
    goodput_tok_s: float
    runner_up_k: int | None
    margin: float  # goodput(best) / goodput(runner-up) - 1; 0 when only one k exists
    # Set where the table's shape overrode the pointwise argmax (see best_table): that argmax.
    # runner_up_k is then the argmax and margin (<= 0) what this choice gives up against it.
    smoothed_from: int | None = None



def goodput_grid(
    batch_sizes: Sequence[int], times: StepTimes, acc: Acceptance, max_k: int | None = None
) -> dict[tuple[int, int], float]:
    top = _usable_max_k(times, acc, max_k)
    return {(b, k): goodput(b, k, times, acc) for b in batch_sizes for k in range(top + 1)}


def choose(b: int, times: StepTimes, acc: Acceptance, max_k: int | None = None) -> Choice:
    """argmax_k goodput(b, k); ties go to the smaller k (less work for the same tokens)."""
    top = _usable_max_k(times, acc, max_k)
    scored = sorted(((goodput(b, k, times, acc), -k) for k in range(top + 1)), reverse=True)
    best_g, neg_k = scored[0]
    if len(scored) == 1:
        return Choice(b, -neg_k, best_g, None, 0.0)
    second_g, neg_k2 = scored[1]
    return Choice(b, -neg_k, best_g, -neg_k2, best_g / second_g - 1.0)


# A table whose k rises again with the batch size is kept only if forcing it to fall costs
# more than this much goodput at some batch size (by the model), or more than the step times'
# own standard error there says they can resolve (StepTimes.tie_tolerance), whichever is
# larger; below, the rise is a tie inside the step-time noise (a tune's margins at such points:
# 0.5-1.5 %; one with 24 % IQR at 18 samples per point: 5.7 %, inside its 7.4 % band).
MONOTONE_TOLERANCE = 0.01


def tie_band(times: StepTimes, batch_size: int,
             monotone_tolerance: float = MONOTONE_TOLERANCE) -> float:
    """The goodput a table may give up at ``batch_size`` to keep k from rising with the batch
    size: the larger of the fixed floor and what the step times cannot resolve there."""
    return max(monotone_tolerance, times.tie_tolerance(batch_size))


def fewest_ranges(goodputs: Sequence[Sequence[float]],
                  bands: Sequence[float]) -> list[int] | None:
    """For batch sizes 1..N (``goodputs[b - 1][k]``), the k per batch size that never grows
    with the batch size, gives up at most ``bands[b - 1]`` of goodput against each batch
    size's best k, and has the fewest ranges (changes of k + 1); among those, the least
    summed relative loss, then the larger k at the smallest batch size. None when no
    non-increasing choice stays inside the bands (a rise the measurements resolve)."""
    if not goodputs or len(bands) != len(goodputs):
        raise ModelError("need one band per batch size, and at least one batch size")
    num_k = len(goodputs[0])
    loss = [[1.0 - g[k] / max(g) if max(g) > 0 else 0.0 for k in range(num_k)] for g in goodputs]
    inf = (math.inf, math.inf)
    # cost[k]: (ranges, summed loss) of the best choice for 1..b with k at b.
    cost = [(1, loss[0][k]) if loss[0][k] <= bands[0] else inf for k in range(num_k)]
    came_from: list[list[int]] = [list(range(num_k))]
    for b in range(1, len(goodputs)):
        new_cost, back = [], []
        for k in range(num_k):
            if loss[b][k] > bands[b]:
                new_cost.append(inf)
                back.append(k)
                continue
            # The previous batch size may use any k' >= k; staying on k adds no range.
            prev = min(range(k, num_k),
                       key=lambda j: (cost[j][0] + (j != k), cost[j][1], j - k))
            ranges, summed = cost[prev]
            new_cost.append((ranges + (prev != k), summed + loss[b][k]))
            back.append(prev)
        cost = new_cost
        came_from.append(back)
    k = min(range(num_k), key=lambda j: (cost[j], -j))
    if cost[k] == inf:
        return None
    ks = [k]
    for b in range(len(goodputs) - 1, 0, -1):
        k = came_from[b][k]
        ks.append(k)
    ks.reverse()
    return ks


def best_table(
    times: StepTimes, acc: Acceptance, max_batch_size: int, max_k: int | None = None,
    monotone_tolerance: float = MONOTONE_TOLERANCE,
) -> tuple[DraftLengthTable, list[Choice]]:
    """The highest-goodput k for every batch size 1..max_batch_size, compacted into ranges.

    Differences the measurements cannot resolve do not shape the table: at each batch size b
    any k within the larger of ``monotone_tolerance`` and ``times.tie_tolerance(b)`` of the
    best goodput is a tie, and among the tables made of ties whose k never rises with b (spare
    compute shrinks as the batch grows) the one with the fewest ranges is used, the pointwise
    argmax where it is one of them. A table that flips k back and forth inside the noise is
    one nobody can trust. Where no such table exists, the argmax is kept: the measurements say
    the rise is real."""
    if max_batch_size < 1:
        raise ModelError(f"max_batch_size must be >= 1, got {max_batch_size}")
    top = _usable_max_k(times, acc, max_k)
    choices = [choose(b, times, acc, top) for b in range(1, max_batch_size + 1)]
    grid = [[goodput(c.batch_size, k, times, acc) for k in range(top + 1)] for c in choices]
    bands = [tie_band(times, c.batch_size, monotone_tolerance) for c in choices]
    smooth = fewest_ranges(grid, bands)
    if smooth is not None:
        choices = [c if k == c.k else Choice(
            c.batch_size, k, g[k], c.k, g[k] / c.goodput_tok_s - 1.0, smoothed_from=c.k)
            for c, k, g in zip(choices, smooth, grid)]
    table = DraftLengthTable.from_mapping({c.batch_size: c.k for c in choices}, top)
    return table, choices


def _usable_max_k(times: StepTimes, acc: Acceptance, max_k: int | None) -> int:
    top = min(times.max_k, acc.max_k)
    return top if max_k is None else min(top, max_k)
