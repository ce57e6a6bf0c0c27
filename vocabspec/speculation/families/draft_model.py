"""An independent draft model: any smaller model with the target's tokenizer drafts a chain or a tree.

The draft model runs as a model of its own (any weight format, its own KV cache) and is what
llama.cpp's `-md`, transformers' `assistant_model` and vLLM's `draft_model` use. The natural
draft here is the target's own low-bit copy: the same GGUF run with 8-bit activations
(`gguf-a8`) drafting for its float32 or bfloat16 self, a fraction of the bytes per step with
nearly the same answers.

The tree grows as EAGLE-2's does (tree.TreeBuilder: top-k children per node, the best
`total_tokens` nodes kept); with top_k = 1 it is a chain. The draft's LM head is a draft-vocabulary
strategy over its own head (vocab/draft_vocab.py): `trim:N` keeps the N tokens the target generates
most (VocabTrim), `fr:N` the N most frequent in a corpus (FR-Spec).

The draft cache holds the committed text up to the last step's root; drafted nodes are pending
slots. After verification the accepted nodes the draft already ran keep their slots (their keys
are those of the accepted text: each node attended to its ancestors only), and the rest of the
accepted text runs with the next root in one forward.
"""

from __future__ import annotations

import time

import torch

from ..config import Family, head_files, register
from ..vocab.draft_vocab import FullVocab, VocabTimedDrafting, make_draft_vocab
from ..proposer import PREFILL_CHUNK, Proposer
from ..tree import Tree, TreeBuilder, chain


class DraftModelMismatch(ValueError):
    """A draft model that cannot draft for its target (another tokenizer or vocabulary)."""


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_args, draft_args, name: str) -> None:
    """Refuse a draft model whose token ids mean other text than the target's."""
    if target_args.vocab_size != draft_args.vocab_size:
        raise DraftModelMismatch(f"draft model {name} has a vocabulary of {draft_args.vocab_size} "
                                 f"tokens, the target {target_args.vocab_size}: a draft model must "
                                 "share the target's tokenizer")
    if target_tokenizer is None or draft_tokenizer is None:
        return
    if target_tokenizer.backend.get_vocab() != draft_tokenizer.backend.get_vocab():
        raise DraftModelMismatch(f"draft model {name} has another tokenizer than the target (the "
                                 "same ids stand for other text): a draft model must share the "
                                 "target's tokenizer")


def load_draft_model(spec: str, target, target_tokenizer=None, weights: str = "auto", room: int = 256):
    """The draft model `spec` (bundled name, GGUF file or HF directory) in `weights` (formats.py;
    auto: the fastest exact format here), positioned as far as the target plus `room` for trees."""
    from ...runtime.loading import load_model
    from ...runtime.tokenizer import load_tokenizer

    draft, path = load_model(spec, weights=weights, device=target.device,
                             max_seq_len=target.args.max_seq_len + room)
    tokenizer = load_tokenizer(path) if target_tokenizer is not None else None
    check_same_tokenizer(target_tokenizer, tokenizer, target.args, draft.args, spec)
    return draft


class DraftModelProposer(VocabTimedDrafting, Proposer):
    """Grows a draft tree (a chain with top_k = 1) with an independent draft model. Timings: the
    draft's forwards ("model"), its head's phases, the tree (the rest).

    With `sizing` (live_tree.LiveSizing) each step's tree is sized live, as EAGLE's: drafted only
    where drafting pays (and at its probes), a level grown only while its frontier's calibrated
    chances pay for it (the draft's forward a level), and cut to the nodes that pay; `depth` and
    `total_tokens` are then the largest tree a step drafts. A step that drafts nothing leaves
    the draft's catch-up (the text it has not run) to the next that does."""

    taps: tuple[int, ...] = ()
    phases = ("model",)

    def __init__(self, draft, draft_vocab=None, depth: int = 6, top_k: int = 1,
                 total_tokens: int = 6):
        if depth < 1 or top_k < 1 or total_tokens < 1:
            raise ValueError(f"need depth >= 1, top_k >= 1, total_tokens >= 1; got "
                             f"{depth}, {top_k}, {total_tokens}")
        self.draft = draft
        self.draft_vocab = draft_vocab if draft_vocab is not None else FullVocab(draft.scoring_head)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_tree_tokens = total_tokens
        self.cache = draft.new_cache()
        self.todo: list[int] = []          # committed text the draft has not run yet
        self.slot_of: dict[int, int] = {}  # tree node -> its pending slot (nodes the draft ran)
        self.tree: Tree | None = None
        self.root_state = None            # the draft's state at this step's root, once run
        self.device = draft.device
        self.reset_timings()

    @property
    def tree_shape(self) -> tuple[int, int]:
        return self.depth, self.total_tokens

    @property
    def draft_forwards(self) -> int:
        """Drafting passes per step: one per tree level."""
        return self.depth

    def draft_parameters(self) -> int:
        """The draft's layers and the rows of its head (its embedding is a lookup)."""
        return _layer_parameters(self.draft.args) + self.draft_vocab.size * self.draft.args.dim

    def reset(self, prompt_ids, prompt_hidden, first_token) -> None:
        if self.sizing is not None:
            self.sizing.start()
        self.cache.reset()
        self.draft_vocab.see_tokens(list(prompt_ids) + [first_token], reset=True)
        # Not timed: the draft's pass over the prompt belongs with the prefill (as EAGLE's).
        device = self.draft.device
        with torch.inference_mode():
            for start in range(0, len(prompt_ids), PREFILL_CHUNK):
                chunk = prompt_ids[start:start + PREFILL_CHUNK]
                self.draft.tree_forward(torch.tensor(chunk, dtype=torch.long, device=device),
                                        torch.arange(start, start + len(chunk), device=device), self.cache)
                self.cache.commit()
        self.todo = []
        self.slot_of = {}
        self.tree = None
        self.root_state = None

    def reads_rows(self) -> bool:
        return False           # the draft model reads the tokens, not the target's states

    def observe(self, accepted, hidden, next_token) -> None:
        start = time.perf_counter()
        if self.live_sizing() is not None:
            self.sizing.observe(accepted)
        self.draft_vocab.see_tokens(list(accepted) + [next_token])
        if self.root_state is None:       # no proposal this step (near the window's end)
            self.todo += list(accepted)
            self.timings["total"] += time.perf_counter() - start
            return
        # The accepted nodes the draft ran keep their slots (a prefix of the path: a node runs
        # only after its parent did); the root's slot was committed when it ran.
        keep, path = [], self.tree.path_to(self._accepted_node(accepted)) if self.tree else [0]
        for node in path[1:]:
            if node not in self.slot_of:
                break
            keep.append(self.slot_of[node])
        self.cache.commit(torch.tensor(keep, dtype=torch.long, device=self.draft.device))
        self.todo = list(accepted[1 + len(keep):])
        self.tree = None
        self.root_state = None
        self.timings["total"] += time.perf_counter() - start

    def _accepted_node(self, accepted: list[int]) -> int:
        """The tree node the accepted tokens (root first) end at."""
        tokens = self.tree.tokens.tolist()
        node = 0
        for token in accepted[1:]:
            node = next(c for c in self.tree.children[node] if tokens[c] == token)
        return node

    def _forward(self, tokens: list[int], positions: torch.Tensor, mask=None) -> torch.Tensor:
        """The draft's normalised last-layer states for `tokens` (pending until committed)."""
        start = time.perf_counter()
        ids = torch.tensor(tokens, dtype=torch.long, device=self.draft.device)
        hidden, _ = self.draft.tree_forward(ids, positions, self.cache, mask)
        states = self.draft.norm(hidden)
        if self.draft_vocab.sync:
            torch.cuda.synchronize()
        self.timings["model"] += time.perf_counter() - start
        return states

    def propose(self, root_token: int) -> Tree:
        start = time.perf_counter()
        sizing = self.live_sizing()
        depth, total = (self.depth, self.total_tokens) if sizing is None else sizing.plan()
        if not depth:                     # the root alone: the draft catches up when it next drafts
            self.timings["total"] += time.perf_counter() - start
            return chain(root_token, [], device=self.draft.device)
        self.cache.discard()              # a proposal asked for again (autotune) starts over
        caught_up = self._catch_up(root_token)
        grown = time.perf_counter()
        tree = self._grow(root_token, depth, total, sizing.stop if sizing is not None else None)
        if sizing is not None:
            drafted = tree
            tree = sizing.choose(tree, sizing.stop.levels, time.perf_counter() - grown, grown - start, caught_up, start)
            if tree is not drafted:       # nodes cut: the kept ones renumbered, in order
                ranks = drafted.ranks.tolist()
                row_of = {row: i for i, row in enumerate(
                    [0] + [row for row in range(1, len(ranks)) if ranks[row] < tree.size])}
                self.slot_of = {row_of[node]: slot for node, slot in self.slot_of.items() if node in row_of}
        self.tree = tree
        self.timings["total"] += time.perf_counter() - start
        return tree

    def _catch_up(self, root_token: int) -> int:
        """The committed text the draft has not run, and the root (all of it the target's
        output), through the draft: its state at the root. The tokens it ran."""
        if self.root_state is not None:
            return 0
        run = self.todo + [root_token]
        base = self.cache.length
        self.root_state = self._forward(run, torch.arange(base, base + len(run), device=self.draft.device))[-1:]
        self.cache.commit()
        self.todo = []
        return len(run)

    def _grow(self, root_token: int, depth: int, total: int, stop) -> Tree:
        """The tree from the root's state: `depth` levels at most (fewer where `stop` says),
        the best `total` nodes kept; `slot_of` set to the pending slot of each node the draft ran."""
        device = self.draft.device
        base = self.cache.length          # the root sits at base - 1; depth d at base - 1 + d
        builder = TreeBuilder(root_token, self.top_k, total)
        tokens, log_probs = self.draft_vocab.top_k(self.root_state, self.top_k, [root_token], 0)
        builder.add_children([0], tokens, log_probs)

        def expand(level, frontier, mask):
            read = [builder.token[n] for n in frontier]
            positions = torch.tensor([base - 1 + builder.depth[n] for n in frontier], device=device)
            return self.draft_vocab.top_k(self._forward(read, positions, mask), self.top_k, read, level)

        slot_of = builder.grow(depth - 1, expand, lambda: self.cache.pending, device, stop)
        tree = builder.build(device)
        # Keyed by the tree's node indices (the builder numbers nodes otherwise), kept nodes only.
        self.slot_of = {builder.flat_index[n]: slot for n, slot in slot_of.items() if n in builder.flat_index}
        return tree


def _layer_parameters(a) -> int:
    attn = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * a.dim
    return a.n_layers * (attn + 3 * a.dim * a.intermediate_size)


def draft_model_parts(model, config, model_name: str, tokenizer=None, log=None):
    """(draft model, draft vocabulary): the independent draft model config.draft_model names, in
    config.draft_weights, with the draft vocabulary config.vocab over its own LM head."""
    draft = load_draft_model(config.draft_model, model, tokenizer, weights=config.draft_weights)
    if log:
        log(f"draft model: {config.draft_model} ({draft.weights}) drafting for the target ({model.weights})")
    vocab = "full" if config.vocab == "auto" else config.vocab
    # Token maps are the target's (the draft shares its tokenizer): VocabTrim's counts the
    # target's own generated text.
    draft_vocab = make_draft_vocab(vocab, draft.head_weight, head_files(config, model_name), config.token_map,
                            None, packed_head=draft.packed_head)
    return draft, draft_vocab


def _build(model, config, model_name: str, tokenizer=None, log=None):
    draft, draft_vocab = draft_model_parts(model, config, model_name, tokenizer, log)
    return DraftModelProposer(draft, draft_vocab, depth=max(1, config.depth), top_k=config.top_k,
                              total_tokens=config.total_tokens)


def _names(base: str) -> dict | None:
    head, plus, vocab = base.partition("+")
    if not head.startswith("model:") or head == "model:":
        return None
    return {"draft_model": head[len("model:"):], "vocab": vocab if plus else "full"}


def _check(config) -> None:
    if config.vocab.startswith("spec"):
        raise ValueError("SpecVocab's ranker is trained for the EAGLE drafter's states: a draft "
                         "model's head takes full, fr:N or trim:N")


register(Family("model", "an independent draft model sharing the target's tokenizer: a bundled name, "
                "a .gguf file or a model directory",
                frozenset({"vocab", "token_map", "depth", "top_k", "total_tokens", "draft_model", "draft_weights"}),
                _build, _names, "model:NAME, model:NAME+VOCAB", argument="draft_model", draft_vocab=True, check=_check))
