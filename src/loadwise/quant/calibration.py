"""Calibration data for the calibrated methods, computed once per set of samples.

Invariant: the activation statistics are taken on the float32 model, before any method changes
it (each method starts from a fresh copy of it), so one set serves every SmoothQuant α."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Calibration:
    def __init__(self, samples: Callable[[], torch.Tensor]) -> None:
        self._make = samples
        self._samples: torch.Tensor | None = None
        self._absmax: list[dict[str, torch.Tensor]] | None = None

    def samples(self) -> torch.Tensor:
        """The calibration segments ``[n, tokens]``."""
        if self._samples is None:
            self._samples = self._make()
        return self._samples

    def absmax(self, float_model: Any) -> list[dict[str, torch.Tensor]]:
        """Per layer and input site, each channel's max |activation| on the samples
        (``smoothing.activation_absmax``), on ``float_model`` the first time."""
        from loadwise.quant.smoothing import activation_absmax

        if self._absmax is None:
            self._absmax = activation_absmax(float_model, self.samples())
        return self._absmax
