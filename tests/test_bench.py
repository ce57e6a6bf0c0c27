"""The benchmark's CI smoke run: two questions per Spec-Bench category, short outputs, every
kind of method, greedy (losslessness checked against vanilla in the same run) and sampled."""

import json

import pytest

from vocabspec.benchmarks.bench import copy_fraction, load_questions
from vocabspec.cli import main
from vocabspec.speculation.config import DraftConfig

from conftest import SPEC_BENCH


def test_method_names_parse_into_draft_configs():
    parse = DraftConfig.from_method
    assert parse("vanilla") == DraftConfig(method="none", vocab="full")
    # eagle2 names read the bundled EAGLE-2 drafter (path "eagle2"); eagle the model's default.
    assert parse("eagle") == DraftConfig(method="eagle", vocab="auto")
    assert parse("eagle2", path=None) == DraftConfig(method="eagle", vocab="full", path="eagle2")
    assert parse("eagle2+fr:32k") == DraftConfig(method="eagle", vocab="fr:32k", path="eagle2")
    assert parse("eagle2+pld") == DraftConfig(method="eagle+pld", vocab="full", path="eagle2")
    assert parse("eagle2+spec:2048,context=0+pld@1x8") == \
        DraftConfig(method="eagle+pld", vocab="spec:2048,context=0", depth=1, total_tokens=8, path="eagle2")
    assert parse("eagle2+fr:32k/float32@1x6") == parse("eagle2+fr:32k@1x6/float32") == \
        DraftConfig(method="eagle", vocab="fr:32k", dtype="float32", depth=1, total_tokens=6, path="eagle2")
    assert parse("eagle2@6x60", path="x", top_k=4) == \
        DraftConfig(method="eagle", vocab="full", path="x", top_k=4, depth=6, total_tokens=60)
    assert parse("eagle3+trim:8k@3x8") == DraftConfig(method="eagle3", vocab="trim:8k", depth=3, total_tokens=8)
    for bad in ("eagle2+fr:", "eagle2pld", "eagle2+", "eagle4", "eagle3+", "eagle2/float16", "eagle2@6", "pld+fr:8k"):
        with pytest.raises(ValueError):
            parse(bad)


def test_copy_fraction():
    assert copy_fraction([1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9, 9, 9]) == pytest.approx(1 / 5)
    assert copy_fraction([1, 2, 3, 4], [7, 8]) == 0.0


def test_questions_come_from_spec_bench_or_the_projects_own_set():
    """With no --questions the benchmark runs the project's own prompts, one per Spec-Bench
    category, so it works on a clone with nothing beside it; Spec-Bench's file reads the same."""
    own = load_questions("builtin", None)
    assert len(own) == 13 and len({q["category"] for q in own}) == 13
    if SPEC_BENCH.exists():
        assert len(load_questions(SPEC_BENCH, 2)) == 26
        assert {q["category"] for q in own} == {q["category"] for q in load_questions(SPEC_BENCH, 1)}
    with pytest.raises(FileNotFoundError, match="builtin"):
        load_questions("no/such/question.jsonl", 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_bench_smoke(tmp_path, temperature):
    out = tmp_path / "bench"
    methods = "vanilla,pld,eagle2,eagle2+fr:8k,eagle2+spec:512" if temperature == 0 else "vanilla,eagle2+fr:8k"
    code = main(["bench", "--model", "smollm2", "--methods", methods,
                 "--per-category", "1", "--max-new-tokens", "6",
                 "--depth", "3", "--tree-top-k", "4", "--total-tokens", "12",
                 "--temperature", str(temperature), "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    names = methods.split(",")
    assert list(summary["methods"]) == names
    assert len(summary["categories"]) == 13
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == summary["questions"] * len(names)
    for record in answers:
        choice = record["choices"][0]
        assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) \
            == len(choice["accept_lengths"])
    for name in names[1:]:
        overall = summary["methods"][name]["categories"]["overall"]
        assert overall["tokens"] > 0 and overall["speedup"] > 0
        if temperature == 0:
            assert summary["methods"][name]["mismatched_questions"] == []
        cost, vanilla = summary["methods"][name]["step_cost"], summary["methods"]["vanilla"]["step_cost"]
        assert cost["verify"] > 0 and cost["whole"] == pytest.approx(cost["verify"] + cost["draft"] + cost["rest"])
        assert cost["rest"] == pytest.approx(cost["prefill"] + cost["other"]) and cost["prefill"] > 0
        assert overall["speedup"] == pytest.approx((cost["tokens_per_step"] / cost["whole"])
                                                   / (vanilla["tokens_per_step"] / vanilla["whole"]))
    assert summary["methods"]["vanilla"]["categories"]["overall"]["tau"] == pytest.approx(1.0)
    assert (out / "speedup.png").stat().st_size > 1000
    assert (out / "draft_breakdown.png").stat().st_size > 1000
    assert "| overall |" in (out / "report.md").read_text()
    assert "## Cost of a step" in (out / "report.md").read_text()


def test_an_interrupted_bench_resumes_with_its_finished_questions(tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                                 for i, (c, t) in enumerate([("qa", "Name a primary colour."),
                                                             ("qa", "What is 2 + 3?"),
                                                             ("writing", "Write a haiku about rain.")])))
    out = tmp_path / "bench"
    args = ["bench", "--questions", str(questions), "--model", "smollm2", "--max-new-tokens", "5",
            "--methods", "vanilla,pld,eagle2+fr:8k@2x6", "--out", str(out), "--no-warmup"]
    assert main(args) == 0
    full = json.loads((out / "summary.json").read_text())
    lines = (out / "answers.jsonl").read_text().splitlines()
    assert len(lines) == 9
    # Interrupted inside the third question: two of its three records written, the last cut off.
    (out / "answers.jsonl").write_text("\n".join(lines[:7]) + "\n" + lines[7][:40])
    assert main(args + ["--resume"]) == 0
    resumed = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [r["tstamp"] for r in resumed[:6]] == [json.loads(line)["tstamp"] for line in lines[:6]]
    assert [r["tstamp"] for r in resumed[6:]] != [json.loads(line)["tstamp"] for line in lines[6:]]
    summary = json.loads((out / "summary.json").read_text())
    for name, entry in full["methods"].items():      # greedy: the same tokens, the same taus
        for key in ("tokens", "tau"):
            assert summary["methods"][name]["categories"]["overall"][key] == \
                pytest.approx(entry["categories"]["overall"][key])
    assert summary["methods"]["eagle2+fr:8k@2x6"]["mismatched_questions"] == []
    kept = (out / "answers.jsonl").read_text()
    assert main([a if a != "5" else "6" for a in args] + ["--resume"]) == 2
    assert "other settings (max_new_tokens)" in capsys.readouterr().err
    assert (out / "answers.jsonl").read_text() == kept         # refused before touching it
