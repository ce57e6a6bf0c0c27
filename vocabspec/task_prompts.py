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


def task_prompts(conversations: list, count: int, *, max_words: int = 450) -> list[str]:
    """`count` user messages, taking summaries, translations and passage questions in turn.

    conversations: (id, [(role, text), ...]) as `sharegpt.iter_conversations` gives them, in
    the order to draw from (passages from the other end, so the kinds rarely share a
    conversation). Translations run out first (ShareGPT has about a hundred
    German, French or Spanish messages); the other two kinds fill the rest.
    """
    sources = [_summaries(conversations, 150, max_words), _translations(conversations, max_words),
               _passage_questions(conversations[::-1], 100, max_words)]
    prompts: list[str] = []
    while sources and len(prompts) < count:
        for source in list(sources):
            prompt = next(source, None)
            if prompt is None:
                sources.remove(source)
            elif len(prompts) < count:
                prompts.append(prompt)
    return prompts
