"""Choosing a proposer: every drafting option in one `DraftConfig`, the drafting families, and
the proposer a config builds.

The CLI, the Python API, the server and the benchmark all describe drafting with a DraftConfig,
and the benchmark's method names (`eagle2+fr:32k+pld@3x8`) parse into one here, so an option
means the same everywhere. Each drafting family (plain decoding, EAGLE-2, prompt lookup, the
hybrid, Medusa, a draft model) is one `register(Family(...))` below: its --draft name, the
options it reads, its benchmark names, how it is built and what the autotuner measures for it.
The CLI's choices and help, the method grammar, the option refusals and the autotuner read the
registry, so a new family is its own module plus one registration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

# Every option a family may read, and its command-line name: one set where the chosen family
# does not read it is refused by name rather than ignored.
FLAGS = {"path": "--draft-path", "vocab": "--draft-vocab", "token_map": "--token-map", "ranker": "--ranker",
         "depth": "--depth", "top_k": "--tree-top-k", "total_tokens": "--total-tokens",
         "dtype": "--draft-dtype", "draft_model": "model:NAME", "draft_weights": "--draft-weights"}
BUNDLED_DRAFTERS = Path(__file__).parents[1] / "drafters"


@dataclass(frozen=True)
class Family:
    """A drafting method, as every place that names, checks, builds, tunes or benchmarks drafting
    reads it.

    name: --draft NAME and DraftConfig.method. summary: its --help line. options: the
    DraftConfig fields it reads (FLAGS' names). build(model, config, model_name, tokenizer, log):
    its proposer for a loaded target (None: decode plainly). bench(name): the DraftConfig fields
    a benchmark method name means (the name without /dtype and @tree), None where the name is
    not this family's; grammar: those names, for help and errors. argument: the field that
    NAME:VALUE sets (model:NAME). head: drafts through a draft-vocabulary head (--draft-vocab
    applies). check(config): its own refusals. sizes: the tree sizes the autotuner measures
    against plain decoding when total_tokens is "auto" (empty: `build` tunes itself, as EAGLE-2's
    cost model, Medusa's ordered tree and a draft model's chain do). trainer: "module:function"
    that `vocabspec train --drafter NAME` calls to train and save its drafter, as
    fn(cfg, target, split, report, ship, log) after the data and features stages (a name, not
    the function: the core never imports training)."""
    name: str
    summary: str
    options: frozenset[str]
    build: Callable
    bench: Callable[[str], dict | None]
    grammar: str
    argument: str | None = None
    head: bool = False
    check: Callable | None = None
    sizes: tuple[int, ...] = ()
    trainer: str | None = None

    @property
    def trainable(self) -> bool:
        return self.trainer is not None

    @property
    def display(self) -> str:
        """How --draft writes it (model:NAME)."""
        return f"{self.name}:{FLAGS[self.argument].partition(':')[2]}" if self.argument else self.name


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a drafting family (see Family); its name must be new and its options known."""
    if family.name in FAMILIES or ":" in family.name:
        raise ValueError(f"a drafting family is already named {family.name!r}" if family.name in FAMILIES
                         else f"a family's name has no colon: {family.name!r}")
    unknown = set(family.options) - set(FLAGS)
    if unknown:
        raise ValueError(f"family {family.name}: unknown options {sorted(unknown)} (known: {', '.join(FLAGS)})")
    if family.sizes and "total_tokens" not in family.options:
        raise ValueError(f"family {family.name}: the autotuner sets total_tokens, so it must read it")
    FAMILIES[family.name] = family
    return family


def draft_names() -> str:
    """Every --draft choice, for messages."""
    return ", ".join(f.display for f in FAMILIES.values())


@dataclass(frozen=True)
class DraftConfig:
    """How to draft: the method, the drafter and its draft vocabulary, and the tree.

    method: none (plain decoding), eagle (EAGLE-2's dynamic tree), pld (prompt lookup),
    eagle+pld (the tree plus prompt lookup's path), medusa (Medusa heads, medusa.py) or model (an
    independent draft model, draft_model.py: `draft_model` names it, `draft_weights` its format,
    auto: the fastest here, which for a float32 or bfloat16 target is its own 8-bit copy). vocab:
    the drafter's LM head: full, fr:N (FR-Spec), trim:N (VocabTrim), spec:K[,context=C]
    [,successors=S][,levels=L] (SpecVocab, see draft_vocab.spec_options; not for a draft model),
    or auto (the head the shipped drafter's config names as fastest for its model, else full;
    full for a draft model). depth/top_k/total_tokens: the tree (total_tokens "auto": chosen by
    timing this machine; for a draft model a chain, for Medusa a prefix of its tree). dtype: what
    the drafter computes in on torch's kernels (auto: bfloat16 for a float32 target where the
    CPU has fast bfloat16); on the native engine it drafts with float32 activations."""
    method: str = "none"
    path: str | None = None          # drafter directory; None: the model's default (its EAGLE-3
                                     # where one is shipped); "random"; "eagle2": the bundled EAGLE-2
    vocab: str = "auto"
    token_map: str | None = None     # for fr:N / trim:N (default: the drafter's own)
    ranker: str | None = None        # for spec:K (default: the drafter's own)
    depth: int = 6
    top_k: int = 10
    total_tokens: int | str = "auto"
    dtype: str = "auto"
    draft_model: str | None = None   # for method model: a bundled name, .gguf file or HF directory
    draft_weights: str = "auto"      # the draft model's format (formats.py)

    def __post_init__(self):
        from .draft_vocab import parse_draft_vocab

        family = FAMILIES.get(self.method)
        if family is None:
            raise ValueError(f"unknown draft method {self.method!r} (choose from {draft_names()})")
        if self.vocab != "auto":
            parse_draft_vocab(self.vocab)
            if not family.head and self.vocab != "full":
                raise ValueError(f"--draft-vocab {self.vocab} applies to a drafter's LM head (--draft "
                                 f"{', '.join(f.display for f in FAMILIES.values() if f.head)}), "
                                 f"not to --draft {self.method}")
        for other in {f.argument for f in FAMILIES.values() if f.argument}:
            owner = [f.display for f in FAMILIES.values() if f.argument == other]
            if other == family.argument and not getattr(self, other):
                raise ValueError(f"--draft {family.display} names its {other.replace('_', ' ')}")
            if other != family.argument and getattr(self, other):
                raise ValueError(f"a {other.replace('_', ' ')} applies to --draft {', '.join(owner)}, "
                                 f"not {self.method}")
        if family.check is not None:
            family.check(self)
        from ..engine.loading import WEIGHTS

        if self.draft_weights not in WEIGHTS:
            raise ValueError(f"unknown draft weight format {self.draft_weights!r} (choose from "
                             f"{', '.join(WEIGHTS)})")
        from .tree import MAX_DEPTH, MAX_TOP_K, MAX_TOTAL_TOKENS

        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or not 0 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth must be an integer from 0 to {MAX_DEPTH}, got {self.depth!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer from 1 to {MAX_TOP_K}, got {self.top_k!r}")
        if self.total_tokens != "auto" and (isinstance(self.total_tokens, bool)
                                            or not isinstance(self.total_tokens, int)
                                            or not 1 <= self.total_tokens <= MAX_TOTAL_TOKENS):
            raise ValueError(f"total_tokens must be an integer from 1 to {MAX_TOTAL_TOKENS} or 'auto', "
                             f"got {self.total_tokens!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"unknown draft dtype {self.dtype!r} (choose from auto, float32, bfloat16)")
        defaults = {f.name: f.default for f in fields(self)}
        arguments = {f.argument for f in FAMILIES.values()}
        for name in sorted(set(FLAGS) - family.options - {"vocab"} - arguments):
            if getattr(self, name) != defaults[name]:
                users = [f.display for f in FAMILIES.values() if name in f.options]
                raise ValueError(f"{FLAGS[name]} does not apply to --draft {self.method} (it applies to "
                                 f"{', '.join(users)})")
        kind = self.vocab.split(":")[0]       # auto: checked once resolved (make_draft_vocab)
        if self.token_map is not None and kind not in ("fr", "trim", "auto"):
            raise ValueError(f"--token-map applies to --draft-vocab fr:N or trim:N, not {self.vocab}")
        if self.ranker is not None and kind not in ("spec", "auto"):
            raise ValueError(f"--ranker applies to --draft-vocab spec:K, not {self.vocab}")

    @classmethod
    def from_draft(cls, draft: str, **fields) -> "DraftConfig":
        """What --draft and `vocabspec.load(draft=...)` name: a family, or NAME:VALUE for a
        family that takes an argument (model:NAME, an independent draft model), with any other
        field."""
        method, colon, value = draft.partition(":")
        if colon:
            family = FAMILIES.get(method)
            if family is None or family.argument is None:
                raise ValueError(f"unknown draft method {draft!r} (choose from {draft_names()})")
            fields[family.argument] = value or None
        return cls(method=method, **fields)

    @classmethod
    def from_method(cls, name: str, **defaults) -> "DraftConfig":
        """A benchmark method name: each family's own names (vanilla, pld, eagle, eagle+pld,
        eagle2, eagle2+fr:32k, eagle2+fr:32k+pld, medusa+fr:32k, model:NAME+trim:32k...: see
        `grammar`), then optionally /float32 or /bfloat16 (the drafter's dtype on torch's kernels)
        and @DEPTHxTOKENS (a fixed tree). `defaults`: other fields (path, depth, top_k,
        total_tokens), applied where the family reads them."""
        base, slash, rest = name.partition("/")           # /dtype before or after @tree
        if slash:
            dtype, at, tree = rest.partition("@")
            base = base + at + tree
        base, at, tree = base.partition("@")
        if tree:
            depth, x, total = tree.partition("x")
            if not (x and depth.isdigit() and total.isdigit() and int(total) > 0):
                raise ValueError(f"method {name!r}: write a fixed tree as @DEPTHxTOKENS, e.g. eagle2@6x60")
            defaults.update(depth=int(depth), total_tokens=int(total))
        if slash:
            if dtype not in ("float32", "bfloat16"):
                raise ValueError(f"method {name!r}: the drafter's dtype is /float32 or /bfloat16")
            defaults["dtype"] = dtype
        for family in FAMILIES.values():
            named = family.bench(base)
            if named is not None:
                # Options given for every method of a benchmark apply where they apply.
                # (A path of None is no path: it leaves the eagle2 names their EAGLE-2 drafter.)
                named.update({k: v for k, v in defaults.items()
                              if k in family.options and not (k == "path" and v is None)})
                return cls(method=family.name, **named)
        raise ValueError(f"unknown method {name!r} ({'; '.join(f.grammar for f in FAMILIES.values())})")

    @property
    def fixed_tree(self) -> bool:
        return self.total_tokens != "auto"


def bundled_drafter_dir(model: str) -> Path | None:
    path = BUNDLED_DRAFTERS / model
    return path if (path / "config.json").exists() else None


def bundled_eagle3_dir(model: str) -> Path | None:
    """The model's shipped EAGLE-3 drafter (drafters/MODEL/eagle3), where it has one."""
    path = BUNDLED_DRAFTERS / model / "eagle3"
    return path if (path / "config.json").exists() else None


EAGLE2 = "eagle2"       # DraftConfig.path of the eagle2 benchmark names: the bundled EAGLE-2 drafter


def default_eagle_path(config: "DraftConfig", model_name: str) -> Path | None:
    """The drafter `eagle`, `eagle+pld` and `eagle3` read without --draft-path: the model's
    shipped EAGLE-3 where it has one (it accepts more), except for heads only EAGLE-2's states
    take (SpecVocab's ranker); the bundled EAGLE-2 drafter otherwise, and for the eagle2 names."""
    eagle3 = bundled_eagle3_dir(model_name)
    eagle2_head = config.vocab.startswith("spec") or config.ranker is not None
    if config.path is None and eagle3 is not None and (config.method == "eagle3" or not eagle2_head):
        return eagle3
    return bundled_drafter_dir(model_name)


def default_vocab(files: Path | None) -> str:
    """The draft head a shipped drafter's config names as fastest for its model ("full" if
    none is named)."""
    if files is None or not (files / "config.json").exists():
        return "full"
    config = json.loads((files / "config.json").read_text())
    return config.get("vocabspec", {}).get("draft_vocab", "full")


def _weights_key(path) -> str:
    """Identifies a drafter's weights, so a retrained drafter gets its tree size re-chosen."""
    weights = Path(str(path)) / "model.safetensors"
    if not weights.exists():
        return str(path)
    stat = weights.stat()
    return f"{weights.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"


def make_proposer(model, config: DraftConfig, model_name: str, tokenizer=None, log=None):
    """The proposer `config` asks for, for the loaded target `model` (None for plain decoding).
    `vocab="auto"` resolves to the shipped drafter's own default head. With total_tokens "auto"
    the size is the autotuner's: measured over the family's `sizes` where it declares them,
    else the family's own tuning; where no size beats plain decoding, plain decoding (eagle+pld:
    prompt lookup alone), and the log says so."""
    family = FAMILIES[config.method]
    if config.total_tokens == "auto" and family.sizes:
        from .autotune import choose_size

        if tokenizer is None:
            raise ValueError("total_tokens='auto' needs the model's tokenizer")
        size = choose_size(model, tokenizer, f"{model_name}|{family.name}|{config}", family.sizes,
                           lambda n: family.build(model, replace(config, total_tokens=n), model_name,
                                                  tokenizer, None), log=log)
        if not size:
            if log:
                log(f"{family.name}: decoding plainly")
            return None
        config = replace(config, total_tokens=size)
    return family.build(model, config, model_name, tokenizer, log)


def _plain(model, config, model_name, tokenizer=None, log=None):
    return None


def _prompt_lookup(model, config, model_name, tokenizer=None, log=None):
    from .pld import PromptLookupProposer

    return PromptLookupProposer(device=model.device)


def make_eagle_proposer(model, config: DraftConfig, model_name: str, tokenizer=None, log=None):
    """EAGLE-2's tree (eagle) or the tree with prompt lookup's path grafted on (eagle+pld)."""
    from .draft_vocab import make_draft_vocab
    from .drafter import EagleDrafter, draft_dtype
    from .eagle3 import Eagle3Drafter, is_eagle3

    dtype = draft_dtype(model, config.dtype)
    path = config.path if config.path not in (None, EAGLE2) else default_eagle_path(config, model_name)
    if config.path == EAGLE2:
        path = bundled_drafter_dir(model_name)
    if path is None:
        raise ValueError(f"no drafter is bundled for {model_name!r}: pass --draft-path DIR "
                         "(an EAGLE checkpoint directory)")
    files = _head_files(config, model_name)
    if config.method == "eagle3" and (path == "random" or not is_eagle3(path)):
        raise ValueError(f"--draft eagle3 reads an EAGLE-3 checkpoint (speculators' or SGLang's layout); "
                         f"{path} is not one: pass --draft-path DIR")
    if path != "random" and is_eagle3(path):
        # An EAGLE-3 checkpoint (speculators' or SGLang's layout): its own head and vocabulary.
        drafter = Eagle3Drafter.load(path, model, dtype=dtype)
        if config.ranker is not None:
            raise ValueError("--ranker applies to SpecVocab heads, which EAGLE-3 drafters do not take")
        if model.native is not None and drafter.native_fits:
            _native_draft_dtype(config)
            drafter.use_native("q8i" if model.weights == "gguf-a8" else "bf16")
        vocab = default_vocab(Path(path)) if config.vocab == "auto" else config.vocab
        head = drafter.draft_head(vocab, files, config.token_map)
        return _eagle_tree(model, config, model_name, tokenizer, log, drafter, head, path, dtype)
    drafter = EagleDrafter.random(model, dtype=dtype) if path == "random" else \
        EagleDrafter.load(path, model, dtype=dtype)
    vocab = default_vocab(files) if config.vocab == "auto" else config.vocab
    if config.vocab == "auto" and log:
        log(f"draft vocabulary: {vocab} (the drafter's default; --draft-vocab to choose)")
    # On the native engine the drafter drafts natively too, and the full and static draft
    # heads score with the target's own head in its run-time format.
    packed_head = None
    if model.native is not None and not drafter.taps:
        _native_draft_dtype(config)
        # With 8-bit activations the drafter's weights go to Q8_0 groups too (lossy, for the
        # drafter only: it changes what is drafted, never what is accepted).
        drafter.use_native("q8i" if model.weights == "gguf-a8" else "bf16")
        packed_head = model.native.head_weight
    head = make_draft_vocab(vocab, model.head_weight, files, config.token_map, config.ranker,
                            dtype=dtype, packed_head=packed_head)
    return _eagle_tree(model, config, model_name, tokenizer, log, drafter, head, path, dtype)


def _native_draft_dtype(config: DraftConfig) -> None:
    if config.dtype != "auto":
        raise ValueError("--draft-dtype chooses what the drafter computes in on torch's kernels; on "
                         "the native engine it drafts with float32 activations over weights in the "
                         "target's format (leave --draft-dtype at auto)")


def _eagle_tree(model, config: DraftConfig, model_name: str, tokenizer, log, drafter, head, path, dtype):
    """EAGLE-2's tree proposer over `drafter` and `head`, the tree chosen where asked (auto)."""
    from .drafter import EagleProposer
    from .pld import PromptLookupProposer

    depth, total, sizing = config.depth, config.total_tokens, None
    if total == "auto":
        from .autotune import choose_static_tree, tree_choice
        from .drafter import drafts_statically
        from .generate import static_by_default

        if tokenizer is None:
            raise ValueError("total_tokens='auto' needs the model's tokenizer")
        key = f"{model_name}|{_weights_key(path)}|{head.name}|{dtype}"
        # Where an Engine runs static steps (a GPU), the tree is chosen by their costs, once.
        if static_by_default(model) and drafts_statically(head):
            depth, total = choose_static_tree(model, drafter, head, tokenizer, depth=depth, top_k=config.top_k,
                                              key=key, log=log)
            if not total:            # measured: no tree beats plain decoding on this device
                if config.method == "eagle+pld":
                    if log:
                        log("eagle+pld: drafting with prompt lookup alone")
                    return PromptLookupProposer(device=model.device)
                if log:
                    log("eagle: decoding plainly")
                return None
        else:
            # Elsewhere each step sizes its tree (live_tree.py): the tuner's choice is the prior,
            # never a verdict; depth and total are the largest tree a step drafts.
            from .autotune import keep_calibration
            from .live_tree import sizing_prior

            chosen, forward = tree_choice(model, drafter, head, tokenizer, depth=depth, top_k=config.top_k,
                                          key=key, log=log)
            sizing = sizing_prior(model, chosen, forward, depth)
            keep_calibration(sizing, key)
            total = sizing.most
    if config.method == "eagle+pld":
        from .hybrid import EagleLookupProposer

        # The tree size is the one chosen for EAGLE alone; the lookup path comes on top.
        proposer = EagleLookupProposer(drafter, head=head, depth=depth, top_k=config.top_k, total_tokens=total)
    else:
        proposer = EagleProposer(drafter, head=head, depth=depth, top_k=config.top_k, total_tokens=total)
    proposer.sizing = sizing
    return proposer


def _head_files(config: DraftConfig, model_name: str) -> Path | None:
    """Where token maps and the ranker are found (they belong to the target): the bundled
    drafter directory, else --draft-path's."""
    files = bundled_drafter_dir(model_name)
    if files is None and config.path not in (None, "random", EAGLE2):
        files = Path(config.path)
    return files


def make_medusa_proposer(model, config: DraftConfig, model_name: str, tokenizer=None, log=None):
    """Medusa's heads (the bundled ones, or config.path's) with the draft head config.vocab."""
    from .draft_vocab import make_draft_vocab
    from .medusa import MEDUSA_63, MedusaHeads, MedusaProposer, bundled_medusa_dir

    path = config.path or bundled_medusa_dir(model_name)
    if path is None:
        raise ValueError(f"no Medusa heads are bundled for {model_name!r}: pass --draft-path DIR "
                         "(made by `vocabspec train --drafter medusa`)")
    heads = MedusaHeads.random(model.args.dim, 4) if path == "random" else \
        MedusaHeads.load(path, model.args)
    # The blocks are a few small matmuls: in the target's dtype (float32 on the native engine).
    heads = heads.to(device=model.device, dtype=model.dtype)
    files = _head_files(config, model_name)
    if config.vocab != "auto":
        vocab = config.vocab
    else:       # the head the shipped heads' config names as fastest, else full
        vocab = "full" if path == "random" else default_vocab(Path(path))
        if log:
            log(f"draft vocabulary: {vocab} (the Medusa heads' default; --draft-vocab to choose)")
    packed = model.native.head_weight if model.native is not None else None
    head = make_draft_vocab(vocab, model.head_weight, files, config.token_map, config.ranker,
                            packed_head=packed)
    if config.total_tokens != "auto":
        return MedusaProposer(model, heads, head, total_tokens=min(config.total_tokens, len(MEDUSA_63)))
    from .autotune import choose_medusa_tree

    if tokenizer is None:
        raise ValueError("total_tokens='auto' needs the model's tokenizer")
    choices, total = choose_medusa_tree(model, heads, head, tokenizer,
                                        key=f"{model_name}|medusa|{_weights_key(path)}|{head.name}", log=log)
    if not total:
        if log:
            log("medusa: decoding plainly")
        return None
    return MedusaProposer(model, heads, head, choices=choices, total_tokens=total)


def make_draft_model_proposer(model, config: DraftConfig, model_name: str, tokenizer=None, log=None):
    """An independent draft model with the draft head config.vocab over its own LM head."""
    from .draft_model import DraftModelProposer, load_draft_model
    from .draft_vocab import make_draft_vocab

    draft = load_draft_model(config.draft_model, model, tokenizer, weights=config.draft_weights)
    if log:
        log(f"draft model: {config.draft_model} ({draft.weights}) drafting for the target ({model.weights})")
    vocab = "full" if config.vocab == "auto" else config.vocab
    packed = draft.native.head_weight if draft.native is not None else None
    # Token maps are the target's (the draft shares its tokenizer): VocabTrim's counts the
    # target's own generated text.
    head = make_draft_vocab(vocab, draft.head_weight, _head_files(config, model_name), config.token_map,
                            None, packed_head=packed)
    if config.total_tokens != "auto":
        return DraftModelProposer(draft, head, depth=max(1, config.depth), top_k=config.top_k,
                                  total_tokens=config.total_tokens)
    from .autotune import CHAIN_LENGTHS, choose_size

    if tokenizer is None:
        raise ValueError("total_tokens='auto' needs the model's tokenizer")
    # The draft is loaded once; the autotuner measures chains of each length over it.
    length = choose_size(model, tokenizer, f"{model_name}|model|{config.draft_model}|{draft.weights}|{head.name}",
                         CHAIN_LENGTHS, lambda n: DraftModelProposer(draft, head, depth=n, top_k=1, total_tokens=n),
                         log=log)
    if not length:
        if log:
            log("model: decoding plainly")
        return None
    return DraftModelProposer(draft, head, depth=length, top_k=1, total_tokens=length)


# ---------------------------------------------------------------- the families

def _names(*names: str, vocab: str = "full"):
    """A family's benchmark names that take no head."""
    return lambda base: {"vocab": vocab} if base in names else None


def _eagle_names(with_lookup: bool):
    """eagle (+pld): the model's default drafter and head, as --draft names them;
    eagle2[+HEAD][+pld]: the bundled EAGLE-2 drafter."""
    def parse(base: str) -> dict | None:
        if base == ("eagle+pld" if with_lookup else "eagle"):
            return {"vocab": "auto"}
        if not base.startswith("eagle2"):
            return None
        rest = base[len("eagle2"):]
        if rest.endswith("+pld") != with_lookup:
            return None
        rest = rest[:-len("+pld")] if with_lookup else rest
        if rest == "":
            return {"vocab": "full", "path": EAGLE2}
        return {"vocab": rest[1:], "path": EAGLE2} if rest.startswith("+") else None
    return parse


def _eagle3_names(base: str) -> dict | None:
    if base == "eagle3":
        return {"vocab": "full"}
    return {"vocab": base[len("eagle3+"):]} if base.startswith("eagle3+") else None


def _medusa_names(base: str) -> dict | None:
    if base == "medusa":
        return {"vocab": "full"}
    return {"vocab": base[len("medusa+"):]} if base.startswith("medusa+") else None


def _draft_model_names(base: str) -> dict | None:
    head, plus, vocab = base.partition("+")
    if not head.startswith("model:") or head == "model:":
        return None
    return {"draft_model": head[len("model:"):], "vocab": vocab if plus else "full"}


def _draft_model_check(config: DraftConfig) -> None:
    if config.vocab.startswith("spec"):
        raise ValueError("SpecVocab's ranker is trained for the EAGLE drafter's states: a draft "
                         "model's head takes full, fr:N or trim:N")


_EAGLE = frozenset({"path", "vocab", "token_map", "ranker", "depth", "top_k", "total_tokens", "dtype"})
register(Family("none", "plain decoding", frozenset(), _plain, _names("vanilla", "none"), "vanilla"))
register(Family("eagle", "EAGLE-2's dynamic tree", _EAGLE, make_eagle_proposer, _eagle_names(False),
                "eagle, eagle2, eagle2+HEAD (HEAD: fr:N, trim:N, spec:K...)", head=True,
                trainer="vocabspec.training.train:train_eagle"))
register(Family("eagle3", "EAGLE-3: three target layers fused, a draft vocabulary of its own (a checkpoint "
                "in speculators' or SGLang's layout, --draft-path; `eagle` reads one too)",
                _EAGLE - {"ranker"}, make_eagle_proposer, _eagle3_names, "eagle3, eagle3+HEAD (HEAD: fr:N, trim:N)",
                head=True, trainer="vocabspec.training.eagle3_train:train_and_save"))
register(Family("pld", "prompt lookup", frozenset(), _prompt_lookup, _names("pld"), "pld"))
register(Family("eagle+pld", "EAGLE-2's tree plus prompt lookup's path", _EAGLE, make_eagle_proposer,
                _eagle_names(True), "eagle+pld, eagle2+pld, eagle2+HEAD+pld", head=True))
register(Family("medusa", "Medusa's heads and tree",
                frozenset({"path", "vocab", "token_map", "ranker", "total_tokens"}), make_medusa_proposer,
                _medusa_names, "medusa, medusa+HEAD", head=True,
                trainer="vocabspec.training.medusa_train:train_and_save"))
register(Family("model", "an independent draft model sharing the target's tokenizer: a bundled name, "
                "a .gguf file or a model directory",
                frozenset({"vocab", "token_map", "depth", "top_k", "total_tokens", "draft_model", "draft_weights"}),
                make_draft_model_proposer, _draft_model_names, "model:NAME, model:NAME+HEAD",
                argument="draft_model", head=True, check=_draft_model_check))
