"""Draft vocabularies: which tokens the drafter's LM head scores, and at what cost.

A strategy turns normalised drafter states (rows, dim) into each row's top-k draft tokens
(target vocabulary ids) with their log-probabilities. Verification never looks here: it always
scores the full target vocabulary, so every strategy is lossless.

- FullVocab: the target's whole LM head (EAGLE-2).
- StaticSubset: the head's rows for a fixed ranked token list (FR-Spec from corpus
  frequencies, VocabTrim from target-generated text); the softmax runs over the subset.
- SpecVocab: a low-rank ranker (W_vocab @ W_down, d' ~ d/16) scores every token cheaply;
  the rows of one tree level share one candidate set (the ranker's best tokens for the
  rows' mean low-rank state, plus the tokens already in the text and the usual successors of
  each row's token), and the exact head runs over those candidates only, in one matmul. By
  default the root's candidate set serves the whole tree (see `SpecVocab.shared_levels`).

Every strategy computes in the dtype of the states it is given (the drafter's, which may be
narrower than the target's: a bfloat16 copy of the rows it scores then halves the bytes read).

Each strategy adds its time to `timings` ("head": the matmuls, "topk": softmax and top-k,
"rank": the ranker) so the benchmark can break drafting time down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...runtime.linear import linear


class _Timed:
    """Accumulates wall time per phase; syncs an accelerator so the split is honest."""

    def __init__(self):
        self.timings: dict[str, float] = {}
        self.sync = False

    def _tick(self, name: str, since: float) -> float:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + (now - since)
        return now

    def _top(self, logits: torch.Tensor, k: int, since: float):
        k = min(k, logits.shape[-1])
        top = torch.topk(logits, k, dim=-1)
        log_probs = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
        self._tick("topk", since)
        return top.indices, log_probs

    def _head_top(self, states: torch.Tensor, k: int):
        """Each row's top k rows of the head `self.weight` and their log-probabilities."""
        start = time.perf_counter()
        if not isinstance(self.weight, torch.Tensor):      # native: one fused call
            indices, log_probs = self.weight.topk(states, k)
            self._tick("head", start)
            return indices, log_probs
        return self._top(head_logits(states, self.weight), k, self._tick("head", start))

    def see_tokens(self, tokens: list[int], reset: bool = False) -> None:
        """The text's tokens as they become known: the prompt (reset=True), then each step's
        committed tokens. Only a strategy that uses them (SpecVocab) keeps them."""


class VocabTimedDrafting:
    """Timing for a proposer that drafts through a draft vocabulary (`self.draft_vocab`): its own
    `phases` in `self.timings` beside "total", the head's, and the tree bookkeeping as what
    remains of the total. `self.device`: where it drafts (timings wait for an accelerator only
    when a breakdown is asked for, `timing_sync`)."""

    phases: tuple[str, ...] = ()

    def time_breakdown(self) -> dict[str, float]:
        """Seconds spent drafting since `reset_timings`, by phase (FR-Spec's Figure 6 split)."""
        parts = {k: v for k, v in self.timings.items() if k != "total"}
        parts.update(self.draft_vocab.timings)
        parts["tree"] = max(0.0, self.timings["total"] - sum(parts.values()))
        return parts

    def reset_timings(self) -> None:
        self.timings = {name: 0.0 for name in self.phases + ("total",)}
        self.draft_vocab.timings = {}

    @property
    def timing_sync(self) -> bool:
        """Whether timings wait for the accelerator at each phase (only a breakdown needs it:
        otherwise drafting queues its work and never waits)."""
        return self.draft_vocab.sync

    @timing_sync.setter
    def timing_sync(self, on: bool) -> None:
        self.draft_vocab.sync = bool(on) and self.device.type == "cuda"


def head_logits(states: torch.Tensor, weight) -> torch.Tensor:
    """states (rows, dim) against a head: a float tensor, or a formats.PackedWeight (the target's
    own head on the native engine), float32."""
    if isinstance(weight, torch.Tensor):
        return linear(states.to(weight.dtype), weight).float()
    return weight.matmul(states)


class FullVocab(_Timed):
    name = "full"

    def __init__(self, head_weight):
        super().__init__()
        self.weight = head_weight
        self.size = head_weight.shape[0]

    def top_k(self, states: torch.Tensor, k: int, tokens: list[int] | None = None,
              level: int | None = None):
        """Each row's top k tokens and log-probabilities; `tokens`: the token each row of
        states has just read, `level`: the rows' tree level, 0 for the root (only SpecVocab
        uses them)."""
        return self._head_top(states, k)


class StaticSubset(_Timed):
    """Draft over a fixed token list: the head's rows for those tokens, ids mapped back."""

    def __init__(self, head_weight, token_ids, name: str = "subset", dtype: torch.dtype | None = None):
        super().__init__()
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        vocab = head_weight.shape[0]
        if token_ids.dim() != 1 or token_ids.numel() == 0:
            raise ValueError("a draft vocabulary needs a non-empty list of token ids")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
            raise ValueError(f"draft vocabulary holds ids outside the target vocabulary [0, {vocab})")
        if torch.unique(token_ids).numel() != token_ids.numel():
            raise ValueError("draft vocabulary lists a token twice")
        self.name = name
        self.size = token_ids.numel()
        if isinstance(head_weight, torch.Tensor):
            self.draft_to_target = token_ids.to(head_weight.device)
            self.weight = head_weight[self.draft_to_target].to(dtype or head_weight.dtype).contiguous()
        else:
            self.draft_to_target = token_ids
            self.weight = head_weight.take_rows(token_ids)

    @classmethod
    def of_rows(cls, rows, token_ids: torch.Tensor, name: str) -> "StaticSubset":
        """A head that is already the subset's rows (an EAGLE-3 drafter's own LM head):
        row i scores target token token_ids[i]."""
        head = cls.__new__(cls)
        _Timed.__init__(head)
        head.name, head.size = name, rows.shape[0]
        head.weight = rows          # a tensor, or a PackedWeight (native drafting)
        head.draft_to_target = token_ids.to(rows.device) if isinstance(rows, torch.Tensor) else token_ids.cpu()
        return head

    def top_k(self, states: torch.Tensor, k: int, tokens: list[int] | None = None,
              level: int | None = None):
        indices, log_probs = self._head_top(states, k)
        return self.draft_to_target[indices], log_probs


class SpecVocab(_Timed):
    """Per-step vocabulary speculation: a low-rank ranker picks candidates, the exact head
    scores only those.

    context_tokens: how many of the `candidates` are reserved for tokens already in the text
    (the most recently seen distinct ones; None: half the candidates; 0: the ranker alone, as
    in the paper). A d' ~ d/16 ranker cannot copy: on Spec-Bench its misses are mostly words
    of the prompt (" Mars", " GDP", " entangled"), which is where text reuse puts the target's
    next token.

    successors: (offsets, ids), each token's most frequent next tokens in a corpus
    (`token_map.successor_lists`); the first `successor_count` of them for the token each row
    has just read join the candidates. Nor can the ranker spell out the rest of a word ("Waik"
    -> "iki") or a fixed pair ("San" -> " Francisco"): most of its remaining misses.

    shared_levels: how many tree levels below the root draft from the root's candidate set
    (plus the successors of each level's tokens) instead of ranking their own rows; None: all
    of them, one ranking and one gather of head rows per tree; 0: a ranking at every level,
    as in the paper. Side by side on Spec-Bench (SmolLM2, commit 002ce78) sharing kept tau at
    3/5 (2.06) and at 6/60 (2.89) and cut the ranking's time by 56% (3/5) and 72% (6/60).
    """

    name = "spec"

    def __init__(self, head_weight: torch.Tensor, down: torch.Tensor, vocab: torch.Tensor,
                 candidates: int = 2048, context_tokens: int | None = None,
                 successors: tuple[torch.Tensor, torch.Tensor] | None = None, successor_count: int = 0,
                 shared_levels: int | None = None):
        super().__init__()
        if down.dim() != 2 or vocab.dim() != 2 or down.shape[1] != head_weight.shape[1] \
                or vocab.shape != (head_weight.shape[0], down.shape[0]):
            raise ValueError(f"ranker shapes {tuple(down.shape)} / {tuple(vocab.shape)} do not fit "
                             f"a head of {tuple(head_weight.shape)}")
        if candidates < 1:
            raise ValueError("SpecVocab needs at least one candidate")
        self.weight = head_weight
        # The ranker only orders tokens (the exact head scores the candidates), so bfloat16
        # weights do: half the memory to stream, 5.4 -> 3.8 ms a ranking for Gemma's 262k rows.
        self.down = down.to(device=head_weight.device, dtype=torch.bfloat16)
        # Stored (d', |V|): a row of states against it is one long contiguous product, faster
        # than the packed (|V|, d') matmul for the single root row on this CPU.
        self.vocab_t = vocab.to(device=head_weight.device, dtype=torch.bfloat16).t().contiguous()
        self.candidates = min(candidates, head_weight.shape[0])
        self.size = self.candidates
        if context_tokens is None:
            context_tokens = self.candidates // 2
        if not 0 <= context_tokens <= self.candidates:
            raise ValueError(f"SpecVocab context tokens ({context_tokens}) must not be negative or "
                             f"exceed the {self.candidates} candidates")
        self.context_tokens = context_tokens
        if successor_count < 0 or (successor_count and successors is None):
            raise ValueError(f"SpecVocab successors per row ({successor_count}) need a successor "
                             "table and must not be negative")
        self.successor_count = successor_count
        if successor_count:
            offsets, ids = successors
            # Python ints: a level looks up at most a few rows, so list slicing beats tensor ops.
            self._successor_offsets = offsets.tolist()
            self._successor_ids = ids.to(device=head_weight.device, dtype=torch.long)
        if shared_levels is not None and shared_levels < 0:
            raise ValueError(f"SpecVocab shared levels must not be negative, got {shared_levels}")
        self.shared_levels = shared_levels
        self._seen: dict[int, None] = {}          # distinct tokens, least recently seen first
        self._context: torch.Tensor | None = None
        # The root's candidates for the tree being drafted: ids and their head rows.
        self._tree: tuple[torch.Tensor, torch.Tensor] | None = None

    def see_tokens(self, tokens: list[int], reset: bool = False) -> None:
        if reset:
            self._seen = {}
        if not self.context_tokens:
            return
        for token in tokens:
            self._seen.pop(token, None)
            self._seen[token] = None
        if len(self._seen) > 2 * self.context_tokens:     # bound the memory of long texts
            self._seen = dict.fromkeys(list(self._seen)[-self.context_tokens:])
        self._context = None

    def context_ids(self) -> torch.Tensor:
        """The tokens always among the candidates: the text's most recent distinct ones."""
        if self._context is None:
            recent = list(self._seen)[-self.context_tokens:] if self.context_tokens else []
            self._context = torch.tensor(recent, dtype=torch.long, device=self.weight.device)
        return self._context

    def successor_ids(self, tokens: list[int]) -> torch.Tensor:
        """The usual next tokens of each of `tokens` (at most successor_count each)."""
        offsets, count = self._successor_offsets, self.successor_count
        spans = [(offsets[t], min(offsets[t] + count, offsets[t + 1])) for t in tokens]
        return torch.cat([self._successor_ids[a:b] for a, b in spans])

    def _low_rank(self, states: torch.Tensor) -> torch.Tensor:
        return linear(states.to(self.down.dtype), self.down)

    def scores(self, states: torch.Tensor) -> torch.Tensor:
        """The ranker's score of every token for each row of drafter states."""
        return self._low_rank(states) @ self.vocab_t

    def candidate_ids(self, states: torch.Tensor, tokens: list[int] | None = None) -> torch.Tensor:
        """One shared candidate set for all rows of a tree level, scored by the exact head in
        one matmul: the text's own tokens (see `context_tokens`) and the successors of the
        tokens the rows have just read (`tokens`, see `successors`), then the ranker's top
        tokens for the mean of the rows' low-rank states, `candidates` in all. Scores are
        linear in those states, so this ranks tokens by the rows' mean score (equivalently, by the
        geometric mean of the ranker's probabilities) at the cost of ranking one row: a per-row
        ranking costs a 262k-score top-k per row, and in an A/B on Spec-Bench (Gemma, 1/4
        trees) the mean kept tau while ranking took 26% less time."""
        low = self._low_rank(states)
        if low.shape[0] > 1:
            low = low.mean(0, keepdim=True)
        scores = low @ self.vocab_t
        # The text's tokens outrank every ranked one, so they fill their share of the set.
        scores.index_fill_(1, self.context_ids(), float("inf"))
        if self.successor_count and tokens:
            scores.index_fill_(1, self.successor_ids(tokens), float("inf"))
        return top_ids(scores, self.candidates)[0]

    def top_k(self, states: torch.Tensor, k: int, tokens: list[int] | None = None,
              level: int | None = None):
        start = time.perf_counter()
        if self._shares(level):
            ids, rows = self._tree
            extra = self._new_successors(tokens)
        else:
            ids = self.candidate_ids(states, tokens)
            # index_select, not weight[ids]: a quarter of the time for 2048 rows of Gemma's head.
            rows = self.weight.index_select(0, ids)
            extra = None
            if level == 0:
                self._tree = (ids, rows)
        start = self._tick("rank", start)
        states = states.to(rows.dtype)
        logits = F.linear(states, rows)
        if extra is not None and extra.numel():
            logits = torch.cat([logits, F.linear(states, self.weight.index_select(0, extra))], dim=1)
            ids = torch.cat([ids, extra])
        indices, log_probs = self._top(logits.float(), k, self._tick("head", start))
        return ids[indices], log_probs

    def _shares(self, level: int | None) -> bool:
        """Whether rows at `level` draft from the root's candidate set."""
        if not level or self._tree is None:
            return False
        return self.shared_levels is None or level <= self.shared_levels

    def _new_successors(self, tokens: list[int] | None) -> torch.Tensor | None:
        """The successors of `tokens` that are not among the root's candidates already."""
        if not (self.successor_count and tokens):
            return None
        successors = torch.unique(self.successor_ids(tokens))
        return successors[~torch.isin(successors, self._tree[0])]


def top_ids(scores: torch.Tensor, k: int, lanes: int = 8) -> torch.Tensor:
    """Indices of the k largest scores of each row, as a set (not sorted), in two cheap passes.

    Each row is cut into `lanes` contiguous lanes; column j gathers the j-th score of every
    lane. The k largest scores all lie in the k columns with the largest maxima (the k-th
    largest score is at least the k-th largest column maximum), so a top-k over column maxima,
    then over those columns' members, finds them. Column maxima are an elementwise max of
    contiguous lanes, which vectorises; for one row of Gemma's 262k scores on 2 threads this
    takes about a third of torch.topk's time. Ties at the k-th value may pick other tokens.
    """
    rows, size = scores.shape
    # Only worth it with many more columns than k: for SmolLM2's 49k scores and k = 2048 a
    # plain top-k was faster here.
    if size % lanes or size // lanes < 16 * k:
        return torch.topk(scores, k, dim=-1, sorted=False).indices
    width = size // lanes
    lane_view = scores.view(rows, lanes, width)
    columns = torch.topk(lane_view.amax(1), k, dim=-1, sorted=False).indices
    members = torch.gather(lane_view, 2, columns[:, None, :].expand(-1, lanes, -1)).reshape(rows, -1)
    inner = torch.topk(members, k, dim=-1, sorted=False).indices
    return inner // k * width + columns.gather(1, inner % k)


# ---------------------------------------------------------------------------- the ranker's file

def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale): a matrix as 8-bit codes with a float scale per row, for weights that only
    choose what is drafted (a ranker, Medusa's blocks), at a quarter of float32's bytes."""
    rows = weight.detach().float()
    scale = (rows.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    return torch.round(rows / scale).to(torch.int8).contiguous(), scale.squeeze(1).contiguous()


def float_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix `int8_rows` encoded."""
    return codes.float() * scale.float()[:, None]


def save_ranker(down: torch.Tensor, vocab: torch.Tensor, path: str | Path, meta: dict | None = None,
                int8: bool = False) -> None:
    """The ranker's two factors in a safetensors file. int8: W_vocab (|V| x d') stored as 8-bit
    codes with a float scale per row (vocab.weight, vocab.scale), half of bfloat16's bytes for a
    262k vocabulary; the ranker only orders tokens."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {k: str(v) for k, v in (meta or {}).items()}
    tensors = {"down.weight": down.contiguous()}
    if int8:
        tensors["vocab.weight"], tensors["vocab.scale"] = int8_rows(vocab)
    else:
        tensors["vocab.weight"] = vocab.contiguous()
    save_file(tensors, str(path), metadata=metadata)


def load_ranker(path: str | Path, head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        down, vocab = tensors["down.weight"], tensors["vocab.weight"]
        if "vocab.scale" in tensors:            # 8-bit rows (save_ranker's int8)
            vocab = float_rows(vocab, tensors["vocab.scale"])
    except Exception as exc:
        raise ValueError(f"ranker {path} is unreadable ({exc})") from exc
    if down.shape[1] != head_weight.shape[1] or vocab.shape[0] != head_weight.shape[0] \
            or vocab.shape[1] != down.shape[0]:
        raise ValueError(f"ranker {path} ({tuple(vocab.shape)} x {tuple(down.shape)}) does not fit "
                         f"this target's head {tuple(head_weight.shape)}: made for another model?")
    return down.to(head_weight), vocab.to(head_weight)


# ---------------------------------------------------------------------------- choosing one

def parse_draft_vocab(spec: str) -> tuple[str, int | None]:
    """'full' | 'fr:N' | 'trim:N' | 'spec:K[,name=value...]' -> (kind, size); sizes accept a k
    suffix (32k). SpecVocab's named options are read by `spec_options`."""
    if not isinstance(spec, str) or not spec:
        raise ValueError("draft vocabulary must be full, fr:N, trim:N or spec:K")
    if spec.startswith("spec:"):
        spec_options(spec)
        spec = spec.split(",")[0]
    kind, _, size = spec.partition(":")
    if kind == "full" and not size:
        return "full", None
    if kind not in ("fr", "trim", "spec") or not size:
        raise ValueError(f"unknown draft vocabulary {spec!r} (use full, fr:N, trim:N or spec:K, "
                         "e.g. fr:32k, spec:2048)")
    text = size.lower()
    multiplier = 1024 if text.endswith("k") else 1
    try:
        value = int(text[:-1] if text.endswith("k") else text) * multiplier
    except ValueError:
        raise ValueError(f"draft vocabulary size must be a positive integer (or Nk), got {size!r}")
    if value < 1:
        raise ValueError(f"draft vocabulary size must be positive, got {size!r}")
    return kind, value


@dataclass(frozen=True)
class SpecVocabOptions:
    """SpecVocab's knobs, by name in `spec:K,context=C,successors=S,levels=L`:
    context: how many of the K candidates are the text's own most recent tokens (default K/2);
    successors: how many usual successors of each row's token join them (default
    DEFAULT_SUCCESSORS where the drafter has a successor table, else 0);
    levels: how many tree levels below the root draft from the root's candidate set (default:
    all; 0: every level ranks its own rows). spec:K,context=0,successors=0,levels=0 is the
    ranker alone at every level, with one difference from the paper: a level's rows share one
    candidate set, ranked for the mean of their low-rank states (the paper ranks each row)."""
    context: int | None = None
    successors: int | None = None
    levels: int | None = None


def spec_options(spec: str) -> SpecVocabOptions:
    fields = spec.split(",")
    if fields[0].count(":") != 1:
        raise ValueError(f"bad SpecVocab spec {spec!r}: its options are named now, e.g. "
                         "spec:2048,context=0,successors=0,levels=0 (context: the text's own tokens "
                         "among the candidates; successors: each drafted token's usual successors; "
                         "levels: tree levels that reuse the root's candidates)")
    options = {}
    for item in fields[1:]:
        name, eq, value = item.partition("=")
        if name not in ("context", "successors", "levels") or not eq or not value.isdigit():
            raise ValueError(f"bad SpecVocab option {item!r} in {spec!r}: use context=C, "
                             "successors=S or levels=L with integers >= 0")
        if name in options:
            raise ValueError(f"SpecVocab option {name} given twice in {spec!r}")
        options[name] = int(value)
    return SpecVocabOptions(**options)


DEFAULT_SUCCESSORS = 16     # per row: 98.0% Spec-Bench recall for SmolLM2 (BENCHMARKS.md)


def make_draft_vocab(spec: str, head_weight: torch.Tensor, files: Path | None,
                     token_map: str | Path | None = None, ranker: str | Path | None = None,
                     dtype: torch.dtype | None = None, packed_head=None):
    """Build the strategy `spec` for a target head, reading token maps / the ranker from
    `files` (the bundled drafter directory) unless paths are given. `dtype`: the drafter's
    (default: the head's); the full and static heads keep a copy of their rows in it.
    packed_head: the target's head on the native engine (a formats.PackedWeight); the full
    and static heads then score with it (or its rows) instead of a float copy."""
    from .token_map import load_successors, load_token_map

    kind, size = parse_draft_vocab(spec)
    vocab = head_weight.shape[0]
    if token_map is not None and kind not in ("fr", "trim"):
        raise ValueError(f"--token-map applies to --draft-vocab fr:N or trim:N, not {spec}")
    if ranker is not None and kind != "spec":
        raise ValueError(f"--ranker applies to --draft-vocab spec:K, not {spec}")
    if kind == "full":
        return FullVocab(packed_head if packed_head is not None else head_weight.to(dtype or head_weight.dtype))
    if kind in ("fr", "trim"):
        path = Path(token_map) if token_map else (files / f"token_map_{kind}.pt" if files else None)
        if path is None or not path.exists():
            raise ValueError(f"--draft-vocab {spec} needs a token map: none bundled here "
                             f"({path}); make one with `vocabspec vocab` and pass --token-map")
        ids = load_token_map(path, vocab)
        if size > vocab:
            raise ValueError(f"draft vocabulary of {size} tokens is larger than the target's {vocab}")
        if size > ids.numel():
            raise ValueError(f"token map {path} ranks only {ids.numel()} tokens, {size} asked for")
        return StaticSubset(packed_head if packed_head is not None else head_weight, ids[:size],
                            name=f"{kind}:{size}", dtype=dtype)
    path = Path(ranker) if ranker else (files / "ranker.safetensors" if files else None)
    if path is None or not path.exists():
        raise ValueError(f"--draft-vocab {spec} needs a trained ranker: none bundled here ({path}); "
                         "train one with `vocabspec ranker` and pass --ranker")
    down, vocab_proj = load_ranker(path, head_weight)
    if size > vocab:
        raise ValueError(f"SpecVocab candidate count {size} exceeds the vocabulary ({vocab})")
    options = spec_options(spec)
    context, asked_successors, shared_levels = options.context, options.successors, options.levels
    table = files / "successors.safetensors" if files else None
    has_table = table is not None and table.exists()
    if asked_successors and not has_table:
        raise ValueError(f"--draft-vocab {spec} asks for successors, but there is no successor table "
                         f"({table}); make one with `vocabspec vocab --successors N`")
    successors = load_successors(table, vocab) if has_table and asked_successors != 0 else None
    successor_count = asked_successors if asked_successors is not None else \
        (DEFAULT_SUCCESSORS if successors is not None else 0)
    # The exact head over the candidates reads a copy of the head in the drafter's dtype:
    # gathering bfloat16 rows moves half the bytes, and the matmul runs in bfloat16 too.
    strategy = SpecVocab(head_weight.to(dtype or head_weight.dtype), down, vocab_proj,
                         candidates=size, context_tokens=context, successors=successors,
                         successor_count=successor_count, shared_levels=shared_levels)
    strategy.name = spec
    return strategy
