"""The measurement scripts still run against the library as it is now (they are not imported
anywhere else, so nothing else would notice when a library change breaks them)."""

import json
import subprocess
import sys

import pytest
from pathlib import Path


from conftest import QUESTIONS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_ranker_recall_script_measures_recall():
    done = subprocess.run([sys.executable, str(SCRIPTS / "ranker_recall_specbench.py"),
                           "--model", "smollm2", "--questions", str(QUESTIONS),
                           "--per-category", "1", "--new-tokens", "8", "--k", "64,4096"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["questions"] == 13 and result["positions"] > 13
    for key in ("candidates_recall_target", "candidates_recall_drafter_top1", "recall_target",
                "recall_drafter_top1", "full_head_recall_target"):
        assert 0.0 <= result[key]["64"] <= result[key]["4096"] <= 1.0
    # A working ranker keeps the drafter's own choice among its top 4096 of 49k tokens nearly
    # always (97% on the full Spec-Bench subset); a broken one would not come close.
    assert result["recall_drafter_top1"]["4096"] > 0.8


def test_cost_curve_script_times_every_size(tmp_path):
    out = tmp_path / "curve.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "cost_curve.py"), "--models", "smollm2",
                           "--weights", "gguf", "--sizes", "1,4", "--contexts", "256,32", "--repeats", "1",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    curves = json.loads(out.read_text())["ms"]["smollm2"]
    assert set(curves) == {"gguf", "gguf @32"}         # one curve per context
    assert all(set(curve) == {"1", "4"} and all(ms > 0 for ms in curve.values()) for curve in curves.values())
    assert out.with_suffix(".png").exists()


def test_generation_benchmark_sets_the_batch_engine_against_the_curve():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_generation.py"), "--prompts", "4",
                           "--batches", "2", "--new-tokens", "8", "--hf-prompts", "0"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    run, curve = (json.loads(line) for line in done.stdout.strip().splitlines())
    assert run["answers"] == 4 and 4 <= run["answer_tokens"] <= 32 and run["steps"]["steps"] > 0
    assert curve["rows"] == 2 and 0 < curve["of_curve"] < curve["steps_of_curve"]


def test_tree_calibration_replay_reproduces_the_runs_own_accept_lengths(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "tree_calibration.py"), "--model", "smollm2",
                           "--questions", str(QUESTIONS), "--limit", "3", "--max-new-tokens", "24",
                           "--out", str(tmp_path / "calibration.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Ranking the recorded nodes by EAGLE-2's own value must give back each step's accept length.
    assert result["steps"] > 3 and result["replay_mismatches_on_complete_steps"] == 0
    assert result["run_tau"] > 1.0
    assert all(1.0 <= tau <= 8.0 for tau in result["replay_tau"].values())


def test_drafter_scaling_script_tabulates_and_plots_acceptance(tmp_path):
    bundled = Path(__file__).resolve().parents[1] / "vocabspec" / "drafters" / "smollm2"
    questions = tmp_path / "questions.jsonl"      # two categories' first questions: enough to tabulate
    lines, seen = [], set()
    for line in QUESTIONS.read_text().splitlines():
        category = json.loads(line)["category"]
        if category not in seen and len(seen) < 2:
            seen.add(category)
            lines.append(line)
    questions.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, str(SCRIPTS / "drafter_scaling.py"), "--model", "smollm2",
                           "--point", f"EAGLE-2,1.5M,{bundled}", "--questions", str(questions),
                           "--per-category", "1", "--max-new-tokens", "8", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert row["tokens"] == 1.5e6 and 0.0 <= row["first_step_acceptance"] <= 1.0
    assert 1.0 <= row["tau_1x1"] <= 2.0 and 1.0 <= row["tau_3x3"] <= 4.0 and row["tau_6x60"] >= 1.0
    assert (tmp_path / "scaling.png").exists() and "| EAGLE-2 | 1.5M |" in (tmp_path / "scaling.md").read_text()


def test_device_runs_plot_chains_continued_runs(tmp_path):
    """The committed reports of the GPU runs behind SmolLM2's EAGLE-3 drafter: a continued
    run's points count the tokens of the runs before it."""
    reports = sorted((SCRIPTS.parent / "docs" / "bench" / "eagle3-gpu-smollm2").glob("run*-report.json"))
    done = subprocess.run([sys.executable, str(SCRIPTS / "plot_device_runs.py"), "--out", str(tmp_path),
                           *map(str, reports)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "points.json").read_text())
    hard = [r for r in rows if r["labels"] == "hard"]
    assert [r["run"] for r in hard] == sorted(r["run"] for r in hard) and hard[-1]["run"] == len(reports)
    assert all(b["tokens"] > a["tokens"] for a, b in zip(hard, hard[1:]))
    assert (tmp_path / "points.png").stat().st_size > 0


def test_heldout_agreement_counts_answer_rows_and_every_row(tmp_path):
    question = {"question_id": 1, "category": "chat", "turns": ["Name a colour."]}
    (tmp_path / "q.jsonl").write_text(json.dumps(question) + "\n")
    answer = {"question_id": 1, "method": "vanilla", "choices": [{"token_ids": [[504, 3258, 314, 2]]}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(answer) + "\n" + json.dumps({**answer, "method": "pld"}) + "\n")
    done = subprocess.run([sys.executable, str(SCRIPTS / "heldout_agreement.py"), "--answers", str(tmp_path / "a.jsonl"),
                           "--questions", str(tmp_path / "q.jsonl")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    # One answer (the pld line is another method's): its 4 tokens are 4 rows; every row adds the
    # prompt's, less the two a row needs before it.
    assert counts["answer_rows"]["rows"] == 4 and counts["every_rows"]["rows"] > 4
    assert all(0.0 <= c["agreement"] <= 1.0 for c in counts.values())


def test_machine_peaks_and_the_roofline_they_set():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_real_sizes
        import machine_peaks
    finally:
        sys.path.remove(str(SCRIPTS))
    peaks = machine_peaks.measure(threads=1, buffer_gib=0.0625)
    assert peaks["bandwidth_gbs"] > 0.5 and peaks["int8_gops"] > 5 and peaks["int8_width"] in (256, 512)
    # A 1 GB-a-token model decoding at 10 tok/s reads 10 GB/s; 16 rows taking 1.5 s more than one
    # row's 0.5 s do 15 rows' 2 GOP each in that 1.5 s: 20 GOPS.
    record = {"ours_tg": 10.0, "ours_ms": {1: 500.0, 16: 2000.0}}
    line = bench_real_sizes.roofline(record, {"bytes": 1e9, "ops": 2e9},
                                     {"bandwidth_gbs": 20.0, "int8_gops": 100.0, "threads": 1, "int8_width": 512})
    assert line["decode_gbs"] == 10.0 and line["decode_of_bandwidth"] == 0.5
    assert line["extra_rows_gops"] == 20 and line["extra_rows_of_int8_peak"] == 0.2


def test_live_vs_static_reads_one_question_a_category_and_the_heldout_prompts():
    import importlib.util

    spec = importlib.util.spec_from_file_location("live_vs_static", SCRIPTS / "live_vs_static.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    categories = [c for c, _ in script.prompts()]
    assert len([c for c in categories if not c.startswith("heldout")]) == 13
    assert len([c for c in categories if c.startswith("heldout")]) == 8
    assert len(set(categories)) == len(categories)


def test_native_variants_script_times_each_variant_in_turn():
    # Two labels of the default build: the script's turns and table, without a second compile.
    done = subprocess.run([sys.executable, str(SCRIPTS / "native_variants.py"), "--model", "smollm2",
                           "--rounds", "1", "--repeats", "1", "--sizes", "0,3", "--variant", "a=", "--variant", "b="],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["forward_ms_by_rows"]) == {"a", "b"}
    assert all(set(row) == {"1", "4"} and all(ms > 0 for ms in row.values())
               for row in result["forward_ms_by_rows"].values())
    refused = subprocess.run([sys.executable, str(SCRIPTS / "native_variants.py"), "--variant", "a=-DX=1"],
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "at least two" in refused.stderr


def test_sizing_headroom_replays_steps_under_other_sizes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sizing_headroom", SCRIPTS / "sizing_headroom.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # The on-path candidates' ranks, shallowest first: a path stops at the first one not kept.
    sure = {"chances": [0.9, 0.5, 0.3], "path": [0, 2], "kept": 1, "seconds": 0.010}
    lost = {"chances": [0.2, 0.1], "path": [], "kept": 0, "seconds": 0.008}
    assert [script.accepted(sure, m) for m in range(4)] == [0, 1, 1, 2]
    assert script.accepted(lost, 2) == 0
    costs = lambda rows: 0.008 + 0.001 * (rows - 1)
    steps, plain_seconds, plain_tokens = [sure, lost], 0.004, 1
    # As run: its own tokens over its own time; another size changes only the rows' cost.
    assert script.replay(steps, plain_seconds, plain_tokens, lambda s: s["kept"], costs) == pytest.approx(4 / 0.022)
    assert script.replay(steps, plain_seconds, plain_tokens, lambda s: 3, costs) == pytest.approx(5 / 0.026)
    fixed = [script.replay(steps, plain_seconds, plain_tokens, lambda s, m=m: m, costs) for m in range(4)]
    best = script.hindsight(steps, plain_seconds, plain_tokens, costs)
    # Knowing each outcome: the sure step keeps its path's three, the lost one the root alone.
    assert best == pytest.approx(5 / 0.024) and best >= max(fixed)
