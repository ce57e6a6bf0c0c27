"""Medusa: K extra heads on the target's last hidden state, and the static sparse tree they draft.

Head k (1..K) is a residual SiLU block, f + SiLU(W_k f + b_k), on the target's feature f (its
last-layer hidden state after the final norm, the vector its LM head multiplies) at the last
accepted token, followed by an LM head: it predicts the token k + 1 places ahead, the target's
own head having predicted the next one (the tree's root). Here every head reads through the
target's LM head, frozen, as FR-Spec's Medusa experiments do, so a draft-vocabulary strategy
(full, fr:N, trim:N, spec:K from vocab/draft_vocab.py) is the heads' LM head, and the heads store only
their blocks. A block starts as zero (the head then repeats the target's next-token guess) and
is trained on the target's features (train.py, `--drafter medusa`).

Drafting costs the K blocks plus one LM-head pass over K rows, with no decoder layer: the
cheapest drafting step of any family here. The heads do not see the tokens drafted before
them, so each depth of the tree is drawn from one head's top-k: a node (i1, ..., id) carries
head d's i_d-th best token below the node (i1, ..., i(d-1)). The tree is Medusa's published
63-node choice (`MEDUSA_63`) or its first m nodes in an order measured here (autotune.py,
`choose_medusa_tree`): nodes by how often verification accepted them, which maximises the
expected accepted length of every prefix.

Where the tree is sized live (`sizing`, live_tree.py; eager greedy steps), each step drafts the
first `most` of those nodes, values each by its path's summed head log-probabilities, and keeps
the best m by value that pay for their rows at this machine's costs (none: a plain step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import BUNDLED_DRAFTERS, Family, default_vocab, head_files, register, vocab_names
from ..vocab.draft_vocab import FullVocab, VocabTimedDrafting, float_rows, int8_rows, make_draft_vocab
from ...runtime.linear import Linear
from ..proposer import Proposer, GraphDrafting
from ...runtime.kv_cache import ancestor_mask
from ..tree import Tree, chain

# Medusa's published tree for its 7B models (FasterDecoding/Medusa, medusa_choices.py,
# mc_sim_7b_63): each entry is a path of top-k indices, one per head, best first.
MEDUSA_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)
TOP_K = 10          # candidates per head the published tree indexes into


class MedusaMismatch(ValueError):
    """Medusa heads that do not fit their target model, or an unreadable checkpoint."""


def check_choices(choices, n_heads: int) -> tuple[tuple[int, ...], ...]:
    """`choices` as tuples, if they form a tree the heads can draft: every path's parent listed
    before it, no repeats, depth at most n_heads, indices below TOP_K."""
    seen: set[tuple[int, ...]] = {()}
    out = []
    for choice in choices:
        choice = tuple(int(i) for i in choice)
        if not choice or len(choice) > n_heads or any(not 0 <= i < TOP_K for i in choice):
            raise ValueError(f"Medusa tree node {list(choice)}: need 1 to {n_heads} indices in [0, {TOP_K})")
        if choice in seen or choice[:-1] not in seen:
            raise ValueError(f"Medusa tree node {list(choice)}: repeated, or listed before its parent")
        seen.add(choice)
        out.append(choice)
    if not out:
        raise ValueError("a Medusa tree needs at least one node")
    return tuple(out)


class MedusaHeads(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if n_heads < 1:
            raise MedusaMismatch(f"Medusa needs at least one head, not {n_heads}")
        self.blocks = nn.ModuleList(Linear(dim, dim, bias=True) for _ in range(n_heads))

    @property
    def n_heads(self) -> int:
        return len(self.blocks)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(rows, dim) target features -> (heads, rows, dim) states for the LM head."""
        features = features.to(self.blocks[0].weight.dtype)
        if self.training or torch.is_grad_enabled():
            return torch.stack([features + F.silu(block(features)) for block in self.blocks])
        # Drafting: the K blocks as one matmul (K small ones cost K calls' overhead each).
        weight, bias = self._fused()
        out = F.silu(torch.addmm(bias, features, weight.T))          # (rows, heads * dim)
        return features[None] + out.view(features.shape[0], self.n_heads, -1).transpose(0, 1)

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple((b.weight.data_ptr(), b.weight._version) for b in self.blocks)
        if getattr(self, "_fused_key", None) != key:
            self._fused_weights = (torch.cat([b.weight for b in self.blocks]).contiguous(),
                                   torch.cat([b.bias for b in self.blocks]).contiguous())
            self._fused_key = key
        return self._fused_weights

    @classmethod
    def zeros(cls, dim: int, n_heads: int) -> "MedusaHeads":
        """Untrained heads: each repeats the target's next-token guess (Medusa's start)."""
        heads = cls(dim, n_heads)
        with torch.no_grad():
            for p in heads.parameters():
                p.zero_()
        return heads

    @classmethod
    def random(cls, dim: int, n_heads: int, seed: int = 0, scale: float = 1.0) -> "MedusaHeads":
        """Random blocks (tests): heads that disagree with the target and with each other."""
        generator = torch.Generator().manual_seed(seed)
        heads = cls(dim, n_heads)
        with torch.no_grad():
            for block in heads.blocks:
                block.weight.copy_(torch.randn(dim, dim, generator=generator) * scale * dim ** -0.5)
                block.bias.copy_(torch.randn(dim, generator=generator) * scale)
        return heads.eval().requires_grad_(False)

    # ------------------------------------------------------------ checkpoints

    def save(self, directory: str | Path, target_args, extra: dict | None = None) -> None:
        """config.json and model.safetensors; weights as 8-bit codes with a float scale per row
        (the heads only choose what is drafted, and the shipped files stay small)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"medusa_num_heads": self.n_heads, "hidden_size": target_args.dim,
                  "vocab_size": target_args.vocab_size,
                  "vocabspec": {"arch": target_args.arch, "feature": "post_norm", **(extra or {})}}
        tensors = {}
        for k, block in enumerate(self.blocks):
            tensors[f"blocks.{k}.weight"], tensors[f"blocks.{k}.scale"] = int8_rows(block.weight)
            tensors[f"blocks.{k}.bias"] = block.bias.detach().float().contiguous()
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(directory / "model.safetensors"))

    @classmethod
    def load(cls, directory: str | Path, target_args) -> "MedusaHeads":
        from .eagle import read_checkpoint

        directory = Path(directory)
        config, tensors = read_checkpoint(directory, "Medusa heads", MedusaMismatch, target_args)
        arch = config.get("vocabspec", {}).get("arch")
        if arch != target_args.arch:
            raise MedusaMismatch(f"Medusa heads {directory} are for a {arch} target, not {target_args.arch}")
        n_heads = config.get("medusa_num_heads")
        if not isinstance(n_heads, int) or n_heads < 1:
            raise MedusaMismatch(f"Medusa heads {directory}: medusa_num_heads={n_heads!r}")
        heads = cls(target_args.dim, n_heads)
        state = {}
        try:
            for k in range(n_heads):
                state[f"blocks.{k}.weight"] = float_rows(tensors[f"blocks.{k}.weight"],
                                                         tensors[f"blocks.{k}.scale"])
                state[f"blocks.{k}.bias"] = tensors[f"blocks.{k}.bias"].float()
            heads.load_state_dict(state, strict=True)
        except (KeyError, RuntimeError) as exc:
            raise MedusaMismatch(f"Medusa heads {directory}: tensors missing or misshapen ({exc})") from exc
        return heads.eval().requires_grad_(False)


class TreeLayout:
    """A choice list's tree, flattened once: nodes by depth (siblings in their parents' order,
    best index first), which head and which of its candidates each node takes, and its rank
    in the choice list (the tree of the first m choices is the nodes ranked below m)."""

    def __init__(self, choices, device: torch.device):
        order = sorted(range(len(choices)), key=lambda i: (len(choices[i]), choices[i]))
        flat = {(): 0}
        parents, depths, heads, picks, ranks = [-1], [0], [], [], [-1]
        for i in order:
            choice = choices[i]
            flat[choice] = len(parents)
            parents.append(flat[choice[:-1]])
            depths.append(len(choice))
            heads.append(len(choice) - 1)
            picks.append(choice[-1])
            ranks.append(i)
        self.max_depth = max(depths)
        self.parents = torch.tensor(parents, dtype=torch.long, device=device)
        self.depths = torch.tensor(depths, dtype=torch.long, device=device)
        self.heads = torch.tensor(heads, dtype=torch.long, device=device)
        self.picks = torch.tensor(picks, dtype=torch.long, device=device)
        self.ranks = torch.tensor(ranks, dtype=torch.long, device=device)
        self.mask = ancestor_mask(self.parents, self.max_depth)

    def tree(self, root: torch.Tensor, ids: torch.Tensor) -> Tree:
        """The tree for a root (0-dim) and each head's candidates `ids`, as device work."""
        tokens = torch.cat([root.view(1), ids[self.heads, self.picks]])
        return Tree(tokens, self.parents, self.depths, self.max_depth, mask=self.mask, ranks=self.ranks)

    def valued_tree(self, root: int, ids: torch.Tensor, log_probs: torch.Tensor) -> Tree:
        """The tree with each node's value, its path's summed log-probabilities (host work), and
        its rank by value (ties: shallower, then earlier): a node's value is at most its
        parent's, so the best m by value are a tree, as EAGLE-2's."""
        picked = log_probs[self.heads, self.picks].double().cpu().tolist()
        parents = self.parents.tolist()
        values = [0.0] * len(parents)
        for node in range(1, len(parents)):
            values[node] = values[parents[node]] + picked[node - 1]
        depths = self.depths.tolist()
        order = sorted(range(1, len(parents)), key=lambda n: (-values[n], depths[n], n))
        ranks = [-1] * len(parents)
        for rank, node in enumerate(order):
            ranks[node] = rank
        tokens = torch.cat([torch.tensor([root], device=ids.device), ids[self.heads, self.picks]])
        return Tree(tokens, self.parents, self.depths, self.max_depth, mask=self.mask,
                    ranks=torch.tensor(ranks, dtype=torch.long, device=self.parents.device),
                    values=torch.tensor(values, dtype=torch.float64))


class MedusaProposer(VocabTimedDrafting, Proposer):
    """Drafts Medusa's graph tree from the target's feature at the last accepted token.
    Timings: the heads' blocks, the LM head's phases, the tree (the rest)."""

    taps: tuple[int, ...] = ()
    phases = ("blocks",)

    def __init__(self, target, heads: MedusaHeads, draft_vocab=None, choices=MEDUSA_63,
                 total_tokens: int | None = None):
        choices = check_choices(choices, heads.n_heads)
        total = len(choices) if total_tokens is None else total_tokens
        if not 1 <= total <= len(choices):
            raise ValueError(f"a Medusa tree of {total} nodes from {len(choices)} choices")
        self.target = target
        self.heads = heads
        self.draft_vocab = draft_vocab or FullVocab(target.head_weight)
        self.choices = choices
        self.total_tokens = total
        self.max_tree_tokens = len(choices)
        self.feature = None
        self._graphed = False              # drafting for graph steps (graph_step.py)
        self._graph_form = None
        self._feature_buffer = None
        self._layouts: dict[int, TreeLayout] = {}
        self.device = target.device
        self.reset_timings()

    @property
    def depth(self) -> int:
        return max(len(c) for c in self.choices[:self.total_tokens])

    @property
    def tree_shape(self) -> tuple[int, int]:
        """(depth, nodes) of its largest tree: sized live, the first `most` choices'."""
        if self.sizing is not None:
            most = min(self.sizing.most, len(self.choices))
            return max(len(c) for c in self.choices[:most]), most
        return self.depth, self.total_tokens

    def layout(self, size: int | None = None) -> TreeLayout:
        """The tree of the first `size` choices (default: total_tokens)."""
        size = self.total_tokens if size is None else size
        if size not in self._layouts:
            self._layouts[size] = TreeLayout(self.choices[:size], self.target.device)
        return self._layouts[size]

    def live_sizing(self):
        """As every proposer's, but never for graph steps (their tree is the fixed layout)."""
        return None if self._graphed else super().live_sizing()

    draft_forwards = 1      # drafting passes per step: the heads run once

    def level_seconds(self, repeats: int = 5) -> float:
        """Seconds of drafting's one pass (the heads and their LM head), the median of a few
        on a zero feature: the live rule's prior for a drafting level (its cost is the same
        for any feature)."""
        feature, self.feature = self.feature, torch.zeros(1, self.target.args.dim, dtype=self.target.dtype,
                                                           device=self.target.device)
        times = []
        try:
            for _ in range(repeats):
                start = time.perf_counter()
                self._candidates([0] * self.heads.n_heads)
                times.append(time.perf_counter() - start)
        finally:
            self.feature = feature
            self.reset_timings()
        return sorted(times)[len(times) // 2]

    def draft_parameters(self) -> int:
        blocks = sum(p.numel() for p in self.heads.parameters())
        return blocks + self.heads.n_heads * self.draft_vocab.size * self.target.args.dim

    def reset(self, prompt_ids, prompt_hidden, first_token) -> None:
        if self.live_sizing() is not None:
            self.sizing.start()
        self.draft_vocab.see_tokens(list(prompt_ids) + [first_token], reset=True)
        self.feature = prompt_hidden[-1:]
        if self._graphed:            # a captured step reads this very tensor
            if self._feature_buffer is None:
                self._feature_buffer = torch.empty_like(self.feature)
            self.feature = self._feature_buffer.copy_(self.feature)

    def observe(self, accepted, hidden, next_token) -> None:
        if self.live_sizing() is not None:
            self.sizing.observe(accepted)
        self.draft_vocab.see_tokens(list(accepted) + [next_token])
        self.feature = hidden[-1:]

    def _candidates(self, root_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """(heads, TOP_K) token ids, each head's best candidates, best first, and their
        log-probabilities."""
        start = time.perf_counter()
        states = self.heads(self.target.norm(self.feature.float()))[:, 0]      # (heads, dim)
        if self.draft_vocab.sync:
            torch.cuda.synchronize()
        self.timings["blocks"] += time.perf_counter() - start
        # Row k is head k + 1's: SpecVocab shares one candidate set per level (its `level`).
        return self.draft_vocab.top_k(states, TOP_K, root_tokens, 0)

    def propose(self, root_token: int) -> Tree:
        start = time.perf_counter()
        device = self.target.device
        sizing = self.live_sizing()
        if sizing is not None and not sizing.plan()[0]:       # the rule drafts nothing this step
            self.timings["total"] += time.perf_counter() - start
            return chain(root_token, [], device=device)
        ids, log_probs = self._candidates([root_token] * self.heads.n_heads)
        if sizing is None:
            tree = self.layout().tree(torch.tensor(root_token, device=device), ids.to(device))
        else:       # every node costs the one pass: the rule keeps the best that pay for their rows
            drafted = self.layout(min(sizing.most, len(self.choices))).valued_tree(root_token, ids.to(device),
                                                                                   log_probs)
            tree = sizing.choose(drafted, 1, time.perf_counter() - start, started=start)
        self.timings["total"] += time.perf_counter() - start
        return tree

    @property
    def graphs(self) -> bool:
        """Whether its graph form drafts without reading the device back (SpecVocab's
        candidate sets need drafted tokens on the host)."""
        return not hasattr(self.draft_vocab, "candidate_ids")

    def graph_form(self, max_len: int | None) -> "MedusaGraphDrafting | None":
        self._graphed = max_len is not None
        if not self._graphed:
            return None
        self.layout()            # built before the first step, which must be like every other
        self.heads._fused()
        if self._graph_form is None:
            self._graph_form = MedusaGraphDrafting(self)
        return self._graph_form


class MedusaGraphDrafting(GraphDrafting):
    """Medusa in graph steps (graph_step.py): the heads read the feature buffer the step
    updates, and the tree is the layout's, as device work."""

    def __init__(self, proposer: MedusaProposer):
        self.proposer = proposer

    @property
    def rows(self) -> int:
        return self.proposer.total_tokens + 1

    def propose(self, root: torch.Tensor) -> Tree:
        p = self.proposer
        start = time.perf_counter()
        tree = p.layout().tree(root, p._candidates(None)[0])
        p.timings["total"] += time.perf_counter() - start
        return tree

    def buffers(self) -> list[torch.Tensor]:
        return [self.proposer.feature]

    def observe(self, reads, rows, count) -> None:
        self.proposer.feature.copy_(rows.index_select(0, (count - 1).view(1)))

    def after(self, accepted, next_token, length) -> None:
        self.proposer.draft_vocab.see_tokens(list(accepted) + [next_token])


def bundled_medusa_dir(model_name: str) -> Path | None:
    path = BUNDLED_DRAFTERS / model_name / "medusa"
    return path if (path / "config.json").exists() else None


def medusa_parts(model, config, model_name: str, log=None):
    """(heads, draft vocabulary, path): the bundled Medusa heads or config.path's, on the target's
    device, with the draft vocabulary config.vocab."""
    path = config.path or bundled_medusa_dir(model_name)
    if path is None:
        raise ValueError(f"no Medusa heads are bundled for {model_name!r}: pass --draft-path DIR "
                         "(made by `vocabspec train --drafter medusa`)")
    heads = MedusaHeads.random(model.args.dim, 4) if path == "random" else \
        MedusaHeads.load(path, model.args)
    # The blocks are a few small matmuls: in the target's dtype (float32 on the native engine).
    heads = heads.to(device=model.device, dtype=model.dtype)
    if config.vocab != "auto":
        vocab = config.vocab
    else:       # the head the shipped heads' config names as fastest, else full
        vocab = "full" if path == "random" else default_vocab(Path(path))
        if log:
            log(f"draft vocabulary: {vocab} (the Medusa heads' default; --draft-vocab to choose)")
    draft_vocab = make_draft_vocab(vocab, model.head_weight, head_files(config, model_name), config.token_map,
                            config.ranker, packed_head=model.packed_head)
    return heads, draft_vocab, path


def _build(model, config, model_name: str, tokenizer=None, log=None):
    heads, draft_vocab, _ = medusa_parts(model, config, model_name, log)
    return MedusaProposer(model, heads, draft_vocab, total_tokens=min(config.total_tokens, len(MEDUSA_63)))


register(Family("medusa", "Medusa's heads and tree",
                frozenset({"path", "vocab", "token_map", "ranker", "total_tokens"}), _build,
                vocab_names("medusa"), "medusa, medusa+VOCAB", draft_vocab=True,
                trainer="vocabspec.training.medusa_train:train_and_save"))
