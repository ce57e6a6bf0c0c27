"""Task-style self-distillation prompts: language detection, the mix of kinds, and their place
after the ShareGPT prompts (so that adding them keeps earlier answers)."""

import pytest

from vocabspec.training.task_prompts import language_of, task_prompts
from vocabspec.training.train import TrainConfig, _distill_prompts

GERMAN = "Ich habe heute keine Zeit, weil ich mit der Familie in die Stadt fahre und das Auto nicht geht."
FRENCH = "Je ne sais pas si le train est déjà parti, mais nous devons être à la gare avant midi pour le voir."
ENGLISH = "The committee met on Tuesday and agreed that the new schedule should start in the spring term."
LONG_ENGLISH = " ".join(["The river runs past the old mill and the bakery toward the sea."] * 20)


def test_language_of_tells_the_seeded_languages_from_english():
    assert language_of(GERMAN) == "German"
    assert language_of(FRENCH) == "French"
    assert language_of(ENGLISH) == ""
    assert language_of("Und die") == ""          # too short to tell


def test_task_prompts_take_kinds_in_turn_and_fill_when_one_runs_out():
    conversations = [(str(i), [("user", f"Question {i}?"), ("assistant", LONG_ENGLISH)])
                     for i in range(5)]
    conversations.append(("de", [("user", GERMAN), ("assistant", "Sure.")]))
    prompts = task_prompts(conversations, 7)
    assert len(prompts) == 7
    assert prompts[0] == f"Summarize: {LONG_ENGLISH}"
    assert prompts[1] == f"Translate German to English: {GERMAN}"
    # Passages are drawn from the other end; "Sure." is too short to be one.
    assert prompts[2] == f"{LONG_ENGLISH}\n\nAnswer from the passage above: Question 4?"
    assert sum(p.startswith("Translate") for p in prompts) == 1     # only one German text
    # Once those run out: code requests (none here) and extractions, after all of them; then
    # arithmetic word problems, as many as asked, the same ones each time.
    every = task_prompts(conversations, 100)
    assert every[:11] == task_prompts(conversations, 11) and len(every) == 100   # 5 + 1 + 5, 5, then 84
    assert every[11] == f"List the key points of this text as bullet points:\n\n{LONG_ENGLISH}"
    problems = every[16:]
    assert all(p.endswith("Show your reasoning step by step.") and any(c.isdigit() for c in p) for p in problems)
    assert len(set(problems)) > 80 and task_prompts(conversations, 100)[16:] == problems


def test_code_requests_ask_about_an_answers_code_block():
    code = "def area(r):\n    pi = 3.14159\n    squared = r * r\n    return pi * squared"
    conversations = [("c", [("user", "Area of a circle?"), ("assistant", "Here:\n```python\nx = 1\n```\n"
                                                                          f"and\n```python\n{code}\n```")]),
                     ("c2", [("user", "Again?"), ("assistant", f"```\n{code}\n```")])]
    prompts = task_prompts(conversations, 5)[:2]                               # then word problems
    assert prompts == [f"Explain what this code does:\n```\n{code}\n```",      # the 1-line block skipped
                       f"Add comments to this code:\n```\n{code}\n```"]


def test_task_prompts_come_after_the_sharegpt_prompts(smollm2):
    cfg = TrainConfig.of(conversations=10, heldout=2, self_distill=3, max_len=1024,
                      distill_new_tokens=128)
    plain = _distill_prompts(cfg, smollm2.tokenizer)
    cfg.data.task_prompts = 4
    mixed = _distill_prompts(cfg, smollm2.tokenizer)
    assert len(plain) == 3 and mixed[:3] == plain and len(mixed) == 7
    texts = [smollm2.tokenizer.decode(ids) for ids in mixed[3:]]
    assert "Summarize: " in texts[0] and "to English: " in texts[1]
    assert "Answer from the passage above: " in texts[2]
    assert all(len(ids) <= cfg.data.max_len - cfg.data.distill_new_tokens for ids in mixed)


def test_later_turns_come_last_with_the_conversation_so_far(smollm2):
    cfg = TrainConfig.of(conversations=10, heldout=2, self_distill=3, task_prompts=2, max_len=1024,
                      distill_new_tokens=128)
    before = _distill_prompts(cfg, smollm2.tokenizer)
    cfg.data.later_turns = 3
    after = _distill_prompts(cfg, smollm2.tokenizer)
    assert after[:5] == before and len(after) == 8
    for ids in after[5:]:
        text = smollm2.tokenizer.decode(ids)
        assert text.count("\nuser\n") >= 2 and text.count("\nassistant\n") >= 2   # specials decode bare
        assert text.endswith("\nassistant\n")
    from vocabspec.training.train import _later_turn_ids
    two = [("a", [("user", "Hi"), ("assistant", "Hello"), ("user", "How are you?"), ("assistant", "Fine"),
                  ("user", "Good")]), ("b", [("user", "Only one turn")])]
    assert len(_later_turn_ids(TrainConfig.of(later_turns=2), smollm2.tokenizer, two, 512)) == 2
    with pytest.raises(ValueError, match="only 2 later turns"):
        _later_turn_ids(TrainConfig.of(later_turns=3), smollm2.tokenizer, two, 512)
    fresh = _later_turn_ids(TrainConfig.of(later_turns=1, later_turns_start=1), smollm2.tokenizer, two, 512)
    assert fresh == _later_turn_ids(TrainConfig.of(later_turns=2), smollm2.tokenizer, two, 512)[1:]
    with pytest.raises(ValueError, match="only 2 later turns"):     # the skipped ones count
        _later_turn_ids(TrainConfig.of(later_turns=2, later_turns_start=1), smollm2.tokenizer, two, 512)
    with pytest.raises(ValueError, match="only 0 later turns"):       # none fits 8 tokens
        _later_turn_ids(TrainConfig.of(later_turns=1), smollm2.tokenizer, two, 8)


def test_training_split_follows_the_settings_it_was_made_with(smollm2, tmp_path):
    from vocabspec.training.train import prepare_sequences

    cfg = TrainConfig.of(out=str(tmp_path), conversations=3, heldout=2, max_len=256)
    first = prepare_sequences(cfg, smollm2.tokenizer)
    assert len(first["train"]) == 3 and len(first["heldout"]) == 2
    assert prepare_sequences(cfg, smollm2.tokenizer)["train"] == first["train"]   # read back
    cfg.data.conversations = 5             # asking for more must not return the stale split
    grown = prepare_sequences(cfg, smollm2.tokenizer)
    assert len(grown["train"]) == 5 and grown["train"][:3] == first["train"]
    assert grown["heldout"] == first["heldout"]


def test_a_fixed_distill_start_keeps_the_prompts_while_the_training_set_grows(smollm2):
    small = TrainConfig.of(conversations=10, heldout=2, self_distill=3, max_len=1024,
                        distill_new_tokens=128)
    grown = TrainConfig.of(conversations=30, distill_start=10, heldout=2, self_distill=3,
                        max_len=1024, distill_new_tokens=128)
    prompts = _distill_prompts(small, smollm2.tokenizer)
    assert _distill_prompts(grown, smollm2.tokenizer) == prompts
    grown.data.distill_start = -1          # the default moves past all 30 training conversations
    assert _distill_prompts(grown, smollm2.tokenizer) != prompts
