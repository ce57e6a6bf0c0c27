"""An archive of the target's own answers, kept in the repository so self-distillation data
accumulates across machines.

Generating answers is a slow part of training on a CPU (the batch engine takes about 20-25
minutes per million answer tokens on 2 cores, transformers took 1.4-1.6 h), and a machine's
work directory may not outlive the run. Each file names its generator: the archive's first
answers came from transformers in bfloat16, later ones from the batch engine. The answers themselves are small (2 or 4 bytes a token), so each run that generates some
can write them to an archive directory, and later runs on any machine read them back instead
of generating them again. Answers are greedy, so a prompt has one answer per target: each file
records a fingerprint of the target's weights file and the answer-length cap, and is refused
for any other target.

A file holds `tokens` (every sequence, prompt + answer, end to end, int32), `lengths` (each
sequence's length) and `prompt_lengths`; its metadata holds the fingerprint and settings.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

FORMAT = "vocabspec-answers-1"


class AnswerArchiveError(ValueError):
    """An archive file is unreadable, or was made for another target or answer length."""


def target_fingerprint(model_path: Path) -> str:
    """Content hash of the target's weights (a GGUF file, or a directory's weight and config
    files): the same model gives the same key on every machine."""
    model_path = Path(model_path)
    files = [model_path] if model_path.is_file() else sorted(
        p for p in model_path.iterdir() if p.suffix in (".safetensors", ".json", ".gguf", ".bin"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:24]


def read_answers(directory: Path, fingerprint: str, max_new_tokens: int) -> dict[tuple, list[int]]:
    """{prompt ids: prompt + answer ids} from every archive file in `directory`."""
    from safetensors import safe_open

    answers: dict[tuple, list[int]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                tokens = handle.get_tensor("tokens").tolist()
                lengths = handle.get_tensor("lengths").tolist()
                prompt_lengths = handle.get_tensor("prompt_lengths").tolist()
        except Exception as exc:
            raise AnswerArchiveError(f"{path}: not a readable answer archive ({exc})") from exc
        if meta.get("format") != FORMAT or sum(lengths) != len(tokens) or len(lengths) != len(prompt_lengths):
            raise AnswerArchiveError(f"{path}: not a {FORMAT} file, or its lengths do not add up")
        if meta.get("target") != fingerprint:
            raise AnswerArchiveError(f"{path}: answers of another target (fingerprint "
                                     f"{meta.get('target')}, this target's is {fingerprint})")
        if meta.get("max_new_tokens") != str(max_new_tokens):
            raise AnswerArchiveError(f"{path}: answers cut at {meta.get('max_new_tokens')} tokens, "
                                     f"this run asks for {max_new_tokens} (--distill-new-tokens)")
        start = 0
        for length, prompt_length in zip(lengths, prompt_lengths):
            sequence = tokens[start:start + length]
            answers[tuple(sequence[:prompt_length])] = sequence
            start += length
    return answers


def write_answers(directory: Path, prompts: list[list[int]], sequences: list[list[int]],
                  fingerprint: str, max_new_tokens: int, generator: str) -> Path | None:
    """Archive these answers as one new file (named by its content, so writing the same answers
    twice leaves one file). Returns its path, or None when there is nothing to write."""
    from safetensors.torch import save_file

    # ShareGPT repeats some first turns word for word; a greedy answer is the same each time.
    unique = {tuple(p): (p, s) for p, s in zip(prompts, sequences)}
    prompts, sequences = [p for p, _ in unique.values()], [s for _, s in unique.values()]
    if not sequences:
        return None
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int32)
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    digest = hashlib.sha256(tokens.numpy().tobytes() + lengths.numpy().tobytes()).hexdigest()[:12]
    if tokens.numel() and int(tokens.max()) < 65536:      # two bytes a token where the ids fit
        tokens = tokens.to(torch.uint16)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"answers-{len(sequences)}-{digest}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": tokens, "lengths": lengths, "prompt_lengths": prompt_lengths}, str(tmp),
              metadata={"format": FORMAT, "target": fingerprint, "max_new_tokens": str(max_new_tokens),
                        "generator": generator, "answers": str(len(sequences)),
                        "tokens": str(tokens.numel())})
    tmp.replace(path)
    return path
