"""Serving many requests at once: continuous batching, each answer bit-identical to serving it alone.

Requests join and leave a running batch between steps. A step asks each running request for its
tree (drafted by its own proposer, or the root alone for plain decoding), runs every tree's rows
through the target in one forward, each over the request's own KV cache, verifies each tree
(the greedy ones in one native call over all of them), commits and streams. On the native engine
a row's bits never depend on the rows beside it, and a request's cache, proposer and sampling
generator are its own: its tokens are exactly those it gets served alone, whatever else runs.
The batch changes when tokens arrive, never which.

The steps run on one thread: the engine's own (`thread=True`), or the caller's, through `run`
(`thread=False`). The second is the fast one on a CPU: OpenMP (libgomp) throttles a parallel
team started outside the process's first thread once its threads outnumber the cores, and every
layer's parallel region then waits on the kernel instead of spinning: on 2 cores a forward in
another thread costs about 4x. So `serve` answers HTTP on a thread of its own and steps the
batch on the main thread, and `generate` steps it on the calling thread.

The engine has `max_batch` slots, each a KV cache of `window` tokens and a proposer built once;
a request takes a free slot (prefilled when it joins), or waits in a queue of at most
`max_waiting`; past that, `submit` refuses (`Busy`). A cancelled request leaves at the next
step.

The draft budget follows the batch and the cost curve. A step of B requests over R rows yields
B tokens plus the drafts accepted, in the time of a forward of R rows, c(R), measured on this
machine when the engine starts (autotune.forward_seconds). A greedy request's tree of d rows
(prompt lookup's actual proposal; another proposer's largest) joins the step only if it raises the step's tokens per second: (B + G + g) / c(R + d) >
(B + G) / c(R), with g the drafts its slot has been accepting per drafted step (a running mean,
from a prior of 0.5) and G those of the trees already in. On a CPU, where each row costs a share
of a forward, a lone request drafts and a full batch decodes plainly; on a GPU, where rows are
nearly free, every request drafts. A greedy request's tokens are the same either way; a sampled
one always drafts as it would alone, so that its random draws, and its tokens, are those of
serving it alone. `BatchLimits.tree_rows` caps the rows instead (None: the cost rule).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..speculation.generate import Engine, Generation, GenerationConfig, GenerationResult, step_together


class Busy(RuntimeError):
    """Every slot is taken and the queue is full."""


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 8          # requests decoding at once (slots)
    max_waiting: int = 64       # requests queued beyond those
    window: int = 4096          # tokens of KV cache per slot: prompt + answer must fit
    # The rows one step verifies over all requests: each greedy request drafts while the
    # batch's rows stay within this. None: the cost rule (module docstring).
    tree_rows: int | None = None

    def __post_init__(self):
        for name in ("max_batch", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {self.max_waiting!r}")
        if self.tree_rows is not None and (not isinstance(self.tree_rows, int) or self.tree_rows < 1):
            raise ValueError(f"tree_rows must be a positive integer or None, got {self.tree_rows!r}")


@dataclass
class Request:
    """A submitted request: `result` once `done` is set; `on_piece(text, result)` hears its
    stream with the result so far (called on the engine's thread)."""
    prompt_ids: list[int]
    config: GenerationConfig
    draft: bool = True
    on_piece: Callable[[str, GenerationResult], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        return self.result


PRIOR_GAIN = 0.5          # drafts accepted per drafted step before a slot has any
GAIN_WEIGHT = 0.1         # the running mean's weight of the latest drafted step


class Slot:
    def __init__(self, engine: Engine, window: int, proposer):
        self.cache = engine.model.new_cache(window)
        self.proposer = proposer
        self.generation: Generation | None = None
        self.request: Request | None = None
        self.gain = PRIOR_GAIN


class Costs:
    """c(rows): the seconds of a target forward over `rows` rows, from measured sizes, linear
    between them and beyond the largest."""

    def __init__(self, seconds: dict[int, float]):
        self.rows = sorted(seconds)
        self.seconds = [seconds[n] for n in self.rows]

    @classmethod
    def measure(cls, model, most: int) -> Costs:
        from ..speculation.autotune import forward_seconds

        sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n < most} | {most - 1})
        return cls({n + 1: s for n, s in forward_seconds(model, sizes, repeats=3).items()})

    def __call__(self, rows: int) -> float:
        xs, ys = self.rows, self.seconds
        if rows <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if rows <= xs[i] or i == len(xs) - 1:
                return ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[0]


class BatchEngine:
    """Continuous batching over `engine`'s model: `submit` requests from any thread; the steps
    run on a background thread (`thread=True`) or on whichever thread calls `run`, `run_once`
    or `generate`. `make_proposer()` builds a slot's proposer (None: plain decoding; called once
    per slot); a request with draft=False decodes plainly in its slot."""

    def __init__(self, engine: Engine, make_proposer: Callable[[], object] | None = None,
                 limits: BatchLimits | None = None, thread: bool = True):
        self.engine, self.limits = engine, limits or BatchLimits()
        model = engine.model
        if self.limits.window > model.args.max_seq_len:
            raise ValueError(f"a slot's window of {self.limits.window} tokens exceeds the model's "
                             f"{model.args.max_seq_len}")
        self.slots = [Slot(engine, self.limits.window, make_proposer() if make_proposer else None)
                      for _ in range(self.limits.max_batch)]
        # The cost curve the draft budget reads: measured once, where anything drafts.
        self.costs = None
        drafting = [slot.proposer for slot in self.slots if slot.proposer is not None]
        if drafting and self.limits.tree_rows is None:
            self.costs = Costs.measure(model, self.limits.max_batch * (drafting[0].max_tree_tokens + 1))
        self.rows = self.drafted = 0          # rows verified, trees drafted (over all steps)
        self.seconds = {"prefill": 0.0, "steps": 0.0}     # time in joining requests' prefill, in steps
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=self.limits.max_waiting)
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
               on_piece: Callable[[str, GenerationResult], None] | None = None) -> Request:
        """Queue a request (ValueError if it cannot run: empty, too long for a slot's window;
        Busy if every slot and the queue are full)."""
        if self.stopping:
            raise RuntimeError("the batch engine has stopped")
        self.check(prompt_ids, config)
        cancel = config.cancel if config.cancel is not None else threading.Event()
        request = Request(list(prompt_ids), replace(config, cancel=cancel), draft, on_piece, cancel=cancel)
        try:
            self.waiting.put_nowait(request)
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
        """ValueError unless the request can run in a slot (Engine.check_prompt, the slot's
        window as the limit)."""
        self.engine.check_prompt(prompt_ids, config, self.limits.window)

    # ---------------------------------------------------------------- the steps

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step the batch on this thread until `close` (or `until()` holds), waiting while
        nothing runs."""
        while not self.stopping and not (until is not None and until()):
            if not self.run_once():
                self.wake.wait(0.05)
                self.wake.clear()
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

    def _stop(self) -> None:
        with self.stepping:
            self._stop_all()

    def _stop_all(self) -> None:
        for slot in self.slots:
            if slot.generation is not None:
                self._end(slot, RuntimeError("the batch engine stopped"))
        while True:
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                return
            request.error = RuntimeError("the batch engine stopped")
            request.done.set()

    def _admit(self) -> None:
        for slot in self.slots:
            if slot.generation is not None:
                continue
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                return
            generation = Generation(self.engine, request.prompt_ids, request.config, cache=slot.cache,
                                    proposer=slot.proposer if request.draft else None,
                                    stream=request.on_piece is not None)
            slot.generation, slot.request = generation, request
            try:
                started = time.perf_counter()
                with torch.inference_mode(), self.engine.model.lock:
                    delta = generation.start()
                self.seconds["prefill"] += time.perf_counter() - started
                self._deliver(slot, delta)
            except BaseException as exc:
                self._end(slot, exc)

    def _step(self, running: list[Slot]) -> None:
        model = self.engine.model
        drafts = self._drafting(running)
        with torch.inference_mode():
            outcomes = step_together(model, [slot.generation for slot in running], drafts)
        for slot, (tree, delta) in zip(running, outcomes):
            if isinstance(delta, BaseException):
                self._end(slot, delta)
                continue
            try:
                if tree.size:
                    accepted = slot.generation.result.steps[-1].accept_length - 1
                    slot.gain += GAIN_WEIGHT * (accepted - slot.gain)
                self._deliver(slot, delta)
            except BaseException as exc:
                self._end(slot, exc)
        trees = [tree for tree, _ in outcomes]
        self.steps += 1
        self.rows += sum(tree.tokens.numel() for tree in trees)
        self.drafted += sum(1 for tree in trees if tree.size)

    def _drafting(self, running: list[Slot]) -> list[bool]:
        """Which running requests draft this step (the module docstring's rule)."""
        sampled = [not slot.generation.config.sampling.greedy for slot in running]
        drafts = [s and slot.generation.can_draft for s, slot in zip(sampled, running)]
        rows = len(running) + sum(slot.proposer.max_tree_tokens for slot, d in zip(running, drafts) if d)
        tokens = len(running) + sum(slot.gain for slot, d in zip(running, drafts) if d)
        # Greedy requests, likeliest to gain first.
        for index in sorted((i for i, slot in enumerate(running) if not sampled[i] and slot.generation.can_draft),
                            key=lambda i: -running[i].gain):
            slot = running[index]
            extra = slot.proposer.next_tree_tokens()
            if extra == 0:
                continue
            if self.costs is None:
                ok = rows + extra <= self.limits.tree_rows
            else:
                ok = (tokens + slot.gain) / self.costs(rows + extra) > tokens / self.costs(rows)
            if ok:
                drafts[index] = True
                rows += extra
                tokens += slot.gain
        return drafts

    def stats(self) -> dict:
        """Steps run, rows verified and trees drafted so far (the draft budget at work), and the
        seconds spent prefilling joining requests and stepping running ones."""
        return {"steps": self.steps, "rows": self.rows, "drafted": self.drafted,
                **{f"{part}_seconds": round(value, 3) for part, value in self.seconds.items()}}

    def _deliver(self, slot: Slot, delta: str) -> None:
        request, generation = slot.request, slot.generation
        if delta and request.on_piece is not None:
            request.on_piece(delta, generation.result)
        if generation.done:
            self._end(slot, None)

    def _end(self, slot: Slot, error: BaseException | None) -> None:
        request, generation = slot.request, slot.generation
        if request is None:
            return
        generation.result.seconds = time.perf_counter() - generation.started
        request.result, request.error = generation.result, error
        slot.generation = slot.request = None
        slot.cache.reset()
        request.done.set()
