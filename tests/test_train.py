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
