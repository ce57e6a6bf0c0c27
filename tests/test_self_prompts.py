"""Prompts the target writes itself: the frame they open, what is kept, the same prompts on a
rerun and from its cache, and their place after every other kind of self-distillation prompt."""

import json
import os
import subprocess
import sys

import pytest

from vocabspec.runtime import native

import vocabspec.training.self_prompts as self_prompts
from vocabspec.training.self_prompts import sample_user_prompts, self_prompt_ids, user_turn_opening
from vocabspec.training.train import TrainConfig, _distill_prompts


def test_the_opening_is_the_frame_up_to_the_users_message(smollm2, gemma3):
    chat, stops = user_turn_opening(smollm2.tokenizer)
    framed = smollm2.tokenizer.encode_chat([{"role": "user", "content": "Hi there"}])
    assert framed[:len(chat)] == chat and len(framed) > len(chat) and stops == ()
    base, stops = user_turn_opening(gemma3.tokenizer)
    assert gemma3.tokenizer.decode(base).endswith("Question:") and stops == ("\n\nAnswer:",)


def test_sampled_prompts_are_kept_by_seed_and_read_back_from_the_cache(smollm2, tmp_path):
    cache = tmp_path / "self-prompts.json"
    first = sample_user_prompts(smollm2.path, 4, 2, cache=cache)
    drawn = json.loads(cache.read_text())
    assert sorted(drawn) == ["4", "5"]
    kept = [text for text in drawn.values() if text and len(text.split()) >= 3]
    assert first == list(dict.fromkeys(kept)) and first        # in seed order, repeats dropped
    assert all("<|im_" not in text for text in first)           # the turn's end is not in the text
    # A rerun reads its draws back without the model (each seed's draw is the batch engine's,
    # exactly as alone: tests/test_batch.py).
    assert sample_user_prompts(tmp_path / "no-model-here", 4, 2, cache=cache) == first


def test_prompts_that_do_not_fit_are_dropped_and_kinds_keep_their_order(smollm2, monkeypatch):
    texts = ["How do I sort a list in Python?", "word " * 600]
    ids = self_prompt_ids(smollm2.tokenizer, texts, 128)
    assert len(ids) == 1 and smollm2.tokenizer.decode(ids[0]).count("sort a list") == 1
    monkeypatch.setattr(self_prompts, "sample_user_prompts", lambda *a, **k: texts[:1])
    cfg = TrainConfig.of(conversations=10, heldout=2, self_distill=2, later_turns=1, max_len=1024,
                      distill_new_tokens=128)
    before = _distill_prompts(cfg, smollm2.tokenizer, smollm2.path)
    cfg.data.self_prompts = 1
    after = _distill_prompts(cfg, smollm2.tokenizer, smollm2.path)
    assert after[:3] == before and after[3:] == ids


@pytest.mark.skipif(not native.available()[0] or (os.cpu_count() or 1) < 2,
                    reason="the native engine on two cores")
def test_the_draw_leaves_the_native_engine_every_core(smollm2, tmp_path):
    # A fresh process, where the draw makes the native engine's first call: its team must not be
    # fixed at the one torch thread the draw samples with (answers and features follow it).
    script = (
        "import sys, torch; from pathlib import Path\n"
        "from vocabspec.runtime import native\n"
        "from vocabspec.training.self_prompts import sample_user_prompts\n"
        "torch.set_num_threads(2)\n"
        "sample_user_prompts(Path(sys.argv[1]), 0, 1, cache=Path(sys.argv[2]))\n"
        "native.set_threads(64)\n"
        "print(torch.get_num_threads(), native.threads())\n")
    out = subprocess.run([sys.executable, "-c", script, str(smollm2.path), str(tmp_path / "c.json")],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "2"]
