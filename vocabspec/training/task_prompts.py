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


NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
ITEMS = ("pencils", "apples", "notebooks", "tickets", "bottles of water", "cookies")


def _math_problem(rng) -> str:
    """One arithmetic word problem of a few steps (GSM8K's kind), numbers drawn from `rng`."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(8)
    if kind == 0:
        price, count = rng.randint(2, 9), rng.randint(3, 12)
        bill = next(b for b in (20, 50, 100, 200) if b > price * count)
        return (f"A shop sells {item} at ${price} each. {name} buys {count} and pays with a ${bill} "
                f"bill. How much change does {name} get?")
    if kind == 1:
        hours, speed, later = rng.randint(2, 6), rng.randint(40, 120), rng.randint(3, 9)
        return (f"A train travels {hours * speed} km in {hours} hours. At the same speed, how far does "
                f"it travel in {later} hours?")
    if kind == 2:
        have, give, buy = rng.randint(10, 60), rng.randint(1, 9), rng.randint(2, 20)
        return (f"{name} has {have} {item}, gives {give} to a friend and then buys {buy} more. How many "
                f"{item} does {name} have now?")
    if kind == 3:
        width, length = rng.randint(3, 30), rng.randint(4, 40)
        return f"A rectangle is {width} cm wide and {length} cm long. What are its area and its perimeter?"
    if kind == 4:
        return f"What is {rng.choice((5, 10, 15, 20, 25, 40, 75))}% of {rng.randint(2, 90) * 20}?"
    if kind == 5:
        a, x, b = rng.randint(2, 12), rng.randint(-10, 15), rng.randint(-30, 30)
        return f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}."
    if kind == 6:
        cups, servings, wanted = rng.randint(2, 6), rng.randint(2, 8), rng.randint(3, 24)
        return (f"A recipe needs {cups} cups of flour for {servings} servings. How much flour is needed "
                f"for {wanted} servings?")
    numbers, mean, extra = rng.randint(3, 9), rng.randint(10, 80), rng.randint(0, 100)
    return (f"The average of {numbers} numbers is {mean}. When the number {extra} is added, what is "
            f"the new average?")


def _math_problems(seed: int = 0):
    """Arithmetic word problems without end, the same ones for the same seed (ShareGPT holds no
    clean source of them; the target's worked answers are what the drafter learns from)."""
    import random

    rng = random.Random(seed)
    while True:
        yield f"{_math_problem(rng)} Show your reasoning step by step."


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
    those run out, code requests and extractions in turn, then arithmetic word problems (as many
    as asked: they never run out).

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
    _in_turn([_math_problems()], count, prompts)
    return prompts
