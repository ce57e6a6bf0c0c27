"""One request's generation: prompt -> prefill -> (draft -> verify -> commit)* -> text.

A `Generation` holds a request's state and its parts of a step: `start` (prefill, the first
token), `propose` (the tree to verify), `finish` (verify, commit, tell the proposer, emit).
`step_together` is the step: every running request's tree through the target in one forward.
The loop that takes those steps, for one request or many, is batch.py's. Vanilla decoding is
the same step with no proposer (the root alone), so every method shares prefill, stopping
rules, streaming and statistics. A proposer (EAGLE drafter, prompt lookup) only has to turn
the committed context into a `Tree` and to hear back which tokens were accepted. A request
whose forwards run outside, one row among many requests' (batched_decoding.py), keeps the rest
of this: `start_outside` and `take` choose, record and emit its tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..engine.model import Transformer
from ..speculation.sampling import SamplingParams, greedy_token, make_generator, sample, target_probs
from ..engine.tokenizer import Tokenizer
from ..engine.kv_cache import KVCache
from ..speculation.tree import Tree, chain
from ..speculation.verify import TreeLogits, Verdict, greedy_verdict, verify_sampling
from ..speculation.proposer import PREFILL_CHUNK, DraftingFailed, Proposer


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
                                       # shared forward, whole; 0 for a static step's one launch)
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
    engine: str = ""         # what ran the target, and why (Transformer.engine)
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
            "stop_reason": self.stop_reason, "engine": self.engine,
            "draft_seconds": round(sum(s.draft_seconds for s in self.steps), 4),
            "verify_seconds": round(sum(s.verify_seconds for s in self.steps), 4),
            "forward_seconds": round(sum(s.forward_seconds for s in self.steps), 4),
        }


def prefill(model: Transformer, cache, prompt_ids: list[int],
            taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit the prompt to the cache; return its hidden states (after the `taps` layers'
    outputs, see `Proposer`) and the last row's logits."""
    tokens = torch.tensor(prompt_ids, dtype=torch.long, device=model.device)
    hidden = []
    for start in range(0, len(prompt_ids), PREFILL_CHUNK):
        chunk = tokens[start:start + PREFILL_CHUNK]
        positions = torch.arange(start, start + chunk.numel(), device=model.device)
        h, logits, *tapped = model(chunk, positions, cache, taps=taps)
        cache.commit()
        hidden.append(proposer_rows(h, tapped))
    return torch.cat(hidden), logits


def proposer_rows(hidden: torch.Tensor, tapped: list[torch.Tensor], rows=None) -> torch.Tensor:
    """The rows a proposer reads (see `Proposer`): `rows` of the last layer's hidden states,
    after the tapped layers' outputs when there are any."""
    if rows is not None:
        hidden, tapped = hidden[rows], [t[rows] for t in tapped]
    return torch.cat([*tapped, hidden], dim=-1) if tapped else hidden


def step_together(model, generations: list["Generation"], drafts: list[bool]) -> list[tuple]:
    """One step of several generations, the one step every loop takes (a single request is a
    batch of one): each proposes (its tree, or the root alone where it does not draft), one
    forward runs every tree (`forward_batch`, with the union of their drafters' taps), the greedy
    ones on the native engine are verified in one call, and each then verifies the rest,
    commits and emits. Returns (tree, the text it shows or the exception that ended it) per
    generation; one whose proposal failed gets (None, its error) and joins no forward.

    A proposer that fails (raises, or drafts a malformed tree) ends its own request before the
    shared forward, and the others step on: a broken drafter must not end every request beside
    it. An interrupt is not such a failure: it ends the whole step."""
    outcomes: list[tuple | None] = [None] * len(generations)
    live, trees = [], []
    for index, (generation, draft) in enumerate(zip(generations, drafts)):
        try:
            trees.append(generation.propose(draft))
            live.append(index)
        except Exception as exc:
            outcomes[index] = (None, exc)
    if live:
        stepped = _step_trees(model, [generations[i] for i in live], trees)
        for index, outcome in zip(live, stepped):
            outcomes[index] = outcome
    return outcomes


def _step_trees(model, generations: list["Generation"], trees: list[Tree]) -> list[tuple]:
    """`step_together` past the proposals: each generation's tree through one forward, then
    verified, committed and emitted."""
    t1 = time.perf_counter()
    taps = tuple(sorted({t for generation in generations for t in generation.taps}))
    out = model.forward_batch([(tree.tokens, tree.positions(g.cache.length), g.cache,
                                tree.parents if tree.size else None)
                               for g, tree in zip(generations, trees)], taps)
    hidden, tapped = out if taps else (out, None)
    forwarded = time.perf_counter()
    greedy = [i for i, generation in enumerate(generations) if generation.native_greedy]
    verdicts = {}
    if greedy:
        found = model.native.verify_greedy_trees(torch.cat([hidden[i] for i in greedy]),
                                                 [(trees[i].tokens, trees[i].parents) for i in greedy])
        verdicts = {i: Verdict(path, following) for i, (path, following) in zip(greedy, found)}
    outcomes = []
    for index, (generation, tree) in enumerate(zip(generations, trees)):
        try:
            rows = own_taps(tapped[index] if taps else None, taps, generation.taps)
            outcomes.append((tree, generation.finish(tree, hidden[index], rows, t1, verdicts.get(index),
                                                     forwarded)))
        except BaseException as exc:
            outcomes.append((tree, exc))
    return outcomes


def own_taps(rows: torch.Tensor | None, taps: tuple[int, ...], wanted: tuple[int, ...]) -> list[torch.Tensor]:
    """The tapped outputs a generation reads (its drafter's layers `wanted`, in its order) from
    its `rows` of a forward over the union `taps`: the list `Generation.finish` takes ([]
    without taps)."""
    if not wanted:
        return []
    dim = rows.shape[-1] // len(taps)
    if tuple(wanted) == taps:
        return [rows]
    return [torch.cat([rows[:, taps.index(t) * dim:(taps.index(t) + 1) * dim] for t in wanted], dim=-1)]


class TextStream:
    """Incremental detokenisation that never emits half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
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


def require_exact(model: Transformer, allow_inexact: bool = False) -> None:
    """Refuse speculative decoding where it could differ from plain decoding, unless asked.

    Speculative output equals plain decoding's only where a tree forward gives each row the
    bits a one-token forward gives it: always on the native engine. torch's kernels promise no
    such thing (SDPA's and the matmuls' reduction order follows the row count): float32 differs
    in the last bits, bfloat16 by whole units of its precision."""
    if model.exact or allow_inexact:
        return
    raise ValueError(
        f"speculative decoding with {model.weights} weights on {model.engine} is not exact: a "
        "tree forward rounds differently from one-token decoding, so the output could differ "
        "from plain decoding. Run on the native CPU engine, or pass --allow-inexact "
        "(allow_inexact=True) to accept that")


def static_by_default(model: Transformer) -> bool:
    """Whether an Engine runs greedy steps as static, capturable steps unless told: on CUDA,
    where CUDA graphs pay (on torch's kernels and on the row-invariant ones alike); on the CPU
    the eager steps score fewer rows."""
    return model.device.type == "cuda"


class Generation:
    """One request's decoding. Iterating yields text deltas as tokens are committed; `.result`
    holds the outcome. A step is `propose` (the tree to verify), the target's forward over it
    (alone, or beside other requests' trees in one batch: batch.py), then `finish`; iterating
    runs those steps for this request alone. `cache` and `proposer` are the engine's unless a
    batch gives the request its own."""

    def __init__(self, engine: "Engine", prompt_ids: list[int], config: GenerationConfig,
                 cache: KVCache | None = None, proposer: Proposer | None = None, stream: bool = True,
                 outside: bool = False):
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.config = config
        self._cache = cache      # None: the engine's, made when first used (static steps bring their own)
        # outside: the caller runs its forwards, one row a step (`start_outside`, `take`), and
        # keeps its keys and values; it drafts nothing.
        self.outside = outside
        self.proposer = None if outside else engine.proposer if cache is None else proposer
        self.result = GenerationResult(prompt_tokens=len(prompt_ids), engine=engine.model.engine)
        self.text = TextStream(engine.tokenizer)
        self.streamed = ""      # text already yielded; never retracted
        # stream=False: nobody reads the text before the end, so it is decoded once then
        # (decoding the answer so far at every step costs more than a step's Python).
        self.stream = stream
        params = config.sampling
        self.generator = None if params.greedy else make_generator(params.seed, engine.model.device)
        # Greedy on the native engine without logprobs: verification is one native call.
        self.native_greedy = engine.model.native is not None and params.greedy and config.logprobs is None
        self.taps = self.proposer.taps if self.proposer is not None else ()
        self.tree_room = (self.proposer.max_tree_tokens if self.proposer is not None else 0) + 1
        self.token = -1          # the last sampled token: the next tree's root
        self.started = 0.0
        # Greedy steps of fixed shapes, one read-back each (static_step.py), for the engine's
        # own request where the engine runs them (`Engine.static`): the loop's device form.
        self.static = (engine.static and cache is None and not outside and params.greedy
                       and config.logprobs is None)
        self.decoder = None      # the static steps' decoder, where they run

    @property
    def cache(self) -> KVCache:
        return self.engine.cache if self._cache is None else self._cache

    @cache.setter
    def cache(self, cache: KVCache) -> None:
        self._cache = cache

    def __iter__(self) -> Iterator[str]:
        # The engine's one-slot batch steps it on this thread (batch.py: the one loop). Each
        # step holds the model's lock; between steps (while the caller reads a delta) a batch's
        # thread or another engine may run theirs.
        return self.engine.solo.run_alone(self)

    # ---------------------------------------------------------------- steps

    def start(self) -> str:
        """Prefill, the first token, the proposer's start; the text that token shows. Static
        steps prefill their decoder's own cache (`static`)."""
        if not self.started:
            self.started = time.perf_counter()
        proposer, taps = self.proposer, self.taps
        if proposer is not None and proposer.static:
            proposer.static_form(None)
        if self.static:
            room = len(self.prompt_ids) + self.config.max_new_tokens + self.tree_room
            self.decoder = self.engine.static_decoder(room)
            self.cache = self.decoder.cache
            rows = self.decoder.enter()
            if proposer is not None:
                self.tree_room = rows
            taps = self.decoder.taps
        self.cache.reset()
        logits, self.token = self._prefill(self.started, self.generator, taps)
        if self.static:
            self.decoder.start(self.token)
        return self._emit([self.token], [logits[0]])

    @property
    def done(self) -> bool:
        """Whether the request has ended (a stop condition, cancelled, or out of time)."""
        return self._stopped()

    @property
    def can_draft(self) -> bool:
        """Whether this step may draft: a proposer, and room for its largest tree in the cache
        (near the end of the window a tree would not fit)."""
        return self.proposer is not None and self.cache.used + self.tree_room <= self.cache.max_len

    def propose(self, draft: bool = True) -> Tree:
        """The tree the next step verifies: the proposer's, or the root alone (plain decoding,
        `draft=False`, or no room for a tree)."""
        self._t0 = time.perf_counter()
        if draft and self.can_draft:
            try:
                tree = self.proposer.propose(self.token)
                self._check_tree(tree)
            except Exception as exc:
                raise DraftingFailed(f"drafting failed ({type(self.proposer).__name__}): {exc}") from exc
            return tree
        return chain(self.token, [], device=self.engine.model.device)

    def _check_tree(self, tree: Tree) -> None:
        """ValueError unless a proposed tree on the host can be verified: rooted at the token
        the step continues from, its drafts in the vocabulary, each parent an earlier row,
        within the cache's room. Checked here, the tree belonging to this request,
        it fails only this request; inside the shared forward it would fail every one. (A
        device's tree is left unread: checking it would wait for the device.)"""
        if tree.tokens.device.type != "cpu":
            return
        from ..engine.native import check_parents, check_range

        rows, room = tree.tokens.numel(), self.cache.max_len - self.cache.used
        if not 1 <= rows <= room or tree.parents.numel() != rows:
            raise ValueError(f"a tree of {rows} rows and {tree.parents.numel()} parents; the cache "
                             f"has room for {room} rows, and each needs a parent")
        # On lists (a fifth of the tensor checks' cost, about 10 us a step); the tensor checks
        # name what is wrong.
        tokens, parents, vocab = tree.tokens.tolist(), tree.parents.tolist(), self.engine.model.args.vocab_size
        if tokens[0] != self.token:
            raise ValueError(f"the tree's root is {tokens[0]}, not the step's token {self.token}")
        if min(tokens) < 0 or max(tokens) >= vocab:
            check_range("drafted token id", tree.tokens, 0, vocab)
        if parents[0] != -1 or not all(0 <= parent < row for row, parent in enumerate(parents[1:], 1)):
            check_parents("the drafted tree", tree.parents)

    def finish(self, tree: Tree, hidden: torch.Tensor, tapped: list[torch.Tensor], t1: float,
               verdict: Verdict | None = None, forwarded: float | None = None) -> str:
        """Verify the step's tree from its rows' hidden states (or take `verdict`, greedy
        verification already done for a batch), commit the accepted path, tell the proposer,
        emit; the text the step shows. t1: when the forward began; forwarded: when it ended."""
        model, cache, proposer = self.engine.model, self.cache, self.proposer
        logits = None
        if verdict is None:
            if self.native_greedy:      # the LM head, the argmax walk: one native call
                verdict = Verdict(*model.native.verify_greedy(hidden, tree.tokens, tree.parents))
            elif self.config.sampling.greedy:       # every row scored: verify_greedy's tensor form
                logits = model.lm_head(hidden)
                verdict = greedy_verdict(tree, logits)
            else:
                logits = TreeLogits(model.lm_head, hidden, tree, model.verify_head_rows)
                verdict = verify_sampling(tree, logits, self.config.sampling, self.generator)
        cache.commit(verdict.path)
        t2 = time.perf_counter()
        tokens = tree.tokens.tolist()
        accepted = [tokens[node] for node in verdict.path]
        if proposer is not None:
            path = torch.tensor(verdict.path, dtype=torch.long, device=model.device)
            proposer.observe(accepted, proposer_rows(hidden, tapped, path), verdict.next_token)
        t3 = time.perf_counter()
        ranks = tuple(tree.ranks[verdict.path[1:]].tolist()) if tree.ranks is not None and len(verdict.path) > 1 else ()
        self.result.steps.append(StepRecord(len(verdict.path), tree.size,
                                            (t1 - self._t0) + (t3 - t2), t2 - t1, ranks,
                                            forward_seconds=(forwarded or t1) - t1,
                                            deepest_row=verdict.path[-1]))
        self.token = verdict.next_token
        # Each emitted token's distribution is the target's row at its parent node (verification
        # has read every one of these rows already).
        rows = None if logits is None else [logits[node] for node in verdict.path]
        return self._emit(accepted[1:] + [self.token], rows)

    def step_static(self) -> str:
        """One static step (static_step.py): device work only, one read-back; the text it shows."""
        t0 = time.perf_counter()
        accepted, self.token, ranks, size = self.decoder.step(self.can_draft)
        if self.decoder.drafting is not None:
            self.decoder.drafting.after(accepted, self.token, self.decoder.length)
        # A step is one launch (a CUDA graph): all of it counts as verification.
        self.result.steps.append(StepRecord(len(accepted), size, 0.0, time.perf_counter() - t0, ranks))
        return self._emit(accepted[1:] + [self.token])

    def start_outside(self, token: int, logits: torch.Tensor) -> str:
        """`start` for a request whose prompt the caller ran beside others' (a batch's slot
        cache: batched_decoding.py): its first token from the prompt's last `logits` (vocab,)
        (`take`'s rule); the text it shows."""
        if not self.started:
            self.started = time.perf_counter()
        self.token = self._choose(token, logits)
        self.result.prefill_seconds = time.perf_counter() - self.started
        return self._emit([self.token], [logits])

    @property
    def reads_logits(self) -> bool:
        """Whether `take` reads its row's logits (to sample, or for logprobs); else the
        caller's argmax is all it needs."""
        return not self.config.sampling.greedy or self.config.logprobs is not None

    def take(self, token: int, logits: torch.Tensor | None, seconds: float) -> str:
        """A plain-decoding step whose forward the caller ran over many requests' rows
        (batched_decoding.py): the next token is `token` for a greedy request (the caller's
        argmax of the row's `logits`, the first on ties as `greedy_token`), else drawn from
        `logits` (vocab,) with this request's settings and generator, the draw serving it alone
        makes (`logits` may be None where not `reads_logits`). Recorded as a step of `seconds`,
        all of it the shared forward's; the text it shows."""
        self.token = self._choose(token, logits)
        self.result.steps.append(StepRecord(1, 0, 0.0, seconds, forward_seconds=seconds))
        return self._emit([self.token], [logits])

    def _choose(self, token: int, logits: torch.Tensor) -> int:
        params = self.config.sampling
        return token if params.greedy else self._pick(logits, params, self.generator)

    def _prefill(self, start: float, generator, taps) -> tuple[torch.Tensor, int]:
        """Run the prompt, pick the first token and start the proposer on the prompt's states;
        (the prompt's last logits, that token)."""
        engine, result = self.engine, self.result
        hidden, logits = prefill(engine.model, self.cache, self.prompt_ids, taps)
        token = self._pick(logits[0], self.config.sampling, generator)
        result.prefill_seconds = time.perf_counter() - start
        if self.proposer is not None:
            self.proposer.size_live = self.config.sampling.greedy
            self.proposer.reset(self.prompt_ids, hidden, token)
        return logits, token

    def _stopped(self) -> bool:
        """Whether the generation ends here: a stop condition met, cancelled, or out of time."""
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

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator) -> int:
        if params.greedy:
            return greedy_token(logits)
        return sample(target_probs(logits[None], params)[0], generator)

    def _emit(self, new_tokens: list[int], rows=None) -> str:
        """Append tokens to the output one at a time, stopping at EOS, max_new_tokens or a stop
        string exactly where one-token decoding would stop, even inside a multi-token step.
        rows[i]: the target's logits new_tokens[i] was chosen from (for config.logprobs)."""
        result, config = self.result, self.config
        for index, token in enumerate(new_tokens):
            if config.stop_on_eos and token in self.engine.eos_ids:
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
        if not self.config.stop and (self.stream or final):
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
