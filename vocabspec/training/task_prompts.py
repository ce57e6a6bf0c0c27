"""Task-style prompts built from ShareGPT text, for self-distillation.

Chat conversations under-represent tasks whose answer leans on a long input: summarizing a
document, translating a passage, answering from given passages. A drafter trained only on
chat answers predicts those answers badly (on Spec-Bench, Gemma's drafter reached tau 1.4
on summarization against 2.4 overall). These prompts wrap ShareGPT texts in such
instructions; the target's own answers to them become training data. Benchmark questions
are never used: every text comes from ShareGPT.
"""

from __future__ import annotations

import re

# Stop words that make up a large share of running text in each language and rarely occur
# in the others: a crude language detector that needs no model.
STOP_WORDS = {
    "German": set("und der die das ist nicht ich sie mit für auf ein eine zu den von sich".split()),
    "French": set("le la les et est une des pour que pas dans du un sur au avec".split()),
    "Spanish": set("el la los que es una por para con del las se un no en".split()),
}
MIN_STOP_SHARE = 0.15
WORDS = re.compile(r"\w+")


def language_of(text: str) -> str:
    """'German', 'French', 'Spanish', or '' (English or anything else)."""
    words = WORDS.findall(text.lower())
    if len(words) < 12:
        return ""
    shares = {lang: sum(w in stop for w in words) / len(words) for lang, stop in STOP_WORDS.items()}
    lang, share = max(shares.items(), key=lambda item: item[1])
    return lang if share >= MIN_STOP_SHARE else ""


def _word_count(text: str) -> int:
    return len(text.split())


def _is_english_prose(text: str, min_words: int, max_words: int) -> bool:
    """Long enough to be worth condensing or asking about, short enough to leave room for
    the answer, and no code: an answer about code mostly copies it, which is not the task."""
    return min_words <= _word_count(text) <= max_words and not language_of(text) \
        and "```" not in text


def _summaries(conversations, min_words: int, max_words: int):
    for _, turns in conversations:
        for role, text in turns:
            if role == "assistant" and _is_english_prose(text, min_words, max_words):
                yield f"Summarize: {text}"
                break


def _translations(conversations, max_words: int):
    for _, turns in conversations:
        for _, text in turns:
            lang = language_of(text)
            if lang and _word_count(text) <= max_words:
                yield f"Translate {lang} to English: {text}"
                break


def _passage_questions(conversations, min_words: int, max_words: int):
    """A conversation's first answer as the passage, its first question after it."""
    for _, turns in conversations:
        question, answer = turns[0][1], turns[1][1]
        if _is_english_prose(answer, min_words, max_words) and _word_count(question) <= 60:
            yield f"{answer}\n\nAnswer from the passage above: {question}"


CODE_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
CODE_REQUESTS = ("Explain what this code does:", "Add comments to this code:",
                 "Find possible bugs in this code and fix them:", "Rewrite this code to be easier to read:")
EXTRACTIONS = ("List the key points of this text as bullet points:",
               "Extract every name, number and date in this text, with what each refers to:",
               "Write a title and a one-sentence abstract for this text:")


def _code_requests(conversations, min_lines: int, max_words: int):
    """Requests about a code block from an answer (the first one of 4 lines or more in each
    conversation), the request rotating through CODE_REQUESTS."""
    n = 0
    for _, turns in conversations:
        blocks = (b.strip("\n") for role, text in turns if role == "assistant" for b in CODE_BLOCK.findall(text))
        block = next((b for b in blocks if b.count("\n") + 1 >= min_lines and _word_count(b) <= max_words), None)
        if block is not None:
            yield f"{CODE_REQUESTS[n % len(CODE_REQUESTS)]}\n```\n{block}\n```"
            n += 1


def _extractions(conversations, min_words: int, max_words: int):
    """Extraction requests on an answer's prose: the last long English answer of each
    conversation (summaries take the first)."""
    n = 0
    for _, turns in conversations:
        texts = [text for role, text in turns if role == "assistant" and _is_english_prose(text, min_words, max_words)]
        if texts:
            yield f"{EXTRACTIONS[n % len(EXTRACTIONS)]}\n\n{texts[-1]}"
            n += 1


def _in_turn(sources, count: int, prompts: list[str]) -> None:
    while sources and len(prompts) < count:
        for source in list(sources):
            prompt = next(source, None)
            if prompt is None:
                sources.remove(source)
            elif len(prompts) < count:
                prompts.append(prompt)


def task_prompts(conversations: list, count: int, *, max_words: int = 450) -> list[str]:
    """`count` user messages: summaries, translations and passage questions in turn, then, once
    those run out, code requests and extractions in turn.

    conversations: (id, [(role, text), ...]) as `sharegpt.iter_conversations` gives them, in
    the order to draw from (passages from the other end, so the kinds rarely share a
    conversation). Translations run out first (ShareGPT has about a hundred
    German, French or Spanish messages); the other two kinds fill the rest. The later kinds
    come only after every earlier prompt, so that asking for more keeps the earlier prompts
    (and their archived answers) where they were.
    """
    prompts: list[str] = []
    _in_turn([_summaries(conversations, 150, max_words), _translations(conversations, max_words),
              _passage_questions(conversations[::-1], 100, max_words)], count, prompts)
    _in_turn([_code_requests(conversations, 4, max_words), _extractions(conversations, 150, max_words)],
             count, prompts)
    return prompts
