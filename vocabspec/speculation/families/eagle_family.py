"""The EAGLE family's build: which drafter a config means (an EAGLE-2 checkpoint or an EAGLE-3
one, in speculators' or SGLang's layout), its draft vocabulary, and the tree proposer over them; and
the registrations of `eagle` and `eagle3` (`eagle+pld` is hybrid.py's).

`eagle_parts` loads the drafter and its head; `tree_proposer` puts a tree on them. The tuner
(tuning/proposers.py) sits between the two where the tree is "auto", so a drafter is loaded
once whatever the tuner measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import (EAGLE2, DraftConfig, Family, default_eagle_path, default_vocab, head_files, register,
                      vocab_names)


@dataclass
class EagleParts:
    """What an EAGLE tree proposer drafts with: the drafter, its draft vocabulary, where it was read
    from (`path`, or "random") and the dtype it computes in on torch's kernels."""
    drafter: object
    draft_vocab: object
    path: object
    dtype: object


def eagle_parts(model, config: DraftConfig, model_name: str, log=None) -> EagleParts:
    """The drafter and head `config` names for the loaded target `model`."""
    from ..vocab.draft_vocab import make_draft_vocab
    from .eagle import EagleDrafter, draft_dtype
    from .eagle3 import Eagle3Drafter, is_eagle3

    dtype = draft_dtype(model, config.dtype)
    path = config.path if config.path not in (None, EAGLE2) else default_eagle_path(config, model_name)
    if path is None:
        raise ValueError(f"no drafter is bundled for {model_name!r}: pass --draft-path DIR "
                         "(an EAGLE checkpoint directory)")
    files = head_files(config, model_name)
    if config.method == "eagle3" and (path == "random" or not is_eagle3(path)):
        raise ValueError(f"--draft eagle3 reads an EAGLE-3 checkpoint (speculators' or SGLang's layout); "
                         f"{path} is not one: pass --draft-path DIR")
    if path != "random" and is_eagle3(path):
        # An EAGLE-3 checkpoint (speculators' or SGLang's layout): its own head and vocabulary.
        drafter = Eagle3Drafter.load(path, model, dtype=dtype)
        if config.ranker is not None:
            raise ValueError("--ranker applies to SpecVocab heads, which EAGLE-3 drafters do not take")
        if model.drafter_format is not None and drafter.native_fits:
            _native_draft_dtype(config)
            drafter.pack(model.drafter_format)
        vocab = default_vocab(Path(path)) if config.vocab == "auto" else config.vocab
        return EagleParts(drafter, drafter.draft_vocab(vocab, files, config.token_map), path, dtype)
    drafter = EagleDrafter.random(model, dtype=dtype) if path == "random" else \
        EagleDrafter.load(path, model, dtype=dtype)
    vocab = default_vocab(files) if config.vocab == "auto" else config.vocab
    if config.vocab == "auto" and log:
        log(f"draft vocabulary: {vocab} (the drafter's default; --draft-vocab to choose)")
    # Beside a target on the native engine the drafter drafts natively too (in the format the
    # target names), and the full and static draft heads score with the target's own head in
    # its run-time format.
    packed_head = None
    if model.drafter_format is not None and not drafter.taps:
        _native_draft_dtype(config)
        drafter.pack(model.drafter_format)
        packed_head = model.packed_head
    draft_vocab = make_draft_vocab(vocab, model.head_weight, files, config.token_map, config.ranker,
                            dtype=dtype, packed_head=packed_head)
    return EagleParts(drafter, draft_vocab, path, dtype)


def _native_draft_dtype(config: DraftConfig) -> None:
    if config.dtype != "auto":
        raise ValueError("--draft-dtype chooses what the drafter computes in on torch's kernels; on "
                         "the native engine it drafts with float32 activations over weights in the "
                         "target's format (leave --draft-dtype at auto)")


def tree_proposer(parts: EagleParts, config: DraftConfig, depth: int, total_tokens: int, sizing=None,
                  kind=None):
    """EAGLE-2's tree over `parts`, a `kind` of EagleProposer (itself by default; the hybrid's
    grafts prompt lookup's path on top of the tree's size). `sizing` (live_tree.LiveSizing):
    each step's tree sized live, depth and total_tokens then the largest tree a step drafts."""
    if kind is None:
        from .eagle import EagleProposer as kind
    proposer = kind(parts.drafter, draft_vocab=parts.draft_vocab, depth=depth, top_k=config.top_k, total_tokens=total_tokens)
    proposer.sizing = sizing
    return proposer


def build_eagle(model, config: DraftConfig, model_name: str, tokenizer=None, log=None, kind=None):
    """EAGLE-2's tree (eagle, eagle3; a `kind` of EagleProposer: tree_proposer) over the drafter
    `config` names, the tree fixed."""
    return tree_proposer(eagle_parts(model, config, model_name, log), config, config.depth, config.total_tokens,
                         kind=kind)


def eagle_names(with_lookup: bool):
    """eagle (+pld): the model's default drafter and head, as --draft names them;
    eagle2[+VOCAB][+pld]: the bundled EAGLE-2 drafter."""
    suffix = "+pld" if with_lookup else ""

    def parse(base: str) -> dict | None:
        if base == "eagle" + suffix:
            return {"vocab": "auto"}
        if base.endswith("+pld") != with_lookup:
            return None
        named = vocab_names("eagle2")(base.removesuffix(suffix))
        return named and {**named, "path": EAGLE2}
    return parse


EAGLE_OPTIONS = frozenset({"path", "vocab", "token_map", "ranker", "depth", "top_k", "total_tokens", "dtype"})
register(Family("eagle", "EAGLE-2's dynamic tree", EAGLE_OPTIONS, build_eagle, eagle_names(False),
                "eagle, eagle2, eagle2+VOCAB (VOCAB: fr:N, trim:N, spec:K...)", draft_vocab=True,
                trainer="vocabspec.training.train:train_eagle"))
register(Family("eagle3", "EAGLE-3: three target layers fused, a draft vocabulary of its own (a checkpoint "
                "in speculators' or SGLang's layout, --draft-path; `eagle` reads one too)",
                EAGLE_OPTIONS - {"ranker"}, build_eagle, vocab_names("eagle3"), "eagle3, eagle3+VOCAB (VOCAB: fr:N, trim:N)",
                draft_vocab=True, trainer="vocabspec.training.eagle3_train:train_and_save"))
