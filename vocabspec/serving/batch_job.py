"""A batch job: a JSONL file of requests answered together (`vocabspec generate --input`), each
answer written as it finishes, so a job of thousands of prompts can be watched, interrupted and
resumed.

The requests run on the batch engine (decoding/batch.py), each answer exactly what the
request gets alone; on torch's kernels with inexact answers allowed, the plain-decoding ones
step as rows of one forward (torch_backend.py), each answer the request's up to rounding,
and the job then serves a sample of its answers alone again and counts those that differ
(`check_alone`: in the summary and the record). Its JSON line (`index`: the request's place among the file's requests,
counting from 0) is written and flushed the moment the request ends, in finish order, or held
back to keep input order (`ordered`). A request that fails gets a line of its own, its index and
`error`; the rest go on.

An output file resumes: `AnswerFile` reads the lines already there, cuts a half-written last
line away (a crash mid-write; a line counts only once its newline is on disk), and the job
answers only the requests missing. Beside the answers, `OUTPUT.job.json` records a hash of the
requests and the options that shape answers, so a rerun after the input or those options changed
is refused rather than mixing two jobs' answers in one file.

`Progress` draws requests done, tokens, tokens a second and the time left on standard error,
and the job ends with a summary line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

FIELDS = {"prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "parse_special"}
JOB_FORMAT = "vocabspec-batch-job-1"


def read_requests(path: Path) -> list[dict]:
    """The file's requests, one JSON object a non-blank line (ValueError naming the line for a
    line that is not one, or has fields no request has)."""
    if not path.is_file():
        raise FileNotFoundError(f"--input {path} does not exist")
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: a request is a JSON object")
        unknown = set(item) - FIELDS
        if unknown:
            raise ValueError(f"{path}:{number}: unknown field(s) {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(sorted(FIELDS))})")
        if ("prompt" in item) == ("messages" in item):
            raise ValueError(f"{path}:{number}: give prompt or messages")
        requests.append(item)
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def request_ids(lm, item: dict, settings: dict, chat: bool) -> list[int]:
    """A request's prompt ids, its parse_special taken out of `settings`: the command's applies
    to plain prompts, a chat request's own is refused (a chat's messages are always text)."""
    in_chat = chat or "messages" in item
    special = settings.pop("parse_special", None)
    return lm.encode_prompt(item.get("prompt", item.get("messages")), chat=in_chat,
                            parse_special=special if not in_chat or "parse_special" in item else None)


def requests_hash(requests: list[dict]) -> str:
    """The requests' identity: blank lines, key order and spacing in the file do not count."""
    digest = hashlib.sha256()
    for item in requests:
        digest.update(json.dumps(item, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    return digest.hexdigest()


def _write_record(record_path: Path, record: dict) -> None:
    """Replace the job's record whole: never a half-written one."""
    temporary = record_path.with_name(record_path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(temporary, record_path)


class AnswerFile:
    """The job's output file: the indices it records (answered or failed), and appending to it.

    `open` resumes it: a missing or empty file starts the job; else its record (`OUTPUT.job.json`)
    must name the same requests and options."""

    def __init__(self, path: Path, recorded: dict[int, bool], discarded: int):
        self.path = path
        self.recorded = recorded        # index -> whether that request failed
        self.discarded = discarded      # bytes of a half-written last line cut away
        self._out: TextIO | None = None

    @staticmethod
    def record_path(path: Path) -> Path:
        return path.with_name(path.name + ".job.json")

    @classmethod
    def open(cls, path: Path, input_path: Path, requests: list[dict], options: dict) -> "AnswerFile":
        record_path = cls.record_path(path)
        record = {"format": JOB_FORMAT, "input": str(input_path), "requests": len(requests),
                  "requests_sha256": requests_hash(requests), "options": options}
        if path.is_dir():
            raise ValueError(f"--output {path} is a directory, not a file")
        if not path.exists() or path.stat().st_size == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_record(record_path, record)
            path.write_bytes(b"")
            return cls(path, {}, 0)
        if not record_path.is_file():
            raise ValueError(f"{path} holds lines but no {record_path.name} saying which requests "
                             f"they answer: name another --output, or move {path} away")
        try:
            previous = json.loads(record_path.read_text(encoding="utf-8"))
            if previous.get("format") != JOB_FORMAT:
                raise ValueError(f"format {previous.get('format')!r}")
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{record_path} is not a batch job's record ({exc})") from None
        if previous.get("requests_sha256") != record["requests_sha256"]:
            begun = f"{path} was begun from {previous.get('input')} ({previous.get('requests')} requests)"
            if previous.get("input") == str(input_path):
                raise ValueError(f"{input_path} has changed since {begun}; it holds {len(requests)} "
                                 f"requests now: restore it, or name another --output")
            raise ValueError(f"{input_path} holds other requests than {begun}: rerun with that input, "
                             f"or name another --output")
        changed = [f"{name} {previous.get('options', {}).get(name)!r}, not {value!r}"
                   for name, value in options.items() if previous.get("options", {}).get(name) != value]
        if changed:
            raise ValueError(f"{path} was begun with {'; '.join(changed)}: rerun with the same "
                             f"options, or name another --output")
        return cls._read(path, len(requests))

    @classmethod
    def _read(cls, path: Path, total: int) -> "AnswerFile":
        data = path.read_bytes()
        complete = data.rfind(b"\n") + 1    # a line is on record once its newline is
        discarded = len(data) - complete
        if discarded:
            with open(path, "r+b") as out:
                out.truncate(complete)
        recorded = {}
        for number, line in enumerate(data[:complete].decode("utf-8").splitlines(), 1):
            try:
                item = json.loads(line)
                index = item["index"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: not an answer line: the file is damaged "
                                 f"(move it away to start over)") from None
            if not isinstance(index, int) or not 0 <= index < total:
                raise ValueError(f"{path}:{number}: index {index!r} is not one of the {total} requests")
            if index in recorded:
                raise ValueError(f"{path}:{number}: request {index} is answered twice")
            recorded[index] = "error" in item
        return cls(path, recorded, discarded)

    def note(self, key: str, value) -> None:
        """Add `key` to the job's record (replaced whole, never half-written): what a run
        found, beside what identifies the job (which a resume reads)."""
        record_path = self.record_path(self.path)
        record = json.loads(record_path.read_text(encoding="utf-8"))
        record[key] = value
        _write_record(record_path, record)

    def write(self, line: dict) -> None:
        if self._out is None:
            self._out = open(self.path, "a", encoding="utf-8")
        # One write and a flush: a kill leaves whole lines and at most one partial last line.
        self._out.write(json.dumps(line) + "\n")
        self._out.flush()
        self.recorded[line["index"]] = "error" in line

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


class StreamAnswers:
    """Answers to standard output (no --output): nothing to resume."""

    def __init__(self, out: TextIO):
        self.out, self.recorded, self.discarded = out, {}, 0

    def note(self, key: str, value) -> None:
        pass

    def write(self, line: dict) -> None:
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        self.recorded[line["index"]] = "error" in line

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


BAR = 24            # characters of the terminal's bar
RATE_WINDOW = 30.0  # seconds the progress's tokens a second are measured over


class Progress:
    """Requests done, tokens (those of requests still decoding too), tokens a second and the
    time left, on `out`: redrawn in place on a terminal, else a line every `every` seconds.

    The time left is the tokens still to come at the recent rate (`rate`): a request decoding
    may run to its max_new_tokens (the ones still running are the long ones: with a batch as
    large as the job, the short ones are gone first), one waiting is expected to fill its
    max_new_tokens as the finished ones filled theirs."""

    def __init__(self, out: TextIO, total: int, done: int, every: float = 10.0):
        self.out, self.total, self.done = out, total, done
        self.terminal = out.isatty()
        self.every = 0.25 if self.terminal else every
        self.started = time.perf_counter()
        self.shown = self.started
        self.finished_tokens = 0          # this run's answers
        self.finished_budget = 0          # their max_new_tokens
        self.budgets: dict[int, int] = {}     # max_new_tokens of the requests not finished
        self.live: dict[int, int] = {}        # tokens so far of those decoding
        # (time, tokens), for `rate`: from the first step on, not the job's start, where the
        # first batch's prompts are prefilled (10 s for 64 prompts on 2 cores) and few tokens flow.
        self.samples: deque[tuple[float, int]] = deque()

    def expect(self, index: int, budget: int) -> None:
        self.budgets[index] = budget

    def piece(self, index: int, tokens: int) -> None:
        self.live[index] = tokens

    def finish(self, index: int, tokens: int) -> None:
        self.live.pop(index, None)
        self.done += 1
        self.finished_tokens += tokens
        self.finished_budget += self.budgets.pop(index, 0)

    def fail(self, index: int) -> None:
        self.live.pop(index, None)
        self.budgets.pop(index, None)
        self.done += 1

    def tokens(self) -> int:
        return self.finished_tokens + sum(self.live.values())

    def rate(self) -> float | None:
        """Tokens a second over the last RATE_WINDOW seconds (None before two samples): the
        job's start (the first batch's prompts prefilled) is slower than its run, and a rate
        since the start would overstate the time left for minutes."""
        now, tokens = time.perf_counter(), self.tokens()
        if not self.samples or now - self.samples[-1][0] >= 0.5:
            self.samples.append((now, tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW:
            self.samples.popleft()
        then, before = self.samples[0]
        return (tokens - before) / (now - then) if now > then else None

    def line(self) -> str:
        rate = self.rate()
        fill = self.finished_tokens / self.finished_budget if self.finished_budget else 1.0
        to_come = sum(budget - self.live[index] if index in self.live else fill * budget
                      for index, budget in self.budgets.items())
        left = _clock(max(to_come, 0) / rate) if rate else "?"
        speed = "?" if rate is None else f"{rate:.1f}"
        return (f"{self.done}/{self.total} requests, {self.tokens()} tokens, {speed} tok/s, "
                f"{left} left")

    def show(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.shown < self.every:
            self.rate()               # keeps its samples of the last RATE_WINDOW seconds
            return
        self.shown = now
        if self.terminal:
            filled = int(BAR * self.done / self.total) if self.total else BAR
            self.out.write(f"\r\033[K|{'#' * filled}{'-' * (BAR - filled)}| " + self.line())
        else:
            self.out.write(f"[{self.line()}]\n")
        self.out.flush()

    def end(self) -> None:
        if self.terminal:
            self.show(force=True)
            self.out.write("\n")
            self.out.flush()


@dataclass
class JobResult:
    answers: int = 0                  # this run's
    failed: int = 0
    tokens: int = 0
    steps: int = 0                    # verification steps of those answers
    accepted: int = 0                 # tokens those steps committed
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    # Where answers may differ from serving alone (rows together on torch_backend.py): how many of a sample
    # were served alone again, and how many of those differ; None where they cannot differ.
    alone_checked: int | None = None
    alone_differ: int = 0

    @property
    def mean_accept_len(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


def error_message(exc: BaseException) -> str:
    text = str(exc)
    return text if isinstance(exc, ValueError) and text else f"{type(exc).__name__}: {text}"


ALONE_SAMPLE = 8      # answers `check_alone` serves alone again


def check_alone(lm, answered: list[tuple[list[int], object, list[int]]], most: int = ALONE_SAMPLE) -> tuple[int, int]:
    """Serve up to `most` of the (prompt ids, config, tokens) answers alone again, spread evenly
    over them, those whose answer is fixed (greedy, or sampled with a seed) and ran to its end
    (not cut by time or cancelled); (how many were served, how many of those got other tokens)."""
    fixed = [item for item in answered if item[1].sampling.greedy or item[1].sampling.seed is not None]
    sample = fixed[::max(1, -(-len(fixed) // most))][:most]
    differ = sum(lm.engine.generate(ids, replace(config, deadline=None, cancel=None)).tokens != tokens
                 for ids, config, tokens in sample)
    return len(sample), differ


def run_job(lm, requests: list[dict], pending: list[int], defaults: dict, chat: bool,
            answers, max_batch: int, ordered: bool, progress: Progress) -> JobResult:
    """Answer `requests[i]` for each i in `pending` (in that order), writing each line to
    `answers` as it finishes (`ordered`: in `pending`'s order). Where the answers may differ
    from serving each alone (inexact batched rows), a sample is served alone (`check_alone`)
    and the count recorded."""
    result = JobResult()
    started = time.perf_counter()
    lines = JobLines(answers, pending, ordered, progress, result)
    prepared = prepare_requests(lm, requests, pending, defaults, chat, progress, lines)
    if prepared:
        batch, answered = decode_requests(lm, prepared, max_batch, progress, lines, result)
    result.seconds = time.perf_counter() - started
    progress.end()
    if prepared and batch.together and not batch.model.exact and answered:
        result.alone_checked, result.alone_differ = check_alone(lm, answered)
        answers.note("alone_check", {"answers": result.alone_checked, "differ": result.alone_differ,
                                     "of": len(answered)})
    return result


class JobLines:
    """Where a job's lines go: to `answers` as each request ends, or (`ordered`) held back to
    keep `pending`'s order; a failure counted, shown and recorded on its line."""

    def __init__(self, answers, pending: list[int], ordered: bool, progress: Progress, result: JobResult):
        self.answers, self.ordered, self.progress, self.result = answers, ordered, progress, result
        self.held: dict[int, dict] = {}
        self.order = deque(pending)

    def record(self, line: dict) -> None:
        if not self.ordered:
            self.answers.write(line)
            return
        self.held[line["index"]] = line
        while self.order and self.order[0] in self.held:
            self.answers.write(self.held.pop(self.order.popleft()))

    def fail(self, index: int, exc: BaseException) -> None:
        self.result.failed += 1
        self.progress.fail(index)
        self.record({"index": index, "error": error_message(exc)})


def prepare_requests(lm, requests: list[dict], pending: list[int], defaults: dict, chat: bool,
                     progress: Progress, lines: JobLines) -> list[tuple]:
    """(index, prompt ids, config) of each pending request, checked against the model's context
    window: one that cannot run fails alone, before anything decodes."""
    prepared = []
    for index in pending:
        item = requests[index]
        settings = {**defaults, **{k: v for k, v in item.items() if k not in ("prompt", "messages")}}
        budget = settings["max_new_tokens"] if isinstance(settings["max_new_tokens"], int) else 0
        progress.expect(index, budget)
        try:
            ids = request_ids(lm, item, settings, chat)
            config = lm._config(**settings)
            lm.engine.check(ids, config)
        except Exception as exc:                  # noqa: BLE001 - recorded on its line
            lines.fail(index, exc)
            continue
        prepared.append((index, ids, config))
    return prepared


def decode_requests(lm, prepared: list[tuple], max_batch: int, progress: Progress, lines: JobLines,
                    result: JobResult) -> tuple:
    """The prepared requests through one batch engine, each line recorded as its request ends;
    (the batch, the (ids, config, tokens) of the answers that ran to their end)."""
    from ..decoding.batch import BatchLimits

    window = max(len(ids) + config.max_new_tokens + 1 for _, ids, config in prepared)
    # A queue as long as the batch: a whole batch joins (one prefill) between two steps.
    batch = lm.batch(BatchLimits(max_batch=max_batch, max_waiting=max(max_batch, BatchLimits.max_waiting),
                                 window=min(max(window, 256), lm.engine.model.args.max_seq_len)))
    asked = {index: (ids, config) for index, ids, config in prepared}
    answered = []
    waiting = deque(prepared)
    running = {}
    while waiting or running:
        submit_waiting(batch, waiting, running, progress, lines)
        batch.run_once()
        for index, request in list(running.items()):
            if not request.done.is_set():
                continue
            del running[index]
            answer = finished_answer(index, request, progress, lines, result)
            if answer is not None and answer.stop_reason not in ("time", "cancelled"):
                answered.append((*asked[index], answer.tokens))
        progress.show()
    return batch, answered


def submit_waiting(batch, waiting: deque, running: dict, progress: Progress, lines: JobLines) -> None:
    """The waiting requests into the batch engine until its queue is full; one it refuses
    otherwise fails alone."""
    from ..decoding.batch import Busy

    while waiting:
        index, ids, config = waiting[0]
        try:
            # Progress counts tokens: no text is decoded before an answer ends.
            request = batch.submit(ids, config, on_piece=lambda _, so_far, index=index:
                                   progress.piece(index, len(so_far.tokens)), stream_text=False)
        except Busy:                     # the engine's queue is full: step, then submit
            break
        except Exception as exc:         # noqa: BLE001 - recorded on its line
            lines.fail(index, exc)
        else:
            running[index] = request
        waiting.popleft()


def finished_answer(index: int, request, progress: Progress, lines: JobLines, result: JobResult):
    """A finished request's line recorded and its figures counted: its answer, or None where
    it failed."""
    if isinstance(request.error, (KeyboardInterrupt, SystemExit)):
        # The batch engine hands an interrupt during a step to the step's requests
        # as their error: it stops the job, and they stay unrecorded, to run again.
        raise request.error
    if request.error is not None:
        lines.fail(index, request.error)
        return None
    answer = request.result
    result.answers += 1
    result.tokens += answer.new_tokens
    result.steps += len(answer.steps)
    result.accepted += sum(step.accept_length for step in answer.steps)
    progress.finish(index, answer.new_tokens)
    lines.record({"index": index, **answer.as_dict(), "tokens": answer.tokens})
    return answer


def summary(result: JobResult, answers, total: int, drafting: bool, output: str | None) -> str:
    """The job's last line: this run's answers, failures, tokens, wall time, tokens a second
    (and tokens per verification step where drafting); where it resumed, what the file holds."""
    rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
    answers_word = "answer" if result.answers == 1 else "answers"
    text = (f"[{result.answers} {answers_word}, {result.failed} failed, {result.tokens} tokens in "
            f"{result.seconds:.1f} s, {rate:.1f} tok/s")
    if drafting:
        text += f", mean accepted length {result.mean_accept_len:.2f}"
    if result.alone_checked is not None:
        text += (f"; {result.alone_differ} of {result.alone_checked} answers served alone again "
                 f"differ (rows batched on torch's kernels)")
    if output is not None:
        failed = sum(answers.recorded.values())
        text += f"; {output} holds {len(answers.recorded)} of {total} requests, {failed} failed"
    return text + "]"
