"""The drafting families' registry (config.Family): a family registered in one place is a
--draft choice with its help line, a benchmark method name, a set of options the others are
refused against, a size the autotuner measures and a trainer `vocabspec train` runs; the built-in
families keep their names."""

import json

import pytest

from vocabspec import cli
from vocabspec.speculation import config as drafting_config
from vocabspec.training import train
from vocabspec.runtime.files import cache_dir
from vocabspec.speculation.families.pld import PromptLookupProposer
from vocabspec.speculation.config import DraftConfig, Family, register
from vocabspec.tuning.proposers import make_proposer


@pytest.fixture
def registry():
    """The registry as it is, restored after the test (in place: its readers hold the dict)."""
    families = drafting_config.FAMILIES
    kept = dict(families)
    yield families
    families.clear()
    families.update(kept)


def train_lookup_n(cfg, target, split, report, ship, log):
    """The throwaway family's trainer: `vocabspec train --drafter lookup-n` resolves to it."""


def test_a_family_registered_once_is_found_everywhere(smollm2, registry, monkeypatch, tmp_path):
    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    built = []

    def build(model, config, model_name, tokenizer=None, log=None):
        built.append(config.total_tokens)
        return PromptLookupProposer(num_draft=config.total_tokens, device=model.device)

    register(Family("lookup-n", "prompt lookup of N tokens", frozenset({"total_tokens"}), build,
                    lambda base: {} if base == "lookup-n" else None, "lookup-n", sizes=(1, 4),
                    trainer=f"{__name__}:train_lookup_n"))

    # The CLI: a choice, with its help line.
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--draft", "lookup-n", "--total-tokens", "3", "hello"])
    assert cli.draft_config(args) == DraftConfig(method="lookup-n", total_tokens=3)
    generate_help = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "lookup-n (prompt lookup of N tokens)" in " ".join(generate_help.split())
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--draft", "lookup-n:x", "hello"])   # takes no argument

    # Training: a --drafter choice, and the trainer it names is the one `vocabspec train` runs.
    assert parser.parse_args(["train", "--model", "smollm2", "--drafter", "lookup-n"]).drafter == "lookup-n"
    assert train.trainer_of("lookup-n") is train_lookup_n
    with pytest.raises(ValueError, match="no trainer for drafter 'pld'"):
        train.trainer_of("pld")

    # The benchmark's grammar, with a fixed size; options it does not read are refused.
    assert DraftConfig.from_method("lookup-n@0x4") == DraftConfig(method="lookup-n", depth=6, total_tokens=4)
    with pytest.raises(ValueError, match="--depth does not apply to --draft lookup-n"):
        DraftConfig(method="lookup-n", depth=3)

    # The autotuner measures each of its sizes against plain decoding and keeps its choice.
    lines = []
    proposer = make_proposer(smollm2.model, DraftConfig(method="lookup-n"), "smollm2",
                             tokenizer=smollm2.tokenizer, log=lines.append)
    measured = [v for k, v in json.loads((cache_dir() / "autotune.json").read_text()).items()
                if "lookup-n" in k]
    assert len(measured) == 1 and set(measured[0]["measured_speedup"]) == {"1", "4"}
    size = measured[0]["size"]
    # Both sizes built for the measurement, then the chosen one (if any beat plain decoding).
    assert sorted(built[:2]) == [1, 4] and built[2:] == ([size] if size else [])
    assert (proposer is None) == (size == 0) and (proposer is None or proposer.num_draft == size)


def test_builtin_families_and_their_names(registry):
    assert list(registry) == ["none", "eagle", "eagle3", "pld", "eagle+pld", "medusa", "model"]
    # (Each family's benchmark names: test_bench.py, test_medusa.py, test_draft_model.py.)
    assert DraftConfig.from_method("eagle") == DraftConfig(method="eagle", vocab="auto")
    assert DraftConfig.from_method("eagle3+trim:4k") == DraftConfig(method="eagle3", vocab="trim:4k")
    with pytest.raises(ValueError, match="does not apply to --draft eagle3"):
        DraftConfig(method="eagle3", ranker="r.safetensors")
    assert DraftConfig.from_draft("model:smollm2").draft_model == "smollm2"
    with pytest.raises(ValueError, match="unknown draft method"):
        DraftConfig.from_draft("pld:3")
    with pytest.raises(ValueError, match="does not apply to --draft pld"):
        DraftConfig(method="pld", depth=3)
    with pytest.raises(ValueError, match="a draft model applies to --draft model:NAME, not eagle"):
        DraftConfig(method="eagle", draft_model="smollm2")
    with pytest.raises(ValueError, match="names its draft model"):
        DraftConfig(method="model")
    with pytest.raises(ValueError, match="registered|already named"):
        register(registry["pld"])
