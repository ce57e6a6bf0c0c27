"""Command-line behaviour: clear errors with exit code 2 and no traceback; JSON output."""

import json
import subprocess
import sys

import pytest
import torch

from vocabspec.speculation.families.eagle import DrafterMismatch, EagleDrafter
from vocabspec.runtime.loading import ModelLoadError, load_model

from conftest import tiny_model


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "vocabspec.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--max-new-tokens", "0"], "positive integer"),
    (["generate", "hi", "--max-new-tokens", "lots"], "positive integer"),
    (["generate", "hi", "--weights", "float64"], "invalid choice"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "neither a bundled name"),
    (["generate", "hi", "--model", "llama9"], "neither a bundled name"),
    (["generate", "hi", "--draft-vocab", "fr:lots"], "draft vocabulary size"),
    (["generate", "hi", "--draft-vocab", "huge:3"], "unknown draft vocabulary"),
    (["generate", "hi", "--draft", "pld", "--draft-vocab", "fr:32k"], "not to --draft pld"),
    (["generate", "hi", "--draft", "eagle", "--draft-vocab", "fr:8k", "--token-map", "/no/map.pt"],
     "token map"),
    (["generate", "hi", "--total-tokens", "many"], "or 'auto'"),
    (["generate", "hi", "--ordered"], "--ordered applies to --input"),
    # Options the chosen method does not read are refused by name, never ignored.
    (["generate", "hi", "--draft", "pld", "--draft-path", "/some/drafter"], "--draft-path does not apply to --draft pld"),
    (["generate", "hi", "--draft", "medusa", "--depth", "3"], "--depth does not apply to --draft medusa"),
    (["generate", "hi", "--draft", "medusa", "--tree-top-k", "3"], "--tree-top-k does not apply"),
    (["generate", "hi", "--draft", "model:smollm2", "--draft-dtype", "bfloat16"], "--draft-dtype does not apply"),
    (["generate", "hi", "--draft", "model:smollm2", "--draft-path", "/d"], "--draft-path does not apply"),
    (["generate", "hi", "--draft", "eagle", "--draft-weights", "gguf"], "--draft-weights does not apply"),
    (["generate", "hi", "--draft", "eagle", "--draft-dtype", "bfloat16"], "on the native engine"),
    (["generate", "hi", "--draft", "eagle", "--draft-vocab", "fr:8k", "--ranker", "/r"], "--ranker applies"),
    (["bench", "--methods", "vanilla,warp9"], "unknown method"),
    (["bench", "--questions", "/no/questions.jsonl", "--methods", "vanilla"], "does not exist"),
    (["train", "--stages", "data,bake"], "unknown stage"),
    (["train", "--drafter", "eagle3", "--snapshot-tokens", "1.9M,lots"], "token counts are numbers"),
    (["train", "--snapshot-tokens", "1.9M"], "applies to --drafter eagle3"),
    (["train", "--drafter", "eagle3", "--ttt-decay", "0"], "a positive number"),
    (["vocab", "--source", "files", "--out", "/tmp/x.pt"], "--files"),
    (["vocab", "--source", "target", "--successors", "4", "--out", "/tmp/x.safetensors"], "counts a corpus"),
    (["generate", "hi", "--draft", "eagle", "--draft-vocab", "spec:64:8:4"], "named"),
    (["generate", "hi", "--draft", "eagle", "--draft-vocab", "spec:64,depth=2"], "bad SpecVocab option"),
])
def test_bad_arguments_fail_cleanly(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_gguf_is_named(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    proc = run_cli("generate", "hi", "--model", str(bad))
    assert proc.returncode == 2 and str(bad) in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(bad))


def test_truncated_real_gguf_is_refused(tmp_path, smollm2):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.path.read_bytes()[: 5_000_000])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(str(cut))


def test_generate_json(smollm2):
    proc = run_cli("generate", "--model", "smollm2", "--chat", "--json", "--max-new-tokens", "8",
                   "--draft", "pld", "Say hello.")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["new_tokens"] == 8 and out["text"] and out["tokens_per_s"] > 0
    assert out["steps"] >= 1 and out["mean_accept_len"] >= 1.0


def test_chat_on_base_model_is_refused(gemma3):
    from vocabspec.serving.api import LanguageModel
    from vocabspec.decoding.batch import Engine

    lm = LanguageModel(Engine(gemma3.model, gemma3.tokenizer), "gemma3")
    with pytest.raises(ValueError, match="no chat template"):
        lm.generate("hi", chat=True, max_new_tokens=2)


def test_over_long_prompt_is_refused_and_engine_still_works(smollm2):
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.decoding.batch import Engine

    engine = Engine(smollm2.model, smollm2.tokenizer)
    with pytest.raises(ValueError, match="context window"):
        engine.generate([5] * 5000, GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="context window"):
        engine.generate([5] * 10, GenerationConfig(max_new_tokens=4090))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([10**7], GenerationConfig(max_new_tokens=4))
    assert engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=3)).new_tokens == 3


def test_drafter_roundtrip_and_mismatch(tmp_path):
    llama = tiny_model("llama")
    drafter = EagleDrafter.random(llama, seed=2)
    drafter.save(tmp_path / "d")
    loaded = EagleDrafter.load(tmp_path / "d", llama)
    tokens, features = torch.tensor([1, 2, 3]), torch.randn(3, llama.args.dim)
    a = drafter(tokens, features, torch.arange(3), drafter.new_cache(8))
    b = loaded(tokens, features, torch.arange(3), loaded.new_cache(8))
    torch.testing.assert_close(a, b)
    other = tiny_model("llama", dim=48, head_dim=12)
    with pytest.raises(DrafterMismatch, match="hidden_size"):
        EagleDrafter.load(tmp_path / "d", other)
    gemma = tiny_model("gemma3")
    with pytest.raises(DrafterMismatch, match="llama target"):
        EagleDrafter.load(tmp_path / "d", gemma)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DrafterMismatch, match="unreadable"):
        EagleDrafter.load(tmp_path / "d", llama)
    with pytest.raises(DrafterMismatch, match="missing"):
        EagleDrafter.load(tmp_path / "nothing", llama)


def test_vocab_writes_a_successor_table_from_files(tmp_path, smollm2):
    from vocabspec.speculation.vocab.token_map import load_successors

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a cat sat. the cat sat. the cat sat. the dog ran.")
    out = tmp_path / "successors.safetensors"
    done = run_cli("vocab", "--model", "smollm2", "--source", "files", "--files", str(corpus),
                   "--successors", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    offsets, ids = load_successors(out, smollm2.model.args.vocab_size)
    the, cat, sat, dog = (smollm2.tokenizer.encode(w, add_bos=False)[0]
                          for w in (" the", " cat", " sat", " dog"))
    # " the" is followed by " cat" twice and " dog" once; " cat" by " sat" three times.
    assert ids[offsets[the]:offsets[the + 1]].tolist() == [cat, dog]
    assert ids[offsets[cat]:offsets[cat + 1]].tolist() == [sat]


def test_every_flag_has_help_text():
    from vocabspec.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    missing = [(name, action.dest) for name, sub in commands.items() for action in sub._actions
               if action.dest != "help" and not action.help]
    assert not missing, f"flags without help: {missing}"


def test_help_names_each_options_default():
    import argparse

    from vocabspec.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    unnamed = []
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS, []) \
                    or isinstance(action.default, bool):
                continue
            if "default" not in formatter._get_help_string(action):
                unnamed.append((name, action.dest))
    assert not unnamed, f"options whose help hides the default: {unnamed}"
    assert "(default 8)" in commands["generate"].format_help()       # --max-batch


def test_train_options_are_declared_once_from_train_config():
    """`vocabspec train`'s TrainConfig options come from one table (cli.TRAIN_OPTIONS), each
    with its field's default; only --model, --out (default: from --model) and --drafter (its
    choices: the trainable families) are declared apart."""
    from vocabspec.cli import TRAIN_OPTIONS, build_parser
    from vocabspec.training.config import TrainConfig

    defaults = TrainConfig()
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    actions = {action.dest: action for action in train._actions}
    names = [name for name, *_ in TRAIN_OPTIONS]
    assert len(names) == len(set(names)) == len(set(names) & set(actions))
    assert {name: actions[name].default for name in names} == {name: defaults.settings()[name] for name in names}
    fields = set(TrainConfig.options())
    assert {dest for dest in actions if dest in fields} - set(names) == {"model", "out", "drafter"}


def test_train_settings_are_grouped_by_concern_and_named_as_their_options():
    """TrainConfig keeps each concern's settings in its own dataclass; `of` routes settings by
    option name (prefixed groups included) and refuses a name no option has; an attribute set
    by a flat name is refused, not silently added; a record from before the split reads as the
    same run's settings."""
    from vocabspec.training.config import TrainConfig
    from vocabspec.training.train import _run_identity

    cfg = TrainConfig.of(lr=3e-3, ranker_lr=1e-2, medusa_heads=2, conversations=10, taps="1,2")
    assert (cfg.optim.lr, cfg.ranker.lr, cfg.medusa.heads, cfg.data.conversations, cfg.features.taps) == \
        (3e-3, 1e-2, 2, 10, "1,2")
    assert cfg.but(lr=1.0).optim.lr == 1.0 and cfg.optim.lr == 3e-3
    with pytest.raises(TypeError, match="lr_peak"):
        TrainConfig.of(lr_peak=1.0)
    with pytest.raises(AttributeError):
        cfg.generate_answers = True
    flat = cfg.settings()
    assert TrainConfig.settings_of(cfg.record()) == flat and TrainConfig.of(**flat) == cfg
    assert _run_identity(flat) == _run_identity(cfg.record()) != _run_identity(cfg.but(lr=1.0).record())


def test_serve_options_reach_the_server(monkeypatch):
    """`vocabspec serve`'s access options travel in its ServerLimits: the API key from --api-key
    or else $VOCABSPEC_API_KEY, the allowed origins, the docs switch; bad values exit 2."""
    from types import SimpleNamespace

    from vocabspec import cli
    from vocabspec.serving import api, server

    model = SimpleNamespace(args=SimpleNamespace(max_seq_len=2048), memory=None)
    monkeypatch.setattr(api, "load", lambda *args, **kwargs: SimpleNamespace(engine=SimpleNamespace(model=model)))
    seen = []
    monkeypatch.setattr(server, "serve", lambda lm, name, host, port, limits: seen.append(limits))
    monkeypatch.setenv("VOCABSPEC_API_KEY", "from-the-environment")
    assert cli.main(["serve", "--allowed-origins", "https://a.example, http://localhost:3000/"]) == 0
    assert (seen[-1].api_key, seen[-1].allowed_origins, seen[-1].docs) == \
        ("from-the-environment", ("https://a.example", "http://localhost:3000"), False)
    assert cli.main(["serve", "--api-key", "from-the-flag", "--docs"]) == 0
    assert (seen[-1].api_key, seen[-1].allowed_origins, seen[-1].docs) == ("from-the-flag", (), True)
    monkeypatch.delenv("VOCABSPEC_API_KEY")
    assert cli.main(["serve"]) == 0 and seen[-1].api_key is None
    assert cli.main(["serve", "--api-key", " "]) == 2
    with pytest.raises(SystemExit) as refused:
        cli.main(["serve", "--allowed-origins", "a.example"])
    assert refused.value.code == 2 and len(seen) == 3
