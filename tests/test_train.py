"""Drafter training on a tiny random target: the candidate-set loss equals the exact loss when
the candidates cover the vocabulary, training lowers the loss, and an interrupted run resumes."""

import json
import pytest
import torch

from vocabspec.speculation.families.eagle import EagleDrafter
from vocabspec.training.train import TrainConfig, _atomic_save, sequence_loss, train_drafter

from conftest import tiny_model, forward


def fake_shards(model, directory, count=6, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for part, n in (("train", count), ("heldout", 2)):
        shard = {"tokens": [], "hidden": [], "candidates": []}
        for _ in range(n):
            ids = torch.randint(model.args.vocab_size, (length,), generator=generator)
            cache = model.new_cache(length)
            with torch.inference_mode():
                hidden, _ = forward(model, ids, torch.arange(length), cache)
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
                                  TrainConfig.of(negatives=0, noise=0.0), std)
    full, _ = sequence_loss(drafter, tokens, hidden, candidates,
                            TrainConfig.of(full_vocab_loss=True, noise=0.0), std)
    assert info["candidates"] == 40
    assert torch.allclose(sampled, full, atol=1e-5)


def test_bfloat16_training_keeps_the_teacher_in_float32():
    """Under --train-dtype bfloat16 the drafter's matmuls run in bfloat16 and its loss stays
    near float32's; the target's distribution (the teacher) is computed in float32 as before."""
    from vocabspec.training.train import training_precision

    model = tiny_model("llama", vocab_size=40)
    drafter = EagleDrafter.random(model).float().requires_grad_(True)      # as training has it
    tokens, hidden = torch.randint(40, (12,)), torch.randn(12, model.args.dim)
    candidates, std = torch.arange(40).repeat(12, 1), torch.ones(model.args.dim)
    cfg = TrainConfig.of(negatives=0, noise=0.0, train_dtype="bfloat16")
    exact = sequence_loss(drafter, tokens, hidden, candidates, cfg, std)[0].detach()
    seen = []
    handle = drafter.fc.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    with training_precision(cfg):
        fast = sequence_loss(drafter, tokens, hidden, candidates, cfg, std)[0].detach()
    handle.remove()
    assert seen == [torch.bfloat16] and fast.dtype == torch.float32
    assert abs(fast.item() - exact.item()) < 0.02 * abs(exact.item())
    with training_precision(TrainConfig.of()):                    # float32: nothing changes
        assert torch.equal(sequence_loss(drafter, tokens, hidden, candidates, cfg, std)[0].detach(), exact)
    with pytest.raises(ValueError, match="train_dtype"):
        training_precision(TrainConfig.of(train_dtype="float16"))


def test_training_lowers_loss_and_resumes(tmp_path):
    model = tiny_model("gemma3", vocab_size=50)
    fake_shards(model, tmp_path)
    cfg = TrainConfig.of(out=str(tmp_path), epochs=30, accumulate=2, lr=3e-3, warmup_steps=2,
                      checkpoint_every=5, max_steps=10, noise=0.0, negatives=8)
    logs = []
    train_drafter(cfg, model, log=logs.append)
    first = torch.load(tmp_path / "checkpoint.pt")["history"]
    assert [h["step"] for h in first] == [5, 10]
    cfg.optim.max_steps = 40
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
    second = TrainConfig.of(out=str(tmp_path), epochs=30, accumulate=2, lr=1e-3, warmup_steps=2,
                         checkpoint_every=5, max_steps=5, noise=0.0, negatives=8, unroll=2,
                         init=str(tmp_path / "drafter"))
    train_drafter(second, model, log=logs.append)
    assert any("moved to checkpoint-" in line for line in logs)
    assert torch.load(tmp_path / "checkpoint.pt")["history"][-1]["step"] == 5
    assert len(list(tmp_path.glob("checkpoint-*.pt"))) == 1


def test_unrolled_loss_adds_a_step_on_predicted_features():
    import torch.nn.functional as F

    from vocabspec.speculation.families.eagle import draft_states, features_of

    model = tiny_model("llama", vocab_size=40)
    drafter = EagleDrafter.random(model).float()
    tokens = torch.randint(40, (12,))
    hidden = torch.randn(12, model.args.dim)
    candidates = torch.arange(40).repeat(12, 1)
    std = torch.ones(model.args.dim)
    cfg = dict(negatives=0, noise=0.0)
    _, one = sequence_loss(drafter, tokens, hidden, candidates, TrainConfig.of(unroll=1, **cfg), std)
    _, two = sequence_loss(drafter, tokens, hidden, candidates, TrainConfig.of(unroll=2, **cfg), std)
    # Step 2 by hand: feature i replaced by the drafter's prediction of it.
    with torch.no_grad():
        features = features_of(model, hidden)
        predicted = draft_states(drafter, tokens, features)
        again = draft_states(drafter, tokens, torch.cat([features[:1], predicted]))[1:]
        second = F.smooth_l1_loss(again, features[2:]).item()
    assert abs(two["regression"] - (one["regression"] + second) / 2) < 1e-5
    assert "accuracy_step2" in two and "accuracy_step2" not in one


def test_held_out_agreement_at_step_k_follows_the_unrolled_chain():
    """evaluate's step-K top-1 is the unrolled loss's step-K accuracy when the loss runs over
    the whole vocabulary: both feed the drafter the same chain of its own predictions."""
    import torch.nn.functional as F

    from vocabspec.speculation.families.eagle import features_of
    from vocabspec.training.train import evaluate

    model = tiny_model("llama", vocab_size=6)     # few tokens: chance agreement is not rare
    drafter = EagleDrafter.random(model, seed=3).float()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(6, (40,), generator=generator)
    hidden = torch.randn(40, model.args.dim, generator=generator)
    with torch.no_grad():
        candidates = torch.topk(F.linear(features_of(model, hidden), model.head_weight), 3).indices
    _, info = sequence_loss(drafter, tokens, hidden, candidates,
                            TrainConfig.of(unroll=3, full_vocab_loss=True, noise=0.0),
                            torch.ones(model.args.dim))
    held_out = evaluate(drafter, [(tokens, hidden, candidates, None)], steps=3)
    expected = [info["accuracy"], info["accuracy_step2"], info["accuracy_step3"]]
    assert list(held_out) == ["top1_step1", "top1_step2", "top1_step3"]
    assert list(held_out.values()) == pytest.approx(expected)
    assert any(0 < value < 1 for value in expected)      # not a vacuous agreement
    # Short sequences score the steps they can: two tokens past the first, one step.
    short = evaluate(drafter, [(tokens[:3], hidden[:3], candidates[:3], None)], steps=3)
    assert short["top1_step2"] == short["top1_step3"] == 0.0


def test_self_distilled_answers_are_the_engines_greedy_answers_with_their_end(tmp_path):
    """The batch engine answers every prompt as plain decoding alone would, the end-of-sequence
    token that ended an answer kept (a drafter learns to propose it), and the file saved."""
    from vocabspec.serving.api import load
    from vocabspec.decoding.generate import GenerationConfig
    from vocabspec.runtime.loading import resolve_model_path
    from vocabspec.runtime.prompts import encode_conversation
    from vocabspec.training.train import _generate_answers

    lm = load("smollm2")
    prompts = [encode_conversation(lm.tokenizer, [("user", text)], answer_open=True)
               for text in ("Say hi.", "Name a colour.", "Write a long poem about the sea.")]
    done, out = {"prompts": [], "sequences": []}, tmp_path / "distilled.pt"
    name = _generate_answers(TrainConfig.of(distill_new_tokens=24, distill_batch=2), resolve_model_path("smollm2"),
                             prompts, done, out)
    assert "batch engine" in name and torch.load(out) == done
    ended = 0
    for prompt in prompts:
        sequence = done["sequences"][done["prompts"].index(prompt)]
        alone = lm.engine.generate(prompt, GenerationConfig(max_new_tokens=24))
        if alone.stop_reason == "eos":
            ended += 1
            assert sequence == prompt + alone.tokens + [alone.eos_token]
        else:
            assert sequence == prompt + alone.tokens and len(alone.tokens) == 24
    assert 0 < ended < len(prompts)          # both endings seen


def test_self_distillation_resumes_per_prompt_and_grows_without_redoing(tmp_path, monkeypatch):
    import vocabspec.training.train as train

    calls = []

    def fake_generate(cfg, model_path, todo, done, out):
        calls.append([tuple(p) for p in todo])
        for prompt in todo:
            done["prompts"].append(prompt)
            done["sequences"].append(prompt + [99])
        _atomic_save(done, out)
        return "fake"

    pool = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
    monkeypatch.setattr(train, "_generate_answers", fake_generate)
    monkeypatch.setattr(train, "_distill_prompts", lambda cfg, tok, path=None: pool[:cfg.data.self_distill])
    cfg = TrainConfig.of(out=str(tmp_path), self_distill=3)
    first = train.distill_sequences(cfg, None, tmp_path / "model.gguf")
    assert first == [[3, 99], [1, 2, 99], [4, 5, 6, 99]]      # shortest prompts first
    cfg.data.self_distill = 5
    grown = train.distill_sequences(cfg, None, tmp_path / "model.gguf")
    assert calls[1] == [(7,), (8, 9)]                           # only the new prompts
    assert grown[:3] == first and grown[3:] == [[7, 99], [8, 9, 99]]
    cfg.data.self_distill = 2                                        # fewer: nothing generated
    assert train.distill_sequences(cfg, None, tmp_path / "model.gguf") == [[3, 99], [1, 2, 99]]
    assert len(calls) == 2
    # The first file format (a count of prompts done) is read back by prompt prefixes.
    _atomic_save({"sequences": [[3, 99], [1, 2, 99]], "prompts": 2}, tmp_path / "distilled.pt")
    cfg.data.self_distill = 3
    assert train.distill_sequences(cfg, None, tmp_path / "model.gguf") == first
    assert calls[2] == [(4, 5, 6)]


def test_answer_archive_carries_answers_to_another_work_directory(tmp_path, monkeypatch):
    import vocabspec.training.train as train
    from vocabspec.training.answers import AnswerArchiveError, read_answers, target_fingerprint

    generated = []

    def fake_generate(cfg, model_path, todo, done, out):
        generated.extend(tuple(p) for p in todo)
        for prompt in todo:
            done["prompts"].append(prompt)
            done["sequences"].append(prompt + [99, 98])
        _atomic_save(done, out)
        return "fake"

    pool = [[1, 2], [3], [4, 5, 6], [7]]
    monkeypatch.setattr(train, "_generate_answers", fake_generate)
    monkeypatch.setattr(train, "_distill_prompts", lambda cfg, tok, path=None: pool[:cfg.data.self_distill])
    model_file, archive = tmp_path / "model.gguf", tmp_path / "archive"
    model_file.write_bytes(b"weights of one target")
    first = TrainConfig.of(out=str(tmp_path / "machine-a"), self_distill=3, answers=str(archive))
    # With an archive, answers it lacks are generated only when asked for: hours, never silently.
    with pytest.raises(ValueError, match="3 of 3 answers .* --generate-answers"):
        train.distill_sequences(first, None, model_file)
    assert not generated
    first.data.generate_answers = True
    sequences = train.distill_sequences(first, None, model_file)
    assert len(generated) == 3 and len(list(archive.glob("*.safetensors"))) == 1
    # Another machine, more prompts: the archived answers come first (in prompt order), only
    # the prompt the archive lacks is generated, and the archive gains a file with its answer.
    second = TrainConfig.of(out=str(tmp_path / "machine-b"), self_distill=4, answers=str(archive),
                         generate_answers=True)
    assert train.distill_sequences(second, None, model_file) == [[1, 2, 99, 98], [3, 99, 98], [4, 5, 6, 99, 98],
                                                                   [7, 99, 98]]
    assert sorted(sequences) == [[1, 2, 99, 98], [3, 99, 98], [4, 5, 6, 99, 98]]
    assert generated[3:] == [(7,)]
    archived = read_answers(archive, target_fingerprint(model_file), 256)
    assert archived == {(1, 2): [1, 2, 99, 98], (3,): [3, 99, 98], (4, 5, 6): [4, 5, 6, 99, 98],
                        (7,): [7, 99, 98]}
    assert len(list(archive.glob("*.safetensors"))) == 2
    # Answers of another target, or cut at another length, are refused, not mixed in.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"weights of another target")
    with pytest.raises(AnswerArchiveError, match="another target"):
        read_answers(archive, target_fingerprint(other), 256)
    with pytest.raises(AnswerArchiveError, match="cut at 256"):
        read_answers(archive, target_fingerprint(model_file), 128)
    next(archive.glob("*.safetensors")).write_bytes(b"not safetensors")
    with pytest.raises(AnswerArchiveError, match="not a readable answer archive"):
        read_answers(archive, target_fingerprint(model_file), 256)


def test_a_repeated_prompt_is_archived_once(tmp_path):
    from vocabspec.training.answers import write_answers

    path = write_answers(tmp_path, [[1, 2], [3], [1, 2]], [[1, 2, 9], [3, 8], [1, 2, 9]], "key", 256, "test")
    assert path.name.startswith("answers-2-")


def test_runtime_features_are_the_states_one_token_decoding_gives():
    """--feature-dtype runtime extracts with the engine a user decodes with: on the native
    engine a sequence's prefill states (and taps) are the ones each token's own decoding step
    gives, the states the drafter reads at inference, kept in bfloat16."""
    from conftest import tiny_native
    from vocabspec.training.train import _features

    _, native = tiny_native("llama", seed=3, n_layers=4)
    ids = torch.randint(200, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    hidden, candidates, tapped = _features(native, native.new_cache(32), ids, 4, taps=(1, 2))
    cache, rows, taps_rows = native.new_cache(32), [], []
    with torch.inference_mode():
        for i, token in enumerate(ids):
            h, _, t = forward(native, torch.tensor([token]), torch.tensor([i]), cache, logits_rows=[], taps=(1, 2))
            cache.commit()
            rows.append(h), taps_rows.append(t)
    assert torch.equal(hidden, torch.cat(rows).to(torch.bfloat16))
    assert torch.equal(tapped, torch.cat(taps_rows).to(torch.bfloat16))
    assert candidates.shape == (23, 4)


def test_feature_shards_of_a_grown_sequence_list_are_rebuilt(tmp_path):
    from vocabspec.training.train import extract_features, load_shards

    model = tiny_model("llama", vocab_size=40)
    cfg = TrainConfig.of(out=str(tmp_path), shard_tokens=20, top_candidates=4, max_len=64)
    sequences = [[i % 40 for i in range(start, start + 12)] for start in range(5)]
    extract_features(cfg, model, {"distill": sequences[:3]})     # shards (0, 2), (2, 3)
    extract_features(cfg, model, {"distill": sequences})         # shards (0, 2), (2, 4), (4, 5)
    assert [t.tolist() for t, *_ in load_shards(cfg, "distill")] == sequences
    extract_features(cfg, model, {"distill": sequences[:2]})     # shrunk: one shard left
    assert [t.tolist() for t, *_ in load_shards(cfg, "distill")] == sequences[:2]


def test_ranker_distillation_lowers_its_loss_on_sampled_positions(tmp_path):
    from vocabspec.training.ranker import train_ranker
    from vocabspec.training.train import load_shards

    model = tiny_model("llama", vocab_size=60)
    fake_shards(model, tmp_path, count=8)
    cfg = TrainConfig.of(out=str(tmp_path))
    drafter = EagleDrafter.random(model).float()
    _, _, metrics = train_ranker(drafter, load_shards(cfg, "train"), load_shards(cfg, "heldout"),
                                 rank=4, epochs=25, lr=1e-2, positions=6, log=lambda _: None)
    assert metrics["positions_per_sequence"] == 6
    assert metrics["loss_last_tenth"] < metrics["loss_first_tenth"]


def test_ranker_training_starts_from_a_given_ranker(tmp_path):
    from vocabspec.training.ranker import svd_init, train_ranker
    from vocabspec.training.train import load_shards

    model = tiny_model("llama", vocab_size=60)
    fake_shards(model, tmp_path, count=4)
    cfg = TrainConfig.of(out=str(tmp_path))
    drafter = EagleDrafter.random(model).float()
    start = svd_init(model.head_weight, 3)
    down, _, metrics = train_ranker(drafter, load_shards(cfg, "train"), load_shards(cfg, "heldout"),
                                    rank=3, lr=1e-2, positions=6, init=start, log=lambda _: None)
    assert metrics["warm_start"]
    assert down.shape == start[0].shape and not torch.equal(down, start[0])
    with pytest.raises(ValueError, match="rank"):
        train_ranker(drafter, load_shards(cfg, "train"), [], rank=4, init=start, log=lambda _: None)


def test_joint_ranker_loss_adds_the_rankers_distillation_to_the_token_loss():
    from vocabspec.training.ranker import distillation_loss, svd_init, teacher
    from vocabspec.speculation.families.eagle import draft_states, features_of

    model = tiny_model("llama", vocab_size=40)
    drafter = EagleDrafter.random(model).float().requires_grad_(True)
    tokens = torch.randint(40, (12,))
    hidden = torch.randn(12, model.args.dim)
    candidates = torch.topk(model.lm_head(features_of(model, hidden)), 5, dim=-1).indices
    std = torch.ones(model.args.dim)
    ranker = svd_init(model.head_weight, 3)
    cfg = dict(negatives=0, noise=0.0, ranker_positions=100)
    plain, _ = sequence_loss(drafter, tokens, hidden, candidates, TrainConfig.of(**cfg), std)
    joint, info = sequence_loss(drafter, tokens, hidden, candidates,
                                TrainConfig.of(ranker_weight=0.5, **cfg), std, ranker=ranker)
    with torch.no_grad():     # by hand: every position of the one step
        features = features_of(model, hidden)
        states = draft_states(drafter, tokens, features)
        by_hand = distillation_loss(states, *ranker, *teacher(model, features[1:], candidates[1:].long()))
    assert abs(info["ranker"] - by_hand.item()) < 1e-5
    assert abs(joint.item() - (plain.item() + 0.1 * 0.5 * by_hand.item())) < 1e-5
    # The ranker's loss reaches the drafter (the paper's point: its states become rankable).
    grads = []
    for loss in (plain, joint):
        drafter.zero_grad()
        loss.backward()
        grads.append(drafter.fc.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_joint_ranker_training_lowers_its_loss_resumes_and_keeps_the_ranker(tmp_path):
    model = tiny_model("llama", vocab_size=60)
    fake_shards(model, tmp_path, count=8)
    cfg = TrainConfig.of(out=str(tmp_path), epochs=30, accumulate=2, lr=3e-3, warmup_steps=2,
                      checkpoint_every=5, max_steps=5, noise=0.0, negatives=8,
                      ranker_weight=1.0, ranker_rank=4, ranker_positions=8, ranker_lr=1e-2)
    logs = []
    train_drafter(cfg, model, log=logs.append)
    saved = torch.load(tmp_path / "checkpoint.pt")["ranker"]
    cfg.optim.max_steps = 40
    drafter = train_drafter(cfg, model, log=logs.append)
    assert any("resuming from step 5" in line for line in logs)
    history = torch.load(tmp_path / "checkpoint.pt")["history"]
    assert history[-1]["train"]["ranker"] < history[0]["train"]["ranker"]
    assert 0.0 <= history[-1]["ranker"]["recall_target"] <= 1.0
    down, vocab = drafter.trained_ranker
    assert down.shape == (4, model.args.dim) and vocab.shape == (60, 4)
    assert not torch.equal(down, saved[0])       # resumed from step 5's ranker and trained on


def recipe_commands(path) -> list[list[str]]:
    """The `vocabspec train` commands of a recipe script, as argument lists (its variables and
    the loop's learning rate filled in)."""
    import re
    import shlex

    text = path.read_text().replace("\\\n", " ")
    variables = dict(re.findall(r'^(\w+)="([^"]*)"', text, re.M))
    commands = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("vocabspec train"):
            for name, value in variables.items():
                line = line.replace("$" + name, value)
            commands.append(shlex.split(line.replace("$lr", "1e-4"))[2:])
    return commands


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_recipes_keep_their_answers_and_generate_what_is_missing(model):
    """No answer archive ships with the repository (greedy answers regenerate the same, and the
    archives the shipped drafters read are in git history): every self-distilling round of a
    recipe names an archive, and generates into it the answers it lacks."""
    from pathlib import Path

    from vocabspec.cli import build_parser, train_config

    root = Path(__file__).resolve().parents[1]
    parser = build_parser()
    rounds = 0
    for argv in recipe_commands(root / "recipes" / f"{model}.sh"):
        args = parser.parse_args(["train", *argv])
        cfg = train_config(args)
        if cfg.data.self_distill or cfg.data.task_prompts:
            assert cfg.data.answers and cfg.data.generate_answers, f"a self-distilling round that would fail: {argv}"
            assert not (root / cfg.data.answers).is_relative_to(root / "data"), cfg.data.answers
            rounds += 1
    assert rounds >= 3


def test_medusa_trainer_trains_and_saves_heads(tmp_path):
    # The Medusa family's trainer as `vocabspec train --drafter medusa` runs it (train.trainer_of).
    from vocabspec.speculation.families.medusa import MedusaHeads
    from vocabspec.training.train import trainer_of

    model = tiny_model("llama", vocab_size=50)
    fake_shards(model, tmp_path)
    cfg = TrainConfig.of(out=str(tmp_path), drafter="medusa", medusa_heads=2, medusa_positions=8,
                      epochs=2, max_steps=6, lr=3e-3, warmup_steps=1, negatives=4)
    report, logs = {}, []
    trainer_of("medusa")(cfg, model, {}, report, False, logs.append)
    heads = MedusaHeads.load(tmp_path / "medusa", model.args)
    # Trained from zero blocks: the saved heads moved, and their figures are the report's.
    assert heads.n_heads == 2 and any(block.weight.abs().sum() > 0 for block in heads.blocks)
    saved = json.loads((tmp_path / "medusa" / "config.json").read_text())["vocabspec"]["training"]
    assert saved == report and report["steps"] == 6 and len(report["heldout"]["top1"]) == 2
