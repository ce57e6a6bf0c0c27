"""How to draft: every drafting option in one `DraftConfig`, and the registry of drafting
families that reads it.

The CLI, the Python API, the server and the benchmark all describe drafting with a DraftConfig,
and the benchmark's method names (`eagle2+fr:32k+pld@3x8`) parse into one here, so an option
means the same everywhere. Each drafting family registers itself (`register(Family(...))`) in
its own module under `families/`: its --draft name, the options it reads, its benchmark names,
its own refusals and how it is built for a fixed tree. Plain decoding ("none") is registered
here. The CLI's choices and help, the method grammar, the option refusals and the tuner read
the registry; the tuner (tuning/proposers.py) sizes a family's tree after its drafter exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
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
    its proposer for a loaded target and a config whose tree is fixed (None: decode plainly;
    a config of total_tokens "auto" is sized first, tuning/proposers.py). bench(name): the DraftConfig fields
    a benchmark method name means (the name without /dtype and @tree), None where the name is
    not this family's; grammar: those names, for help and errors. argument: the field that
    NAME:VALUE sets (model:NAME). draft_vocab: drafts through a draft vocabulary (--draft-vocab
    applies). check(config): its own refusals. sizes: the tree sizes the autotuner measures
    against plain decoding when total_tokens is "auto" (empty: the tuner's own rule for the
    family sizes it, as EAGLE-2's live rule, Medusa's ordered tree and a draft model's chain
    are). trainer: "module:function" that `vocabspec train --drafter NAME` calls to train and
    save its drafter, as
    fn(cfg, target, split, report, ship, log) after the data and features stages (a name, not
    the function: the core never imports training)."""
    name: str
    summary: str
    options: frozenset[str]
    build: Callable
    bench: Callable[[str], dict | None]
    grammar: str
    argument: str | None = None
    draft_vocab: bool = False
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
        from .vocab.draft_vocab import parse_draft_vocab

        family = FAMILIES.get(self.method)
        if family is None:
            raise ValueError(f"unknown draft method {self.method!r} (choose from {draft_names()})")
        if self.vocab != "auto":
            parse_draft_vocab(self.vocab)
            if not family.draft_vocab and self.vocab != "full":
                raise ValueError(f"--draft-vocab {self.vocab} applies to a drafter's LM head (--draft "
                                 f"{', '.join(f.display for f in FAMILIES.values() if f.draft_vocab)}), "
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
        from ..runtime.loading import WEIGHTS

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
    """The draft vocabulary a shipped drafter's config names as fastest for its model ("full" if
    none is named)."""
    if files is None or not (files / "config.json").exists():
        return "full"
    config = json.loads((files / "config.json").read_text())
    return config.get("vocabspec", {}).get("draft_vocab", "full")


def weights_key(path) -> str:
    """Identifies a drafter's weights, so a retrained drafter gets its tree size re-chosen."""
    weights = Path(str(path)) / "model.safetensors"
    if not weights.exists():
        return str(path)
    stat = weights.stat()
    return f"{weights.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"


def head_files(config: DraftConfig, model_name: str) -> Path | None:
    """Where token maps and the ranker are found (they belong to the target): the bundled
    drafter directory, else --draft-path's."""
    files = bundled_drafter_dir(model_name)
    if files is None and config.path not in (None, "random", EAGLE2):
        files = Path(config.path)
    return files


def bench_names(*names: str, vocab: str = "full"):
    """A family's benchmark names that take no head."""
    return lambda base: {"vocab": vocab} if base in names else None


def vocab_names(name: str):
    """A family's benchmark names NAME (the full head) and NAME+VOCAB."""
    return lambda base: {"vocab": "full"} if base == name else \
        {"vocab": base[len(name) + 1:]} if base.startswith(name + "+") else None


def _plain(model, config, model_name, tokenizer=None, log=None):
    return None


register(Family("none", "plain decoding", frozenset(), _plain, bench_names("vanilla", "none"), "vanilla"))
