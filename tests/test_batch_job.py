"""`vocabspec generate --input` as a batch job (serving/batch_job.py): each answer the request's
own alone, in whatever order the file lists them; a job killed mid-run and rerun ends with
exactly an uninterrupted run's answers; an interrupt stops it with nothing recorded as failed;
a half-written last line is cut; a changed input or option is refused."""

import itertools
import json
import signal
import subprocess
import sys
import time

import pytest

import vocabspec
from vocabspec.cli import main
from vocabspec.serving import batch_job

TOPICS = ["rain", "copper", "the moon", "bridges", "owls", "tea", "glass", "rivers"]


def make_requests(count: int) -> list[dict]:
    """Prompts and chats, greedy and seeded sampling, of 8 to 12 new tokens."""
    items = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        item = {"messages": [{"role": "user", "content": f"Tell me one fact about {topic}."}]} \
            if index % 2 == 0 else {"prompt": f"A short note on {topic}:"}
        item["max_new_tokens"] = 8 + index % 5
        if index % 3 == 1:
            item.update(temperature=0.8, top_p=0.9, seed=index)
        items.append(item)
    return items


def write_jsonl(path, items) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def job(source, *extra) -> list[str]:
    return ["generate", "--input", str(source), "--max-seq-len", "512", "--progress-every", "0", *extra]


def alone(lm, item):
    settings = {k: v for k, v in item.items() if k not in ("prompt", "messages")}
    return lm.generate(item.get("prompt", item.get("messages")), chat="messages" in item, **settings)


@pytest.fixture(scope="module")
def lms():
    return {"none": vocabspec.load("smollm2", max_seq_len=512),
            "pld": vocabspec.load("smollm2", draft="pld", max_seq_len=512)}


def test_each_answer_is_the_requests_alone_in_any_order_and_a_bad_one_fails_alone(lms, tmp_path, capsys):
    items = make_requests(6)
    items.insert(3, {"prompt": "Too long for the window", "max_new_tokens": 5000})
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    write_jsonl(source, items)
    assert main(job(source, "--output", str(out), "--max-batch", "3", "--draft", "pld")) == 1
    err = capsys.readouterr().err
    assert "/7 requests," in err and "tok/s" in err and " left]" in err          # progress
    assert "[6 answers, 1 failed," in err and "mean accepted length" in err      # the summary
    lines = read_lines(out)
    assert sorted(line["index"] for line in lines) == list(range(7))
    for line in lines:
        if line["index"] == 3:
            assert "context window" in line["error"]
        else:
            assert line["tokens"] == alone(lms["pld"], items[line["index"]]).tokens, line["index"]

    # The same requests listed backwards, plain decoding, in input order on standard output.
    backwards = tmp_path / "backwards.jsonl"
    write_jsonl(backwards, items[::-1])
    assert main(job(backwards, "--max-batch", "2", "--ordered")) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == list(range(7))
    for line in lines:
        item = items[6 - line["index"]]
        if "error" in line:
            assert item["max_new_tokens"] == 5000
        else:
            assert line["tokens"] == alone(lms["none"], item).tokens, line["index"]


def test_a_killed_job_reruns_to_exactly_the_uninterrupted_answers(lms, tmp_path, capsys):
    # The last three are long (greedy stories that run to their limit): once the first answer
    # is on disk, a hundred steps are left to kill the process in, whatever the host's speed.
    items = make_requests(9) + [{"messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
                                 "max_new_tokens": 120} for topic in TOPICS[:3]]
    source = tmp_path / "requests.jsonl"
    write_jsonl(source, items)
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    assert main(job(source, "--output", str(whole), "--max-batch", "3")) == 0
    assert [line["stop_reason"] for line in read_lines(whole) if line["index"] >= 9] == ["length"] * 3
    # The same job in a process of its own, killed (no chance to tidy up) once answers appear.
    log = tmp_path / "killed.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "vocabspec.cli",
                                    *job(source, "--output", str(resumed), "--max-batch", "3")],
                                   stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if resumed.exists() and resumed.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    assert process.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    written = resumed.read_bytes().count(b"\n")
    assert 1 <= written < len(items), written                 # killed part way, answers on disk
    assert main(job(source, "--output", str(resumed), "--max-batch", "3")) == 0
    assert f"holds {written} of 12 requests: answering the rest" in capsys.readouterr().err
    first, second = read_lines(whole), read_lines(resumed)
    assert sorted(line["index"] for line in second) == list(range(12))     # none twice, none lost
    by_index = {line["index"]: line for line in first}
    for line in second:
        want = by_index[line["index"]]
        assert (line["tokens"], line["text"], line["stop_reason"]) == \
            (want["tokens"], want["text"], want["stop_reason"]), line["index"]


def test_an_interrupt_a_half_written_last_line_and_a_changed_job(lms, tmp_path, capsys, monkeypatch):
    items = make_requests(3)
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    write_jsonl(source, items)
    # Ctrl-C inside a step, where a real one lands: the batch engine hands it to the step's
    # requests as their error; the job stops (exit 130) and records none of them as failed.
    pieces = itertools.count()
    piece = batch_job.Progress.piece

    def interrupted(self, index, tokens):
        if next(pieces) == 12:            # the first answer (8 tokens) done, the second decoding
            raise KeyboardInterrupt
        piece(self, index, tokens)

    monkeypatch.setattr(batch_job.Progress, "piece", interrupted)
    assert main(job(source, "--output", str(out), "--max-batch", "1")) == 130
    monkeypatch.undo()
    assert "rerun the same command" in capsys.readouterr().err
    assert [line["index"] for line in read_lines(out)] == [0]
    assert main(job(source, "--output", str(out))) == 0
    complete = out.read_bytes()
    assert {line["index"]: line["tokens"] for line in read_lines(out)} == \
        {index: alone(lms["none"], item).tokens for index, item in enumerate(items)}
    lines = complete.splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])    # a crash mid-write
    capsys.readouterr()
    assert main(job(source, "--output", str(out))) == 0
    assert "discarded a half-written last line" in capsys.readouterr().err
    again = read_lines(out)
    assert len(again) == 3 and out.read_bytes().endswith(b"\n")
    assert {line["index"]: line["tokens"] for line in again} == \
        {json.loads(line)["index"]: json.loads(line)["tokens"] for line in lines}

    # Refused before loading anything, each naming what changed.
    assert main(job(source, "--output", str(out))) == 0                     # nothing left to do
    assert "already holds all 3 requests" in capsys.readouterr().err
    write_jsonl(source, items[:2] + [{"prompt": "Something else"}])
    assert main(job(source, "--output", str(out))) == 2
    err = capsys.readouterr().err
    assert f"{source} has changed since {out} was begun" in err and "Traceback" not in err
    write_jsonl(source, items)
    assert main(job(source, "--output", str(out), "--max-new-tokens", "9")) == 2
    assert "--max-new-tokens 256, not 9" in capsys.readouterr().err
    stray = tmp_path / "stray.jsonl"
    stray.write_text('{"index": 0}\n')
    assert main(job(source, "--output", str(stray))) == 2
    assert "no stray.jsonl.job.json" in capsys.readouterr().err
    out.write_bytes(b"garbage\n" + complete)
    assert main(job(source, "--output", str(out))) == 2
    assert f"{out}:1: not an answer line" in capsys.readouterr().err
