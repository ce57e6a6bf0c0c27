"""The decoding loop: continuous batching, each answer bit-identical to serving it alone.

Every request is stepped here. A single request (`Engine.stream`, `Engine.generate`) is a
batch of one: the engine's one-slot `BatchEngine` (`Engine.solo`), stepped on the caller's
thread, which drafts at every step its proposer can. On CUDA that request's greedy steps take
the loop's device form, static steps captured as CUDA graphs (static_step.py).

Requests join and leave a running batch between steps. A step asks each running request for its
tree (drafted by its own proposer, or the root alone for plain decoding), runs every tree's rows
through the target in one forward, each over the request's own KV cache, verifies each tree
(the greedy ones in one native call over all of them), commits and streams. On the native engine
a row's bits never depend on the rows beside it, and a request's cache, proposer and sampling
generator are its own: its tokens are exactly those it gets served alone, whatever else runs.
The batch changes when tokens arrive, never which.

On torch's kernels (a GPU's path, and `--backend torch` on a CPU) `forward_batch` runs the
requests in turn, a forward each. There the plain-decoding requests step instead as rows of one
forward over per-slot caches (batched_decoding.py; `BatchLimits.batched`), one captured step for
them all on a GPU: on the row-invariant kernels (`--backend triton`) always, each answer exactly
the request's own; on torch's with inexact answers allowed (`--allow-inexact`), each answer the
request's own up to the rounding of rows batched together, and without it every request keeps
the per-request step, each answer exactly what it gets alone. There a drafted request keeps its
keys in a slot too, its prefill run alone there (its proposer reads the prompt's states), and at
each step its tree (or its root alone, where the cost rule below says not to draft) is rows of
the same forward as the plain rows, verified and committed as when it runs alone
(`BatchedDecoding.step_with_trees`).

The steps run on one thread: the engine's own (`thread=True`), or the caller's, through `run`
(`thread=False`). The second is the fast one on a CPU: OpenMP (libgomp) throttles a parallel
team started outside the process's first thread once its threads outnumber the cores, and every
layer's parallel region then waits on the kernel instead of spinning: on 2 cores a forward in
another thread costs about 4x. So `serve` answers HTTP on a thread of its own and steps the
batch on the main thread, and `generate` steps it on the calling thread.

The engine has `max_batch` slots, each a KV cache of `window` tokens and a proposer built once;
a request takes a free slot (prefilled when it joins), or waits in a queue of at most
`max_waiting`; past that, `submit` refuses (`Busy`). A cancelled request leaves at the next
step. A request whose proposer fails (raises, or drafts a tree that cannot be
verified) ends with that error (generate.DraftingFailed) before the step's forward; the others
step on. So does one that cannot start (its generation, its sampling generator or its prefill
raises). Should the loop itself fail, every request not yet answered gets the error and the
engine stops (`run`): nobody waits for an answer that will not come.

The draft budget follows the batch and the cost curve. A step of B requests over R rows yields
B tokens plus the drafts accepted, in the time of a forward of R rows, c(R), measured on this
machine when the engine starts (cost_curve.py), with the LM head's own cost per row scored
(a plain request scores one, a tree up to the head's first pass, and a second pass at the rate
its slot's paths have left the first). A greedy request's tree of d rows (its proposer's next
proposal, where it can say cheaply; else its largest) joins the step only if it raises the
step's tokens per second: (B + G + g) / c(R + d) > (B + G) / c(R), with g the drafts its slot
has been accepting per drafted step (a running mean, from a prior of 0.5) and G those of the
trees already in. On a CPU, where each row costs a share
of a forward, a lone request drafts and a full batch decodes plainly; on a GPU, where rows are
nearly free, every request drafts. A greedy request's tokens are the same either way; a sampled
one always drafts as it would alone, so that its random draws, and its tokens, are those of
serving it alone. `BatchLimits.tree_rows` caps the rows instead (None: the cost rule). Where
trees join the batched rows' step, those plain rows count among the B requests and R rows.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from ..engine.kv_cache import KVCache
from ..engine.model import Transformer
from ..engine.tokenizer import Tokenizer
from .cost_curve import Costs
from .generate import (Generation, GenerationConfig, GenerationResult, require_exact, static_by_default,
                       step_together)
from ..speculation.proposer import Proposer


class Engine:
    """A target model (and optionally a proposer) ready to generate."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None,
                 proposer: Proposer | None = None, allow_inexact: bool = False,
                 static: bool | None = None):
        if proposer is not None:
            require_exact(model, allow_inexact)
        self.model = model
        self.allow_inexact = allow_inexact
        self.tokenizer = tokenizer
        self.proposer = proposer
        # Greedy steps with static shapes and one read-back each, captured as CUDA graphs on
        # a GPU (static_step.py). None: `static_by_default`, for proposers that can (prompt
        # lookup, Medusa, EAGLE without SpecVocab).
        if static is None:
            static = static_by_default(model)
        if static and model.native is not None:
            raise ValueError("static steps run on torch's kernels (a GPU's path); the native "
                             "engine keeps its own cache: load with backend='torch'")
        if static and proposer is not None and not proposer.static:
            static = False
        self.static = static
        self.decoders: dict[int, object] = {}    # static_step.StaticDecoder by cache size
        self.max_len = model.args.max_seq_len
        self._solo: BatchEngine | None = None
        eos = set(model.args.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos

    @property
    def cache(self) -> KVCache:
        """The cache of the engine's own request (its one slot's), made when first needed:
        static steps keep their own per size (`decoders`), and a cache of the whole context
        window is the largest allocation a request makes (1 GB for an 8B model at 8k tokens in
        bfloat16)."""
        return self.solo.slots[0].cache

    @property
    def solo(self) -> "BatchEngine":
        """The one-slot batch that steps this engine's own request (`stream`, `generate`) on
        the calling thread: a single request is a batch of one. It drafts at every step its
        proposer can, the tree the user chose (the batch's cost rule weighs trees against other
        requests' rows, and there are none)."""
        if self._solo is None:
            # Rows capped at the window (no tree outgrows it: `Generation.can_draft`), not by cost.
            limits = BatchLimits(max_batch=1, max_waiting=1, window=self.max_len, tree_rows=self.max_len,
                                 batched=False)
            self._solo = BatchEngine(self, lambda: self.proposer, limits, thread=False, allocate=False)
        return self._solo

    def check_prompt(self, prompt_ids: list[int], config: GenerationConfig, limit: int | None = None) -> None:
        """ValueError unless the prompt can run: not empty, ids in the vocabulary, prompt and
        answer within `limit` tokens of cache (default: this engine's)."""
        limit = self.max_len if limit is None else limit
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        room = limit - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model's context "
                             f"window here is {limit} tokens")
        if config.max_new_tokens > room - 1:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                             f"({config.max_new_tokens}) exceed the context window of {limit} "
                             f"tokens; at most {room - 1} new tokens fit")

    def static_decoder(self, tokens: int):
        """The static steps' decoder with room for `tokens`, its cache's slots rounded up to a
        power of two (from 256) so that a few sizes, and their CUDA graphs, serve every request."""
        from .static_step import StaticDecoder

        size = 256
        while size < tokens:
            size *= 2
        size = min(size, self.max_len)
        if size not in self.decoders:
            self.decoders[size] = StaticDecoder(self.model, self.proposer, size)
        return self.decoders[size]

    def stream(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        """The request's `Generation`: iterating it steps it (`solo`) and yields its text."""
        self.check_prompt(prompt_ids, config)
        return Generation(self, list(prompt_ids), config)

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> GenerationResult:
        self.check_prompt(prompt_ids, config)
        # Nobody reads the text before the end: it is decoded once then.
        generation = Generation(self, list(prompt_ids), config, stream=False)
        for _ in generation:
            pass
        return generation.result


def check_cache_fits(model: Transformer, slots: int, window: int) -> None:
    """ValueError, with the numbers, where `slots` caches of `window` tokens do not fit the
    memory free now: a server meets its memory need when it starts, or says it cannot."""
    from ..engine.loading import memory_available

    need, have = model.memory.kv_per_token * window * slots, memory_available()
    if have is not None and need > have:
        raise ValueError(f"{slots} slots of {window} tokens need {need / 2**30:.2f} GiB of KV cache, and this "
                         f"machine has {have / 2**30:.2f} GiB free: fewer slots (--max-batch) or a smaller "
                         "window (--kv-tokens)")


class Busy(RuntimeError):
    """Every slot is taken and the queue is full."""


class Stopped(RuntimeError):
    """The engine takes no more requests: closed, or its loop failed (`BatchEngine.run`)."""


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 8          # requests decoding at once (slots)
    max_waiting: int = 64       # requests queued beyond those
    window: int = 4096          # tokens of KV cache per slot: prompt + answer must fit
    # The rows one step verifies over all requests: each greedy request drafts while the
    # batch's rows stay within this. None: the cost rule (module docstring).
    tree_rows: int | None = None
    # Plain-decoding requests as rows of one forward over per-slot caches (batched_decoding.py),
    # not a forward each. None: where that is the faster way and allowed: a model on the
    # row-invariant kernels (exact there), or on torch's with inexact answers allowed
    # (Engine.allow_inexact); never the native engine, whose step is one call already.
    batched: bool | None = None

    def __post_init__(self):
        for name in ("max_batch", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if self.tree_rows is not None and (not isinstance(self.tree_rows, int) or self.tree_rows < 1):
            raise ValueError(f"tree_rows must be a positive integer or None, got {self.tree_rows!r}")


@dataclass(eq=False)           # each request is itself (BatchEngine.unanswered holds them)
class Request:
    """A submitted request: `result` once `done` is set; `on_piece(text, result)` hears its
    stream with the result so far (called on the engine's thread). stream_text=False: it hears
    every step with no text, the text decoded once at the end (a listener that counts tokens:
    decoding a growing answer at every step costs more than a batched step's share of it)."""
    prompt_ids: list[int]
    config: GenerationConfig
    draft: bool = True
    on_piece: Callable[[str, GenerationResult], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    generation: Generation | None = None    # made by the caller for the slot (`run_alone`)
    stream_text: bool = True

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        return self.result


PRIOR_GAIN = 0.5          # drafts accepted per drafted step before a slot has any
PRIOR_PASSES = 0.25       # second head passes per drafted step before a slot has any
GAIN_WEIGHT = 0.1         # the running means' weight of the latest drafted step


class Slot:
    def __init__(self, engine: Engine, window: int, proposer, allocate: bool = True,
                 cache: KVCache | None = None):
        self.model, self.window = engine.model, window
        self._cache = cache if cache is not None else self.model.new_cache(window) if allocate else None
        self.proposer = proposer
        self.generation: Generation | None = None   # outside: in the engine's `batched` rows
        self.request: Request | None = None
        self.gain = PRIOR_GAIN
        self.passes = PRIOR_PASSES

    @property
    def cache(self) -> KVCache:
        """The slot's KV cache of `window` tokens (made when first used where the slot was not
        allocated: a request on static steps uses its decoder's instead)."""
        if self._cache is None:
            self._cache = self.model.new_cache(self.window)
        return self._cache


class BatchEngine:
    """Continuous batching over `engine`'s model: `submit` requests from any thread; the steps
    run on a background thread (`thread=True`) or on whichever thread calls `run`, `run_once`
    or `generate`. `make_proposer()` builds a slot's proposer (None: plain decoding; called once
    per slot); a request with draft=False decodes plainly in its slot."""

    def __init__(self, engine: Engine, make_proposer: Callable[[], object] | None = None,
                 limits: BatchLimits | None = None, thread: bool = True, allocate: bool = True):
        self.engine, self.limits = engine, limits or BatchLimits()
        model = engine.model
        if self.limits.window > model.args.max_seq_len:
            raise ValueError(f"a slot's window of {self.limits.window} tokens exceeds the model's "
                             f"{model.args.max_seq_len}")
        # A server meets its memory need when it starts, not under its first load. allocate=False
        # (the engine's own batch of one): each cache when first used, since static steps use
        # their decoder's. With `batched` rows, plain requests keep their keys there, in as many
        # slots as the device's memory holds, and drafted requests do too (their trees join the
        # step).
        self.batched = None
        batched = self.limits.batched
        if batched is None:
            batched = model.native is None and (model.kernels or engine.allow_inexact)
        elif batched and model.native is not None:
            raise ValueError("batched rows run on torch's kernels or the row-invariant ones; the "
                             "native engine steps every request's rows in one call already")
        elif batched and not (model.kernels or engine.allow_inexact):
            raise ValueError(f"batched rows on {model.engine} round each row differently with "
                             "other rows beside it, so an answer could differ from serving it alone: "
                             "run on the row-invariant kernels (--backend triton), or allow inexact "
                             "answers (--allow-inexact, allow_inexact=True)")
        slots = self.limits.max_batch
        if batched:
            from .batched_decoding import BatchedDecoding

            self.batched = BatchedDecoding(model, self.limits.window, self.limits.max_batch)
            slots, allocate = self.batched.slots, False
        in_slots = self.batched is not None
        if allocate and model.memory is not None and model.device.type == "cpu":
            check_cache_fits(model, slots, self.limits.window)
        self.slots = [Slot(engine, self.limits.window, make_proposer() if make_proposer else None, allocate,
                           self.batched.sequence(index) if in_slots else None)
                      for index in range(slots)]
        # The cost curve the draft budget reads: measured once, where anything drafts.
        self.costs = None
        drafting = [slot.proposer for slot in self.slots if slot.proposer is not None]
        if drafting and self.limits.tree_rows is None:
            self.costs = Costs.measure(model, self.limits.max_batch * (drafting[0].max_tree_tokens + 1),
                                       heads=self.limits.max_batch * model.verify_head_rows)
        self.rows = self.drafted = 0          # rows verified, trees drafted (over all steps)
        self.seconds = {"prefill": 0.0, "steps": 0.0}     # time in joining requests' prefill, in steps
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=self.limits.max_waiting)
        # Every request submitted and not yet answered, wherever it is (queued, in a slot, or
        # between the two): if the loop dies, each of them gets the error (`run`).
        self.unanswered: set[Request] = set()
        self.unanswered_lock = threading.Lock()
        self.died: BaseException | None = None     # what ended the loop, if anything did
        self.wake = threading.Event()
        self.stopping = False
        self.steps = 0
        self.stepping = threading.RLock()      # one thread steps at a time
        self.thread = None
        if thread:
            self.thread = threading.Thread(target=self.run, name="vocabspec-batch", daemon=True)
            self.thread.start()

    # ---------------------------------------------------------------- requests

    def submit(self, prompt_ids: list[int], config: GenerationConfig, draft: bool = True,
               on_piece: Callable[[str, GenerationResult], None] | None = None,
               stream_text: bool = True) -> Request:
        """Queue a request (ValueError if it cannot run: empty, too long for a slot's window;
        Busy if every slot and the queue are full). on_piece, stream_text: see `Request`."""
        if self.stopping:
            raise Stopped("the batch engine has stopped" +
                          (f": its loop failed ({self.died!r})" if self.died is not None else ""))
        self.check(prompt_ids, config)
        cancel = config.cancel if config.cancel is not None else threading.Event()
        request = Request(list(prompt_ids), replace(config, cancel=cancel), draft, on_piece, cancel=cancel,
                          stream_text=stream_text)
        try:
            self._queue(request)
        except queue.Full:
            raise Busy(f"all {self.limits.max_batch} slots are decoding and {self.limits.max_waiting} "
                       "requests wait: try again later") from None
        self.wake.set()
        return request

    def _queue(self, request: Request) -> None:
        with self.unanswered_lock:
            self.waiting.put_nowait(request)
            self.unanswered.add(request)

    def generate(self, prompts: list[list[int]], config: GenerationConfig | list[GenerationConfig],
                 draft: bool = True) -> list[GenerationResult]:
        """Every prompt's result, the prompts decoded together (submitted as slots free up)."""
        configs = config if isinstance(config, list) else [config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError("one config per prompt")
        for ids, cfg in zip(prompts, configs):
            self.check(ids, cfg)
        pending, requests = list(zip(prompts, configs)), []
        while pending or not all(request.done.is_set() for request in requests):
            while pending:
                ids, cfg = pending[0]
                try:
                    requests.append(self.submit(ids, replace(cfg, cancel=None), draft))
                except Busy:                  # the queue is full: decode on, then submit
                    break
                pending.pop(0)
            if self.thread is None:
                self.run_once()
            elif pending:
                time.sleep(0.01)
            else:
                for request in requests:
                    request.done.wait()
        return [request.wait() for request in requests]

    def run_alone(self, generation: Generation) -> Iterator[str]:
        """Run `generation`, made for this engine's slot (`Engine.stream`: the engine's own
        request), stepping on this thread; yields its text as it comes, raises what ended it."""
        pieces: list[str] = []
        with self.stepping:
            if any(slot.generation is not None for slot in self.slots) or not self.waiting.empty():
                raise RuntimeError("this engine is running another generation: finish it first, "
                                   "or serve several at once with a BatchEngine")
            request = Request(generation.prompt_ids, generation.config,
                              on_piece=lambda text, _: pieces.append(text), generation=generation)
            self._queue(request)
            self._run_once()           # admitted (prefilled) before anything can abandon it
        try:
            while True:
                while pieces:
                    yield pieces.pop(0)
                if request.done.is_set():
                    break
                self.run_once()
        finally:
            if not request.done.is_set():       # abandoned by the caller: free the slot
                with self.stepping:
                    for slot in self.slots:
                        if slot.request is request:
                            self._end(slot, None)
        if request.error is not None:
            raise request.error

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join()
        else:
            self._stop()

    def check(self, prompt_ids: list[int], config: GenerationConfig) -> None:
        """ValueError unless the request can run in a slot (Engine.check_prompt, the slot's
        window as the limit)."""
        self.engine.check_prompt(prompt_ids, config, self.limits.window)

    # ---------------------------------------------------------------- the steps

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step the batch on this thread until `close` (or `until()` holds), waiting while
        nothing runs. Each request's own failures end that request alone (`_admit`, `_step`);
        should the loop itself fail anyway, every unanswered request gets the error, the engine
        takes no more (`submit` raises Stopped) and the exception is raised here: nobody waits
        for an answer that will not come."""
        try:
            while not self.stopping and not (until is not None and until()):
                if not self.run_once():
                    self.wake.wait(0.05)
                    self.wake.clear()
        except BaseException as exc:
            self.died, self.stopping = exc, True
            self._stop(Stopped("the batch engine was interrupted" if isinstance(exc, KeyboardInterrupt)
                               else f"the batch engine's loop failed: {exc!r}"))
            raise
        if self.stopping:
            self._stop()

    def run_once(self) -> bool:
        """Admit waiting requests and run one step of the running ones; False if none ran."""
        with self.stepping:
            return self._run_once()

    def _run_once(self) -> bool:
        self._admit()
        running = [slot for slot in self.slots if slot.generation is not None]
        if not running:
            return False
        try:
            started = time.perf_counter()
            with self.engine.model.lock:
                self._step(running)
            self.seconds["steps"] += time.perf_counter() - started
        except BaseException as exc:       # a failed step fails its requests, not the engine
            for slot in running:
                self._end(slot, exc)
        return True

    def _stop(self, error: BaseException | None = None) -> None:
        with self.stepping:
            self._stop_all(error or Stopped("the batch engine stopped"))

    def _stop_all(self, error: BaseException) -> None:
        """End every request with `error`: those decoding, those queued, and any between."""
        for slot in self.slots:
            if slot.generation is not None:
                self._end(slot, error)
        while True:
            try:
                self._fail(self.waiting.get_nowait(), error)
            except queue.Empty:
                break
        with self.unanswered_lock:
            left = list(self.unanswered)
        for request in left:
            self._fail(request, error)

    def _fail(self, request: Request, error: BaseException) -> None:
        """Answer a request that holds no slot with `error`."""
        with self.unanswered_lock:
            self.unanswered.discard(request)
        if not request.done.is_set():
            request.error = error
            request.done.set()

    def _admit(self) -> None:
        """Waiting requests into free slots, each prefilled (or its rows joining `batched`'s
        prefill). Everything a request's admission builds from it (its generation, its sampling
        generator, its prefill) runs in its own failure handler: a request that cannot start
        ends alone with its error, as one whose step fails does."""
        joining = []           # (slot index, slot) of requests whose rows join `batched`
        for index, slot in enumerate(self.slots):
            if slot.generation is not None:
                continue
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                break
            try:
                if self._place(slot, request):
                    joining.append((index, slot))
            except BaseException as exc:
                if slot.request is request:
                    self._end(slot, exc)
                else:
                    self._fail(request, exc)
        if joining:
            try:
                started = time.perf_counter()
                with torch.inference_mode(), self.engine.model.lock:
                    outcomes = self.batched.start([(index, slot.generation) for index, slot in joining])
                self.seconds["prefill"] += time.perf_counter() - started
            except BaseException as exc:
                outcomes = [exc] * len(joining)
            self._settle([slot for _, slot in joining], outcomes)

    def _place(self, slot: Slot, request: Request) -> bool:
        """The request's generation in `slot`, prefilled and its first text delivered; True
        where instead its rows join `batched` (prefilled there, with the others joining)."""
        stream = request.on_piece is not None and request.stream_text
        if request.generation is None and self.batched is not None and \
                not (request.draft and slot.proposer is not None):
            slot.generation = Generation(self.engine, request.prompt_ids, request.config,
                                         stream=stream, outside=True)
            slot.request = request
            return True
        generation = request.generation or Generation(
            self.engine, request.prompt_ids, request.config, cache=slot.cache,
            proposer=slot.proposer if request.draft else None, stream=stream)
        slot.generation, slot.request = generation, request
        started = time.perf_counter()
        with torch.inference_mode(), self.engine.model.lock:
            delta = generation.start()
        self.seconds["prefill"] += time.perf_counter() - started
        self._deliver(slot, delta)
        return False

    def _settle(self, slots: list[Slot], outcomes: list) -> None:
        """Deliver each slot's text, or end its request with the exception in its place."""
        for slot, outcome in zip(slots, outcomes):
            if isinstance(outcome, BaseException):
                self._end(slot, outcome)
                continue
            try:
                self._deliver(slot, outcome)
            except BaseException as exc:
                self._end(slot, exc)

    def _step(self, running: list[Slot]) -> None:
        model = self.engine.model
        if running[0].generation.static:        # the engine's own request on static steps
            with torch.inference_mode():
                delta = running[0].generation.step_static()
            self.steps += 1
            self._deliver(running[0], delta)
            return
        rows = [(index, slot) for index, slot in enumerate(self.slots)
                if slot.generation is not None and slot.generation.outside]
        if self.batched is not None and len(rows) < len(running):
            self._step_with_trees(rows, [slot for slot in running if not slot.generation.outside])
            return
        if rows:
            running = [slot for slot in running if not slot.generation.outside]
            with torch.inference_mode():
                outcomes = self.batched.step([(index, slot.generation) for index, slot in rows])
            self.rows += len(rows)
            self._settle([slot for _, slot in rows], outcomes)
            if not running:
                self.steps += 1
                return
        drafts = self._drafting(running)
        with torch.inference_mode():
            outcomes = step_together(model, [slot.generation for slot in running], drafts)
        self._settle_trees(running, outcomes)
        self.steps += 1

    def _step_with_trees(self, rows: list[tuple[int, Slot]], drafting: list[Slot]) -> None:
        """A step of batched rows with drafted requests running: each proposes
        its tree (the cost rule, `_drafting`, counting the plain rows in), and the plain rows
        and every tree run as rows of one forward (`BatchedDecoding.step_with_trees`)."""
        drafts = self._drafting(drafting, plain=len(rows))
        proposed, trees = [], []
        with torch.inference_mode():
            for slot, draft in zip(drafting, drafts):
                try:
                    trees.append((slot.generation, slot.generation.propose(draft)))
                    proposed.append(slot)
                except Exception as exc:      # its drafting failed: that request alone ends
                    self._end(slot, exc)
            plain, outcomes = self.batched.step_with_trees([(index, slot.generation) for index, slot in rows], trees)
        self.rows += len(rows)
        self._settle([slot for _, slot in rows], plain)
        self._settle_trees(proposed, outcomes)
        self.steps += 1

    def _settle_trees(self, slots: list[Slot], outcomes: list[tuple]) -> None:
        """After a step of trees: each slot's running means of drafts accepted and of second
        head passes, its text delivered (or its request ended with the exception in its
        place), and the step's rows and trees counted."""
        model = self.engine.model
        for slot, (tree, delta) in zip(slots, outcomes):
            if isinstance(delta, BaseException):
                self._end(slot, delta)
                continue
            try:
                if tree.size:
                    step = slot.generation.result.steps[-1]
                    slot.gain += GAIN_WEIGHT * (step.accept_length - 1 - slot.gain)
                    second = step.deepest_row >= model.verify_head_rows
                    slot.passes += GAIN_WEIGHT * (second - slot.passes)
                self._deliver(slot, delta)
            except BaseException as exc:
                self._end(slot, exc)
        trees = [tree for tree, _ in outcomes if tree is not None]     # None: its drafting failed
        self.rows += sum(tree.tokens.numel() for tree in trees)
        self.drafted += sum(1 for tree in trees if tree.size)

    def _drafting(self, running: list[Slot], plain: int = 0) -> list[bool]:
        """Which running requests draft this step (the module docstring's rule), with `plain`
        more requests' rows in the same forward."""
        sampled = [not slot.generation.config.sampling.greedy for slot in running]
        drafts = [s and slot.generation.can_draft for s, slot in zip(sampled, running)]
        first = self.engine.model.verify_head_rows       # head rows a tree is scored by first
        trees = [slot.generation.proposer.max_tree_tokens for slot, d in zip(running, drafts) if d]
        rows = len(running) + plain + sum(trees)
        heads = len(running) + plain + sum(min(extra + 1, first) - 1 for extra in trees)
        tokens = len(running) + plain + sum(slot.gain for slot, d in zip(running, drafts) if d)
        # A path that leaves a tree's first head rows costs a pass of its own (a slot's running
        # rate of them): on Gemma's head that is more than a quarter of a step.
        passes = sum(slot.passes for slot, d in zip(running, drafts) if d)
        one_pass = self.costs.head_pass() if self.costs is not None else 0.0
        # Greedy requests, likeliest to gain first.
        for index in sorted((i for i, slot in enumerate(running) if not sampled[i] and slot.generation.can_draft),
                            key=lambda i: -running[i].gain):
            slot = running[index]
            extra = slot.generation.proposer.next_tree_tokens()
            if extra == 0:
                continue
            more = min(extra + 1, first) - 1
            second = slot.passes if extra + 1 > first else 0.0
            if self.costs is None:
                ok = rows + extra <= self.limits.tree_rows
            else:
                ok = (tokens + slot.gain) / (self.costs(rows + extra, heads + more) + (passes + second) * one_pass) \
                    > tokens / (self.costs(rows, heads) + passes * one_pass)
            if ok:
                drafts[index] = True
                rows += extra
                heads += more
                passes += second
                tokens += slot.gain
        return drafts

    def stats(self) -> dict:
        """Steps run, rows verified and trees drafted so far (the draft budget at work), and the
        seconds spent prefilling joining requests and stepping running ones."""
        return {"steps": self.steps, "rows": self.rows, "drafted": self.drafted,
                **{f"{part}_seconds": round(value, 3) for part, value in self.seconds.items()}}

    def _deliver(self, slot: Slot, delta: str) -> None:
        request, generation = slot.request, slot.generation
        if request.on_piece is not None and (delta or not request.stream_text):
            request.on_piece(delta, generation.result)
        if generation.done:
            self._end(slot, None)

    def _end(self, slot: Slot, error: BaseException | None) -> None:
        request, generation = slot.request, slot.generation
        if request is None:
            return
        generation.result.seconds = time.perf_counter() - generation.started
        request.result, request.error = generation.result, error
        slot.generation = slot.request = None      # its cache is reset when the next one starts
        with self.unanswered_lock:
            self.unanswered.discard(request)
        request.done.set()
