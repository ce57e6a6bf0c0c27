"""The decoding loop: continuous batching, each answer bit-identical to serving it alone.

Every step is one path: each running request proposes its tree (drafted by its own proposer, or
its root alone for plain decoding), the trees are laid out as one `StepRows`, the backend runs
them in one forward (each over the request's own KV cache), greedy requests are verified in one
call (`Backend.verify_greedy`), and each request then verifies the rest, commits and streams
(`Generation.finish`). A request joins with its prompt's prefill (`Backend.prefill`) and leaves
between steps. On the native engine a row's bits never depend on the rows beside it, and a
request's cache, proposer and sampling generator are its own: its tokens are exactly those it
gets served alone, whatever else runs. A single request is a batch of one (`Engine`).

The steps run on one thread: the engine's own (`thread=True`), or the caller's, through `run`
(`thread=False`). The second is the fast one on a CPU: OpenMP (libgomp) throttles a parallel
team started outside the process's first thread once its threads outnumber the cores, and every
layer's parallel region then waits on the kernel instead of spinning: on 2 cores a forward in
another thread costs about 4x. So `serve` answers HTTP on a thread of its own and steps the
batch on the main thread, and `generate` steps it on the calling thread.

Whatever a request's own part of a step raises ends that request alone (`_isolated`, the one
handler) and the others step on; a failure of the shared forward ends the step's requests;
should the loop itself fail, every request not yet answered gets the error (`run`).

The draft budget follows the batch and the cost curve. A step of B requests over R rows yields
B tokens plus the drafts accepted, in the time of a forward of R rows, c(R), measured on this
machine when the engine starts (cost_curve.py), with the LM head's own cost per row scored (a
plain request scores one, a tree up to the head's first pass, and a second pass at the rate its
slot's paths have left the first). A greedy request's tree of d rows (its proposer's next
proposal) joins the step only if it raises the step's tokens per second: (B + G + g) / c(R + d)
> (B + G) / c(R), with g the drafts its slot has been accepting per drafted step (a running
mean) and G those of the trees already in. On a CPU a lone request drafts and a full batch
decodes plainly; on a GPU, where rows are nearly free, every request drafts. A sampled request
always drafts as it would alone, so that its random draws, and its tokens, are those of serving
it alone. `BatchLimits.tree_rows` caps the rows instead (None: the cost rule).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from ..runtime.backend import Backend
from ..runtime.step_rows import StepRows
from ..runtime.tokenizer import Tokenizer
from .cost_curve import Costs
from .generate import Generation, GenerationConfig, GenerationResult, Target, require_exact, graphs_by_default
from ..speculation.proposer import Proposer


def check_prompt(model: Backend, prompt_ids: list[int], config: GenerationConfig, limit: int) -> None:
    """ValueError unless the prompt can run: not empty, ids in the vocabulary, prompt and
    answer within `limit` tokens of cache."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    vocab = model.args.vocab_size
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


def check_cache_fits(model: Backend, slots: int, window: int) -> None:
    """ValueError, with the numbers, where `slots` caches of `window` tokens do not fit the
    memory free now: a server meets its memory need when it starts, or says it cannot."""
    from ..runtime.loading import memory_available

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
    # Requests as rows of one forward over a slot table (torch_backend.py), not a forward each.
    # None: where that is the faster way and allowed: a model on the row-invariant kernels
    # (exact there), or on torch's with inexact answers allowed; never the native engine, whose
    # step is one call already.
    batched: bool | None = None

    def __post_init__(self):
        for name, least in (("max_batch", 1), ("window", 1), ("max_waiting", 0), ("tree_rows", 1)):
            value = getattr(self, name)
            if (value is not None or name != "tree_rows") and \
                    (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


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
    stream_text: bool = True
    generation: Generation | None = None    # its state once it holds a slot

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
    """A place for one request: its KV cache of `window` tokens (made when first used where not
    given: a request on graph steps uses its decoder's instead), the proposer built for it, and
    the running means the cost rule reads."""

    def __init__(self, model: Backend, window: int, proposer, cache=None):
        self.model, self.window = model, window
        self._cache = cache
        self.proposer = proposer
        self.generation: Generation | None = None
        self.request: Request | None = None
        self.gain = PRIOR_GAIN
        self.passes = PRIOR_PASSES

    @property
    def cache(self):
        if self._cache is None:
            self._cache = self.model.new_cache(self.window)
        return self._cache


class BatchEngine:
    """Continuous batching over `model` (a Backend): `submit` requests from any thread; the
    steps run on a background thread (`thread=True`) or on whichever thread calls `run`,
    `run_once` or `generate`. `make_proposer()` builds a slot's proposer (None: plain decoding;
    called once per slot); a request with draft=False decodes plainly in its slot. Drafting
    needs an exact backend unless `allow_inexact`. allocate=False: each slot's cache is made
    when first used."""

    def __init__(self, model: Backend, tokenizer: Tokenizer | None = None,
                 make_proposer: Callable[[], object] | None = None, limits: BatchLimits | None = None,
                 allow_inexact: bool = False, thread: bool = True, allocate: bool = True):
        self.limits = limits or BatchLimits()
        if self.limits.window > model.args.max_seq_len:
            raise ValueError(f"a slot's window of {self.limits.window} tokens exceeds the model's "
                             f"{model.args.max_seq_len}")
        self.model, self.allow_inexact = model, allow_inexact
        self.target = Target.of(model, tokenizer)
        self.tokenizer, self.eos_ids, self.max_len = self.target.tokenizer, self.target.eos_ids, self.limits.window
        caches = self._caches(allocate)
        proposers = [make_proposer() if make_proposer else None for _ in caches]
        if any(p is not None for p in proposers):
            require_exact(model, allow_inexact)
        self.slots = [Slot(model, self.limits.window, proposer, cache) for proposer, cache in zip(proposers, caches)]
        # The cost curve the draft budget reads: measured once, where anything drafts.
        self.costs = None
        drafting = [slot.proposer for slot in self.slots if slot.proposer is not None]
        if drafting and self.limits.tree_rows is None:
            self.costs = Costs.measure(model, self.limits.max_batch * (drafting[0].max_tree_tokens + 1),
                                       heads=self.limits.max_batch * model.head_rows)
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

    def _caches(self, allocate: bool) -> list:
        """Each slot's cache: the backend's (rows together over one slot table where the limits
        ask or the backend batches so by default), or None (made when first used). A server
        meets its memory need when it starts, not under its first load."""
        model, limits = self.model, self.limits
        together = model.together(self.allow_inexact, limits.batched)
        self.together = together        # its requests' rows run as one forward over a slot table
        if together:
            return model.caches(limits.max_batch, limits.window, together=True)[:limits.max_batch]
        if not allocate:
            return [None] * limits.max_batch
        if model.memory is not None and model.device.type == "cpu":
            check_cache_fits(model, limits.max_batch, limits.window)
        return model.caches(limits.max_batch, limits.window)

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
            with self.unanswered_lock:
                self.waiting.put_nowait(request)
                self.unanswered.add(request)
        except queue.Full:
            raise Busy(f"all {self.limits.max_batch} slots are decoding and {self.limits.max_waiting} "
                       "requests wait: try again later") from None
        self.wake.set()
        return request

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

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join()
        else:
            self._stop()

    def check(self, prompt_ids: list[int], config: GenerationConfig) -> None:
        """ValueError unless the request can run in a slot (within its window)."""
        check_prompt(self.model, prompt_ids, config, self.limits.window)

    # ---------------------------------------------------------------- the steps

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step the batch on this thread until `close` (or `until()` holds), waiting while
        nothing runs. Each request's own failures end that request alone (`_isolated`);
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
            self._admit(self._take_waiting())
            running = [slot for slot in self.slots if slot.generation is not None]
            if not running:
                return False
            try:
                started = time.perf_counter()
                with self.model.lock, torch.inference_mode():
                    self._step(running)
                self.seconds["steps"] += time.perf_counter() - started
            except BaseException as exc:       # a failed step fails its requests, not the engine
                for slot in running:
                    self._end(slot, exc)
            return True

    def _isolated(self, slot: Slot, action: Callable[[], object]):
        """`action()` for the request in `slot` (its value); where it raises, that request alone
        ends with the error and None is returned: the one per-request failure handler. An
        interrupt is no request's failure: it ends the whole step (`run_once`)."""
        try:
            return action()
        except Exception as exc:
            self._end(slot, exc)
            return None

    def _take_waiting(self) -> list[Slot]:
        """Waiting requests placed into free slots, in order; the slots that took one."""
        placed = []
        for slot in self.slots:
            if slot.request is not None:
                continue
            try:
                slot.request = self.waiting.get_nowait()
            except queue.Empty:
                break
            placed.append(slot)
        return placed

    def _admit(self, slots: list[Slot]) -> None:
        """The requests just placed in `slots` start: each its generation (its sampling generator
        and its backend's cache and proposer with it), then every prompt prefilled together
        (`Backend.prefill`) and each first token delivered; a request whose part fails ends
        alone, and a failed prefill ends those it held."""
        joining = [slot for slot in slots if self._isolated(slot, lambda slot=slot: self._start(slot))]
        if not joining:
            return
        started = time.perf_counter()
        try:
            with self.model.lock, torch.inference_mode():
                prefilled = self.model.prefill([(slot.generation.prompt_ids, slot.generation.cache,
                                                  slot.generation.taps) for slot in joining])
        except Exception as exc:
            for slot in joining:
                self._end(slot, exc)
            return
        self.seconds["prefill"] += time.perf_counter() - started
        for slot, (rows, logits) in zip(joining, prefilled):
            self._isolated(slot, lambda slot=slot, rows=rows, logits=logits:
                           self._deliver(slot, slot.generation.start(rows, logits)))

    def _start(self, slot: Slot) -> bool:
        """The request in `slot` gets its generation, its backend's form of it (`prepare`) and a
        fresh cache; True (`_admit` keeps the slots whose start did not raise)."""
        request = slot.request
        stream = request.on_piece is not None and request.stream_text
        proposer = slot.proposer if request.draft else None
        generation = Generation(self.target, request.prompt_ids, request.config, None, proposer, stream)
        generation.started = time.perf_counter()
        slot.generation = request.generation = generation
        self.model.prepare(generation)
        if generation.cache is None:
            generation.cache = slot.cache
        generation.cache.reset()
        return True

    def _step(self, running: list[Slot]) -> None:
        """One step of every running request: proposals -> StepRows -> the backend's forward ->
        greedy verification -> each request's finish (module docstring)."""
        rows, trees = StepRows(), {}
        for slot, draft in zip(running, self._drafting(running)):
            tree = self._isolated(slot, lambda slot=slot, draft=draft: slot.generation.propose(draft))
            if tree is not None:
                trees[slot.generation.span(rows, tree, owner=slot)] = tree
        if not rows.spans:
            return
        rows.taps = tuple(sorted({t for span in rows.spans for t in span.owner.generation.step_taps}))
        t1 = time.perf_counter()
        self.model.forward(rows)
        forwarded = time.perf_counter()
        self.model.verify_greedy(rows, [span for span in rows.spans if span.owner.generation.verifies_greedily
                                        and span.settled is None])
        for span, tree in trees.items():
            slot = span.owner
            self._isolated(slot, lambda: self._finish(slot, rows, span, tree, t1, forwarded))
        self.rows += rows.rows
        self.drafted += sum(1 for tree in trees.values() if tree.size)
        self.steps += 1

    def _finish(self, slot: Slot, rows: StepRows, span, tree, t1: float, forwarded: float) -> None:
        """A request's step past the shared forward: its verification, commit and text
        (`Generation.finish`), its slot's running means of drafts accepted and of second head
        passes (a drafted step's), its text delivered."""
        delta = slot.generation.finish(rows, span, tree, t1, forwarded)
        step = slot.generation.result.steps[-1]
        if tree.size or step.tree_size:
            slot.gain += GAIN_WEIGHT * (step.accept_length - 1 - slot.gain)
            second = step.deepest_row >= self.model.head_rows
            slot.passes += GAIN_WEIGHT * (second - slot.passes)
        self._deliver(slot, delta)

    def _drafting(self, running: list[Slot]) -> list[bool]:
        """Which running requests draft this step (the module docstring's rule)."""
        sampled = [not slot.generation.config.sampling.greedy for slot in running]
        drafts = [s and slot.generation.can_draft for s, slot in zip(sampled, running)]
        first = self.model.head_rows       # head rows a tree is scored by first
        trees = [slot.generation.proposer.max_tree_tokens for slot, d in zip(running, drafts) if d]
        rows = len(running) + sum(trees)
        heads = len(running) + sum(min(extra + 1, first) - 1 for extra in trees)
        tokens = len(running) + sum(slot.gain for slot, d in zip(running, drafts) if d)
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
        """The request in `slot` answered (with `error`, or its result) and the slot freed (its
        cache is reset when the next request starts)."""
        request, generation = slot.request, slot.generation
        if request is None:
            return
        if generation is not None:
            generation.result.seconds = time.perf_counter() - generation.started
        request.result, request.error = (generation.result if generation is not None else None), error
        slot.generation = slot.request = None
        with self.unanswered_lock:
            self.unanswered.discard(request)
        request.done.set()

    def _stop(self, error: BaseException | None = None) -> None:
        """End every request with `error`: those decoding, those queued, and any between."""
        error = error or Stopped("the batch engine stopped")
        with self.stepping:
            for slot in self.slots:
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


class Stream:
    """A request an `Engine` steps on the caller's thread as the caller iterates: its text as
    it comes; `result` once done; what ended it raised at the end."""

    def __init__(self, engine: "Engine", request: Request):
        self.engine, self.request = engine, request

    def __iter__(self) -> Iterator[str]:
        return self.engine.run_alone(self.request)

    @property
    def generation(self) -> Generation | None:
        return self.request.generation

    @property
    def result(self) -> GenerationResult | None:
        return self.request.result or (self.generation.result if self.generation is not None else None)


class Engine(BatchEngine):
    """A target model (and optionally a proposer) ready to generate: a batch of one slot, its
    request stepped on the caller's thread, drafting at every step its proposer can (the tree
    the user chose: the cost rule weighs trees against other requests' rows, and there are
    none). Its cache is made when first needed (a cache of the whole context window is the
    largest allocation a request makes: 1 GB for an 8B model at 8k tokens in bfloat16). Greedy
    steps run as graph steps captured as CUDA graphs (`graphs`; None: on CUDA, for proposers
    that can: prompt lookup, Medusa, EAGLE without SpecVocab; graph_step.py)."""

    def __init__(self, model: Backend, tokenizer: Tokenizer | None = None, proposer: Proposer | None = None,
                 allow_inexact: bool = False, graphs: bool | None = None):
        if graphs is None:
            graphs = graphs_by_default(model) and (proposer is None or proposer.graphs)
        self.loaded = model         # the backend as loaded (graph steps wrap it)
        if graphs:
            from .graph_step import GraphBackend

            model = GraphBackend(model, proposer)
        # Rows capped at the window (no tree outgrows it: `Generation.can_draft`), not by cost.
        limits = BatchLimits(max_batch=1, max_waiting=1, window=model.args.max_seq_len,
                             tree_rows=model.args.max_seq_len, batched=False)
        super().__init__(model, tokenizer, lambda: proposer, limits, allow_inexact, thread=False, allocate=False)
        self.graphs = graphs

    @property
    def proposer(self) -> Proposer | None:
        return self.slots[0].proposer

    def stream(self, prompt_ids: list[int], config: GenerationConfig, stream_text: bool = True) -> Stream:
        """The request as a `Stream`: iterating it steps it and yields its text."""
        self.check(prompt_ids, config)
        return Stream(self, Request(list(prompt_ids), config, stream_text=stream_text))

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> GenerationResult:
        # Nobody reads the text before the end: it is decoded once then.
        stream = self.stream(prompt_ids, config, stream_text=False)
        for _ in stream:
            pass
        return stream.result

    def run_alone(self, request: Request) -> Iterator[str]:
        """Run `request` in the slot, stepping on this thread; yield its text as it comes, raise
        what ended it."""
        pieces: list[str] = []
        request.on_piece = lambda text, _: pieces.append(text)
        slot = self.slots[0]
        with self.stepping:
            if slot.request is not None:
                raise RuntimeError("this engine is running another generation: finish it first, "
                                   "or serve several at once with a BatchEngine")
            with self.unanswered_lock:
                self.unanswered.add(request)
            slot.request = request
            self._admit([slot])           # prefilled before anything can abandon it
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
                    self._end(slot, None)
        if request.error is not None:
            raise request.error
