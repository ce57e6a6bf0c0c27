"""Drafter training on a tiny random target: the candidate-set loss equals the exact loss when
the candidates cover the vocabulary, training lowers the loss, and an interrupted run resumes."""

import torch

from vocabspec.drafter import EagleDrafter
from vocabspec.train import TrainConfig, _atomic_save, sequence_loss, train_drafter

from conftest import tiny_model


def fake_shards(model, directory, count=6, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for part, n in (("train", count), ("heldout", 2)):
        shard = {"tokens": [], "hidden": [], "candidates": []}
        for _ in range(n):
            ids = torch.randint(model.args.vocab_size, (length,), generator=generator)
            cache = model.new_cache(length)
            with torch.inference_mode():
                hidden, _ = model(ids, torch.arange(length), cache)
                candidates = torch.topk(model.lm_head(hidden), 8, dim=-1).indices
            shard["tokens"].append(ids.int())
            shard["hidden"].append(hidden.to(torch.bfloat16))
            shard["candidates"].append(candidates.int())
        _atomic_save(shard, directory / "features" / f"{part}-00000.pt")


def test_candidate_loss_equals_full_loss_when_candidates_cover_vocab(tmp_path):
    model = tiny_model("llama", vocab_size=40)
    drafter = EagleDrafter.random(model).float()
    tokens = torch.randint(40, (12,))
    hidden = torch.randn(12, model.args.dim)
    candidates = torch.arange(40).repeat(12, 1)      # every token is a candidate
    std = torch.ones(model.args.dim)
    sampled, info = sequence_loss(drafter, tokens, hidden, candidates,
                                  TrainConfig(negatives=0, noise=0.0), std)
    full, _ = sequence_loss(drafter, tokens, hidden, candidates,
                            TrainConfig(full_vocab_loss=True, noise=0.0), std)
    assert info["candidates"] == 40
    assert torch.allclose(sampled, full, atol=1e-5)


def test_training_lowers_loss_and_resumes(tmp_path):
    model = tiny_model("gemma3", vocab_size=50)
    fake_shards(model, tmp_path)
    cfg = TrainConfig(out=str(tmp_path), epochs=30, accumulate=2, lr=3e-3, warmup_steps=2,
                      checkpoint_every=5, max_steps=10, noise=0.0, negatives=8)
    logs = []
    train_drafter(cfg, model, log=logs.append)
    first = torch.load(tmp_path / "checkpoint.pt")["history"]
    assert [h["step"] for h in first] == [5, 10]
    cfg.max_steps = 40
    drafter = train_drafter(cfg, model, log=logs.append)
    assert any("resuming from step 10" in line for line in logs)
    history = torch.load(tmp_path / "checkpoint.pt")["history"]
    assert history[-1]["step"] == 40
    first_loss = history[0]["train"]["regression"] + history[0]["train"]["classification"]
    last_loss = history[-1]["train"]["regression"] + history[-1]["train"]["classification"]
    assert last_loss < first_loss
    # The trained drafter saves in EAGLE's layout and loads back for the same target.
    drafter.save(tmp_path / "drafter")
    again = EagleDrafter.load(tmp_path / "drafter", model)
    assert torch.equal(again.fc.weight, drafter.fc.weight)
    # A second round from this drafter, with other settings, starts afresh from it and keeps
    # the first round's checkpoint.
    second = TrainConfig(out=str(tmp_path), epochs=30, accumulate=2, lr=1e-3, warmup_steps=2,
                         checkpoint_every=5, max_steps=5, noise=0.0, negatives=8, unroll=2,
                         init=str(tmp_path / "drafter"))
    train_drafter(second, model, log=logs.append)
    assert any("moved to checkpoint-" in line for line in logs)
    assert torch.load(tmp_path / "checkpoint.pt")["history"][-1]["step"] == 5
    assert len(list(tmp_path.glob("checkpoint-*.pt"))) == 1


def test_unrolled_loss_adds_a_step_on_predicted_features():
    import torch.nn.functional as F

    from vocabspec.train import draft_states, features_of

    model = tiny_model("llama", vocab_size=40)
    drafter = EagleDrafter.random(model).float()
    tokens = torch.randint(40, (12,))
    hidden = torch.randn(12, model.args.dim)
    candidates = torch.arange(40).repeat(12, 1)
    std = torch.ones(model.args.dim)
    cfg = dict(negatives=0, noise=0.0)
    _, one = sequence_loss(drafter, tokens, hidden, candidates, TrainConfig(unroll=1, **cfg), std)
    _, two = sequence_loss(drafter, tokens, hidden, candidates, TrainConfig(unroll=2, **cfg), std)
    # Step 2 by hand: feature i replaced by the drafter's prediction of it.
    with torch.no_grad():
        features = features_of(model, hidden)
        predicted = draft_states(drafter, tokens, features)
        again = draft_states(drafter, tokens, torch.cat([features[:1], predicted]))[1:]
        second = F.smooth_l1_loss(again, features[2:]).item()
    assert abs(two["regression"] - (one["regression"] + second) / 2) < 1e-5
    assert "accuracy_step2" in two and "accuracy_step2" not in one


class _CharTokenizer:
    chat_template = None

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_self_distilled_answers_end_at_eos_or_the_stop_string():
    from vocabspec.train import _cut_answer

    text = [ord(c) for c in "Paris.\n\nQuestion: next"]
    assert _cut_answer(text, {ord(".")}, _CharTokenizer()) == [ord(c) for c in "Paris."]
    assert _cut_answer(text, set(), _CharTokenizer()) == [ord(c) for c in "Paris.\n\nQuestion:"]
    assert _cut_answer(text[:6], set(), _CharTokenizer()) == text[:6]
