"""Capturing device work as a CUDA graph, the one routine the batch's decode steps
(slots.DecodeStep) and the greedy graph steps (decoding/graph_step.py) share: warm-up runs on
a side stream (so that lazy initialisation and allocator growth happen outside the capture),
then the capture itself, optionally in a memory pool shared between graphs. `kept_state`
undoes what the warm-up runs and the capture did to a step's state."""

from __future__ import annotations

import contextlib

import torch

from .kv_cache import DeviceKVCache


@contextlib.contextmanager
def kept_state(state: list[torch.Tensor], caches: list[DeviceKVCache]):
    """Leaves the device tensors `state` and the caches' host counts as the block found them."""
    saved = [t.clone() for t in state]
    hosts = [(c, c.bound, c.pending) for c in caches]
    try:
        yield
    finally:
        for tensor, value in zip(state, saved):
            tensor.copy_(value)
        for cache, bound, pending in hosts:
            cache.bound, cache.pending = bound, pending


def capture_graph(fn, state: list[torch.Tensor] = (), caches: list[DeviceKVCache] = (),
                  warmup: int = 2, pool=None):
    """(graph, output): `fn` (device work that updates `state` in place) captured as a CUDA
    graph (in `pool`, where given) after `warmup` runs on a side stream. The warm-up runs and
    the capture leave `state` and the caches' host counts as they found them (what they wrote
    to cache slots past the committed ones is never read)."""
    with kept_state(state, caches):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out
