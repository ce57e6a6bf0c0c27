"""A GGUF vocabulary as a `tokenizers` pipeline that tokenizes text as llama.cpp does.

The pipeline sees only raw text: special tokens are split out before it (special_tokens.py),
so it holds none of them as added tokens and never grows the vocabulary. Per kind of tokenizer:

- SentencePiece (`llama`): a space before every text fragment where the file asks for one
  (add_space_prefix, on by default: `' Hello'` is `▁▁Hello`), spaces as `▁`, then merges of the
  highest-scoring adjacent pair first, bytes (`<0xNN>`) for what no token covers.
- byte-level BPE (`gpt2`): the pre-tokenizer's regular expressions (llama.cpp's, one list per
  `tokenizer.ggml.pre`), GPT-2's byte-to-character map, then the file's merges by rank; where
  llama.cpp ignores merges (Llama 3), a word that is itself a token is that token.
- Gemma 4 (`gemma4`): spaces as `▁`, runs of newlines apart from the rest, merges by rank on
  the characters themselves, bytes for what no token covers.
- WordPiece (`bert`): lower-cased and accents stripped where the file asks, split at spaces,
  punctuation and CJK characters, each word's longest known start first; the file writes a
  word's first piece `▁piece` and the rest bare, the pipeline `piece` and `##rest`. (llama.cpp's
  own character table counts Hangul's medial and final jamo as accents and strips them; this
  pipeline keeps them, as transformers does. No model here runs WordPiece.)
"""

from __future__ import annotations

import json

from .vocab import Vocab, VocabError

# llama.cpp's pre-tokenizer regular expressions (llama-vocab.cpp, llm_tokenizer_bpe), by the
# name of the list, and the tokenizer.ggml.pre values that choose each list.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
          "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CJK_LLM = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
REGEXES = {
    "default": ("[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
               "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "gpt2": (_GPT2,),
    "starcoder": ("\\p{N}", _GPT2),
    "falcon": ("[\\p{P}\\$\\+<=>\\^~\\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", "\\s+\\z", _CJK_LLM, "\\p{N}+"),
    "deepseek-coder": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK_LLM, "\\p{N}"),
    "deepseek-v3": ("\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
    "tekken": ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}"
               "\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
               "[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "gpt-4o": ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _CONTRACTIONS
               + "?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _CONTRACTIONS
               + "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "gemma4": ("[^\\n]+|[\\n]+",),
}
PRE_TOKENIZERS = {   # tokenizer.ggml.pre -> (regular expressions, ignore merges)
    **{name: ("default", False) for name in ("default",)},
    **{name: ("llama3", True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                           "pixtral", "midm-2.0", "lfm2", "jina-v5-nano")},
    **{name: ("llama3", False) for name in ("dbrx", "smaug-bpe", "chatglm-bpe", "glm5")},
    "glm4": ("llama3", True),
    **{name: ("qwen2", False) for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez",
                                           "stablelm2", "hunyuan", "solar-open", "grok-2")},
    "qwen35": ("qwen35", False),
    **{name: ("gpt2", False) for name in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat",
                                          "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
                                          "modern-bert", "exaone4", "mpt", "olmo", "jais",
                                          "trillion", "granite-docling")},
    **{name: ("starcoder", False) for name in ("starcoder", "refact", "command-r", "smollm",
                                               "codeshell", "exaone", "minerva-7b", "mellum2")},
    "falcon": ("falcon", False),
    "deepseek-llm": ("deepseek-llm", False),
    "deepseek-coder": ("deepseek-coder", False),
    **{name: ("deepseek-v3", False) for name in ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4")},
    "tekken": ("tekken", True),
    **{name: ("gpt-4o", False) for name in ("gpt-4o", "llama4", "kanana2", "talkie")},
    "gemma4": ("gemma4", False),
}


def pipeline_json(vocab: Vocab) -> str:
    """The `tokenizers` JSON of the pipeline that tokenizes this vocabulary's raw text."""
    if vocab.kind == "wpm":
        return _wordpiece(vocab)
    if vocab.kind == "spm":
        model = _bpe(vocab, _merges_by_score(vocab), byte_fallback=True, ignore_merges=False)
        steps = ([{"type": "Prepend", "prepend": "▁"}] if vocab.add_space_prefix else []) + \
            [{"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]
        normalizer, pre_tokenizer = {"type": "Sequence", "normalizers": steps}, None
    else:
        if vocab.pre not in PRE_TOKENIZERS:
            raise VocabError(f"{vocab.source}: pre-tokenizer {vocab.pre!r} (tokenizer.ggml.pre) is not "
                             f"supported ({', '.join(sorted(PRE_TOKENIZERS))})")
        regexes, ignore_merges = PRE_TOKENIZERS[vocab.pre]
        splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
                  for r in REGEXES[regexes]]
        escaped = vocab.model == "gemma4"    # characters as they are, spaces as ▁
        normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"} if escaped else None
        if not escaped:
            splits.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False})
        pre_tokenizer = {"type": "Sequence", "pretokenizers": splits}
        model = _bpe(vocab, _ranked_merges(vocab), byte_fallback=escaped, ignore_merges=ignore_merges)
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
                       "post_processor": None, "decoder": None, "model": model}, ensure_ascii=False)


def _wordpiece(vocab: Vocab) -> str:
    from .vocab import SPECIAL_ATTRS

    pieces = {}
    for i, (text, attr) in enumerate(zip(vocab.tokens, vocab.attrs)):
        piece = text if attr & SPECIAL_ATTRS else text[1:] if text.startswith("▁") else "##" + text
        pieces.setdefault(piece, i)
    model = {"type": "WordPiece", "unk_token": vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else "[UNK]",
             "continuing_subword_prefix": "##", "max_input_chars_per_word": 1 << 30, "vocab": pieces}
    normalizer = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                  "strip_accents": vocab.strip_accents, "lowercase": vocab.lowercase}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": normalizer, "pre_tokenizer": {"type": "BertPreTokenizer"},
                       "post_processor": None, "decoder": None, "model": model}, ensure_ascii=False)


def _bpe(vocab: Vocab, merges: list[tuple[str, str]], byte_fallback: bool, ignore_merges: bool) -> dict:
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None and byte_fallback else None
    return {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": byte_fallback,
            "ignore_merges": ignore_merges, "vocab": {t: i for i, t in enumerate(vocab.tokens)},
            "merges": merges}      # pairs, written as JSON lists


def _merges_by_score(vocab: Vocab) -> list[tuple[str, str]]:
    """SentencePiece's merges: every pair of tokens that makes a token, the best-scoring merged
    token first (llama.cpp's llm_tokenizer_spm: any token text, of any type, is a merge's end)."""
    if vocab.scores is None:
        raise VocabError(f"{vocab.source}: a SentencePiece vocabulary needs tokenizer.ggml.scores")
    index = {t: i for i, t in enumerate(vocab.tokens)}
    ranked = []
    for merged, text in enumerate(vocab.tokens):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in index and right in index:
                ranked.append((-vocab.scores[merged], merged, index[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _ranked_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """The file's merges in rank order, each pair once at its first rank (as llama.cpp keeps
    them); a merge whose parts or result are no token can never apply and is left out."""
    tokens = set(vocab.tokens)
    merges = dict.fromkeys(pair for pair in vocab.merges
                           if pair[0] in tokens and pair[1] in tokens and pair[0] + pair[1] in tokens)
    return list(merges)
