"""Command line: `vocabspec generate ...`. Bad input ends with a one-line error, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path


def set_threads(threads: int | None) -> None:
    """--threads: torch's and the native engine's thread count, fixed; None: torch's default and
    the native engine's governor (see native.c, "threads")."""
    if threads:
        import torch

        from .runtime import native

        torch.set_num_threads(threads)
        if native.available()[0]:
            native.set_threads(threads)

def _int_at_least(minimum: int, what: str, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _total_tokens(text: str):
    from .speculation.tree import MAX_TOTAL_TOKENS

    return "auto" if text == "auto" else \
        _int_at_least(1, f"an integer from 1 to {MAX_TOTAL_TOKENS} or 'auto'", MAX_TOTAL_TOKENS)(text)


def _tree_depth(text: str) -> int:
    from .speculation.tree import MAX_DEPTH

    return _int_at_least(0, f"an integer from 0 to {MAX_DEPTH}", MAX_DEPTH)(text)


def _tree_top_k(text: str) -> int:
    from .speculation.tree import MAX_TOP_K

    return _int_at_least(1, f"an integer from 1 to {MAX_TOP_K}", MAX_TOP_K)(text)


API_KEY_VARIABLE = "VOCABSPEC_API_KEY"      # `serve`'s API key where --api-key is not given


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: scheme://host[:port] each, comma-separated, or '*'."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    bad = [o for o in origins if o != "*" and "://" not in o]
    if not origins or bad:
        raise argparse.ArgumentTypeError(f"origins are scheme://host[:port] (or '*'), got {text!r}")
    return origins


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _token_list(text: str) -> str:
    """fr:N or trim:N: a token map's first N tokens."""
    from .speculation.vocab.draft_vocab import parse_draft_vocab

    try:
        kind, _ = parse_draft_vocab(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))
    if kind not in ("fr", "trim"):
        raise argparse.ArgumentTypeError(f"expected fr:N or trim:N, got {text!r}")
    return text


def field_option(parser: argparse.ArgumentParser, config: type, name: str, kind, text: str,
                 flag: str | None = None, **extra) -> None:
    """The dataclass `config`'s field `name` as an option (--NAME, or `flag`): its default is
    the field's, declared once, in the dataclass. `kind` parses it (bool: an on/off flag; None:
    the text as given); `extra`: more of add_argument's keywords (metavar, choices, dest)."""
    from dataclasses import MISSING, fields

    found = next((f for f in fields(config) if f.name == name), None)
    if found is None:
        raise AttributeError(f"{config.__name__} has no field {name!r}")
    default = found.default if found.default is not MISSING else found.default_factory()
    flag = flag or "--" + name.replace("_", "-")
    if kind is bool:
        if default:
            raise ValueError(f"{config.__name__}.{name}: an on/off option's field defaults to off")
        parser.add_argument(flag, action="store_true", help=text, **extra)
    else:
        parser.add_argument(flag, type=kind, default=default, help=text, **extra)


def config_of(config: type, args, **given):
    """The dataclass `config` from the options named as its fields (see field_option), the
    fields no option sets at their defaults, and `given` in place of options."""
    from dataclasses import fields

    return config(**{f.name: getattr(args, f.name) for f in fields(config)
                     if f.name not in given and hasattr(args, f.name)}, **given)


def add_weight_args(parser: argparse.ArgumentParser) -> None:
    from .runtime.formats import FORMATS

    parser.add_argument("--weights", default="auto", choices=["auto", *FORMATS],
                        help="the target's run-time weight format: gguf (the file's own quantized "
                             "groups, float32 activations), gguf-a8 (the same weights, 8-bit "
                             "activations in products, as llama.cpp), bf16 or f32; auto: the "
                             "fastest exact one here")
    parser.add_argument("--backend", default="auto", choices=["auto", "native", "torch", "triton"],
                        help="native: the CPU engine whose rows are bit-identical at any row count "
                             "(auto where it runs); torch: torch's kernels, any device; triton: "
                             "torch's path on row-invariant Triton kernels, exact on a GPU "
                             "(the cuda extra) (default auto)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--allow-inexact", action="store_true",
                        help="draft even where verification is not bit-exact (on torch's "
                             "kernels): the output may then differ from plain decoding; and "
                             "(serve, generate --input) step plain requests' rows together in one "
                             "forward there, each answer its own up to rounding")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="bundled name (smollm2, gemma3), a .gguf file or a HF model directory")
    add_weight_args(parser)
    _threads_option(parser)
    parser.add_argument("--max-seq-len", type=_positive_int, default=None,
                        help="KV cache size in tokens (default 4096, capped by the model)")
    add_draft_args(parser)


def add_draft_args(parser: argparse.ArgumentParser, method: bool = True) -> None:
    """The fields of config.DraftConfig (the bench names its methods instead of --draft)."""
    from .speculation.config import FAMILIES, DraftConfig

    def option(name, kind, text, **extra):
        field_option(parser, DraftConfig, name, kind, text, **extra)

    if method:
        parser.add_argument("--draft", default="none", type=_draft_method, metavar="METHOD",
                            help="proposer: " + ", ".join(f"{f.display} ({f.summary})"
                                                          for f in FAMILIES.values()))
        option("draft_weights", None, "the draft model's weight format (--draft model:NAME): auto (the fastest "
               "here: with a float32 or bfloat16 target, its own 8-bit copy), gguf, gguf-a8, bf16 or f32")
        option("vocab", None, "drafter LM head: full, fr:N (FR-Spec), trim:N (VocabTrim), "
               "spec:K[,context=C][,successors=S][,levels=L] (SpecVocab: K candidates, C of them (default "
               "K/2) tokens already in the text, S (default 16) usual successors of each drafted token, the "
               "root's candidates serving L tree levels (default: all)); auto: the head the shipped drafter "
               "names as fastest for its model", flag="--draft-vocab")
        option("token_map", None, "token map file for fr:N / trim:N (default: the drafter's own)")
        option("ranker", None, "ranker file for spec:K (default: the drafter's own)")
        option("dtype", None, "what the drafter computes in on torch's kernels (auto: bfloat16 for a float32 "
               "target on hardware with fast bfloat16); verification always uses the target's weights and "
               "kernels", flag="--draft-dtype", choices=("auto", "float32", "bfloat16"))
    option("path", None, "EAGLE drafter or Medusa heads directory (default: the bundled one; 'random' for an "
           "untrained one)", flag="--draft-path")
    option("depth", _tree_depth, "tree expansion steps (with --total-tokens auto: the deepest tried)")
    option("top_k", _tree_top_k, "children per expanded node", flag="--tree-top-k")
    option("total_tokens", _total_tokens, "drafted tokens verified per step, or 'auto': each step's tree sized "
           "from the drafter's confidence and this machine's measured costs, a timing of the machine (cached) "
           "its starting point")


def _draft_method(text: str) -> str:
    from .speculation.config import DraftConfig

    try:
        DraftConfig.from_draft(text)        # the family, and its NAME:VALUE argument
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))
    return text


def draft_config(args):
    """The DraftConfig the command line asks for."""
    from .speculation.config import DraftConfig

    return DraftConfig.from_draft(args.draft, path=args.draft_path, vocab=args.draft_vocab,
                                  token_map=args.token_map, ranker=args.ranker, depth=args.depth,
                                  top_k=args.tree_top_k, total_tokens=args.total_tokens,
                                  dtype=args.draft_dtype, draft_weights=args.draft_weights)


def train_config(args):
    """The TrainConfig `vocabspec train`'s command line asks for (--out: runs/train-MODEL unless given)."""
    from .training.config import TrainConfig

    settings = {k: getattr(args, k) for k in TrainConfig.options() if hasattr(args, k)}
    settings["out"] = args.out or f"runs/train-{args.model}"
    return TrainConfig.of(**settings)


def _labels(text: str) -> str:
    from .training.eagle3_train import LABELS
    if text not in LABELS:
        raise argparse.ArgumentTypeError(f"labels are {' or '.join(LABELS)}, not {text!r}")
    return text


def _train_option(name: str, kind, text: str, **extra) -> tuple:
    """One of `vocabspec train`'s TrainConfig options: the field `name` as --NAME, its default
    the field's; `kind` parses it (bool: an on/off flag; None: the text as given); `extra`: more
    of add_argument's keywords (metavar, choices)."""
    return name, kind, text, extra


# `vocabspec train`'s options that are TrainConfig's fields, in --help's order. Help names each
# one's default (ShowDefaults), unless its text already does.
TRAIN_OPTIONS = (
    _train_option("conversations", _positive_int, "training conversations (after the held-out ones)"),
    _train_option("heldout", _positive_int, "held-out conversations for evaluation"),
    _train_option("max_len", _positive_int, "tokens per sequence (longer conversations are cut)"),
    _train_option("epochs", _positive_int, "passes over the training sequences"),
    _train_option("accumulate", _positive_int, "sequences per optimizer step"),
    _train_option("top_candidates", _positive_int, "the target's top token ids stored per position"),
    _train_option("negatives", _non_negative_int, "random negative tokens added to each sequence's candidates"),
    _train_option("max_steps", _non_negative_int, "stop after this many optimizer steps (0: run every epoch)"),
    _train_option("lr", _float, "peak learning rate"),
    _train_option("noise", _float, "uniform noise on input features, in units of each dimension's std"),
    _train_option("cls_weight", _float, "weight of the token loss beside the feature loss (EAGLE's)"),
    _train_option("distill_new_tokens", _positive_int, "tokens per self-distilled answer, at most"),
    _train_option("distill_batch", _positive_int, "prompts the target answers together"),
    _train_option("unroll", _positive_int, "drafting steps trained per position (1: EAGLE's loss)"),
    _train_option("checkpoint_every", _positive_int, "optimizer steps between checkpoints"),
    _train_option("warmup_steps", _non_negative_int, "learning-rate warm-up steps"),
    _train_option("ranker_weight", _float, "train SpecVocab's ranker jointly with this loss weight (0: no ranker)"),
    _train_option("ranker_rank", _non_negative_int, "the ranker's rank d' (0: d/16)"),
    _train_option("ranker_positions", _positive_int, "positions per sequence and step in the ranker's loss"),
    _train_option("ranker_lr", _float, "the ranker's learning rate"),
    _train_option("layers", _positive_int, "drafter layers (EAGLE: 1; added layers start as the identity)"),
    _train_option("ttt_steps", _positive_int, "--drafter eagle3: draft steps trained per position (training-time test)"),
    _train_option("ttt_decay", _float, "--drafter eagle3: step k's loss weighs this to the k (normalized; EAGLE-3's "
                                       "code uses 0.8)"),
    _train_option("labels", _labels, "--drafter eagle3: soft (the target's distribution over the draft vocabulary) "
                                     "or hard (the target's choice)"),
    _train_option("draft_vocab", _token_list, "--drafter eagle3: its draft vocabulary, fr:N or trim:N (a bundled "
                                              "token map's first N)"),
    _train_option("medusa_heads", _positive_int, "Medusa heads (--drafter medusa)"),
    _train_option("medusa_positions", _positive_int, "positions sampled per sequence and step (Medusa)"),
    _train_option("archive_sequences", _non_negative_int, "also train on this many sequences of the answer "
                                                          "archive (--answers), as they are"),
    _train_option("self_distill", _non_negative_int,
                  "also train on the target's own greedy answers to this many unused ShareGPT prompts "
                  "(self-distillation)"),
    _train_option("distill_start", _non_negative_int,
                  "take those prompts from the conversations after the first N training ones (default: "
                  "after all of them); keeping N fixed lets --conversations grow without generating new "
                  "answers", metavar="N"),
    _train_option("task_prompts", _non_negative_int,
                  "and to this many task-style prompts built from ShareGPT text (summarize, translate, "
                  "answer from a passage; then code requests and extractions; then arithmetic word problems)"),
    _train_option("later_turns", _non_negative_int,
                  "and to this many later user turns of those conversations, with the turns before them "
                  "(ShareGPT's answers too) as the context"),
    _train_option("later_turns_start", _non_negative_int,
                  "take those later turns after the first N (the ones an earlier run answered): a fresh "
                  "slice for a run that continues a drafter", metavar="N"),
    _train_option("self_prompts", _non_negative_int,
                  "and to up to N prompts the target writes itself (sampled from its frame's opening of a "
                  "user turn, one seed each; repeats and unfinished draws dropped): data past what ShareGPT "
                  "holds", metavar="N"),
    _train_option("self_prompts_start", _non_negative_int,
                  "the first of those prompts' seeds (an earlier run's start + N: a fresh slice)",
                  metavar="SEED"),
    _train_option("answers", None,
                  "answer archive: self-distilled answers found there are not generated again, and the "
                  "ones this run generates are added to it (e.g. runs/answers-MODEL)", metavar="DIR"),
    _train_option("generate_answers", bool,
                  "with --answers: generate the answers the archive lacks (hours on a CPU; without this "
                  "flag such a run stops and says how many are missing)"),
    _train_option("init", None, "start from this drafter directory instead of a random drafter"),
    _train_option("ranker_init", None,
                  "with --ranker-weight: the SpecVocab ranker file to start from (default: the LM head's "
                  "truncated SVD)"),
    _train_option("taps", None,
                  "target layers whose outputs join the drafter's input feature, as in EAGLE-3 "
                  "(comma-separated indices, e.g. 1,14; default: none)"),
    _train_option("feature_dtype", None,
                  "target dtype for feature extraction on torch's kernels (auto: bfloat16 where the device "
                  "has fast bfloat16 matmuls, else float32); runtime: the engine and format a user decodes "
                  "with (on these CPUs the native engine, faster, and the very states the drafter reads at "
                  "inference; default %(default)s)", choices=["auto", "float32", "bfloat16", "runtime"]),
    _train_option("train_dtype", None,
                  "the drafter's matmuls in training: bfloat16 runs them under autocast (weights and "
                  "optimizer stay float32); auto: bfloat16 where the device has fast bfloat16 matmuls",
                  choices=["float32", "bfloat16", "auto"]),
    _train_option("snapshot_tokens", None,
                  "--drafter eagle3: keep the run as it stood after these many training tokens (e.g. "
                  "1.9M,5.7M), as OUT/checkpoint-eagle3-at-N.pt: the smaller points of a scaling table "
                  "from one run", metavar="N,N"),
    _train_option("online_features", bool,
                  "compute the target's features as training draws each sequence instead of storing "
                  "feature shards (no disk; the same forwards for one epoch)"),
    _train_option("full_vocab_loss", bool, "exact cross-entropy over the whole vocabulary (slow on a CPU)"),
    _train_option("device", None,
                  "where answers are generated, features computed and --drafter eagle3 trained: cpu, cuda "
                  "or cuda:N (the same recipe; the other families train on the CPU; default %(default)s)"),
)


class ShowDefaults(argparse.HelpFormatter):
    """Help that names each option's default, unless its text already says it or there is none
    to show (None, an on/off flag, an empty list)."""

    def _get_help_string(self, action):
        text = action.help or ""
        value = action.default
        if "default" in text or not action.option_strings or value in (None, argparse.SUPPRESS) \
                or isinstance(value, bool) or value == []:
            return text
        return f"{text} (default {value})"


def build_parser() -> argparse.ArgumentParser:
    """The command line: each subcommand's options from a function of its own, in --help's
    order; the option groups several subcommands share from one function each."""
    parser = argparse.ArgumentParser(prog="vocabspec", description=__doc__, formatter_class=ShowDefaults)
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=partial(argparse.ArgumentParser, formatter_class=ShowDefaults))
    for add_options in (_generate_options, _train_options, _vocab_options, _ranker_options, _bench_options,
                        _serve_options, _export_options):
        add_options(sub)
    return parser


def _model_name_option(parser: argparse.ArgumentParser) -> None:
    """--model for the commands that read a model's files (generate and serve: add_model_args)."""
    parser.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF directory")


def _threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="CPU threads (default: all, fewer while other processes hold cores)")


def _generate_options(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt, or answer a JSONL file of prompts")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt text (or --input)")
    _batch_job_options(gen)
    add_model_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--no-parse-special", dest="parse_special", action="store_false",
                     help="a plain prompt's special-token texts stay text (by default they are those "
                          "tokens, as in llama.cpp's completion); a chat's messages are always text")
    _sampling_options(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def _batch_job_options(gen: argparse.ArgumentParser) -> None:
    """generate --input: a JSONL file of requests answered together (serving/batch_job.py)."""
    gen.add_argument("--input", default=None,
                     help="a JSONL file of requests, one object a line: prompt (text) or messages "
                          "(chat), and optionally max_new_tokens, temperature, top_p, top_k, seed, "
                          "stop, parse_special (prompts only); answered together (continuous "
                          "batching), each exactly as alone; a request that fails gets an error "
                          "line and the exit code 1, the rest go on")
    gen.add_argument("--output", default=None,
                     help="with --input: the JSONL answers' file, a line written as each request "
                          "finishes ('index': its place among the requests, from 0; 'error' where "
                          "it failed); rerun the same command to answer only the requests it lacks "
                          "(default stdout)")
    gen.add_argument("--ordered", action="store_true",
                     help="with --input: hold answers back to write them in input order")
    gen.add_argument("--progress-every", type=_float, default=10.0, metavar="SECONDS",
                     help="with --input: seconds between progress lines where standard error is "
                          "not a terminal (a terminal's bar is redrawn in place)")
    gen.add_argument("--max-batch", type=_positive_int, default=8, help="with --input: requests decoding at once")


def _sampling_options(gen: argparse.ArgumentParser) -> None:
    """generate's answer length, sampling and stop strings (a request of --input may set its own)."""
    from .decoding.generate import GenerationConfig
    from .speculation.sampling import SamplingParams

    field_option(gen, GenerationConfig, "max_new_tokens", _positive_int, "tokens to generate at most")
    field_option(gen, SamplingParams, "temperature", _float, "0 = greedy")
    field_option(gen, SamplingParams, "top_p", _float, "nucleus sampling mass (1: off)")
    field_option(gen, SamplingParams, "top_k", _non_negative_int, "sample among the k likeliest (0: off)")
    field_option(gen, SamplingParams, "seed", int, "sampling seed (default: random)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _train_options(sub) -> None:
    from .speculation.config import FAMILIES
    from .training.config import TrainConfig

    train = sub.add_parser("train", help="train a drafter for a model (data, features, training); "
                                         "--drafter names its family")
    _model_name_option(train)
    train.add_argument("--out", default=None, help="work directory (default runs/train-MODEL)")
    train.add_argument("--stages", default="data,features,train",
                       help="comma-separated subset of data,features,train")
    trainable = [f for f in FAMILIES.values() if f.trainable]
    field_option(train, TrainConfig, "drafter", None, "what to train: " + ", ".join(
        f"{f.name} ({f.summary})" for f in trainable), choices=tuple(f.name for f in trainable))
    train.add_argument("--ship", action="store_true",
                       help="copy the trained drafter (bfloat16; Medusa heads: 8-bit rows) into the "
                            "package as the bundled default")
    options = TrainConfig.options()
    for name, kind, text, extra in TRAIN_OPTIONS:
        holder, attribute, _ = options[name]
        field_option(train, holder, attribute, kind, text, flag="--" + name.replace("_", "-"), dest=name, **extra)
    _threads_option(train)


def _vocab_options(sub) -> None:
    vocab = sub.add_parser("vocab", help="rank tokens by frequency and write a draft token map")
    _model_name_option(vocab)
    vocab.add_argument("--source", default="sharegpt",
                       help="sharegpt (FR-Spec corpus), target (VocabTrim: the target's own "
                            "greedy predictions, from `vocabspec train` features), or files")
    vocab.add_argument("--files", nargs="*", default=[], help="extra text files to count")
    vocab.add_argument("--features", default=None,
                       help="feature directory for --source target (default runs/train-MODEL/features)")
    vocab.add_argument("--size", type=_positive_int, default=None,
                       help="tokens to keep (default: the whole ranked vocabulary)")
    vocab.add_argument("--format", default="sglang", choices=["sglang", "eagle3"],
                       help="sglang: torch-saved id list; eagle3: d2t/t2d safetensors")
    vocab.add_argument("--successors", type=_positive_int, default=None, metavar="N",
                       help="write SpecVocab's successor table instead (each token's N most frequent "
                            "next tokens in ShareGPT and --files; successors.safetensors beside a "
                            "drafter is read by spec:K)")
    vocab.add_argument("--out", required=True, help="output file")


def _ranker_options(sub) -> None:
    ranker = sub.add_parser("ranker", help="train SpecVocab's low-rank ranker by distillation")
    _model_name_option(ranker)
    ranker.add_argument("--draft-path", default=None, help="drafter (default: the bundled one)")
    ranker.add_argument("--features", default=None, help="default runs/train-MODEL")
    ranker.add_argument("--rank", type=_positive_int, default=None, help="d' (default d/16)")
    ranker.add_argument("--sequences", type=_positive_int, default=None, help="training sequences")
    ranker.add_argument("--epochs", type=_positive_int, default=1, help="passes over the training sequences")
    ranker.add_argument("--positions", type=_positive_int, default=128,
                        help="positions per sequence in the loss (random; default 128)")
    ranker.add_argument("--init", default=None,
                        help="ranker file to start from (default: the head's truncated SVD)")
    ranker.add_argument("--out", default=None, help="default: next to the bundled drafter")


def _bench_options(sub) -> None:
    from .benchmarks.bench import BenchConfig
    from .speculation.config import FAMILIES

    bench = sub.add_parser("bench", help="Spec-Bench: every method side by side, with plots")
    bench.add_argument("--questions", default="builtin",
                       help="Spec-Bench's question.jsonl (from github.com/hemingkx/Spec-Bench, "
                            "data/spec_bench/question.jsonl), or builtin (default): the project's own "
                            "13 prompts, one per Spec-Bench category")
    _model_name_option(bench)
    bench.add_argument("--methods", default="vanilla,pld,eagle2,eagle2+fr:32k,eagle2+trim:32k,eagle2+spec:2048",
                       help="comma-separated: " + "; ".join(f.grammar for f in FAMILIES.values())
                            + "; then /float32 or /bfloat16 sets the drafter's dtype on torch's kernels "
                            "and @DEPTHxTOKENS fixes the tree (eagle2+fr:32k@3x8)")
    bench.add_argument("--out", default=None, help="output directory (default runs/bench-MODEL)")
    bench.add_argument("--throughput", default=None,
                       help="the serving benchmark instead: concurrent clients (official openai "
                            "client) against the OpenAI server, e.g. 1,2,4,8,16; aggregate tok/s, "
                            "p50/p95 latency and answers differing from alone per method")
    bench.add_argument("--requests-per-client", type=_positive_int, default=4,
                       help="with --throughput: answers per client at each concurrency")
    field_option(bench, BenchConfig, "max_new_tokens", _positive_int, "new tokens per turn")
    field_option(bench, BenchConfig, "per_category", _positive_int, "questions per category (default: all 480)")
    field_option(bench, BenchConfig, "temperature", _float, "0 = greedy (mismatches are counted)")
    field_option(bench, BenchConfig, "seed", int, "sampling seed")
    add_weight_args(bench)
    _threads_option(bench)
    add_draft_args(bench, method=False)
    bench.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    field_option(bench, BenchConfig, "resume", bool, "keep the questions an interrupted run in --out finished "
                 "(same settings)")


def _serve_options(sub) -> None:
    from .serving.server import ServerLimits

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (streaming)")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_positive_int, default=8000, help="port to listen on")
    for name, kind, text in (
            ("max_tokens_cap", _positive_int, "largest max_tokens a request may ask for"),
            ("max_seconds", _float, "generation time per request"),
            ("max_queue", _positive_int, "requests waiting or running"),
            ("max_batch", _positive_int, "requests decoding at once (continuous batching; each answer exactly as "
             "alone, or up to rounding with --allow-inexact on torch's kernels; there and on --backend triton "
             "the slots the device's free memory holds cap it)")):
        field_option(serve, ServerLimits, name, kind, text)
    serve.add_argument("--kv-tokens", type=_positive_int, default=None,
                       help="KV cache budget in tokens over the decoding requests (default: max-batch x "
                            "the model window, capped at 4096 each); a request's prompt and answer fit "
                            "in its share")
    _access_options(serve)


def _access_options(serve: argparse.ArgumentParser) -> None:
    """Who may use the server (serving/guards.py), and whether it serves its API's docs."""
    from .serving.server import ServerLimits

    field_option(serve, ServerLimits, "api_key", None, "require 'Authorization: Bearer KEY' on every /v1/ route "
                 f"(401 without it); default: ${API_KEY_VARIABLE} if set, else no key")
    field_option(serve, ServerLimits, "allowed_origins", _origins, "comma-separated web origins (e.g. "
                 "https://app.example) allowed to call the server from a browser, with CORS headers for them; "
                 "'*' for any (default: none, and a request a page sends gets 403)")
    field_option(serve, ServerLimits, "docs", bool, "serve the API's /docs page and /openapi.json (the page "
                 "loads Swagger UI's scripts from a CDN)")


def _export_options(sub) -> None:
    export = sub.add_parser("export", help="write the drafter (EAGLE/SGLang layout) and the draft "
                                           "vocabulary (SGLang token map, EAGLE-3 d2t/t2d)")
    _model_name_option(export)
    export.add_argument("--draft-path", default=None, help="drafter directory (default: bundled)")
    export.add_argument("--draft-vocab", default=None, help="fr:N or trim:N to export as a token map (an "
                        "EAGLE-3 drafter: its own vocabulary narrowed to it)")
    export.add_argument("--token-map", default=None, help="token map file to cut fr:N/trim:N from")
    export.add_argument("--layout", default=None, choices=("speculators", "sglang"),
                        help="an EAGLE-3 drafter's layout: speculators (vLLM) or sglang "
                             "(LlamaForCausalLMEagle3) (default: speculators)")
    export.add_argument("--q8-0", action="store_true",
                        help="an EAGLE-3 drafter's matrices as Q8_0 groups: the package's bundle form "
                             "(about half of bfloat16's bytes; vocabspec reads it, other engines do not)")
    export.add_argument("--out", required=True, help="output directory")


def load_target(args):
    """The model and drafter the model options ask for (serving.api.load), its notes on stderr."""
    from .serving.api import load

    return load(args.model, draft=draft_config(args), weights=args.weights, device=args.device,
                max_seq_len=args.max_seq_len, backend=args.backend, allow_inexact=args.allow_inexact,
                log=lambda message: print(message, file=sys.stderr))


def cmd_serve(args) -> int:
    import os
    import traceback

    from .serving.server import ServerFailed, ServerLimits, serve

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE) or None
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty")
    set_threads(args.threads)
    lm = load_target(args)
    window = args.kv_tokens // args.max_batch if args.kv_tokens else 4096
    limits = config_of(ServerLimits, args, window=min(window, lm.engine.model.args.max_seq_len), api_key=api_key)
    print(resident(lm, slots=limits.max_batch, tokens=limits.window), file=sys.stderr)
    try:
        serve(lm, args.model, host=args.host, port=args.port, limits=limits)
    except ServerFailed as exc:         # exit at once, non-zero: a supervisor restarts it
        if exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"vocabspec: error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_export(args) -> int:
    from .export import export

    written = export(args.model, args.out, draft_path=args.draft_path, draft_vocab=args.draft_vocab,
                     token_map=args.token_map, layout=args.layout, q8_0=args.q8_0)
    for path in written:
        print(path)
    return 0


def cmd_bench(args) -> int:
    from .benchmarks.bench import BenchConfig, run_bench
    from .speculation.config import DraftConfig

    set_threads(args.threads)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    for method in methods:
        DraftConfig.from_method(method)
    if args.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {args.temperature}")
    if args.throughput is not None:
        from .benchmarks.throughput import run_throughput

        try:
            concurrencies = [int(c) for c in args.throughput.split(",")]
        except ValueError:
            raise ValueError(f"--throughput takes client counts, e.g. 1,2,4,8, not {args.throughput!r}") from None
        if not concurrencies or min(concurrencies) < 1:
            raise ValueError("--throughput takes positive client counts")
        out = Path(args.out or f"runs/throughput-{args.model}")
        run_throughput(args.model, list(methods), concurrencies, str(out), questions=args.questions,
                       per_category=args.per_category or 1, max_tokens=args.max_new_tokens,
                       temperature=args.temperature, seed=args.seed, requests_per_client=args.requests_per_client,
                       weights=args.weights, log=lambda m: print(m, file=sys.stderr))
        print((out / "report.md").read_text())
        print(f"[report, tables and plots in {out}/]", file=sys.stderr)
        return 0
    cfg = config_of(BenchConfig, args, methods=methods, out=args.out or f"runs/bench-{args.model}",
                    warmup=not args.no_warmup)
    summary = run_bench(cfg, log=lambda m: print(m, file=sys.stderr))
    print((Path(cfg.out) / "report.md").read_text())
    print(f"[report, answers, tables and plots in {cfg.out}/]", file=sys.stderr)
    bad = {n: m["mismatched_questions"] for n, m in summary["methods"].items() if m.get("mismatched_questions")}
    if bad:
        print(f"vocabspec: LOSSLESSNESS VIOLATION: greedy output differs from vanilla: {bad}", file=sys.stderr)
        return 1
    return 0


def cmd_vocab(args) -> int:

    from .runtime.loading import load_model
    from .training.sharegpt import count_sharegpt
    from .speculation.vocab.token_map import (count_files, count_target_predictions, rank, save_eagle3,
                                              save_token_map)
    from .runtime.tokenizer import load_tokenizer

    if args.source == "files" and not args.files:
        raise ValueError("--source files needs --files PATH ...")
    model, path = load_model(args.model, max_seq_len=64)
    tokenizer = load_tokenizer(path)
    vocab = model.args.vocab_size
    if args.successors:
        return _write_successors(args, tokenizer, vocab)
    if args.source == "sharegpt":
        counts = count_sharegpt(tokenizer)
        fallback = []
    elif args.source == "target":
        features = Path(args.features or f"runs/train-{args.model}/features")
        counts = count_target_predictions(features)
        fallback = rank(count_sharegpt(tokenizer), vocab)   # corpus order for unseen tokens
    elif args.source == "files":
        counts, fallback = count_files(tokenizer, args.files), []
    else:
        raise ValueError(f"unknown source {args.source!r} (sharegpt, target, files)")
    if args.files and args.source != "files":
        counts.update(count_files(tokenizer, args.files))
    ranked = rank(counts, vocab, fallback)
    size = args.size or len(ranked)
    if size > vocab:
        raise ValueError(f"--size {size} exceeds the vocabulary ({vocab})")
    ranked = ranked[:size]
    seen = sum(1 for t in ranked if counts.get(t))
    covered = sum(counts.get(t, 0) for t in ranked) / max(sum(counts.values()), 1)
    if args.format == "sglang":
        save_token_map(ranked, args.out)
    else:
        save_eagle3(ranked, vocab, args.out)
    print(f"wrote {args.out}: {size} tokens ({seen} counted), covering {covered:.2%} of "
          f"{sum(counts.values())} counted tokens")
    return 0


def _write_successors(args, tokenizer, vocab: int) -> int:
    from .training.sharegpt import sharegpt_ids
    from .speculation.vocab.token_map import file_ids, save_successors, successor_lists

    if args.source not in ("sharegpt", "files"):
        raise ValueError("--successors counts a corpus: --source sharegpt or files")
    texts = list(file_ids(tokenizer, args.files))
    if args.source == "sharegpt":
        texts += list(sharegpt_ids(tokenizer))
    offsets, ids = successor_lists(texts, vocab, args.successors)
    tokens = sum(len(t) for t in texts)
    save_successors(offsets, ids, args.out, meta={"source": args.source, "files": len(args.files),
                                                  "width": args.successors, "tokens": tokens})
    rows = int((offsets.diff() > 0).sum())
    print(f"wrote {args.out}: up to {args.successors} successors for each of {rows} tokens "
          f"({ids.numel()} in all), counted over {tokens} tokens")
    return 0


def cmd_ranker(args) -> int:

    import torch

    from .speculation.config import bundled_drafter_dir
    from .speculation.families.eagle import EagleDrafter
    from .runtime.loading import load_model
    from .speculation.vocab.draft_vocab import load_ranker, save_ranker
    from .training.ranker import train_ranker
    from .training.train import TrainConfig, load_shards

    target, _ = load_model(args.model, backend="torch")
    draft_path = args.draft_path or bundled_drafter_dir(args.model)
    if draft_path is None:
        raise ValueError(f"no drafter bundled for {args.model}: pass --draft-path")
    drafter = EagleDrafter.load(draft_path, target).float()
    cfg = TrainConfig.of(model=args.model, out=args.features or f"runs/train-{args.model}",
                      taps=",".join(map(str, drafter.taps)))
    # The target's own answers (self-distillation) are what the drafter meets when drafting.
    train_set = load_shards(cfg, "train") + load_shards(cfg, "distill")
    heldout = load_shards(cfg, "heldout")
    if not train_set:
        raise ValueError(f"no feature shards under {cfg.out}/features: run vocabspec train first")
    init = load_ranker(args.init, target.head_weight) if args.init else None
    rank = args.rank or (init[0].shape[0] if init else max(1, target.args.dim // 16))
    down, vocab, metrics = train_ranker(drafter, train_set, heldout, rank, epochs=args.epochs,
                                        max_sequences=args.sequences, positions=args.positions,
                                        init=init)
    out = Path(args.out) if args.out else Path(draft_path) / "ranker.safetensors"
    save_ranker(down.to(torch.bfloat16), vocab.to(torch.bfloat16), out, meta=metrics)
    print(f"wrote {out}: {metrics}")
    return 0



def cmd_train(args) -> int:
    from .training.train import parse_token_counts, run

    set_threads(args.threads)
    stages = tuple(s for s in args.stages.split(",") if s)
    unknown = set(stages) - {"data", "features", "train"}
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))} (data, features, train)")
    if args.snapshot_tokens and args.drafter != "eagle3":
        raise ValueError("--snapshot-tokens applies to --drafter eagle3")
    parse_token_counts(args.snapshot_tokens)          # before hours of data and features
    if args.ttt_decay <= 0:
        raise ValueError(f"--ttt-decay weighs step k's loss by its k-th power: a positive number, not {args.ttt_decay}")
    run(train_config(args), stages=stages, ship=args.ship)
    return 0


def cmd_generate(args) -> int:
    from .speculation.sampling import SamplingParams

    set_threads(args.threads)
    # Validate cheap things before spending seconds on loading the model.
    config_of(SamplingParams, args)
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give a prompt or --input FILE.jsonl (not both)")
    if args.chat and not args.parse_special:
        raise ValueError("--no-parse-special applies to a plain prompt: a chat message's content is "
                         "always tokenized as text")
    if args.input is not None:
        return generate_file(args)
    if args.output is not None or args.ordered:
        raise ValueError(f"{'--output' if args.output is not None else '--ordered'} applies to --input")
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    lm = load_target(args)
    print(describe(lm, args.draft), file=sys.stderr)
    print(resident(lm), file=sys.stderr)
    generation = lm.stream(args.prompt, chat=args.chat, parse_special=None if args.chat else args.parse_special,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    for piece in generation:
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    result = generation.result
    if args.json:
        print(json.dumps({"model": args.model, "draft": args.draft, "weights": lm.engine.model.weights,
                          **result.as_dict()}))
    else:
        sys.stdout.write("\n")
        print(f"[{result.new_tokens} tokens, {result.seconds:.2f} s, {result.tokens_per_s:.1f} tok/s"
              + (f", mean accepted length {result.mean_accept_len:.2f}" if args.draft != "none" else "")
              + "]", file=sys.stderr)
    return 0


def generate_file(args) -> int:
    """--input: a batch job (serving/batch_job.py): every request of a JSONL file answered
    together, each answer's line written as it finishes; an --output file resumes."""
    from .serving.batch_job import AnswerFile, Progress, StreamAnswers, read_requests, run_job, summary

    if args.progress_every < 0:
        raise ValueError(f"--progress-every takes seconds >= 0, not {args.progress_every}")
    path = Path(args.input)
    requests = read_requests(path)
    # What shapes the answers: a rerun into the same --output must keep them.
    options = {"--model": args.model, "--weights": args.weights, "--draft": args.draft,
               "--chat": args.chat, "--max-new-tokens": args.max_new_tokens,
               "--temperature": args.temperature, "--top-p": args.top_p, "--top-k": args.top_k,
               "--seed": args.seed, "--stop": list(args.stop)}
    if not args.parse_special:
        options["--no-parse-special"] = True
    if args.output is not None:
        answers = AnswerFile.open(Path(args.output), path, requests, options)
        if answers.discarded:
            print(f"[{args.output}: discarded a half-written last line ({answers.discarded} bytes)]",
                  file=sys.stderr)
        if answers.recorded and len(answers.recorded) < len(requests):
            print(f"[{args.output} holds {len(answers.recorded)} of {len(requests)} requests: "
                  f"answering the rest]", file=sys.stderr)
    else:
        answers = StreamAnswers(sys.stdout)
    pending = [index for index in range(len(requests)) if index not in answers.recorded]
    failed_before = sum(answers.recorded.values())
    if not pending:
        print(f"[{args.output} already holds all {len(requests)} requests, {failed_before} failed]",
              file=sys.stderr)
        return 1 if failed_before else 0
    lm = load_target(args)
    print(describe(lm, args.draft), file=sys.stderr)
    print(resident(lm, slots=args.max_batch), file=sys.stderr)     # at most: each slot its window
    defaults = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), parse_special=args.parse_special)
    progress = Progress(sys.stderr, len(requests), len(answers.recorded), every=args.progress_every)
    try:
        result = run_job(lm, requests, pending, defaults, args.chat, answers, args.max_batch,
                         args.ordered, progress)
    except KeyboardInterrupt:
        if args.output is not None:
            print(f"\n[interrupted: {args.output} holds {len(answers.recorded)} of {len(requests)} "
                  f"requests; rerun the same command to answer the rest]", file=sys.stderr)
        raise
    finally:
        answers.close()
    print(summary(result, answers, len(requests), args.draft != "none", args.output), file=sys.stderr)
    return 1 if sum(answers.recorded.values()) else 0


def resident(lm, slots: int = 1, tokens: int | None = None) -> str:
    """One line on what the model holds in memory: its weights and the KV caches of `slots`
    contexts of `tokens` (default: its window)."""
    need = lm.engine.model.memory
    if need is None:
        return "[memory: not stated for this model]"
    if tokens is not None:
        from dataclasses import replace

        need = replace(need, tokens=tokens)
    return f"[memory: {need.describe(slots)}, {(need.weights + slots * need.kv) / 2**30:.2f} GiB resident]"


def describe(lm, draft: str) -> str:
    """One line on what decoding will do: the weights, what runs them, and the proposer."""
    engine = lm.engine
    what = f"[{lm.name}, weights {engine.model.weights} on {engine.model.runs_on}: "
    if engine.proposer is None:
        if draft != "none":
            return what + f"plain decoding: no {draft} tree beat it when this machine was timed]"
        return what + "plain decoding, no drafting (--draft eagle for EAGLE-2 speculative decoding)]"
    shape = engine.proposer.tree_shape
    draft_vocab = engine.proposer.draft_vocab
    tree = f", tree depth {shape[0]} x {shape[1]} tokens" if shape else ""
    if getattr(engine.proposer, "sizing", None) is not None:
        tree = f", tree sized each step from its confidence and this machine's costs (at most {shape[0]} deep, " \
               f"{shape[1]} tokens)"
    vocab = f", draft vocabulary {draft_vocab.name}" if draft_vocab is not None else ""
    return what + f"{draft}{vocab}{tree}; output identical to plain decoding]"


COMMANDS = {"generate": cmd_generate, "train": cmd_train, "vocab": cmd_vocab, "ranker": cmd_ranker, "bench": cmd_bench,
            "serve": cmd_serve, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .speculation.families.eagle import DrafterMismatch
    from .runtime.loading import ModelLoadError

    try:
        return COMMANDS[args.command](args)
    except (ValueError, ModelLoadError, DrafterMismatch, FileNotFoundError, NotImplementedError) as exc:
        print(f"vocabspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
