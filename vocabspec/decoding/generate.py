"""One request's generation: prompt -> prefill -> (draft -> verify -> commit)* -> text.

A `Generation` holds a request's state and its parts of a step, whatever runs the target:
`start` (the first token from the prefill's last logits, the proposer's start), `propose` (the
tree to verify, or the root alone), `span` (its rows in the step's `StepRows`) and `finish`
(verify, commit, tell the proposer, emit). The loop that runs those steps, for one request or
many, is batch.py's: every step is proposals -> StepRows -> the backend's forward -> greedy
verification -> each request's `finish`. Vanilla decoding is the same step with no proposer (the
root alone), so every method shares prefill, stopping rules, streaming and statistics. A
proposer (EAGLE drafter, prompt lookup) only has to turn the committed context into a `Tree`
and to hear back which tokens were accepted. A generation never knows its engine: what every
request of an engine shares (the backend, the tokenizer, the end-of-sequence ids) is a `Target`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..runtime.backend import Backend
from ..runtime.step_rows import RowSpan, StepRows
from ..runtime.tokenizer import Tokenizer
from ..speculation.proposer import DraftingFailed, Proposer
from ..speculation.sampling import SamplingParams, greedy_token, make_generator, sample, target_probs
from ..speculation.tree import Tree, chain
from ..speculation.verify import TreeLogits, Verdict, greedy_verdict, verify_sampling


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_on_eos: bool = True
    # Checked between steps: a set event ends the generation ("cancelled"), and so does
    # passing the deadline (time.monotonic() seconds; "time").
    cancel: object | None = None
    deadline: float | None = None
    # Record each emitted token's log-probability under the target's own distribution (the
    # raw logits' softmax) and the `logprobs` likeliest alternatives; None records nothing.
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


MAX_LOGPROBS = 20


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]   # the likeliest tokens and their log-probabilities, best first


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under softmax(logits), computed in float32. The logits row
    is the one verification read for this token, which on an exact engine carries the bits
    plain decoding would give it, so speculation leaves the numbers unchanged."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(logp[token]), alternatives)


@dataclass
class StepRecord:
    accept_length: int       # tokens added by this step (accepted drafts + the bonus token)
    tree_size: int           # drafted tokens verified
    draft_seconds: float
    verify_seconds: float    # the target's forward over the tree, verification and the commit
    path_ranks: tuple[int, ...] = ()   # value ranks of the accepted drafts (see Tree.ranks)
    forward_seconds: float = 0.0       # of verify_seconds, the target's forward alone (a batch's
                                       # shared forward, whole; 0 for a graph step's one launch)
    deepest_row: int = 0               # the accepted path's last tree row (past the LM head's
                                       # first pass: verification scored more rows in a second)


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    stop_reason: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per token, if asked
    runs_on: str = ""        # what ran the target, and why (Backend.runs_on)
    eos_token: int = -1      # the end-of-sequence token that ended it (stop_reason "eos")

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens per verification step (Spec-Bench's tau, bonus token counted)."""
        lengths = [s.accept_length for s in self.steps]
        return sum(lengths) / len(lengths) if lengths else 0.0

    def as_dict(self) -> dict:
        return {
            "text": self.text, "new_tokens": self.new_tokens, "prompt_tokens": self.prompt_tokens,
            "seconds": round(self.seconds, 4), "tokens_per_s": round(self.tokens_per_s, 2),
            "mean_accept_len": round(self.mean_accept_len, 3), "steps": len(self.steps),
            "stop_reason": self.stop_reason, "runs_on": self.runs_on,
            "draft_seconds": round(sum(s.draft_seconds for s in self.steps), 4),
            "verify_seconds": round(sum(s.verify_seconds for s in self.steps), 4),
            "forward_seconds": round(sum(s.forward_seconds for s in self.steps), 4),
        }


@dataclass(frozen=True)
class Target:
    """What every request of an engine decodes with: the backend that runs the model, its
    tokenizer (None: no text) and the tokens that end a generation."""
    model: Backend
    tokenizer: Tokenizer | None = None
    eos_ids: frozenset = frozenset()

    @classmethod
    def of(cls, model: Backend, tokenizer: Tokenizer | None = None) -> "Target":
        eos = set(model.args.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(model, tokenizer, frozenset(eos))


def proposer_rows(rows: StepRows, span: RowSpan, taps: tuple[int, ...], path: list[int]) -> torch.Tensor:
    """The rows a proposer reads (see `Proposer`) at the span's rows `path`: its drafter's
    tapped layers' outputs, then the last layer's hidden states."""
    hidden, tapped = rows.hidden_of(span), rows.tapped_of(span, taps)
    if path[-1] == len(path) - 1:       # the first rows (a root alone, a chain's path): a slice
        pick = slice(0, len(path))
    else:
        pick = torch.tensor(path, dtype=torch.long, device=rows.hidden.device)
    return torch.cat([*(t[pick] for t in tapped), hidden[pick]], dim=-1) if tapped else hidden[pick]


class TextStream:
    """Incremental detokenisation that never emits half a UTF-8 character. live=False: nobody
    reads the text before the end, so it is decoded once then (decoding the answer so far at
    every step costs more than a step's Python)."""

    def __init__(self, tokenizer: Tokenizer | None, live: bool = True):
        self.tokenizer = tokenizer
        self.live = live
        self.text = ""

    def update(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(tokens)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


def require_exact(model: Backend, allow_inexact: bool = False) -> None:
    """Refuse speculative decoding where it could differ from plain decoding, unless asked.

    Speculative output equals plain decoding's only where a tree forward gives each row the
    bits a one-token forward gives it: always on the native engine. torch's kernels promise no
    such thing (SDPA's and the matmuls' reduction order follows the row count): float32 differs
    in the last bits, bfloat16 by whole units of its precision."""
    if model.exact or allow_inexact:
        return
    raise ValueError(
        f"speculative decoding with {model.weights} weights on {model.runs_on} is not exact: a "
        "tree forward rounds differently from one-token decoding, so the output could differ "
        "from plain decoding. Run on the native CPU engine, or pass --allow-inexact "
        "(allow_inexact=True) to accept that")


def graphs_by_default(model: Backend) -> bool:
    """Whether an Engine runs greedy steps as graph steps (fixed shapes, capturable) unless told: on CUDA,
    where CUDA graphs pay (on torch's kernels and on the row-invariant ones alike); on the CPU
    the eager steps score fewer rows."""
    return model.device.type == "cuda"


class Generation:
    """One request's decoding (module docstring); `result` holds the outcome. `cache` is the
    request's KV cache (its slot's, or the one its backend gives it: `Backend.prepare`);
    `proposer` drafts its trees (None: plain decoding). stream: whether its text is read as it
    comes (`TextStream.live`)."""

    def __init__(self, target: Target, prompt_ids: list[int], config: GenerationConfig, cache,
                 proposer: Proposer | None = None, stream: bool = True):
        self.target = target
        self.prompt_ids = prompt_ids
        self.config = config
        self.cache = cache
        self.proposer = proposer
        self.result = GenerationResult(prompt_tokens=len(prompt_ids), runs_on=target.model.runs_on)
        self.text = TextStream(target.tokenizer, live=stream)
        self.streamed = ""      # text already yielded; never retracted
        params = config.sampling
        self.generator = None if params.greedy else make_generator(params.seed, target.model.device)
        self.token = -1          # the last chosen token: the next tree's root
        self.started = 0.0
        self._t0 = 0.0
        self.reads_rows = False  # whether this step's rows go to the proposer (its `reads_rows`)

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose outputs its proposer reads."""
        return self.proposer.taps if self.proposer is not None else ()

    @property
    def step_taps(self) -> tuple[int, ...]:
        """The taps this step's forward computes for it: none where its proposer reads no rows."""
        return self.taps if self.reads_rows else ()

    @property
    def tree_room(self) -> int:
        """Rows the largest step takes (the root and the proposer's largest tree)."""
        return (self.proposer.max_tree_tokens if self.proposer is not None else 0) + 1

    @property
    def verifies_greedily(self) -> bool:
        """Whether the backend verifies its trees (`Backend.verify_greedy`): greedy, and no
        logprobs to read from every row."""
        return self.config.sampling.greedy and self.config.logprobs is None

    # ---------------------------------------------------------------- steps

    def start(self, prompt_rows: torch.Tensor, logits: torch.Tensor) -> str:
        """After the prompt's prefill (`prompt_rows`: what the proposer reads of it; `logits`:
        its last row's): the first token, the proposer's start; the text that token shows."""
        self.token = self._pick(logits[0])
        self.result.prefill_seconds = time.perf_counter() - self.started
        if self.proposer is not None:
            self.proposer.size_live = self.config.sampling.greedy
            self.proposer.reset(self.prompt_ids, prompt_rows, self.token)
        return self._emit([self.token], [logits[0]])

    @property
    def can_draft(self) -> bool:
        """Whether this step may draft: a proposer, and room for its largest tree in the cache
        (near the end of the window a tree would not fit)."""
        return self.proposer is not None and self.cache.used + self.tree_room <= self.cache.max_len

    def propose(self, draft: bool = True) -> Tree:
        """The tree the next step verifies: the proposer's, or the root alone (plain decoding,
        `draft=False`, or no room for a tree). Asks first whether the proposer reads the step's
        rows (what it reads decides that, not the step's drafting)."""
        self._t0 = time.perf_counter()
        self.reads_rows = self.proposer is not None and self.proposer.reads_rows()
        if draft and self.can_draft:
            try:
                tree = self.proposer.propose(self.token)
                if not self.proposer.drafts_on_device:
                    self._check_tree(tree)
            except Exception as exc:
                raise DraftingFailed(f"drafting failed ({type(self.proposer).__name__}): {exc}") from exc
            return tree
        return chain(self.token, [], device=self.target.model.device)

    def span(self, rows: StepRows, tree: Tree, owner=None) -> RowSpan:
        """The tree's rows in the step: after the cache's committed tokens, a root alone as
        one causal row."""
        return rows.add(tree.tokens, self.cache, tree.parents if tree.size else None,
                        tree.positions(self.cache.used), owner=owner)

    def _check_tree(self, tree: Tree) -> None:
        """ValueError unless a proposed tree on the host can be verified: rooted at the step's
        token, its drafts in the vocabulary, each parent an earlier row, within the cache's
        room. Checked here, it fails only this request; inside the shared forward it would fail
        every one. (A device's tree is left unread: checking it would wait for the device.)"""
        if tree.tokens.device.type != "cpu":
            return
        from ..runtime.native import check_parents, check_range

        rows, room = tree.tokens.numel(), self.cache.max_len - self.cache.used
        if not 1 <= rows <= room or tree.parents.numel() != rows:
            raise ValueError(f"a tree of {rows} rows and {tree.parents.numel()} parents; the cache "
                             f"has room for {room} rows, and each needs a parent")
        # On lists (a fifth of the tensor checks' cost, about 10 us a step); the tensor checks
        # name what is wrong.
        host, vocab = tree.rows(), self.target.model.args.vocab_size
        tokens, parents = host.tokens, host.parents
        if tokens[0] != self.token:
            raise ValueError(f"the tree's root is {tokens[0]}, not the step's token {self.token}")
        if min(tokens) < 0 or max(tokens) >= vocab:
            check_range("drafted token id", tree.tokens, 0, vocab)
        if parents[0] != -1 or not all(0 <= parent < row for row, parent in enumerate(parents[1:], 1)):
            check_parents("the drafted tree", tree.parents)

    def finish(self, rows: StepRows, span: RowSpan, tree: Tree, t1: float, forwarded: float) -> str:
        """Verify the step's tree from its rows (or take the backend's greedy verdict, or a
        step the backend ran whole: `span.settled`), commit the accepted path, tell the
        proposer, emit; the text the step shows. t1: when the forward began; forwarded: when
        it ended."""
        if span.settled is not None:
            accepted, ranks, size = span.settled
            self.result.steps.append(StepRecord(len(accepted), size, t1 - self._t0, forwarded - t1, ranks))
            self.token = span.next_token
            return self._emit(accepted[1:] + [self.token])
        verdict, logits = self._verdict(rows, span, tree)
        self.cache.commit(verdict.path)
        t2 = time.perf_counter()
        host = tree.rows()
        accepted = [host.tokens[node] for node in verdict.path]
        if self.proposer is not None:
            read = proposer_rows(rows, span, self.taps, verdict.path) if self.reads_rows else None
            self.proposer.observe(accepted, read, verdict.next_token)
        t3 = time.perf_counter()
        ranks = tuple(host.ranks[node] for node in verdict.path[1:]) if host.ranks is not None else ()
        self.result.steps.append(StepRecord(len(verdict.path), tree.size, (t1 - self._t0) + (t3 - t2), t2 - t1,
                                            ranks, forward_seconds=forwarded - t1, deepest_row=verdict.path[-1]))
        self.token = verdict.next_token
        # Each emitted token's distribution is the target's row at its parent node (verification
        # has read every one of these rows already).
        emitted = None if logits is None else [logits[node] for node in verdict.path]
        return self._emit(accepted[1:] + [self.token], emitted)

    def _verdict(self, rows: StepRows, span: RowSpan, tree: Tree):
        """(the step's Verdict, the logits it read (None where the backend verified))."""
        model, hidden = self.target.model, rows.hidden_of(span)
        if span.path is not None:
            return Verdict(span.path, span.next_token), None
        if self.config.sampling.greedy:       # every row scored: logprobs read them all
            logits = model.lm_head(hidden)
            return greedy_verdict(tree, logits), logits
        logits = TreeLogits(model.lm_head, hidden, tree, model.head_rows)
        return verify_sampling(tree, logits, self.config.sampling, self.generator), logits

    def _pick(self, logits: torch.Tensor) -> int:
        params = self.config.sampling
        if params.greedy:
            return greedy_token(logits)
        return sample(target_probs(logits[None], params)[0], self.generator)

    @property
    def done(self) -> bool:
        """Whether the request has ended (a stop condition, cancelled, or out of time)."""
        result, config = self.result, self.config
        if result.stop_reason:
            return True
        if config.cancel is not None and config.cancel.is_set():
            result.stop_reason = "cancelled"
        elif config.deadline is not None and time.monotonic() > config.deadline:
            result.stop_reason = "time"
        else:
            return False
        self._decode_text(final=True)
        return True

    def _emit(self, new_tokens: list[int], rows=None) -> str:
        """Append tokens to the output one at a time, stopping at EOS, max_new_tokens or a stop
        string exactly where one-token decoding would stop, even inside a multi-token step.
        rows[i]: the target's logits new_tokens[i] was chosen from (for config.logprobs)."""
        result, config = self.result, self.config
        for index, token in enumerate(new_tokens):
            if config.stop_on_eos and token in self.target.eos_ids:
                result.stop_reason, result.eos_token = "eos", token
                break
            result.tokens.append(token)
            if config.logprobs is not None:
                result.logprobs.append(token_logprob(rows[index], token, config.logprobs))
            if len(result.tokens) >= config.max_new_tokens:
                result.stop_reason = "length"
            if config.stop and self._cut_at_stop_string():
                result.stop_reason = "stop"
            if result.stop_reason:
                break
        self._decode_text(final=bool(result.stop_reason))
        # Text that may be the start of a stop string is held back until the next tokens
        # show whether the stop string follows (then it is cut, never streamed).
        end = len(result.text) if result.stop_reason else self._streamable(result.text)
        if not result.text.startswith(self.streamed) or end <= len(self.streamed):
            return ""
        delta = result.text[len(self.streamed):end]
        self.streamed += delta
        return delta

    def _decode_text(self, final: bool) -> None:
        """result.text: the answer so far, decoded at each step where it streams and once at
        the end otherwise (with stop strings it is decoded token by token, to find them)."""
        if not self.config.stop and (self.text.live or final):
            self.text.update(self.result.tokens)
        self.result.text = self.text.text

    def _streamable(self, text: str) -> int:
        held = 0
        for stop in self.config.stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return len(text) - held

    def _cut_at_stop_string(self) -> bool:
        self.text.update(self.result.tokens)
        found = [i for i in (self.text.text.find(stop) for stop in self.config.stop) if i != -1]
        if found:
            self.text.text = self.text.text[:min(found)]
        return bool(found)
