"""What the loop asks of a proposer (`Proposer`), and of its drafting in graph steps
(`GraphDrafting`): the core's one interface between the decoding loop and every drafting
family. A proposer turns the committed context into a `Tree` and hears back which tokens were
accepted; the loop never asks which family it is."""

from __future__ import annotations

import torch

from .tree import Tree
from ..runtime.backend import PREFILL_CHUNK  # noqa: F401  (the proposers' reads chunk prompts alike)


class Proposer:
    """What the engine, the batch, graph steps and the benchmark ask of a proposer; every
    proposer derives from it. A proposer implements `reset`, `propose` and `observe`; the rest
    have defaults that mean "not this proposer's concern".

    `hidden` rows are the target's last-layer hidden states (before the final norm) of the
    tokens given, preceded by the outputs of the layers in `taps` (a fused-feature drafter's
    inputs; empty for most). `max_tree_tokens`: the most drafted tokens a proposal holds (the
    engine keeps that much room in the cache)."""

    max_tree_tokens: int
    taps: tuple[int, ...] = ()
    timing_sync: bool = False   # time each phase after waiting for the device (a breakdown's cost)
    graphs: bool = False        # drafts greedy steps of fixed shapes: `graph_form` returns its drafting
    draft_vocab = None          # its draft vocabulary (vocab/draft_vocab.py), if it drafts through one
    cache = None                # its own KV cache, if it keeps one
    draft_forwards: int | None = None   # drafting passes a step, where not its tree's depth + 1
    tree_shape: tuple[int, int] | None = None   # (depth, total tokens) of its tree, if sized so
    # Whether this request's trees may be sized from the machine's timing (live_tree.py): a
    # greedy request's only, set by its Generation; a sampled request's trees must not depend
    # on timing, so that its seed gives the same tokens in a batch and alone.
    size_live: bool = True
    # Its live tree-size rule (live_tree.LiveSizing), where its trees are sized each step: its
    # depth and tree size are then the largest tree a step drafts. None: every step one tree.
    sizing = None
    # Whether its drafting runs inside the backend's step (graph steps): a proposal is then
    # the root alone, with nothing to check on the host.
    drafts_on_device: bool = False

    def reset(self, prompt_ids: list[int], prompt_hidden: torch.Tensor, first_token: int) -> None:
        raise NotImplementedError

    def propose(self, root_token: int) -> Tree:
        raise NotImplementedError

    def observe(self, accepted: list[int], hidden: torch.Tensor | None, next_token: int) -> None:
        """The step accepted `accepted` (the root first) and chose `next_token` after them;
        `hidden`: the target's rows at the accepted tokens (None where `reads_rows` said no)."""
        raise NotImplementedError

    def reads_rows(self) -> bool:
        """Whether the next step's rows are read (`observe`'s `hidden`): where they are not, the
        step computes no tapped outputs for this proposer and gathers none."""
        return True

    def graph_form(self, max_len: int | None) -> "GraphDrafting | None":
        """Draft for graph steps (graph_step.py) over a target cache of `max_len` slots: the
        proposer keeps its state where those steps read it and returns its drafting in their
        form; None: back to the general loop (returns None). The tensors a form's steps read
        are made once for a size: a captured step holds them."""
        if max_len is not None:
            raise ValueError(f"{type(self).__name__} does not draft in graph steps")
        return None

    def live_sizing(self):
        """The live rule where this request's trees are sized each step (a greedy request's
        only, `size_live`), else None."""
        return self.sizing if self.size_live else None

    def next_tree_tokens(self) -> int:
        """The drafted tokens of the next proposal, where it can say so cheaply (the batch's
        draft budget: the live rule's next size); else the most a proposal holds."""
        live = self.live_sizing()
        return live.next_size() if live is not None else self.max_tree_tokens

    def time_breakdown(self) -> dict[str, float]:
        """Seconds spent drafting since `reset_timings`, by phase (the benchmark's breakdown)."""
        return {}

    def reset_timings(self) -> None:
        pass

    def draft_parameters(self) -> int:
        """Parameters one draft step reads (0 without a model): VocabTrim's memory-bound speedup."""
        return 0


class DraftingFailed(RuntimeError):
    """A request's proposer raised, or drafted a tree that cannot be verified: that request
    ends with it, and the requests beside it step on."""


class GraphDrafting:
    """A proposer's drafting as graph steps run it (graph_step.py), returned by
    `Proposer.graph_form`: device work of fixed shapes, with no read-back inside a step."""

    cache = None                # the drafter's own DeviceKVCache, if it keeps one

    @property
    def rows(self) -> int:
        """The next step's tree rows, the root included (host: the tree's shape fixes them)."""
        raise NotImplementedError

    def propose(self, root: torch.Tensor) -> Tree:
        """The tree after `root` (a device tensor): `rows` rows, padding marked invalid."""
        raise NotImplementedError

    def observe(self, reads: torch.Tensor, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Inside the step: `reads` (m,), each accepted token's successor, and `rows` (m, width),
        the target's rows of the accepted nodes, of which the first `count` (0-dim) count."""

    def after(self, accepted: list[int], next_token: int, length: int) -> None:
        """After the step's read-back: what it accepted, and the committed `length`."""

    def buffers(self) -> list[torch.Tensor]:
        """Device tensors a step updates in place (restored after warm-up and capture)."""
        return []
