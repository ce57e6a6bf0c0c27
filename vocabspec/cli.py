"""Command line: `vocabspec generate ...`. Bad input ends with a one-line error, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="bundled name (smollm2, gemma3), a .gguf file or a HF model directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--threads", type=_positive_int, default=None, help="CPU threads for torch")
    parser.add_argument("--max-seq-len", type=_positive_int, default=None,
                        help="KV cache size in tokens (default 4096, capped by the model)")
    parser.add_argument("--draft", default="none", choices=["none", "eagle", "pld"],
                        help="proposer: none (vanilla), eagle (EAGLE-2 tree), pld (prompt lookup)")
    parser.add_argument("--draft-path", default=None,
                        help="EAGLE drafter directory ('random' for an untrained one)")
    parser.add_argument("--depth", type=_non_negative_int, default=6, help="tree expansion steps")
    parser.add_argument("--tree-top-k", type=_positive_int, default=10, help="children per expanded node")
    parser.add_argument("--total-tokens", type=_positive_int, default=60, help="drafted tokens verified per step")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vocabspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="the prompt text")
    add_model_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=256)
    gen.add_argument("--temperature", type=_float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=_float, default=1.0)
    gen.add_argument("--top-k", type=_non_negative_int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    train = sub.add_parser("train", help="train an EAGLE drafter for a model (data, features, training)")
    from .train import TrainConfig
    defaults = TrainConfig()
    train.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF directory")
    train.add_argument("--out", default=None, help="work directory (default runs/train-MODEL)")
    train.add_argument("--stages", default="data,features,train",
                       help="comma-separated subset of data,features,train")
    train.add_argument("--ship", action="store_true",
                       help="copy the trained drafter (bfloat16) into the package as the bundled default")
    for name, kind in (("conversations", _positive_int), ("heldout", _positive_int),
                       ("max_len", _positive_int), ("epochs", _positive_int),
                       ("accumulate", _positive_int), ("top_candidates", _positive_int),
                       ("negatives", _non_negative_int), ("max_steps", _non_negative_int),
                       ("lr", _float), ("noise", _float), ("cls_weight", _float)):
        train.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name))
    train.add_argument("--feature-dtype", default=defaults.feature_dtype, choices=["float32", "bfloat16"])
    train.add_argument("--full-vocab-loss", action="store_true",
                       help="exact cross-entropy over the whole vocabulary (slow on a CPU)")
    train.add_argument("--threads", type=_positive_int, default=None)
    return parser


def cmd_train(args) -> int:
    import torch

    from .train import TrainConfig, run

    if args.threads:
        torch.set_num_threads(args.threads)
    stages = tuple(s for s in args.stages.split(",") if s)
    unknown = set(stages) - {"data", "features", "train"}
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))} (data, features, train)")
    fields = {k: getattr(args, k) for k in TrainConfig.__dataclass_fields__ if hasattr(args, k)}
    fields["out"] = args.out or f"runs/train-{args.model}"
    run(TrainConfig(**fields), stages=stages, ship=args.ship)
    return 0


def cmd_generate(args) -> int:
    import torch

    from .api import load
    from .sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    # Validate cheap things before spending seconds on loading the model.
    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    lm = load(args.model, draft=args.draft, draft_path=args.draft_path, dtype=args.dtype,
              device=args.device, max_seq_len=args.max_seq_len, depth=args.depth,
              tree_top_k=args.tree_top_k, total_tokens=args.total_tokens)
    generation = lm.stream(args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                           seed=args.seed, stop=args.stop)
    for piece in generation:
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    result = generation.result
    if args.json:
        print(json.dumps({"model": args.model, "draft": args.draft, **result.as_dict()}))
    else:
        sys.stdout.write("\n")
        print(f"[{result.new_tokens} tokens, {result.seconds:.2f} s, {result.tokens_per_s:.1f} tok/s"
              + (f", mean accepted length {result.mean_accept_len:.2f}" if args.draft != "none" else "")
              + "]", file=sys.stderr)
    return 0


COMMANDS = {"generate": cmd_generate, "train": cmd_train}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .drafter import DrafterMismatch
    from .loading import ModelLoadError

    try:
        return COMMANDS[args.command](args)
    except (ValueError, ModelLoadError, DrafterMismatch, FileNotFoundError, NotImplementedError) as exc:
        print(f"vocabspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
