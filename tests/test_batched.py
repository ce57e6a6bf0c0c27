"""Many sequences in one forward (runtime/slots.py) and EAGLE-3 trained a batch at a time
(training/eagle3_train.py's train_batched, eagle3_device.py), on torch's CPU kernels: each sequence's rows
get what a forward of its own gives them, and a batch's loss is the one-sequence loss."""

import numpy as np
import pytest
import torch

from conftest import tiny_model, forward
from vocabspec.runtime.slots import SlotCache, forward_rows, greedy_answers, pad_rows
from vocabspec.speculation.families.eagle3 import Eagle3Drafter
from vocabspec.training.eagle3_train import batch_loss, length_batches, target_features
from vocabspec.training.eagle3_train import StepAttention, sequence_loss


def greedy_alone(model, prompt, new):
    cache = model.new_cache(256)
    _, logits = forward(model, torch.tensor(prompt), torch.arange(len(prompt)), cache)
    cache.commit()
    out = []
    for _ in range(new):
        token = int(logits[-1].argmax())
        out.append(token)
        if token in model.args.eos_token_ids:
            break
        _, logits = forward(model, torch.tensor([token]), torch.tensor([len(prompt) + len(out) - 1]), cache)
        cache.commit()
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_rows_are_each_sequences_own(arch):
    """Prefill into slots, then decode steps over the slot tables: every row's hidden state is
    the one a forward of its own sequence gives (Gemma's sliding window of 6 included: the
    sequences pass it)."""
    model = tiny_model(arch, seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (11, 4, 9)]
    cache = SlotCache(model, slots=4, window=16)
    rows, lengths = pad_rows(prompts, "cpu")
    prefill = forward_rows(model, rows, torch.arange(rows.shape[1]).expand_as(rows), cache)
    follow = [torch.randint(0, 97, (3,), generator=gen).tolist() for _ in prompts]
    positions = lengths.clone()
    steps = []
    for t in range(3):
        tokens = torch.tensor([f[t] for f in follow])
        steps.append(forward_rows(model, tokens[:, None], positions[:, None], cache,
                                  context=int(positions.max()) + 1)[:, 0])
        positions += 1
    for b, prompt in enumerate(prompts):
        whole = prompt + follow[b]
        alone, _ = forward(model, torch.tensor(whole), torch.arange(len(whole)), model.new_cache(32), all_logits=True)
        torch.testing.assert_close(prefill[b, :len(prompt)], alone[:len(prompt)], rtol=1e-4, atol=1e-4)
        for t in range(3):
            torch.testing.assert_close(steps[t][b], alone[len(prompt) + t], rtol=1e-4, atol=1e-4)


def test_greedy_answers_are_each_prompts_own_answer(smollm2):
    """Two slots for four prompts: finished answers leave, queued prompts take their slots,
    the live ones move down; every answer is the one decoding the prompt alone gives
    (float32 on torch's kernels), the end-of-sequence token that ended it kept."""
    from vocabspec.runtime.loading import load_model

    model, _ = load_model("smollm2", weights="f32", backend="torch", max_seq_len=256)
    texts = ["Say hi.", "What is 17 times 23?", "Name three primes.", "Why is the sky blue?"]
    prompts = [smollm2.prompt_ids(t) for t in texts]
    answers = greedy_answers(model, prompts, 16, model.args.eos_token_ids, slots=2, check_every=3)
    assert answers == [greedy_alone(model, p, 16) for p in prompts]
    assert any(a[-1] in model.args.eos_token_ids for a in answers)      # some ended early
    with pytest.raises(ValueError, match="empty prompt"):
        greedy_answers(model, [[]], 4, [])
    with pytest.raises(ValueError, match="window"):
        greedy_answers(model, [[1] * 250], 10, [])


def test_length_batches_cover_every_sequence_once_within_the_budget():
    sequences = [[0] * n for n in (5, 50, 7, 30, 31, 2, 90, 40)]
    batches = length_batches(sequences, tokens=100, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(len(sequences)))
    for batch in batches:
        assert len(batch) == 1 or max(len(sequences[i]) for i in batch) * len(batch) <= 100


def tiny_eagle3(target, vocab=64):
    from test_eagle3 import random_config

    return Eagle3Drafter.random(target, random_config(target, vocab, aux=(1, 2, 3)), seed=2, dtype=torch.float32)


def test_a_batch_loss_is_the_sequences_own_loss():
    """One sequence: eagle3_train.sequence_loss's loss and accuracies. Two copies of it: the
    same, so each copy attends within itself. A padded, shorter second sequence: the first's
    rows are unchanged by it (its loss alone and in the batch, weighed by rows, agree)."""
    target = tiny_model("llama", seed=5, n_layers=4)
    drafter = tiny_eagle3(target)
    gen = torch.Generator().manual_seed(1)
    long_seq = torch.randint(0, 97, (24,), generator=gen).tolist()
    short_seq = torch.randint(0, 97, (15,), generator=gen).tolist()
    taps = drafter.taps
    one = target_features(target, [long_seq], taps)
    ref_hidden, _, ref_tapped = forward(target, torch.tensor(long_seq), torch.arange(24), target.new_cache(32),
                                       all_logits=True, taps=taps)
    torch.testing.assert_close(one["hidden"][0], ref_hidden, rtol=1e-5, atol=1e-5)
    candidates = one["chosen"][0][:, None]
    ref_loss, ref_info = sequence_loss(drafter, torch.tensor(long_seq), ref_hidden, candidates, ref_tapped, 3, 0.8)
    loss, info = batch_loss(drafter, one, 3, 0.8, "soft")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert {k: float(v) for k, v in info.items()} == pytest.approx(ref_info)
    twice, _ = batch_loss(drafter, target_features(target, [long_seq, long_seq], taps), 3, 0.8, "soft")
    torch.testing.assert_close(twice, loss, rtol=1e-5, atol=1e-5)
    # Every token in the draft vocabulary, so every row counts: 20 rows of the long sequence and
    # 11 of the short one at each step, and the padded batch's loss is their row-weighted mean.
    whole = tiny_eagle3(target, vocab=97)
    alone = [float(batch_loss(whole, target_features(target, [seq], taps), 3, 0.8, "soft")[0])
             for seq in (long_seq, short_seq)]
    padded, _ = batch_loss(whole, target_features(target, [long_seq, short_seq], taps), 3, 0.8, "soft")
    assert float(padded) == pytest.approx((20 * alone[0] + 11 * alone[1]) / 31, rel=1e-5)
    # With hard labels the same rows count; the loss is the cross-entropy to the target's choice.
    hard, _ = batch_loss(drafter, one, 3, 0.8, "hard")
    assert torch.isfinite(hard) and float(hard) != pytest.approx(float(loss))
    with pytest.raises(ValueError, match="labels"):
        batch_loss(drafter, one, 3, 0.8, "medium")


def test_step_attention_over_a_batch_is_each_sequences_own():
    gen = torch.Generator().manual_seed(2)
    b, heads, kv, n, dim, step = 3, 4, 2, 5, 8, 2
    q = torch.randn(1, heads, b * n, dim, generator=gen)
    keys = torch.randn(1, kv, (step + 1) * b * n, dim, generator=gen)
    values = torch.randn(1, kv, (step + 1) * b * n, dim, generator=gen)
    together = StepAttention(step, sequences=b).attend(q, keys, values, 0.3)
    for s in range(b):
        rows = slice(s * n, (s + 1) * n)
        mine = torch.cat([keys[:, :, j * b * n:(j + 1) * b * n][:, :, rows] for j in range(step + 1)], dim=2)
        mine_v = torch.cat([values[:, :, j * b * n:(j + 1) * b * n][:, :, rows] for j in range(step + 1)], dim=2)
        alone = StepAttention(step).attend(q[:, :, rows], mine, mine_v, 0.3)
        torch.testing.assert_close(together[:, :, rows], alone, rtol=1e-5, atol=1e-6)


def test_the_device_recipe_answers_trains_and_writes_a_loadable_drafter(smollm2, tmp_path):
    """The GPU recipe end to end on the CPU, a few prompts: answers written and read back,
    both label kinds trained on the same batches, drafters that load for the target, and a
    continued run from one of them."""
    from vocabspec.training import eagle3_device as recipe

    prompts = [smollm2.prompt_ids(t) for t in ("Say hi.", "Name a color.", "What is 2+2?", "Count to three.")]
    parts = {"prompts": prompts[:3], "conversations": [prompts[0] + prompts[1]], "heldout": prompts[3:]}
    np.savez_compressed(tmp_path / "prompts.npz", **{f"{n}_{k}": v for n, lists in parts.items()
                                                     for k, v in recipe.pack(lists).items()})
    common = ["--model", "smollm2", "--prompts", str(tmp_path / "prompts.npz"), "--device", "cpu",
              "--max-new-tokens", "8", "--max-len", "64", "--tokens-per-batch", "64", "--budget-s", "300",
              "--snapshot-m", "0.00002"]
    assert recipe.main(["run", *common, "--out", str(tmp_path / "a")]) == 0
    report = __import__("json").loads((tmp_path / "a" / "report.json").read_text())
    assert report["answers"]["answered"] == 4
    assert {p["drafter"] for p in report["points"]} == {"soft", "hard"}
    assert [p["at"] for p in report["points"] if p["drafter"] == "soft"][-1] == "end"
    kept_prompts, kept_answers = recipe.read_answers(sorted((tmp_path / "a").glob("answers-*.npz")))
    assert sorted(kept_prompts) == sorted(parts["prompts"] + parts["heldout"]) and all(kept_answers)
    drafter = Eagle3Drafter.load(tmp_path / "a" / "drafter-soft", smollm2.model)
    assert drafter.config.draft_vocab_size == 8192
    # Continued on the answers so far and on prompts the target writes itself, answered here.
    assert recipe.main(["run", *common, "--out", str(tmp_path / "b"), "--answers", str(tmp_path / "a"),
                        "--init", str(tmp_path / "a" / "drafter-soft"), "--labels", "soft",
                        "--self-prompts", "2", "--self-prompts-start", "4"]) == 0
    report = __import__("json").loads((tmp_path / "b" / "report.json").read_text())
    assert report["answers_read"] == 4 and report["args"]["init"].endswith("drafter-soft")
    fresh = report["self_prompts"]["kept"]
    assert fresh >= 1 and report["answers"]["prompts"] == fresh
    kept_prompts, kept_answers = recipe.read_answers(sorted((tmp_path / "b").glob("answers-*.npz")))
    assert len(kept_prompts) == 4 + fresh and all(kept_answers)
    assert report["train_sequences"] == 3 + fresh + 1      # answered prompts, no held out, a conversation
