"""x @ W.T for the decoding hot path: weights packed once for oneDNN on CPU.

At decoding batch sizes (one row for plain decoding, a few dozen for a draft tree) PyTorch's
default CPU matmul wastes most of the memory bandwidth that decoding lives on: float32
matrix-vector products run on one thread, and small GEMMs repack the whole weight on every
call. oneDNN with the weight reordered once into its blocked layout streams it at full speed,
and it gives each row the same bits whatever the number of rows, so a token scored inside a
verification tree gets the logits it would get decoded alone.

Measured on the 2-core AVX-512 CPU, float32 (scripts/bench_forward.py, BENCHMARKS.md):
SmolLM2's 49,152 x 576 LM head 10.3 -> 5.0 ms for one row and 17.2 -> 5.4 ms for twelve.

Everything else (GPU tensors, autograd, other dtypes, VOCABSPEC_PACKED_LINEAR=0) goes to
F.linear. Packs are cached per weight and rebuilt when the weight changes (training steps,
`.to()`), so callers never manage them.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

_packs: dict[int, tuple] = {}


def packing_enabled() -> bool:
    return os.environ.get("VOCABSPEC_PACKED_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or x.dtype != weight.dtype or weight.dim() != 2:
        return False
    if weight.dtype == torch.bfloat16:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    elif weight.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return packing_enabled()


def _version(weight: torch.Tensor) -> int:
    try:
        return weight._version
    except RuntimeError:  # inference tensors keep no version counter and cannot change in place
        return 0


def packed(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of `weight`, built on first use and whenever the weight changed."""
    ident = id(weight)
    key = (weight.data_ptr(), _version(weight), weight.dtype, tuple(weight.shape))
    entry = _packs.get(ident)
    if entry is not None and entry[0]() is weight and entry[1] == key:
        return entry[2]
    pack = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    _packs[ident] = (weakref.ref(weight, lambda _ref: _packs.pop(ident, None)), key, pack)
    return pack


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through a packed weight where that is faster (see the module docstring).

    Use it for weights that live across calls; a weight gathered afresh for each call is
    cheaper through F.linear than packed once and thrown away.
    """
    if not _packable(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed(weight), bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint keys) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
