"""What to quantize and how: weights, activations (per token, dynamic) and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadwise.quant.formats import FormatError, QuantFormat

FULL_BITS = 16  # --a-bits/--kv-bits 16: left in float32


@dataclass(frozen=True)
class QuantSpec:
    weights: QuantFormat | None
    activations: QuantFormat | None = None
    kv: QuantFormat | None = None

    @property
    def name(self) -> str:
        """``W4A4KV16``-style label with the formats, e.g. ``W4A4 int4-channel/int4-channel``."""
        def bits(f: QuantFormat | None) -> str:
            return str(f.bits) if f else str(FULL_BITS)
        parts = [f"W{bits(self.weights)}A{bits(self.activations)}"
                 + (f"KV{bits(self.kv)}" if self.kv else "")]
        if self.weights:
            parts.append(self.weights.name)
        if self.activations:
            parts.append("a:" + self.activations.name)
        if self.kv:
            parts.append("kv:" + self.kv.name)
        return " ".join(parts)

    @classmethod
    def build(cls, kind: str, w_bits: int, a_bits: int, kv_bits: int,
              group_size: int | None, asym_weights: bool = False,
              kv_group_size: int = 64) -> QuantSpec:
        """The CLI's spelling: one format kind for all three. Weights take ``group_size`` (None:
        per output channel); activations are per token (FP4 kinds: their own groups); the KV
        cache per token and head (``kv_group_size``, the head size)."""
        if kind != "int" and group_size is not None:
            raise FormatError(f"{kind} has its own groups; --group-size is for int formats")

        def one(bits: int, group: int | None, symmetric: bool = True) -> QuantFormat | None:
            if bits >= FULL_BITS:
                return None
            if kind != "int":
                if bits != 4:
                    raise FormatError(f"{kind} is a 4-bit format: --*-bits 4 or {FULL_BITS}")
                return QuantFormat(kind)  # type: ignore[arg-type]
            return QuantFormat("int", bits, group, symmetric)
        return cls(one(w_bits, group_size, not asym_weights), one(a_bits, None),
                   one(kv_bits, kv_group_size))

    def to_json(self) -> dict[str, Any]:
        def f(x: QuantFormat | None) -> dict[str, Any] | None:
            return None if x is None else {"kind": x.kind, "bits": x.bits,
                                           "group_size": x.group_size, "symmetric": x.symmetric}
        return {"name": self.name, "weights": f(self.weights), "activations": f(self.activations),
                "kv": f(self.kv)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuantSpec:
        def f(x: dict[str, Any] | None) -> QuantFormat | None:
            return None if x is None else QuantFormat(x["kind"], x["bits"], x["group_size"],
                                                      x["symmetric"])
        return cls(f(d["weights"]), f(d["activations"]), f(d["kv"]))
