"""User prompts the target writes itself, for drafter data past what ShareGPT holds.

A chat model given its template up to the opening of a user turn, and nothing after it,
writes a user's message: a question, a request for code, a plan to make (Magpie, Xu et al.
2024, builds instruction sets this way). A base model given its "Question:" frame after the
worked example writes a question. Sampled at temperature 1 (top-p 0.95), each seed gives
another prompt, so the supply does not run out as ShareGPT's first and later turns do: the
drafter recipe's fresh data once those are used.

Prompt `i` is drawn with seed `i`, on the batch engine (each request exactly as alone), so the
prompts of seeds [start, start + count) are the same on every machine and format where the
target's bits are, and a later run asks for the next seeds. A draw is kept only if it ended
(the turn's end or the frame's stop, not the token limit), has at least three words and is
not a repeat of an earlier one in the run, so a run keeps at most `count` prompts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..runtime import native
from ..runtime.prompts import conversation_text, encode_conversation, is_chat

PLACEHOLDER = "\x00user message\x00"
TEMPERATURE, TOP_P = 1.0, 0.95
MAX_PROMPT_TOKENS = 96
BASE_QUESTION_STOP = "\n\nAnswer:"
SAVE_SECONDS = 120.0      # between saves of the draws so far: an interruption loses at most these


def user_turn_opening(tokenizer) -> tuple[list[int], tuple[str, ...]]:
    """The tokens a user's message follows in the target's frame, and the stop strings that end
    it (a chat model ends its turn with its end-of-sequence token instead)."""
    text = conversation_text(tokenizer, [("user", PLACEHOLDER)], answer_open=True)
    opening = text[:text.index(PLACEHOLDER)]
    if is_chat(tokenizer):
        return tokenizer.encode(opening, add_bos=False), ()
    return tokenizer.encode(opening.rstrip(" ")), (BASE_QUESTION_STOP,)


def sample_user_prompts(model_path: Path, start: int, count: int, *, device: str = "cpu",
                        batch: int = 32, cache: Path | None = None, deadline: float | None = None,
                        weights: str = "auto", backend: str = "auto", allow_inexact: bool = False) -> list[str]:
    """The kept user messages of seeds [start, start + count), in seed order. `cache` (a JSON
    file) holds the draws so far: a rerun draws only the seeds it lacks. `deadline` (a
    time.perf_counter() value): no seed starts after it, and those not drawn are left out (a
    rerun with the cache draws them). weights, backend: the target's (loading.load_model);
    allow_inexact: batch the draws on torch's kernels, where a draw then depends on its batch's
    rounding (training data only: the device recipe's bfloat16 answers do too)."""
    drawn: dict[int, str | None] = {}
    if cache is not None and cache.exists():
        drawn = {int(k): v for k, v in json.loads(cache.read_text()).items()}
    todo = [seed for seed in range(start, start + count) if seed not in drawn]
    threads = torch.get_num_threads()
    if todo and device == "cpu":
        # The native engine's largest team is OpenMP's maximum at its first call: fixed here
        # first, or the draw's single torch thread would bound every later native forward.
        if native.available()[0]:
            native.threads()
        # A draw's torch work (the nucleus over one vocabulary row) is too small to share among
        # threads: at two threads beside busy cores 40 sampled tokens took 12.2 s, at one 3.4 s.
        torch.set_num_threads(1)
    try:
        if todo:
            _draw(model_path, todo, drawn, device, batch, cache, deadline,
                  dict(weights=weights, backend=backend, allow_inexact=allow_inexact))
    finally:
        torch.set_num_threads(threads)
    kept, seen = [], set()
    for seed in range(start, start + count):
        text = drawn.get(seed)
        if text and len(text.split()) >= 3 and text not in seen:
            seen.add(text)
            kept.append(text)
    return kept


def _draw(model_path: Path, todo: list[int], drawn: dict, device: str, batch: int,
          cache: Path | None, deadline: float | None, loading: dict) -> None:
    """Draw the seeds in `todo` into `drawn` (None: a draw that did not end), then save; past
    `deadline` no seed starts."""
    from ..serving.api import load
    from ..decoding.batch import BatchLimits
    from ..decoding.generate import GenerationConfig
    from ..speculation.sampling import SamplingParams

    lm = load(str(model_path), device=device, **loading)
    opening, stops = user_turn_opening(lm.tokenizer)
    engine = lm.batch(BatchLimits(max_batch=batch, max_waiting=2 * batch,
                                  window=len(opening) + MAX_PROMPT_TOKENS + 1))
    bar = tqdm(total=len(todo), desc="prompts the target writes", unit="prompt")
    queue, running, saved = list(reversed(todo)), [], time.perf_counter()
    while queue or running:
        if deadline is not None and time.perf_counter() > deadline:
            queue.clear()
        while queue and len(running) < 2 * batch:
            seed = queue.pop()
            config = GenerationConfig(max_new_tokens=MAX_PROMPT_TOKENS, stop=stops,
                                      sampling=SamplingParams(TEMPERATURE, TOP_P, seed=seed))
            running.append((seed, engine.submit(opening, config)))
        engine.run_once()
        for seed, request in [item for item in running if item[1].done.is_set()]:
            result = request.wait()
            ended = result.stop_reason in ("eos", "stop")
            drawn[seed] = result.text.strip() if ended else None
            bar.update(1)
        running = [item for item in running if not item[1].done.is_set()]
        if cache is not None and time.perf_counter() - saved > SAVE_SECONDS:
            _save(drawn, cache)
            saved = time.perf_counter()
    bar.close()
    engine.close()
    if cache is not None:
        _save(drawn, cache)


def _save(drawn: dict, cache: Path) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(drawn.items())}))
    tmp.replace(cache)


def self_prompt_ids(tokenizer, texts: list[str], room: int) -> list[list[int]]:
    """Each message as a prompt in the target's frame, those that fit `room` tokens."""
    prompts = (encode_conversation(tokenizer, [("user", text)], answer_open=True) for text in texts)
    return [ids for ids in prompts if len(ids) <= room]
