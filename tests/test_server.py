"""The OpenAI-compatible server, for real on loopback: streaming, bad input (a 4xx each, and the
server keeps serving), a disconnecting client cancels its generation, and a load test (8
concurrent clients, 200 requests) with no failure, bounded memory and greedy results identical
to single-client runs; a stopped server lets its model be freed; a request whose drafter breaks
mid-answer gets a 500 while the requests beside it and after it are served."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import httpx
import pytest

import vocabspec
from vocabspec.serving.server import HTTPThread, ServerLimits, create_app
from vocabspec.benchmarks.throughput import rss_mb

PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hi.", "Name a fruit.", "Write one word."]


@pytest.fixture(scope="module")
def server():
    lm = vocabspec.load("smollm2", draft="pld", max_seq_len=1024)
    app = create_app(lm, "smollm2", ServerLimits(max_tokens_cap=256, max_seconds=60, max_queue=64))
    http = HTTPThread(app)
    yield http.wait_ready(), lm, app
    http.stop(10)


def chat(base, content, **extra):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


def test_models_health_and_completion(server):
    base, lm, _ = server
    assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "smollm2"
    response = chat(base, "Say hi.")
    assert response.status_code == 200
    data = response.json()
    expected = lm.generate("Say hi.", chat=True, max_new_tokens=6)
    assert data["choices"][0]["message"]["content"] == expected.text
    usage = data["usage"]
    assert usage["completion_tokens"] == expected.new_tokens
    assert usage["speculative"]["steps"] >= 1 and usage["speculative"]["mean_accept_len"] >= 1
    text = httpx.post(base + "/v1/completions", json={"prompt": "The capital of France is",
                                                      "max_tokens": 5, "temperature": 0}, timeout=60)
    assert text.status_code == 200 and text.json()["choices"][0]["text"]


def test_streaming_matches_non_streaming(server):
    base, lm, _ = server
    body = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12,
            "temperature": 0, "stream": True}
    pieces, final = [], None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            pieces.append(chunk["choices"][0]["delta"].get("content", ""))
            if chunk.get("usage"):
                final = chunk
    assert "".join(pieces) == lm.generate("Name a fruit.", chat=True, max_new_tokens=12).text
    assert final["choices"][0]["finish_reason"] in ("stop", "length")


BAD_REQUESTS = {
    "empty prompt": ("/v1/completions", {"prompt": "   "}),
    "prompt over the context window": ("/v1/completions", {"prompt": "word " * 3000}),
    "max_tokens 0": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    "max_tokens absurd": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}),
    "temperature < 0": ("/v1/completions", {"prompt": "hi", "temperature": -0.5}),
    "top_p 0": ("/v1/completions", {"prompt": "hi", "top_p": 0}),
    "top_p > 1": ("/v1/completions", {"prompt": "hi", "top_p": 1.5}),
    "unknown model": ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}),
    "prompt wrong type": ("/v1/completions", {"prompt": 42}),
    "max_tokens wrong type": ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}),
    "stream wrong type": ("/v1/completions", {"prompt": "hi", "stream": "yes"}),
    "messages missing": ("/v1/chat/completions", {"prompt": "hi"}),
    "message without content": ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    "bad role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    "body not an object": ("/v1/completions", [1, 2, 3]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_4xx_and_server_keeps_serving(server, case):
    base, _, _ = server
    path, body = BAD_REQUESTS[case]
    response = httpx.post(base + path, json=body, timeout=60)
    assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
    assert response.json()["error"]["message"]
    assert chat(base, "Say hi.").status_code == 200


def test_malformed_json_and_invalid_utf8(server):
    base, _, _ = server
    for raw in (b'{"prompt": "hi", ', b'\xff\xfe{"prompt": "hi"}'):
        response = httpx.post(base + "/v1/completions", content=raw,
                              headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["message"]
    assert chat(base, "Say hi.").status_code == 200


def test_disconnecting_client_cancels_generation(server):
    base, _, app = server
    before = app.state.server.counts["cancelled"]
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break          # one chunk, then hang up
    for _ in range(100):
        if app.state.server.counts["cancelled"] > before:
            break
        time.sleep(0.1)
    assert app.state.server.counts["cancelled"] == before + 1
    assert chat(base, "Say hi.").status_code == 200


def test_load_8_clients_200_requests(server):
    base, lm, _ = server
    expected = {p: lm.generate(p, chat=True, max_new_tokens=4).text for p in PROMPTS}
    rss_before = rss_mb()

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        response = chat(base, prompt, max_tokens=4)
        return prompt, response.status_code, response.json()

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(200)))
    failures = [(p, s) for p, s, _ in results if s != 200]
    assert not failures, failures[:5]
    wrong = [p for p, _, data in results if data["choices"][0]["message"]["content"] != expected[p]]
    assert not wrong, f"{len(wrong)} results differ from single-client runs"
    assert rss_mb() - rss_before < 300, "memory grew under load"
    assert httpx.get(base + "/health").json()["waiting"] == 0


# Each field a client may send that this server does not honour: a 400 naming it.
REFUSED = {
    "presence_penalty": ("/v1/chat/completions", 0.5),
    "frequency_penalty": ("/v1/chat/completions", -1.0),
    "logit_bias": ("/v1/chat/completions", {"42": 5}),
    "tools": ("/v1/chat/completions", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "tool_choice": ("/v1/chat/completions", "auto"),
    "response_format": ("/v1/chat/completions", {"type": "json_object"}),
    "n": ("/v1/chat/completions", 2),
    "frobnicate": ("/v1/chat/completions", 1),
    "top_logprobs": ("/v1/chat/completions", 3),        # without logprobs: true
    "best_of": ("/v1/completions", 2),
    "echo": ("/v1/completions", True),
    "suffix": ("/v1/completions", "end"),
    "logprobs": ("/v1/completions", 6),                 # OpenAI's bound is 5
    "stream_options": ("/v1/completions", {"include_usage": True}),   # without stream
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_unsupported_fields_are_refused_by_name(server, field):
    base, _, _ = server
    path, value = REFUSED[field]
    body = {"max_tokens": 4, "temperature": 0, field: value}
    body.update({"messages": [{"role": "user", "content": "Say hi."}]} if "chat" in path else {"prompt": "Hi"})
    response = httpx.post(base + path, json=body, timeout=60)
    assert response.status_code == 400, (field, response.text)
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_out_of_range_penalty_refused_and_zero_accepted(server):
    base, _, _ = server
    response = chat(base, "Say hi.", presence_penalty=9)
    assert response.status_code == 400 and "presence_penalty" in response.json()["error"]["message"]
    assert chat(base, "Say hi.", presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                response_format={"type": "text"}, tool_choice="none", user="u1").status_code == 200


def test_content_as_text_parts(server):
    base, lm, _ = server
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "fruit."}]
    response = chat(base, parts)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == chat(base, "Name a\nfruit.").json()[
        "choices"][0]["message"]["content"]
    image = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    refused = chat(base, image)
    assert refused.status_code == 400 and "image_url" in refused.json()["error"]["message"]


def test_logprobs_from_the_target(server):
    """Chat logprobs (streamed and not) and completions logprobs are the engine's: the
    target's log-probabilities of the emitted tokens, under prompt lookup as without it."""
    base, lm, _ = server
    expected = lm.generate("Count from one to ten.", chat=True, max_new_tokens=12, logprobs=2)
    plain = chat(base, "Count from one to ten.", max_tokens=12, logprobs=True, top_logprobs=2).json()
    content = plain["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [e.logprob for e in expected.logprobs]
    assert len(content) == plain["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"] for c in content)
    assert "".join(c["token"] for c in content) == plain["choices"][0]["message"]["content"]
    assert chat(base, "Say hi.").json()["choices"][0]["logprobs"] is None
    body = {"messages": [{"role": "user", "content": "Count from one to ten."}], "max_tokens": 12,
            "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 2}
    streamed = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                streamed += logprobs["content"] if logprobs else []
    assert streamed == content
    text = httpx.post(base + "/v1/completions", json={"prompt": "One, two, three,", "max_tokens": 6,
                                                      "temperature": 0, "logprobs": 1}, timeout=60).json()
    logprobs = text["choices"][0]["logprobs"]
    reference = lm.generate("One, two, three,", max_new_tokens=6, logprobs=1)
    assert logprobs["token_logprobs"] == [e.logprob for e in reference.logprobs]
    assert len(logprobs["tokens"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == 6


def test_a_stopped_server_lets_its_model_go():
    """Once its server has stopped, nothing keeps a model alive (the serving benchmark loads one
    model per method in one process)."""
    import gc
    import weakref

    def serve_once():
        lm = vocabspec.load("smollm2", max_seq_len=512)
        app = create_app(lm, "smollm2", ServerLimits(max_batch=2, window=256, max_queue=4))
        http = HTTPThread(app)
        base = http.wait_ready()
        assert chat(base, "Say hi.").status_code == 200
        http.stop(10)
        app.state.server.batch.close()
        return weakref.ref(lm.engine.model)

    model = serve_once()
    gc.collect()
    assert model() is None, "a stopped server's model is still referenced"


class Gate:
    """Holds the batch's steps while the test lines requests up: a proposer that drafts while
    the gate is closed blocks there (and with it the step), until the test opens it once the
    engine's queue holds what it waits for. Nothing is left to the clock."""

    def __init__(self):
        self.open_ = threading.Event()
        self.holding = threading.Event()     # a step is blocked at the gate
        self.open_.set()

    def close(self) -> None:
        self.holding.clear()
        self.open_.clear()

    def pass_(self) -> None:
        if not self.open_.is_set():
            self.holding.set()
            assert self.open_.wait(120), "the gate was never opened"

    def open_when(self, batch, queued: Callable[[list], bool]) -> None:
        """Open once a step is held and `queued(requests waiting)` holds (within 2 minutes)."""
        deadline = time.monotonic() + 120
        assert self.holding.wait(120), "no step reached the gate"
        while not queued(list(batch.waiting.queue)):
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.005)
        self.open_.set()


def test_a_request_whose_drafting_fails_ends_alone(monkeypatch):
    """One request's drafter raising mid-answer ends that request with a 500 naming the failure;
    the requests decoding beside it get the tokens they get alone, and later requests (in every
    slot, the broken request's among them) are served."""
    lm = vocabspec.load("smollm2", draft="eagle", depth=3, total_tokens=8, max_seq_len=1024)
    # tree_rows: every request drafts at every step (the cost rule may decode a full batch plainly).
    app = create_app(lm, "smollm2", ServerLimits(max_batch=4, window=512, max_queue=8, max_tokens_cap=64,
                                                 tree_rows=4 * 9))
    server = app.state.server
    # Answers longer than 24 tokens: no good request can end before the bad one's third tree
    # (4 steps of at most 4 tokens after the gate).
    bad_prompt = "Name a colour."
    good_prompts = ["Write a story about a dragon.", "Describe the ocean.", "Explain how a bicycle works."]
    bad_ids = lm.tokenizer.encode_chat([{"role": "user", "content": bad_prompt}])
    running_when_broken = []        # requests decoding when the drafter raised
    gate = Gate()

    def breaking(proposer):
        """The slot's proposer, raising at the third tree it drafts for the bad prompt and
        stopping at the gate while it is closed; its state: whether its request is the bad
        one, trees drafted, requests started."""
        state = {"bad": False, "trees": 0, "requests": 0}
        reset, propose = proposer.reset, proposer.propose

        def reset_watching(prompt_ids, hidden, first_token):
            state.update(bad=list(prompt_ids) == bad_ids, trees=0, requests=state["requests"] + 1)
            reset(prompt_ids, hidden, first_token)

        def propose_or_break(root_token):
            gate.pass_()
            if state["bad"]:
                state["trees"] += 1
                if state["trees"] == 3:
                    running_when_broken.append(sum(s.generation is not None for s in server.batch.slots))
                    raise RuntimeError("the drafter broke")
            return propose(root_token)

        monkeypatch.setattr(proposer, "reset", reset_watching)
        monkeypatch.setattr(proposer, "propose", propose_or_break)
        return state

    states = [breaking(slot.proposer) for slot in server.batch.slots]
    http = HTTPThread(app)
    try:
        base = http.wait_ready()
        with ThreadPoolExecutor(4) as pool:
            # The good requests' first step waits at the gate until the bad one has queued.
            gate.close()
            good = [pool.submit(chat, base, p, max_tokens=24) for p in good_prompts]
            assert gate.holding.wait(120)
            bad = pool.submit(chat, base, bad_prompt, max_tokens=24)
            gate.open_when(server.batch, lambda queued: any(r.prompt_ids == bad_ids for r in queued))
            bad, good = bad.result(), [future.result() for future in good]
        assert bad.status_code == 500, bad.text
        message = bad.json()["error"]["message"]
        assert bad.json()["error"]["type"] == "server_error"
        assert "drafting failed" in message and "the drafter broke" in message, message
        assert running_when_broken and running_when_broken[0] > 1, running_when_broken
        for prompt, response in zip(good_prompts, good):
            assert response.status_code == 200, response.text
            alone = lm.generate(prompt, chat=True, max_new_tokens=24)
            data = response.json()
            assert (data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]) == \
                (alone.text, alone.new_tokens), prompt
            assert alone.new_tokens == 24, prompt
        # Later requests fill every slot, the broken request's too: each is served. The first
        # step waits at the gate until all four have arrived, so each holds a slot of its own.
        broken = next(i for i, state in enumerate(states) if state["bad"])
        started = states[broken]["requests"]
        later = good_prompts + ["Write one word."]
        with ThreadPoolExecutor(4) as pool:
            gate.close()
            answers = [pool.submit(chat, base, p, max_tokens=16) for p in later]
            gate.open_when(server.batch, lambda queued: len(queued) + sum(
                slot.generation is not None for slot in server.batch.slots) == len(later))
            answers = [future.result() for future in answers]
        assert states[broken]["requests"] > started, "no later request ran in the broken request's slot"
        for prompt, response in zip(later, answers):
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == \
                lm.generate(prompt, chat=True, max_new_tokens=16).text
        assert server.counts["failed"] == 1 and httpx.get(base + "/health").status_code == 200
    finally:
        gate.open_.set()
        http.stop(10)
        server.batch.close()
