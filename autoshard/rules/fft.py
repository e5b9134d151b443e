"""The fft family: the transformed (trailing) dims stay whole; the others split where
XLA's partitioner splits an FFT (``xla.partitions_fft``), else the FFT is computed whole."""

from __future__ import annotations

import math

from autoshard.rules import Einsum, LabelMaker, register
from autoshard.target.xla import partitions_fft


@register("fft")
def fft(node, out_shapes) -> Einsum:
    """FFT, IFFT, RFFT, IRFFT over the last ``len(fft_lengths)`` dims (RFFT and IRFFT
    change the last dim's size); about 5 n log2 n flops per transform of n points."""
    (shape,), (out_shape,) = node.operand_shapes, out_shapes
    lengths = node.params["fft_lengths"]
    batch = len(shape) - len(lengths)
    labels = LabelMaker()
    split = partitions_fft()
    term = tuple(labels.new(d) if i < batch and split else None for i, d in enumerate(shape))
    points = math.prod(lengths)
    transforms = math.prod(shape[:batch])
    flops = 5.0 * transforms * points * max(1.0, math.log2(max(points, 2)))
    return Einsum((term,), (term[:batch] + (None,) * (len(out_shape) - batch),), labels.sizes,
                  flops=flops)
