"""Kernel launches a decoder layer costs: on a GPU a small model's step is bound by how many
kernels it launches, so fusing them (kernels.py, Block.fused) is measured by counting them.

Two kinds are counted while the first layer of a forward runs: the row-invariant kernels'
launches (kernels.launches) and torch's operations that compute something (one kernel each on
a GPU; views, which launch none, are left out, and so is whatever torch runs on behalf of
Triton's CPU interpreter).

A one-token forward's layer (tests/test_kernels.py, tiny models), row-invariant kernels +
torch's operations:

    Llama, unfused                                       7 + 11 = 18
    Llama, norms, activation and residuals fused         5 +  7 = 12
    Llama, and rotary and the cache write in QKV's       5 +  0 =  5
    Gemma 3, unfused                                    11 + 16 = 27
    Gemma 3, norms, activation and residuals fused       9 + 14 = 23
    Gemma 3, and its query/key norms, rotary and the
      cache write in one kernel after QKV's              8 +  2 = 10
      (its post-norms keep two residual adds apart)

A whole greedy graph step (graph_step.py) on a one-layer tiny Llama, plain decoding: 6 + 62
before rotary and the cache write joined QKV's kernel and the argmax the head's, 7 + 54 after
(the head: its kernel, torch's float and argmax before; its kernel and the tiles' reduction
after, no logits stored). Each further layer: 12 before, 5 after.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import kernels


class _TorchOps(TorchDispatchMode):
    """Counts torch's computing operations while `counting` is set."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not func.is_view and func.__name__.split(".")[0] not in ("empty", "empty_like"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _kernels_uncounted(ops: _TorchOps):
    """Inside a row-invariant kernel's launch, torch's operations are the interpreter's own."""
    launch = kernels._launch

    def quiet(*args, **meta):
        ops.counting = False
        try:
            launch(*args, **meta)
        finally:
            ops.counting = True
    kernels._launch = quiet
    try:
        yield
    finally:
        kernels._launch = launch


class _FirstLayerDone(Exception):
    """Raised once the first layer has run: nothing after it is counted, so nothing runs."""


@torch.inference_mode()
def layer_launches(model, tokens: torch.Tensor, positions: torch.Tensor, cache, **forward) -> dict:
    """{"triton": row-invariant kernel launches, "torch": torch's operations} in the first
    layer of `model.tree_forward(tokens, positions, cache, **forward)` (kernel_backend's: it runs
    each layer through its `block`). The forward stops after that layer: the cache counts no new token (its
    first layer's slots past the committed ones are written)."""
    ops = _TorchOps()
    marks = {}
    block = model.block

    def first_layer(*args):
        marks["start"] = (kernels.launches(), ops.count)
        block(*args)
        marks["end"] = (kernels.launches(), ops.count)
        raise _FirstLayerDone
    model.block = first_layer
    try:
        with _kernels_uncounted(ops), ops:
            model.tree_forward(tokens, positions, cache, **forward)
    except _FirstLayerDone:
        pass
    finally:
        del model.block
    return {"triton": marks["end"][0] - marks["start"][0], "torch": marks["end"][1] - marks["start"][1]}
