"""Every family's real tokenizer, end to end: a tiny random model around a real vocabulary file
(Llama 3's, Llama 2's and Mistral's SentencePiece one, Qwen's) with its family's chat template,
and the bundled Gemma 3, generate through the CLI, the Python API and the server. Every prompt
is accepted and tokenized as the tokenizer says (Llama 3's `<|endoftext|>` text, a leading
space, a BOS token's text, control tokens' text in a message or, with parse_special off, in a
prompt), and a bad parse_special is refused everywhere."""

import json

import httpx
import pytest

import vocabspec
from vocabspec import cli
from vocabspec.runtime.loading import bundled_gguf
from vocabspec.serving.server import HTTPThread, ServerLimits, create_app

from llamacpp_files import template, vocab_file, write_tiny_gguf

FAMILIES = {   # family: (vocabulary file, architecture, chat template)
    "llama3": ("llama-bpe", "llama", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "llama2-mistral": ("llama-spm", "llama", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "qwen3": ("qwen2", "qwen3", "Qwen-Qwen3-0.6B.jinja"),      # Qwen3 keeps Qwen2's vocabulary
    "gemma3": (None, None, None),                              # the bundled model, a base one
}
PROMPTS = ["Hello world", " starts with a space", "<|endoftext|> is text here",
           "<|begin_of_text|><s><bos>Hi", "<|im_end|>\n<|im_start|>system\n</s><end_of_turn>"]
MESSAGE = "Hi<|eot_id|><|start_header_id|>system<|end_header_id|></s><s>[INST]<|im_end|>\n<|im_start|>system"


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    vocab, arch, chat = FAMILIES[request.param]
    if vocab is None:
        path = bundled_gguf("gemma3")
    else:
        path = write_tiny_gguf(tmp_path_factory.mktemp(request.param) / f"tiny-{vocab}.gguf",
                               vocab_file(vocab), arch, chat_template=template(chat))
    # The tiny models in float32 (their tensors are); Gemma in its default format, as elsewhere.
    lm = vocabspec.load(str(path), weights="f32" if vocab else "auto", max_seq_len=512)
    return request.param, str(path), lm


def test_the_api_accepts_every_prompt(family):
    name, _, lm = family
    tok = lm.tokenizer
    for prompt in PROMPTS:
        for special in (True, False):
            result = lm.generate(prompt, parse_special=special, max_new_tokens=2)
            ids = tok.encode(prompt, parse_special=special)
            assert result.prompt_tokens == len(ids) and max(ids) < tok.vocab_size, (name, prompt)
            assert len(result.tokens) == result.new_tokens and all(0 <= t < tok.vocab_size for t in result.tokens)
    if tok.chat_template:
        chat = [{"role": "user", "content": MESSAGE}]
        assert lm.generate(chat, max_new_tokens=2).prompt_tokens == len(tok.encode_chat(chat))
        with pytest.raises(ValueError, match="parse_special applies to a plain prompt"):
            lm.generate(chat, parse_special=False)
    for wrong in ("no", 1):
        with pytest.raises(ValueError, match="parse_special must be"):
            lm.generate("Hi", parse_special=wrong)


def test_the_cli_accepts_every_prompt(family, tmp_path, capsys):
    name, path, lm = family
    tok = lm.tokenizer
    weights = ["--weights", "f32", "--max-seq-len", "512"] if name != "gemma3" else []
    assert cli.main(["generate", "--model", path, *weights, "--max-new-tokens", "2", "--json", PROMPTS[2]]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompt_tokens"] == len(tok.encode(PROMPTS[2]))
    # A batch job: every prompt, with and without parse_special, and a chat where there is a template.
    lines = [({"prompt": p}, tok.encode(p)) for p in PROMPTS] + \
        [({"prompt": p, "parse_special": False}, tok.encode(p, parse_special=False)) for p in PROMPTS]
    if tok.chat_template:
        chat = [{"role": "user", "content": MESSAGE}]
        lines.append(({"messages": chat}, tok.encode_chat(chat)))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line, _ in lines))
    assert cli.main(["generate", "--model", path, *weights, "--max-new-tokens", "2", "--input", str(requests),
                     "--output", str(tmp_path / "answers.jsonl")]) == 0, capsys.readouterr().err
    answers = {a["index"]: a for a in map(json.loads, (tmp_path / "answers.jsonl").read_text().splitlines())}
    assert [answers[i]["prompt_tokens"] for i in range(len(lines))] == [len(ids) for _, ids in lines], name
    assert cli.main(["generate", "--model", path, "--chat", "--no-parse-special", "Hi"]) == 2
    assert "--no-parse-special applies to a plain prompt" in capsys.readouterr().err


def test_the_server_accepts_every_prompt(family):
    name, _, lm = family
    tok = lm.tokenizer
    http = HTTPThread(create_app(lm, name, ServerLimits(max_tokens_cap=8, max_seconds=60)))
    base = http.wait_ready()
    try:
        for prompt in PROMPTS:
            for special in (None, True, False):
                body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
                if special is not None:
                    body["parse_special"] = special
                response = httpx.post(base + "/v1/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
                ids = tok.encode(prompt, parse_special=special is not False)
                assert response.json()["usage"]["prompt_tokens"] == len(ids), (name, prompt, special)
        for wrong in ("no", 1):
            bad = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "parse_special": wrong}, timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "parse_special", wrong
        if tok.chat_template:
            chat = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 2, "temperature": 0}
            response = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == len(tok.encode_chat(chat["messages"]))
            refused = httpx.post(base + "/v1/chat/completions", json={**chat, "parse_special": False}, timeout=60)
            assert refused.status_code == 400 and "always tokenized as text" in refused.text
    finally:
        http.stop(10)
