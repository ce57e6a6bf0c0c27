"""Every subcommand over foreign and broken inputs: drafters in the ecosystem's layouts
(vLLM's speculators, SGLang's, EAGLE-2's), truncated files, wrong shapes, unreadable configs,
malformed JSONL and feature shards. Each run ends in success or in one line of error (exit 2),
never in a traceback. Runs in process (cli.main), so that any exception escaping a command
fails the test with its traceback; `serve`, which would block on success, runs as a process."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_layout import untrained_speculators_checkpoint
from vocabspec import cli
from vocabspec.speculation.families.eagle import EagleDrafter
from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, smollm2):
    """Drafter directories and files for SmolLM2, good and broken, by name."""
    root = tmp_path_factory.mktemp("foreign")
    target = smollm2.model
    a = target.args
    out = {"speculators": untrained_speculators_checkpoint(root / "speculators", a, draft_vocab=1024, embed=False)}
    config = Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                          intermediate_size=256, n_layers=1, norm_eps=1e-5, rope_base=10000.0,
                          draft_vocab_size=2048, aux_layers=(2, 15, 27), target_dim=a.dim)
    eagle3 = Eagle3Drafter.random(target, config, seed=2, dtype=torch.float32)
    eagle3.save(root / "sglang", layout="sglang")
    out["sglang"] = root / "sglang"
    EagleDrafter.random(target, seed=3).save(root / "eagle2")
    out["eagle2"] = root / "eagle2"

    def broken(name, source, change):
        directory = root / name
        shutil.copytree(source, directory)
        change(directory)
        out[name] = directory

    def truncate(directory):
        path = directory / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def reshape(directory):
        state = load_file(str(directory / "model.safetensors"))
        state["fc.weight"] = state["fc.weight"][:, :100].contiguous()
        save_file(state, str(directory / "model.safetensors"))

    def bad_json(directory):
        (directory / "config.json").write_text('{"speculators_model_type": "eagle3", "draft_voc')

    broken("truncated", out["speculators"], truncate)
    broken("eagle2_truncated", out["eagle2"], truncate)
    broken("wrong_shape", out["speculators"], reshape)
    broken("eagle2_wrong_shape", out["eagle2"], reshape)
    broken("bad_config", out["speculators"], bad_json)
    (root / "empty").mkdir()
    out["empty"] = root / "empty"
    (root / "requests.jsonl").write_text('{"prompt": "Hi", "max_new_tokens": 3}\n{"prompt": "Hello", "max_ne\n')
    out["broken_jsonl"] = root / "requests.jsonl"
    (root / "questions.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["Hi"]}\nnot json\n')
    out["broken_questions"] = root / "questions.jsonl"
    (root / "features").mkdir()
    (root / "features" / "train-00000.pt").write_bytes(b"PK\x03\x04 not a torch file")
    out["broken_features"] = root
    out["root"] = root
    return out


def run(argv, capsys):
    """(exit code, stdout, stderr) of `vocabspec ARGV` in process; an escaping exception fails
    the test."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exit_:          # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


GENERATE = ["generate", "--model", "smollm2", "--max-new-tokens", "4", "--depth", "3", "--total-tokens", "8"]

# (arguments, expected: "ok" or the text the one-line error must hold)
CASES = [
    (GENERATE + ["--draft", "eagle", "--draft-path", "{speculators}", "Hi"], "ok"),
    (GENERATE + ["--draft", "eagle3", "--draft-path", "{sglang}", "Hi"], "ok"),
    (GENERATE + ["--draft", "eagle", "--draft-path", "{eagle2}", "Hi"], "ok"),
    (GENERATE + ["--draft", "eagle", "--draft-path", "{truncated}", "Hi"], "unreadable checkpoint"),
    (GENERATE + ["--draft", "eagle", "--draft-path", "{eagle2_truncated}", "Hi"], "unreadable checkpoint"),
    (GENERATE + ["--draft", "eagle", "--draft-path", "{wrong_shape}", "Hi"], "fc.weight"),
    (GENERATE + ["--draft", "eagle", "--draft-path", "{eagle2_wrong_shape}", "Hi"], "shapes"),
    (GENERATE + ["--draft", "eagle3", "--draft-path", "{bad_config}", "Hi"], "bad_config is not one"),
    (GENERATE + ["--draft", "eagle", "--draft-path", "{empty}", "Hi"], "drafter"),
    (GENERATE + ["--input", "{broken_jsonl}"], "requests.jsonl:2: not JSON"),
    (["export", "--model", "smollm2", "--draft-path", "{speculators}", "--draft-vocab", "trim:512",
      "--layout", "speculators", "--out", "{root}/export-narrow"], "ok"),
    (["export", "--model", "smollm2", "--draft-path", "{sglang}", "--layout", "speculators",
      "--out", "{root}/export-sglang"], "ok"),
    (["export", "--model", "smollm2", "--draft-path", "{truncated}", "--out", "{root}/export-bad"],
     "unreadable checkpoint"),
    (["export", "--model", "smollm2", "--draft-path", "{wrong_shape}", "--draft-vocab", "trim:512",
      "--out", "{root}/export-bad2"], "fc.weight"),
    (["bench", "--questions", "{broken_questions}", "--methods", "vanilla", "--max-new-tokens", "2"], "questions.jsonl:2"),
    (["vocab", "--source", "target", "--features", "{broken_features}/features", "--out", "{root}/map.pt"],
     "train-00000.pt: unreadable"),
    (["ranker", "--draft-path", "{truncated}", "--features", "{broken_features}", "--out", "{root}/r.pt"],
     "unreadable checkpoint"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(CASES)])
def test_subcommands_end_in_success_or_one_line_of_error(inputs, capsys, argv, expected):
    code, _, err = run([a.format(**inputs) for a in argv], capsys)
    if expected == "ok":
        assert code == 0, err
    else:
        lines = [line for line in err.splitlines() if line.startswith("vocabspec: error:")]
        assert code == 2 and len(lines) == 1, err
        assert expected in lines[0], lines[0]
        assert "Traceback" not in err


def test_exported_narrow_speculators_drafter_loads_back_and_drafts_losslessly(inputs, capsys):
    """export --draft-vocab trim:N of a speculators checkpoint writes a drafter that loads and
    drafts plain decoding's tokens."""
    out = inputs["root"] / "export-narrow-again"
    code, _, err = run(["export", "--model", "smollm2", "--draft-path", inputs["speculators"], "--draft-vocab",
                        "trim:512", "--layout", "speculators", "--out", out], capsys)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 512
    common = GENERATE[:3] + ["--max-new-tokens", "12", "--json", "--chat"]
    code, plain, err = run(common + ["Name a color."], capsys)
    assert code == 0, err
    code, drafted, err = run(common + ["--draft", "eagle", "--draft-path", out, "--depth", "4",
                                       "--total-tokens", "16", "Name a color."], capsys)
    assert code == 0, err
    assert json.loads(drafted)["draft"] == "eagle"
    assert (json.loads(drafted)["text"], json.loads(drafted)["new_tokens"]) == \
        (json.loads(plain)["text"], json.loads(plain)["new_tokens"])


def test_serve_with_a_broken_drafter_exits_with_one_line(inputs):
    done = subprocess.run([sys.executable, "-m", "vocabspec.cli", "serve", "--draft", "eagle", "--draft-path",
                           str(inputs["truncated"]), "--port", "18731"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "unreadable checkpoint" in done.stderr
