"""The tokenizer against llama.cpp's own test suite: every vocabulary file of its
tests/test-tokenizer-0 gives llama.cpp's ids for every string (each encoded as that test does:
no BOS, special tokens not parsed), SentencePiece vocabularies round-trip every token and
character where test-tokenizer-1-spm asserts it, the BOS token comes where llama.cpp puts it,
and the vocabulary is the file's, never grown."""

from functools import lru_cache

import pytest

from vocabspec.runtime.loading import ModelLoadError, bundled_gguf
from vocabspec.runtime.tokenizer import load_tokenizer

from llamacpp_files import models_dir, vectors, vocab_file

# Every vocabulary of test-tokenizer-0 (models/*.gguf.inp). The families the README names:
# llama-spm (Llama 2, Mistral), llama-bpe (Llama 3), qwen2 and qwen35 (Qwen2, Qwen3), phi-3,
# gemma-4 (nearest there to Gemma 3); the rest are other byte-level BPE pre-tokenizers and
# BERT's WordPiece.
VOCABS = ["llama-spm", "llama-bpe", "qwen2", "qwen35", "phi-3", "gemma-4", "command-r", "deepseek-coder",
          "deepseek-llm", "falcon", "gpt-2", "mpt", "refact", "starcoder", "bert-bge"]
# A kind of tokenizer no model here runs, refused by name (it has no vectors there).
UNSUPPORTED = {"nomic-bert-moe": "tokenizer model 't5' is not supported"}


@lru_cache(maxsize=None)
def tokenizer(name: str):
    return load_tokenizer(vocab_file(name))


def test_every_vocabulary_with_vectors_is_checked():
    names = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
             for p in models_dir().glob("ggml-vocab-*.gguf.inp")}
    assert names == set(VOCABS)


@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_tokenizer_vectors(name):
    cases = vectors(name)
    tok = tokenizer(name)
    got = dict(zip(cases, tok.encode_batch(list(cases), add_bos=False, parse_special=False)))
    wrong = {s: (ids, got[s]) for s, ids in cases.items() if got[s] != ids}
    assert not wrong, f"{len(wrong)} of {len(cases)} differ from llama.cpp (string: (llama.cpp, ours)): {wrong}"
    assert tok.vocab_size == len(tok.tokens) and tok.backend.get_vocab_size() == tok.vocab_size


@pytest.mark.parametrize("name, message", UNSUPPORTED.items())
def test_unsupported_vocabulary_is_refused_by_name(name, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        load_tokenizer(vocab_file(name))
    assert str(vocab_file(name)) in str(info.value)


def spm_sources():
    return [pytest.param(lambda: vocab_file("llama-spm"), id="llama-spm"),
            pytest.param(lambda: vocab_file("phi-3"), id="phi-3"),
            pytest.param(lambda: bundled_gguf("gemma3"), id="gemma3")]


@pytest.mark.parametrize("source", spm_sources())
def test_sentencepiece_tokens_round_trip(source):
    # test-tokenizer-1-spm: every token's text (special tokens rendered) tokenizes, special
    # tokens parsed, to ids that decode to that text again.
    tok = load_tokenizer(source())
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    ids = tok.encode_batch(texts, add_bos=False, parse_special=True)
    bad = [(i, t) for i, (t, back) in enumerate(zip(texts, ids)) if tok.decode(back, skip_special_tokens=False) != t]
    assert not bad, f"{len(bad)} tokens do not round-trip, e.g. {bad[:5]}"


def test_sentencepiece_characters_round_trip():
    # test-tokenizer-1-spm's second half: every code point but the surrogates, the unassigned
    # planes 4-13 and U+2581 (SentencePiece's space) decodes to itself (llama.cpp runs it on llama-spm).
    tok = tokenizer("llama-spm")
    chars = [chr(c) for c in range(0x110000)
             if not (0xD800 <= c <= 0xDFFF or 0x40000 <= c <= 0xE0000 or c == 0x2581)]
    ids = tok.encode_batch(chars, add_bos=False, parse_special=True)
    bad = [c for c, back in zip(chars, ids) if tok.decode(back) != c]
    assert not bad, f"{len(bad)} characters do not round-trip, e.g. {[hex(ord(c)) for c in bad[:8]]}"


# llama.cpp's choice, from the file's tokenizer.ggml.add_bos_token or else the family's default
# (SentencePiece and Llama 3's pre-tokenizer add it; Gemma 4 always does).
# BERT's WordPiece puts its [CLS] and [SEP] around every text.
ADDS_BOS = {"llama-spm": True, "llama-bpe": True, "phi-3": True, "gemma-4": True, "qwen2": False,
            "qwen35": False, "gpt-2": False, "bert-bge": True}


@pytest.mark.parametrize("name", ADDS_BOS)
def test_bos_where_llamacpp_adds_it(name):
    tok = tokenizer(name)
    plain = tok.encode("Hello world", add_bos=False)
    around = ([tok.bos_token_id] if ADDS_BOS[name] else [], [102] if name == "bert-bge" else [])
    assert tok.encode("Hello world") == around[0] + plain + around[1]


def test_llama3_vocabulary_is_the_files_and_endoftext_is_text():
    tok = tokenizer("llama-bpe")
    assert tok.vocab_size == 128256 and tok.bos_token == "<|begin_of_text|>"
    ids = tok.encode("<|endoftext|> and <|begin_of_text|>")
    assert ids[0] == 128000 and max(ids) < 128256
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|><|endoftext|> and <|begin_of_text|>"
    assert tok.encode("<|begin_of_text|>x", add_bos=False) == [128000, 87]
    assert 128000 not in tok.encode("<|begin_of_text|>x", add_bos=False, parse_special=False)


def test_sentencepiece_keeps_a_leading_space():
    tok = tokenizer("llama-spm")
    assert tok.encode(" Hello", add_bos=False) == [29871, 15043]
    assert tok.encode(" ", add_bos=False) == [259] and tok.decode([259]) == " "


def test_a_gguf_without_model_keys_still_gives_its_tokenizer():
    # gemma-4's file has per-layer head counts transformers' GGUF reader refuses; only its
    # tokenizer keys are read here.
    assert tokenizer("gemma-4").encode("Hello") == [2, 9259]


