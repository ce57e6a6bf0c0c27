"""Python API: `vocabspec.load(...)` wires a target model, its tokenizer and a proposer.

    import vocabspec
    lm = vocabspec.load("smollm2", draft="pld")
    print(lm.generate("Tell me a joke", chat=True, max_new_tokens=64).text)
    for piece in lm.stream("Once upon a time", max_new_tokens=32):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

from pathlib import Path

import torch

from .generate import Engine, GenerationConfig, GenerationResult
from .loading import load_model
from .sampling import SamplingParams
from .tokenizer import load_tokenizer

DRAFTS = ("none", "eagle", "pld", "eagle+pld")
BUNDLED_DRAFTERS = Path(__file__).parent / "drafters"


def bundled_drafter_dir(model: str) -> Path | None:
    path = BUNDLED_DRAFTERS / model
    return path if (path / "config.json").exists() else None


def _weights_key(path) -> str:
    """Identifies a drafter's weights, so a retrained drafter gets its tree size re-chosen."""
    weights = Path(str(path)) / "model.safetensors"
    if not weights.exists():
        return str(path)
    stat = weights.stat()
    return f"{weights.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"


class LanguageModel:
    def __init__(self, engine: Engine, name: str):
        self.engine = engine
        self.name = name
        self.tokenizer = engine.tokenizer

    def encode_prompt(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        if not isinstance(prompt, (str, list)):
            raise ValueError("prompt must be a string or a list of chat messages")
        if isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(messages)
        if not prompt:
            raise ValueError("the prompt is empty")
        return self.tokenizer.encode(prompt)

    def _config(self, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                stop=(), cancel=None, deadline=None) -> GenerationConfig:
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)):
            raise ValueError("stop must be a string or a list of strings")
        return GenerationConfig(max_new_tokens=max_new_tokens, stop=tuple(stop),
                                sampling=SamplingParams(temperature=temperature, top_p=top_p,
                                                        top_k=top_k, seed=seed),
                                cancel=cancel, deadline=deadline)

    def stream(self, prompt, chat: bool = False, **kwargs):
        """Iterate over text pieces as they are generated; `.result` on the iterator at the end."""
        return self.engine.stream(self.encode_prompt(prompt, chat), self._config(**kwargs))

    def generate(self, prompt, chat: bool = False, **kwargs) -> GenerationResult:
        return self.engine.generate(self.encode_prompt(prompt, chat), self._config(**kwargs))


def make_proposer(model, draft: str, draft_path: str | None, model_name: str,
                  depth: int = 6, top_k: int = 10, total_tokens: int | str = 60,
                  draft_vocab: str = "full", token_map: str | None = None, ranker: str | None = None,
                  tokenizer=None, log=None, draft_dtype: str = "auto"):
    from .draft_vocab import make_draft_vocab, parse_draft_vocab
    from .drafter import EagleDrafter, EagleProposer, draft_dtype as resolve_draft_dtype
    from .pld import PromptLookupProposer

    parse_draft_vocab(draft_vocab)
    if not draft.startswith("eagle") and draft_vocab != "full":
        raise ValueError(f"--draft-vocab {draft_vocab} applies to the EAGLE drafter only (--draft eagle)")
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft method {draft!r} (choose from {', '.join(DRAFTS)})")
    dtype = resolve_draft_dtype(model, draft_dtype)
    if draft == "none":
        return None
    if draft == "pld":
        return PromptLookupProposer(device=model.device)
    path = draft_path or bundled_drafter_dir(model_name)
    if path is None:
        raise ValueError(f"no drafter is bundled for {model_name!r}: pass --draft-path DIR "
                         "(an EAGLE checkpoint directory)")
    if path == "random":
        drafter = EagleDrafter.random(model, dtype=dtype)
    else:
        drafter = EagleDrafter.load(path, model, dtype=dtype)
    files = bundled_drafter_dir(model_name)
    if files is None and path != "random":
        files = Path(path)
    # On the native engine the drafter drafts natively too, and the full and static draft
    # heads score with the target's own head in its run-time format.
    packed_head = None
    if model.native is not None and not drafter.taps:
        # With 8-bit activations the drafter's weights go to Q8_0 groups too (lossy, for the
        # drafter only: the same tau on Spec-Bench prompts, 1.1-1.3x faster drafting).
        drafter.use_native("q8i" if model.weights == "gguf-a8" else "bf16")
        packed_head = model.native.head_weight
    head = make_draft_vocab(draft_vocab, model.embed.weight, files, token_map, ranker, dtype=dtype,
                            packed_head=packed_head)
    if total_tokens == "auto":
        from .autotune import choose_tree

        if tokenizer is None:
            raise ValueError("total_tokens='auto' needs the model's tokenizer")
        depth, total_tokens = choose_tree(model, drafter, head, tokenizer, depth=depth, top_k=top_k,
                                           key=f"{model_name}|{_weights_key(path)}|{draft_vocab}|{dtype}",
                                           log=log)
    elif isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1:
        raise ValueError(f"total_tokens must be a positive integer or 'auto', got {total_tokens!r}")
    if draft == "eagle+pld":
        # The tree size is the one chosen for EAGLE alone; the lookup path comes on top.
        from .hybrid import EagleLookupProposer

        return EagleLookupProposer(drafter, head=head, depth=depth, top_k=top_k,
                                   total_tokens=total_tokens)
    return EagleProposer(drafter, head=head, depth=depth, top_k=top_k, total_tokens=total_tokens)


def load(model: str = "smollm2", draft: str = "none", draft_path: str | None = None,
         weights: str = "auto", device: str = "cpu", max_seq_len: int | None = None,
         depth: int = 6, tree_top_k: int = 10, total_tokens: int | str = "auto",
         draft_vocab: str = "full", token_map: str | None = None,
         ranker: str | None = None, log=None, draft_dtype: str = "auto", backend: str = "auto",
         allow_inexact: bool = False) -> LanguageModel:
    """Load a target model with an optional proposer.

    draft: none | eagle | pld | eagle+pld (EAGLE-2's tree plus prompt lookup's path).
    draft_vocab (EAGLE only): full | fr:N | trim:N | spec:K.
    total_tokens: drafted tokens verified per step, or "auto" to choose it and the depth (at
    most `depth`) by timing the target and drafter on this machine (cached per machine and model).
    draft_dtype: what the drafter computes in: auto (bfloat16 for a float32 target where the
    hardware does bfloat16 matmuls fast), float32, bfloat16. Verification always uses the
    target's dtype, so the output does not depend on it.
    weights: the target's run-time format, auto | gguf | bf16 | f32 (see loading.load_model);
    backend: auto | native | torch. allow_inexact: draft even where verification is not
    bit-exact (bfloat16 on torch's kernels; see generate.Engine).
    """
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft method {draft!r} (choose from {', '.join(DRAFTS)})")
    target, path = load_model(model, weights=weights, device=device, max_seq_len=max_seq_len,
                              backend=backend)
    tokenizer = load_tokenizer(path)
    proposer = make_proposer(target, draft, draft_path, model, depth, tree_top_k, total_tokens,
                             draft_vocab, token_map, ranker, tokenizer=tokenizer, log=log,
                             draft_dtype=draft_dtype)
    return LanguageModel(Engine(target, tokenizer, proposer, allow_inexact=allow_inexact), model)
