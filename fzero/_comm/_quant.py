"""Quantized communication (ZeRO++'s qwZ and qgZ): int8 blocks with one scale each.

A 1-D tensor is cut into blocks of `block` elements (the last may be shorter); each
block travels as int8 codes `round(x / scale)` with `scale = max|x| / 127` in float32,
and arrives as `codes * scale`. Per element the error is at most

    |x - x̂| <= max(max|block|, 127 * 2**-126) / 254 * (1 + 2**-14)

(half a step of the block's scale; the scale is kept a normal float32 so tiny blocks
cannot underflow it, and the factor covers float32 rounding of the divide and the
multiply), plus half an ulp of a dtype narrower than float32 (bf16, fp16), which the
value is rounded back to on arrival. A block's zeros, including padding, arrive as exact
zeros. One byte per element plus four per block: 3.94x fewer bytes than float32 at the
default 256.

A block holding inf or NaN travels with a NaN scale and arrives as NaN: the receivers,
not the sender, find out, so every rank that must fail fails together (a sender that
raised alone would leave its peers waiting in the collective).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_MIN_SCALE = 2.0**-126  # the smallest normal float32: a scale never underflows


class QuantizedComm(NamedTuple):
    """Which collectives of a step travel as int8 blocks (`sharded_step(quantize=...)`).

    Attributes:
      weights: qwZ. Stage 3's all-gathers of parameter shards (forward and backward)
        travel quantized; every rank, the shard's owner included, computes with the
        dequantized values, so ranks agree and the masters stay exact. Where a gather
        sends nothing (one rank, or a shard axis of one) the weights are still rounded
        so: the same arithmetic at every world size, for no bytes saved there.
      grads: qgZ. Gradient reduce-scatters (stages 1-3) run as a quantized all-to-all
        and a float32 sum of what arrives (float64 for float64 gradients; the owner's
        own slice exact); across the
        groups of a 2-D mesh the reduced shard is exchanged quantized again, and every
        replica ends with the same dequantized values.
      block: elements per scale.
    """

    weights: bool = True
    grads: bool = True
    block: int = 256

    def check(self) -> QuantizedComm:
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"QuantizedComm.block must be a positive int, got {self.block!r}")
        return self


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(codes, scales)` of the rows of `x` (shape `(rows, n)` or `(n,)`): int8 codes of
    the same shape, float32 scales of shape `(rows, ceil(n / block))`, NaN for a block
    holding inf or NaN."""
    rows = x.reshape(-1, x.shape[-1]).float()
    n = rows.shape[1]
    nb = -(-n // block)
    pad = nb * block - n
    padded = torch.nn.functional.pad(rows, (0, pad)) if pad else rows
    blocks = padded.view(rows.shape[0], nb, block)
    absmax = blocks.abs().amax(dim=2)
    bad = ~torch.isfinite(absmax)
    absmax = absmax.masked_fill(bad, 1.0)
    scales = (absmax / 127).clamp_min_(_MIN_SCALE)
    codes = (blocks / scales.unsqueeze(2)).round_().nan_to_num_(0.0).clamp_(-127, 127)
    codes = codes.to(torch.int8)
    scales = scales.masked_fill(bad, float("nan"))
    return codes.view(rows.shape[0], nb * block)[:, :n].contiguous(), scales


def check_finite(scales: torch.Tensor, what: str) -> None:
    """Raises a ValueError naming `what` if a block arrived non-finite (a host sync)."""
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(
            f"{what}: quantized communication (QuantizedComm) met inf or NaN in the values "
            f"sent; int8 blocks cannot carry them. Find the overflow, or turn it off"
        )


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """The values `(codes, scales)` of `quantize` stand for, as `(rows, n)` in `dtype`."""
    rows, n = codes.shape
    nb = scales.shape[1]
    pad = nb * block - n
    c = torch.nn.functional.pad(codes, (0, pad)) if pad else codes
    out = c.view(rows, nb, block).float() * scales.unsqueeze(2)
    return out.view(rows, nb * block)[:, :n].to(dtype)
