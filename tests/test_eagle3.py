"""EAGLE-3 drafters in the ecosystem's layouts (eagle3.py).

- vLLM's `speculators` package builds and saves a small random Eagle3 drafter in its own
  environment (a virtual environment beside this one, made once: its pins clash with ours);
  vocabspec loads the checkpoint and gives the package's own draft logits, for the first draft
  step and for a second that reads the first's outputs.
- The speculators and SGLang layouts round-trip: saved in one, loaded, saved in the other, the
  same drafter.
- Drafting with a loaded EAGLE-3 drafter through `--draft-path` (its own head, FR-Spec and
  VocabTrim subsets of it, and grafted prompt lookup) gives plain decoding's tokens.
- Checkpoints that do not fit their target are refused by name.
"""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vocabspec
from vocabspec.speculation.families.eagle3 import Eagle3Config, Eagle3Drafter, is_eagle3
from vocabspec.runtime.files import cache_dir

from conftest import tiny_native, forward

SPECULATORS = ["speculators==0.9.0", "hs-connectors==0.9.0"]      # installed without their pins
SPECULATORS_NEEDS = ["loguru", "pydantic-settings", "datasets<=5.1.0"]


@pytest.fixture(scope="module")
def speculators_python() -> str:
    """A Python that imports `speculators`: a virtual environment over this one's packages (its
    torch among them) with the package added, made on first use in the cache directory."""
    env = cache_dir() / "speculators-env"
    python = env / "bin" / "python"
    check = [str(python), "-c", "import torch, speculators.models.eagle3"]
    if not python.exists() or subprocess.run(check, capture_output=True).returncode != 0:
        # Not system_site_packages: from inside a virtual environment that reaches the base
        # interpreter's packages, not this one's torch. A .pth file in the new environment
        # names this interpreter's own package directories instead, after the environment's.
        venv.create(env, with_pip=True, clear=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        # addsitedir, not bare paths: their own .pth files (editable installs) count too.
        ours = [p for p in sys.path if p and Path(p).is_dir() and Path(p).name in ("site-packages", "dist-packages")]
        Path(site, "_running_interpreter.pth").write_text(f"import site; list(map(site.addsitedir, {ours!r}))\n")
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        for args in (["--no-deps", *SPECULATORS], SPECULATORS_NEEDS):
            done = subprocess.run(pip + args, capture_output=True, text=True)
            assert done.returncode == 0, f"installing {args} failed:\n{done.stderr[-2000:]}"
        done = subprocess.run(check, capture_output=True, text=True)
        assert done.returncode == 0, f"speculators does not import:\n{done.stderr[-2000:]}"
    return str(python)


def tiny_target():
    """A target whose width and vocabulary the reference drafter fits (6 layers, so its fused
    hidden states 1, 3 and 5 are three of the engine's taps)."""
    _, target = tiny_native("llama", seed=4, n_layers=6)
    return target


def test_speculators_checkpoint_gives_the_packages_draft_logits(speculators_python, tmp_path):
    script = Path(__file__).with_name("speculators_reference.py")
    done = subprocess.run([speculators_python, str(script), str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    ref = torch.load(tmp_path / "reference.pt")
    target = tiny_target()
    assert is_eagle3(tmp_path / "checkpoint")
    for native in (False, True):       # torch's kernels, then the native engine's
        drafter = Eagle3Drafter.load(tmp_path / "checkpoint", target, dtype=torch.float32)
        if native:
            drafter.pack("f32")
        check_draft_logits(drafter, ref, target, exact_fc=not native)
    # Its draft vocabulary maps through d2t to the target's ids.
    state = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    assert torch.equal(drafter.draft_ids, torch.arange(state["d2t"].numel()) + state["d2t"])


def check_draft_logits(drafter, ref, target, exact_fc: bool):
    """The drafter's logits at a first draft step and at a second that reads the first's
    outputs, against the package's (`ref`)."""
    assert drafter.taps == (0, 2, 4)            # hidden states 1, 3 and 5: outputs of layers 0, 2, 4
    n, dim = ref["tokens"].numel(), target.args.dim
    # The engine's rows (taps side by side, then the last layer) carry the fused states in order.
    last = torch.randn(n, dim)
    rows = torch.cat([ref["fused"], last], dim=-1)
    features = drafter.input_rows(rows)
    with torch.no_grad():
        torch.testing.assert_close(features, drafter.fc(ref["fused"]), rtol=0 if exact_fc else 1e-5,
                                   atol=0 if exact_fc else 1e-5)
        cache = drafter.new_cache(64)
        out1 = drafter(ref["tokens"], features, torch.arange(n), cache)
        cache.commit()
        logits1 = drafter.lm_head(drafter.head_input(out1))
        torch.testing.assert_close(logits1, ref["logits1"], rtol=1e-4, atol=1e-4)
        out2 = torch.empty_like(out1)
        for i in reversed(range(n)):       # row i writes slot i + 1, which no row before it reads
            cache.length, cache.pending = i + 1, 0
            out2[i] = drafter(ref["second"][i:i + 1], out1[i:i + 1], torch.tensor([i + 1]), cache,
                              tree_mask=torch.ones(1, 1, dtype=torch.bool))[0]
        logits2 = drafter.lm_head(drafter.head_input(out2))
    torch.testing.assert_close(logits2, ref["logits2"], rtol=1e-4, atol=1e-4)


def random_config(target, draft_vocab: int, aux=(1, 3, 5)) -> Eagle3Config:
    a = target.args
    return Eagle3Config(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                        intermediate_size=a.intermediate_size, n_layers=1, norm_eps=1e-6, rope_base=10000.0,
                        draft_vocab_size=draft_vocab, aux_layers=tuple(aux), target_dim=a.dim)


def test_layouts_round_trip(tmp_path):
    target = tiny_target()
    drafter = Eagle3Drafter.random(target, random_config(target, 150), seed=1)
    drafter.draft_ids.copy_(torch.randperm(200, generator=torch.Generator().manual_seed(2))[:150])
    drafter.save(tmp_path / "speculators", layout="speculators")
    sglang = Eagle3Drafter.load(tmp_path / "speculators", target)
    sglang.save(tmp_path / "sglang", layout="sglang")
    again = Eagle3Drafter.load(tmp_path / "sglang", target)
    assert json.loads((tmp_path / "sglang" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "midlayer.hidden_norm.weight" in load_file(str(tmp_path / "sglang" / "model.safetensors"))
    for a, b in zip(drafter.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    tokens, features = torch.randint(200, (5,)), torch.randn(5, target.args.dim)
    with torch.no_grad():
        want = drafter(tokens, features, torch.arange(5), drafter.new_cache(16))
        got = again(tokens, features, torch.arange(5), again.new_cache(16))
    assert torch.equal(want, got)


@pytest.fixture(scope="module")
def smollm2_eagle3(tmp_path_factory):
    """A random EAGLE-3 drafter for SmolLM2 in speculators' layout: 8k draft vocabulary."""
    from vocabspec.runtime.loading import load_model

    target, _ = load_model("smollm2")
    directory = tmp_path_factory.mktemp("eagle3-smollm2")
    config = random_config(target, 8192, aux=(2, 15, 27))
    config.intermediate_size = 1536
    drafter = Eagle3Drafter.random(target, config, seed=3)
    drafter.draft_ids.copy_(torch.arange(8192))
    drafter.save(directory, layout="speculators")
    return directory


@pytest.mark.parametrize("method,vocab", [("eagle", "full"), ("eagle3", "fr:4k"), ("eagle+pld", "trim:4k")])
def test_eagle3_drafting_gives_plain_decodings_tokens(smollm2_eagle3, method, vocab):
    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime."]
    plain = vocabspec.load("smollm2")
    drafted = vocabspec.load("smollm2", draft=method, path=str(smollm2_eagle3), vocab=vocab, depth=3,
                             top_k=4, total_tokens=8)
    for prompt in prompts:
        want = plain.generate(prompt, chat=True, max_new_tokens=40)
        got = drafted.generate(prompt, chat=True, max_new_tokens=40)
        assert got.tokens == want.tokens, f"{method} {vocab}: {prompt}"
    assert drafted.engine.proposer.draft_vocab.name.startswith(vocab.split(":")[0] if vocab != "full" else "eagle3")


# ---------------------------------------------------------------- training (eagle3_train.py)

def test_training_time_test_drafts_what_a_tree_drafts():
    """Step k of training-time test gives row i the state a tree's level-k node gets when it
    drafts the same chain at inference: the same attention, positions and features."""
    from vocabspec.training.eagle3_train import StepAttention, StepKeys

    target = tiny_target()
    drafter = Eagle3Drafter.random(target, random_config(target, 150), seed=5)
    tokens, features = torch.randint(200, (12,)), torch.randn(12, target.args.dim)
    steps, n = 3, 12 - 1 - 3
    with torch.no_grad():
        cache, chain = StepKeys(), [features[:n]]
        for k in range(steps):
            chain.append(drafter(tokens[1 + k:1 + k + n], chain[-1], torch.arange(n) + k, cache,
                                 tree_mask=StepAttention(k)))
        for i in (0, 3, n - 1):
            live = drafter.new_cache(32)
            state = drafter(tokens[1:2 + i], features[:i + 1], torch.arange(i + 1), live)[-1:]
            live.commit()
            torch.testing.assert_close(state, chain[1][i:i + 1], rtol=1e-5, atol=1e-5)
            for k in range(1, steps):       # a chain of tree nodes below position i
                mask = torch.ones(1, k, dtype=torch.bool)
                state = drafter(tokens[1 + i + k:2 + i + k], state, torch.tensor([i + k]), live,
                                tree_mask=mask)
                torch.testing.assert_close(state, chain[k + 1][i:i + 1], rtol=1e-5, atol=1e-5)


def test_eagle3_training_lowers_the_loss_resumes_and_saves_a_loadable_drafter(tmp_path, monkeypatch):
    from vocabspec.speculation import config as drafting_config
    from vocabspec.training import eagle3_train
    from vocabspec.training.train import TrainConfig, _atomic_save

    _, target = tiny_native("llama", seed=4, n_layers=8)   # fuses hidden states 2, 4, 5
    taps = (1, 3, 4)
    generator = torch.Generator().manual_seed(0)
    for part, count in (("train", 8), ("heldout", 2)):
        shard = {"tokens": [], "hidden": [], "candidates": [], "taps": list(taps), "tapped": []}
        for _ in range(count):
            ids = torch.randint(200, (20,), generator=generator)
            with torch.inference_mode():
                hidden, _, tapped = forward(target, ids, torch.arange(20), target.new_cache(20), logits_rows=[],
                                           taps=taps)
                candidates = torch.topk(target.lm_head(hidden), 8, dim=-1).indices
            shard["tokens"].append(ids.int())
            shard["hidden"].append(hidden.to(torch.bfloat16))
            shard["candidates"].append(candidates.int())
            shard["tapped"].append(tapped.to(torch.bfloat16))
        _atomic_save(shard, tmp_path / "features" / f"{part}-00000.pt")
    torch.save(torch.randperm(200, generator=generator), tmp_path / "token_map_trim.pt")
    monkeypatch.setattr(drafting_config, "bundled_drafter_dir", lambda name: tmp_path)
    cfg = TrainConfig.of(out=str(tmp_path), drafter="eagle3", taps="1,3,4", draft_vocab="trim:150", epochs=6,
                      accumulate=2, lr=3e-3, warmup_steps=2, checkpoint_every=6, max_steps=6,
                      snapshot_tokens="100,1M")
    reference = eagle3_train.new_drafter(target, eagle3_train.draft_vocabulary("trim:150", target, tmp_path), 0)

    def mean_loss(drafter):
        shards = torch.load(tmp_path / "features" / "train-00000.pt")
        with torch.no_grad():
            return sum(float(eagle3_train.sequence_loss(drafter, t, h, c, tp, 3)[0])
                       for t, h, c, tp in zip(shards["tokens"], shards["hidden"], shards["candidates"],
                                              shards["tapped"])) / 8
    before = mean_loss(reference)
    # Step k's loss weighs decay**k: a vanishing decay leaves the first step's loss alone (over
    # the rows that three steps train, as one step over the sequence two tokens shorter).
    shards = torch.load(tmp_path / "features" / "train-00000.pt")
    first = [shards[key][0] for key in ("tokens", "hidden", "candidates", "tapped")]
    with torch.no_grad():
        torch.testing.assert_close(eagle3_train.sequence_loss(reference, *first, 3, decay=1e-12)[0],
                                   eagle3_train.sequence_loss(reference, *(t[:-2] for t in first), 1)[0])
    drafter = eagle3_train.train(cfg, target, log=lambda *_: None)
    # The run as it stood once it had trained on 100 tokens: step 3, 2 sequences of 20 a step.
    kept = torch.load(tmp_path / "checkpoint-eagle3-at-100.pt")
    assert (kept["step"], kept["tokens"]) == (3, 120) and not list(tmp_path.glob("*-at-1M.pt"))
    eagle3_train.drafter_from_checkpoint(tmp_path / "checkpoint-eagle3-at-100.pt", target)
    cfg.optim.max_steps = 12                                     # resumes at step 6, not from scratch
    logs = []
    resumed = eagle3_train.train(cfg, target, log=logs.append)
    assert any("resuming from step 6" in line for line in logs)
    assert mean_loss(resumed) < mean_loss(drafter) < before
    report = {}
    cfg.optim.max_steps = 12
    eagle3_train.train_and_save(cfg, target, {}, report, ship=False, log=lambda *_: None)
    assert {"top1_step1", "top1_step2", "top1_step3"} <= set(report)
    loaded = Eagle3Drafter.load(tmp_path / "drafter", target)
    assert torch.equal(loaded.draft_ids, reference.draft_ids) and loaded.taps == taps
    # The last checkpoint holds the saved drafter (a run measured part of the way uses this), its
    # matrices written as the Q8_0 groups the engine drafts with.
    from vocabspec.runtime.formats import q8_0_float, q8_0_groups

    checkpointed = eagle3_train.drafter_from_checkpoint(tmp_path / "checkpoint-eagle3.pt", target).state_dict()
    saved = loaded.state_dict()
    assert checkpointed.keys() == saved.keys()
    grouped = [k for k in saved if not torch.equal(checkpointed[k], saved[k])]
    assert grouped and all(torch.equal(saved[k], q8_0_float(*q8_0_groups(checkpointed[k]))) for k in grouped)
    with pytest.raises(ValueError, match="--ship"):
        eagle3_train.train_and_save(cfg, target, {}, {}, ship=True, log=lambda *_: None)
    # The same shards serve an EAGLE-2 run (no taps: the last layer's states only), not other taps.
    from vocabspec.training.train import load_shards
    untapped = load_shards(TrainConfig.of(out=str(tmp_path), taps=""), "train")
    assert len(untapped) == 8 and all(tp is None for *_, tp in untapped)
    with pytest.raises(ValueError, match="holds taps"):
        load_shards(TrainConfig.of(out=str(tmp_path), taps="1,2,4"), "train")


def test_a_training_device_is_checked_before_any_work_and_a_run_resumes_on_another():
    from vocabspec.training.train import TrainConfig, _run_identity, check_device

    for bad in ("tpu", "gpu0"):
        with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
            check_device(TrainConfig.of(drafter="eagle3", device=bad), ("data", "train"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            check_device(TrainConfig.of(drafter="eagle3", device="cuda:99"), ("train",))
        with pytest.raises(ValueError, match="trains --drafter eagle3"):
            check_device(TrainConfig.of(drafter="eagle", device="cuda"), ("data", "train"))
        check_device(TrainConfig.of(drafter="eagle", device="cuda"), ("data", "features"))
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            check_device(TrainConfig.of(drafter="eagle3", device="cuda"), ("train",))
    check_device(TrainConfig.of(drafter="eagle", device="cpu"), ("train",))
    # A checkpoint written on one device resumes on another: the device is not the run's identity.
    assert _run_identity(TrainConfig.of(device="cpu").record()) == _run_identity(TrainConfig.of(device="cuda").record())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_time_test_loss_on_a_gpu_is_the_cpus():
    """The EAGLE-3 loss and its held-out agreement on a GPU, rows handed over on the CPU as
    features come, match the CPU's (float32: within rounding)."""
    from vocabspec.training.eagle3_train import evaluate, sequence_loss

    target = tiny_target()
    drafter = Eagle3Drafter.random(target, random_config(target, 150), seed=5, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(3):
        ids = torch.randint(200, (16,), generator=generator)
        with torch.inference_mode():
            hidden, _, tapped = forward(target, ids, torch.arange(16), target.new_cache(16), logits_rows=[], taps=(1, 3, 5))
            candidates = torch.topk(target.lm_head(hidden), 4, dim=-1).indices
        rows.append((ids.int(), hidden.clone(), candidates.int(), tapped.clone()))
    with torch.no_grad():
        on_cpu = [float(sequence_loss(drafter, *row, 3)[0]) for row in rows]
        held_cpu = evaluate(drafter, rows, 3)
        target.to("cuda"), drafter.to("cuda")
        on_gpu = [float(sequence_loss(drafter, *(t.cuda() for t in row), 3)[0]) for row in rows]
        held_gpu = evaluate(drafter, rows, 3)
    assert on_gpu == pytest.approx(on_cpu, rel=1e-4)
    assert held_gpu == held_cpu


def test_export_writes_an_eagle3_drafter_in_either_layout(smollm2_eagle3, tmp_path):
    from vocabspec.export import export
    from vocabspec.runtime.loading import load_model

    target, _ = load_model("smollm2")
    original = Eagle3Drafter.load(smollm2_eagle3, target, dtype=torch.bfloat16)
    for layout in ("sglang", "speculators"):
        export("smollm2", tmp_path / layout, draft_path=str(smollm2_eagle3), layout=layout)
        config = json.loads((tmp_path / layout / "config.json").read_text())
        assert ("speculators_model_type" in config) == (layout == "speculators")
        again = Eagle3Drafter.load(tmp_path / layout, target, dtype=torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ValueError, match="EAGLE-1/2"):
        export("smollm2", tmp_path / "y", layout="sglang")
    # Narrowed to the bundled VocabTrim map's first 2k tokens that its vocabulary holds, as Q8_0
    # groups (the bundle's form): the narrowed drafter's own head is that subset, its drafts those
    # of the subset head over the full drafter, its weights within Q8_0's rounding.
    export("smollm2", tmp_path / "narrow", draft_path=str(smollm2_eagle3), draft_vocab="trim:2k", q8_0=True)
    narrow = Eagle3Drafter.load(tmp_path / "narrow", target, dtype=torch.float32)
    subset = original.draft_vocab("trim:2k", Path(vocabspec.__file__).parent / "drafters" / "smollm2")
    assert narrow.config.draft_vocab_size == subset.size == 2048
    assert torch.equal(narrow.draft_ids, subset.draft_to_target)
    torch.testing.assert_close(narrow.lm_head.weight, subset.weight.float(), atol=0.02, rtol=0.02)
    torch.testing.assert_close(narrow.fc.weight, original.fc.weight.float(), atol=0.02, rtol=0.02)
    assert "fc.weight_scale" in load_file(str(tmp_path / "narrow" / "model.safetensors"))


def test_the_shipped_eagle3_drafter_is_smollm2s_default_and_gives_plain_decodings_tokens():
    """`eagle`, `eagle+pld` and `eagle3` draft with the shipped EAGLE-3 drafter; the eagle2 names
    and SpecVocab heads (trained on EAGLE-2's states) with the bundled EAGLE-2 drafter."""
    from vocabspec.speculation.config import (DraftConfig, bundled_drafter_dir, bundled_eagle3_dir,
                                              default_eagle_path)

    shipped = bundled_eagle3_dir("smollm2")
    assert shipped is not None and shipped.parent == bundled_drafter_dir("smollm2")
    assert default_eagle_path(DraftConfig(method="eagle"), "smollm2") == shipped
    assert default_eagle_path(DraftConfig(method="eagle3", vocab="trim:4k"), "smollm2") == shipped
    assert default_eagle_path(DraftConfig(method="eagle", vocab="spec:2048"), "smollm2") == bundled_drafter_dir("smollm2")
    assert default_eagle_path(DraftConfig(method="eagle"), "gemma3") == bundled_drafter_dir("gemma3")
    plain = vocabspec.load("smollm2")
    default = vocabspec.load("smollm2", draft="eagle", depth=4, top_k=8, total_tokens=16)
    eagle2 = vocabspec.load("smollm2", draft=DraftConfig.from_method("eagle2@4x16"))
    assert isinstance(default.engine.proposer.drafter, Eagle3Drafter)
    assert default.engine.proposer.draft_vocab.name.startswith("trim:")     # the shipped config's head
    assert not isinstance(eagle2.engine.proposer.drafter, Eagle3Drafter)
    for prompt in ["Write a Python function that reverses a string.", "Why do leaves change color?"]:
        want = plain.generate(prompt, chat=True, max_new_tokens=48)
        got = default.generate(prompt, chat=True, max_new_tokens=48)
        assert got.tokens == want.tokens, prompt
