"""llama.cpp's own C++ tools as the benchmark record's peers (scripts/build_llamacpp.sh builds
them): a greedy answer from llama-completion (plain) or llama-lookup (prompt lookup) with the
times the tool reports, and llama-bench's decode-only figures. LCPP_BIN names a directory
holding the tools instead of building them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

LLAMA_CPP = Path(os.environ["LCPP_BIN"]) if os.environ.get("LCPP_BIN") else None


def llama_cpp_bin() -> Path:
    """Where scripts/build_llamacpp.sh put llama.cpp's tools (it builds them if need be)."""
    if LLAMA_CPP is not None:
        return LLAMA_CPP
    done = subprocess.run(["bash", str(Path(__file__).with_name("build_llamacpp.sh"))],
                          capture_output=True, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


class LlamaCppTool:
    """llama.cpp's own llama-completion (plain) or llama-lookup (prompt lookup), one process per
    answer, greedy; the seconds are the prompt's and the generation's as the tool reports them.
    The prompt is the same templated text our tokenizer encoded (its special tokens written
    out; llama.cpp adds a BOS itself where the model asks for one)."""

    def __init__(self, path: Path, tokenizer, threads: int, lookup: bool):
        self.path, self.tokenizer, self.threads, self.lookup = path, tokenizer, threads, lookup
        self.tool = llama_cpp_bin() / ("llama-lookup" if lookup else "llama-completion")

    def run(self, ids: list[int], new_tokens: int, ignore_eos: bool = False) -> subprocess.CompletedProcess:
        bos = self.tokenizer.bos_token_id
        text = self.tokenizer.decode(ids[1:] if ids and ids[0] == bos else ids, skip_special_tokens=False)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompt:
            prompt.write(text)
            prompt.flush()
            cmd = [str(self.tool), "-m", str(self.path), "-t", str(self.threads), "-f", prompt.name,
                   "-n", str(new_tokens), "--temp", "0", "-c", "4096"]
            if not self.lookup:        # (llama-lookup has neither option)
                cmd += ["-no-cnv", "--no-display-prompt", "--no-warmup"]
            if ignore_eos:
                cmd += ["--ignore-eos"]
            # errors="replace": an answer cut at a token count may end inside a UTF-8 character.
            done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        return done

    def answer(self, ids: list[int], new_tokens: int) -> str:
        """llama-completion's greedy continuation of `ids` as text (exactly `new_tokens`; the
        tool writes a newline before it)."""
        text = self.run(ids, new_tokens, ignore_eos=True).stdout
        return text[1:] if text.startswith("\n") else text

    def generate(self, ids: list[int], new_tokens: int) -> tuple[int, float]:
        """(new tokens, seconds of prompt and generation as the tool reports them)."""
        log = self.run(ids, new_tokens).stderr
        if self.lookup:          # "encoded N tokens in X seconds", "decoded M tokens in Y seconds"
            encoded = float(re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log).group(1))
            decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
            return min(int(decoded.group(1)), new_tokens), encoded + float(decoded.group(2))
        prompt_ms = float(re.search(r"prompt eval time =\s+([\d.]+) ms", log).group(1))
        eval_match = re.search(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs", log)
        return int(eval_match.group(2)) + 1, (prompt_ms + float(eval_match.group(1))) / 1000


def decode_only(path: Path, threads: int, repeats: int = 5) -> dict:
    """llama-bench tg128 after 0 and 256 tokens: tokens/s, mean and spread as it reports them."""
    cmd = [str(llama_cpp_bin() / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "0",
           "-n", "128", "-d", "0,256", "-r", str(repeats), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {f"tg128@d{row['n_depth']}": {"tokens_per_s": round(row["avg_ts"], 1),
                                          "stddev": round(row["stddev_ts"], 1)} for row in rows}


