"""What `loadwise evaluate` runs: its configuration and the configurations it compares."""

from __future__ import annotations

from dataclasses import dataclass

from loadwise.errors import ConfigError
from loadwise.measure.profile import Profile
from loadwise.policy.table import DraftLengthTable

DOCS_TABLE = [[1, 64, 3], [65, 128, 1], [129, 512, 0]]
MEASURED = "measured table"
DOCS = "docs table"


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
    # content. Without it a window continues whatever requests were in flight, and at low load
    # one request's acceptance decides the window (docs/evaluate.md).
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
    # The target: the measured table at most this much slower than the best fixed k, judged
    # per load on a distribution-free interval for the median round loss, at this confidence.
    target_loss: float = 0.03
    verdict_confidence: float = 0.9

    def __post_init__(self) -> None:
        if not self.loads or min(self.loads) < 1:
            raise ConfigError(f"loads must be >= 1, got {self.loads}")
        if self.repeats < 1 or self.duration_s <= 0:
            raise ConfigError("repeats must be >= 1 and duration > 0")
        if self.retime_rounds < 0:
            raise ConfigError(f"retime_rounds must be >= 0, got {self.retime_rounds}")
        if self.confirm_rounds < 0:
            raise ConfigError(f"confirm_rounds must be >= 0, got {self.confirm_rounds}")
        if self.confirm_max_rounds is not None and (
                self.confirm_rounds < 1 or self.confirm_max_rounds < self.confirm_rounds):
            raise ConfigError(f"confirm_max_rounds ({self.confirm_max_rounds}) needs confirm_rounds "
                             f">= 1 and at least as many rounds ({self.confirm_rounds})")
        if not 0.0 <= self.target_loss < 1.0:
            raise ConfigError(f"target_loss is a fraction in [0, 1), got {self.target_loss}")
        if not 0.0 < self.verdict_confidence < 1.0:
            raise ConfigError(f"verdict_confidence must be in (0, 1), got {self.verdict_confidence}")

    @property
    def looks(self) -> tuple[int, ...]:
        """Round counts after which a confirmation judges its verdict (empty: no confirmation)."""
        if not self.confirm_rounds:
            return ()
        return confirm_looks(self.confirm_rounds, self.confirm_max_rounds or self.confirm_rounds)

    @property
    def confidence_per_look(self) -> float:
        return per_look_confidence(self.verdict_confidence, max(len(self.looks), 1))

    def num_steps(self, num_workloads: int, num_configs: int) -> int:
        """Progress units of a full run: every window, re-timing and confirmation window."""
        per_load = (self.repeats * num_configs + (1 if self.retime_rounds else 0)
                    + 4 * max(self.looks, default=0))
        return num_workloads * len(self.loads) * per_load


def configurations(profile: Profile, workload: str) -> list[tuple[str, DraftLengthTable]]:
    """No speculation, every fixed k, the docs' example table and the profile's table."""
    n = profile.max_num_seqs
    out = [(f"k={k}", DraftLengthTable.fixed(k, profile.max_k, n)) for k in range(profile.max_k + 1)]
    # The docs' example assumes k <= 3; on a smaller engine vLLM clamps it, and so do we.
    out.append((DOCS, DraftLengthTable.parse(DOCS_TABLE, max(3, profile.max_k)).clamped(profile.max_k)))
    out.append((MEASURED, profile.table_for(workload)))
    return out


def confirm_looks(first_rounds: int, max_rounds: int) -> tuple[int, ...]:
    """Round counts after which a sequential confirmation judges its verdict and may stop:
    ``first_rounds``, then doubling, and ``max_rounds`` last. Fixed before any round runs, so
    each look's confidence can be set from their number (``per_look_confidence``)."""
    if first_rounds < 1 or max_rounds < first_rounds:
        raise ConfigError(f"looks need 1 <= first_rounds <= max_rounds, got {first_rounds}, "
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
        raise ConfigError(f"need at least one look, got {num_looks}")
    return 1.0 - (1.0 - confidence) / num_looks
