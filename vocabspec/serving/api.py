"""Python API: `vocabspec.load(...)` wires a target model, its tokenizer and a proposer.

    import vocabspec
    lm = vocabspec.load("smollm2", draft="eagle")
    print(lm.generate("Tell me a joke", chat=True, max_new_tokens=64).text)
    for piece in lm.stream("Once upon a time", max_new_tokens=32):
        print(piece, end="", flush=True)

Drafting options are those of `config.DraftConfig`: pass one as `draft=`, or its method
name and any of its fields as keywords (draft="eagle", vocab="fr:32k", depth=4, ...).
"""

from __future__ import annotations

from dataclasses import fields

from ..decoding.batch import BatchEngine, BatchLimits, Engine
from ..decoding.generate import GenerationConfig, GenerationResult, require_exact
from ..runtime.loading import load_model
from ..speculation.config import DraftConfig
from ..tuning.proposers import make_proposer
from ..speculation.sampling import SamplingParams
from ..runtime.tokenizer import load_tokenizer

DRAFT_FIELDS = {f.name for f in fields(DraftConfig)} - {"method"}


class LanguageModel:
    def __init__(self, engine: Engine, name: str, draft: DraftConfig | None = None):
        self.engine = engine
        self.name = name
        self.tokenizer = engine.tokenizer
        self.draft = draft or DraftConfig()
        self._batch = None

    def encode_prompt(self, prompt: str | list[dict], chat: bool = False,
                      parse_special: bool | None = None) -> list[int]:
        """A prompt's token ids. A plain prompt's special-token texts are those tokens unless
        parse_special is False (as llama.cpp's completion); a chat's messages are always text
        (only the template's markup becomes special tokens), so a chat refuses parse_special."""
        if not isinstance(prompt, (str, list)):
            raise ValueError("prompt must be a string or a list of chat messages")
        if parse_special is not None and not isinstance(parse_special, bool):
            raise ValueError(f"parse_special must be True or False, not {parse_special!r}")
        if isinstance(prompt, list) or chat:
            if parse_special is not None:
                raise ValueError("parse_special applies to a plain prompt: a chat message's content "
                                 "is always tokenized as text")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(messages)
        if not prompt:
            raise ValueError("the prompt is empty")
        return self.tokenizer.encode(prompt, parse_special=parse_special is not False)

    def _config(self, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                stop=(), cancel=None, deadline=None, logprobs=None) -> GenerationConfig:
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)):
            raise ValueError("stop must be a string or a list of strings")
        return GenerationConfig(max_new_tokens=max_new_tokens, stop=tuple(stop),
                                sampling=SamplingParams(temperature=temperature, top_p=top_p,
                                                        top_k=top_k, seed=seed),
                                cancel=cancel, deadline=deadline, logprobs=logprobs)

    def stream(self, prompt, chat: bool = False, parse_special: bool | None = None, **kwargs):
        """Iterate over text pieces as they are generated; `.result` on the iterator at the end."""
        return self.engine.stream(self.encode_prompt(prompt, chat, parse_special), self._config(**kwargs))

    def generate(self, prompt, chat: bool = False, parse_special: bool | None = None,
                 **kwargs) -> GenerationResult:
        return self.engine.generate(self.encode_prompt(prompt, chat, parse_special), self._config(**kwargs))

    def batch(self, limits: BatchLimits | None = None, thread: bool = False) -> BatchEngine:
        """A continuous-batching engine over this model (batch.py), each slot drafting as this
        model does; built on first use, kept for later calls with the same settings. `thread`:
        steps on a background thread of its own, else on the thread that calls its `run` or
        `generate` (the fast choice on a CPU: see batch.py)."""
        engine = self.engine
        limits = limits or BatchLimits(window=min(BatchLimits.window, engine.model.args.max_seq_len))
        if self._batch is None or self._batch.limits != limits or (self._batch.thread is not None) != thread:
            if self._batch is not None:
                self._batch.close()
            make = None if engine.proposer is None else \
                (lambda: make_proposer(engine.loaded, self.draft, self.name, tokenizer=self.tokenizer))
            self._batch = BatchEngine(engine.loaded, self.tokenizer, make, limits, engine.allow_inexact, thread=thread)
        return self._batch

    def generate_batch(self, prompts: list, chat: bool = False, limits: BatchLimits | None = None,
                       parse_special: bool | None = None, **kwargs) -> list[GenerationResult]:
        """Every prompt's result, decoded together: each one exactly what `generate` gives it
        alone (batch.py). Keywords as for `generate`, the same for every prompt."""
        ids = [self.encode_prompt(prompt, chat, parse_special) for prompt in prompts]
        return self.batch(limits).generate(ids, self._config(**kwargs))


def load(model: str = "smollm2", draft: str | DraftConfig = "none", weights: str = "auto",
         device: str = "cpu", max_seq_len: int | None = None, backend: str = "auto",
         allow_inexact: bool = False, log=None, **draft_options) -> LanguageModel:
    """Load a target model with an optional proposer.

    draft: a DraftConfig, or its method (none | eagle | pld | eagle+pld | medusa | model:NAME)
    with any other DraftConfig field as a keyword (path, vocab, token_map, ranker, depth, top_k,
    total_tokens, dtype, draft_weights). weights: the target's run-time format, auto | gguf | gguf-a8 | bf16 | f32
    (loading.load_model); backend: auto | native | torch. allow_inexact: draft even where
    verification is not bit-exact (torch's kernels; see generate.require_exact).
    """
    if isinstance(draft, DraftConfig):
        if draft_options:
            raise ValueError("pass drafting options in the DraftConfig or as keywords, not both")
        config = draft
    else:
        unknown = set(draft_options) - DRAFT_FIELDS
        if unknown:
            raise ValueError(f"unknown drafting option(s) {', '.join(sorted(unknown))} "
                             f"(DraftConfig fields: {', '.join(sorted(DRAFT_FIELDS))})")
        config = DraftConfig.from_draft(draft, **draft_options)
    target, path = load_model(model, weights=weights, device=device, max_seq_len=max_seq_len,
                              backend=backend)
    if config.method != "none":      # before a drafter is built and its tree timed
        require_exact(target, allow_inexact)
    tokenizer = load_tokenizer(path)
    proposer = make_proposer(target, config, model, tokenizer=tokenizer, log=log)
    return LanguageModel(Engine(target, tokenizer, proposer, allow_inexact=allow_inexact), model, config)
