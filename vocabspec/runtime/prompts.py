"""How a conversation becomes a prompt for each kind of model.

A chat model (SmolLM2-Instruct) gets its own chat template. A base model (Gemma 3 270M) has
none and, given a bare question, mostly repeats it; so it gets a plain "Question: / Answer:"
frame after one short worked example, and stops at the next "Question:". Training data and
benchmarks use the same frames, so a drafter sees at run time the text it was trained on.
"""

from __future__ import annotations

from .tokenizer import Tokenizer

BASE_EXAMPLE = ("Question: What is the boiling point of water at sea level?\n\n"
                "Answer: Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea "
                "level, where the air pressure is one standard atmosphere.\n\n")
BASE_STOP = "\n\nQuestion:"


def is_chat(tokenizer: Tokenizer) -> bool:
    return bool(tokenizer.chat_template)


def conversation_text(tokenizer: Tokenizer, turns: list[tuple[str, str]], *,
                      answer_open: bool, example: bool = True) -> str:
    """Render (role, text) turns, role in {"user", "assistant"}.

    answer_open: end with the opening of an assistant answer (a prompt) rather than after
    the last turn (training text).
    """
    if is_chat(tokenizer):
        messages = [{"role": role, "content": text} for role, text in turns]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=answer_open)
    parts = [BASE_EXAMPLE] if example else []
    for role, text in turns:
        parts.append(f"Question: {text}\n\n" if role == "user" else f"Answer: {text}\n\n")
    text = "".join(parts)
    return text + "Answer:" if answer_open else text.rstrip("\n")


def encode_conversation(tokenizer: Tokenizer, turns: list[tuple[str, str]], *,
                        answer_open: bool, example: bool = True) -> list[int]:
    """The turns' token ids. The turns' text is text either way: a chat template's own markup
    gives the only special tokens (and its BOS), a base frame gets the model's BOS."""
    if is_chat(tokenizer):
        return tokenizer.encode_chat([{"role": role, "content": text} for role, text in turns],
                                     add_generation_prompt=answer_open)
    text = conversation_text(tokenizer, turns, answer_open=answer_open, example=example)
    return tokenizer.encode(text, parse_special=False)


def stop_strings(tokenizer: Tokenizer) -> tuple[str, ...]:
    return () if is_chat(tokenizer) else (BASE_STOP,)
