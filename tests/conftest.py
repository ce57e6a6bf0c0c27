"""Shared fixtures: the two real bundled models (in the default weight format, or any format
through `loaded`) and tiny random models of both architectures. Real models load once per
test run; their dequantized and re-encoded weights are cached on disk."""

import json
import os
from pathlib import Path

import pytest
import torch

# Triton's kernels (kernels.py) run on the CPU under its interpreter, which must be chosen before
# anything imports triton (transformers may, through its integrations).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vocabspec.runtime.loading import load_model
from vocabspec.runtime.kv_cache import ancestor_mask
from vocabspec.runtime.model import ModelArgs, Transformer
from vocabspec.runtime.tokenizer import load_tokenizer
from vocabspec.runtime.torch_backend import TorchBackend

# Two threads a test process, or the cores' share of each where pytest-xdist runs several. The
# native engine's largest team is OpenMP's maximum at its first call: fixed first, at every core,
# so that its thread tests run here and its governor shares the cores with the other worker.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    from vocabspec.runtime import native

    if native.available()[0]:
        native.threads()
torch.set_num_threads(int(os.environ.get("VOCABSPEC_TEST_THREADS",
                                         max(1, min(2, (os.cpu_count() or 1) // _workers)))))

# The files whose tests take longest, started first so that pytest-xdist's workers (whole files
# each) end together instead of one finishing a long file alone.
LONGEST_FILES = ("test_lossless.py", "test_bf16.py", "test_sampling.py", "test_native.py", "test_graph_step.py",
                 "test_cli.py", "test_kernels.py", "test_scripts.py", "test_batch.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))    # stable: each file's order kept

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "question.jsonl"
# Spec-Bench's questions where they lie beside the repository, else the project's own prompts in
# the same categories and format (vocabspec/data/prompts.jsonl): every test runs on a lone clone.
QUESTIONS = SPEC_BENCH if SPEC_BENCH.exists() else \
    Path(__file__).resolve().parents[1] / "vocabspec" / "data" / "prompts.jsonl"


class Loaded:
    def __init__(self, name, weights="auto", backend="auto"):
        self.name = name
        self.model, self.path = load_model(name, weights=weights, backend=backend)
        self.tokenizer = load_tokenizer(self.path)

    def prompt_ids(self, text: str) -> list[int]:
        if self.tokenizer.chat_template:
            return self.tokenizer.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(f"Question: {text}\nAnswer:")


@pytest.fixture(scope="session")
def smollm2():
    return Loaded("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    return Loaded("gemma3")


@pytest.fixture(scope="session", params=["smollm2", "gemma3"])
def real_model(request):
    return request.getfixturevalue(request.param)


_LOADED = {}


def loaded(name: str, weights: str, backend: str = "auto") -> Loaded:
    """A real model in a given weight format (and backend), loaded once per test run: tests
    that share it must leave it as they found it."""
    if (name, weights, backend) not in _LOADED:
        _LOADED[(name, weights, backend)] = Loaded(name, weights, backend)
    return _LOADED[(name, weights, backend)]


def spec_bench_prompts() -> list[tuple[str, str]]:
    """One first-turn prompt per Spec-Bench category (13), read from ../shared by path; where
    that file is absent (a clone on its own), the project's own prompts in the same categories."""
    seen = {}
    for line in QUESTIONS.read_text().splitlines():
        q = json.loads(line)
        seen.setdefault(q["category"], q["turns"][0])
    return sorted(seen.items())


def tiny_args(arch: str, **overrides) -> ModelArgs:
    base = dict(arch=arch, vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                intermediate_size=48, norm_eps=1e-6, rope_base=10000.0, max_seq_len=256,
                eos_token_ids=[])
    if arch == "gemma3":
        base.update(sliding_window=6, sliding_window_pattern=2, query_pre_attn_scalar=8.0,
                    rope_base=1e6)
    base.update(overrides)
    return ModelArgs(**base)


def forward(model, tokens, positions, cache, tree_mask=None, logits_rows=None, all_logits=False, taps=(),
            parents=None):
    """One sequence's forward, (hidden, logits[, tapped]), on the reference model or a backend:
    its `tree_forward`, or a StepRows of one tree where `parents` are given (the reference model
    takes their ancestor mask), then its LM head over the rows asked for (`logits_rows`, every
    row with `all_logits`, else the last)."""
    if isinstance(model, Transformer):
        if parents is not None:
            assert not cache.pending, "a tree given by its parents sees every cached token"
            tree_mask = ancestor_mask(parents)
        hidden, tapped = model(tokens, positions, cache, tree_mask, taps)
    elif parents is not None:
        rows = model.run(tokens, cache, taps, parents)
        hidden, tapped = rows.hidden, rows.tapped
    else:
        hidden, tapped = model.tree_forward(tokens, positions, cache, tree_mask, taps)
    if all_logits:
        logits = model.lm_head(hidden)
    elif logits_rows is not None:
        logits = model.lm_head(hidden[logits_rows]) if len(logits_rows) else None
    else:
        logits = model.lm_head(hidden[-1:])
    return (hidden, logits, tapped) if taps else (hidden, logits)


def tiny_module(arch: str, seed: int = 0, **overrides) -> Transformer:
    """A tiny random reference model (the module)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_args(arch, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.5)
    return model.eval().requires_grad_(False)


def tiny_model(arch: str, seed: int = 0, **overrides) -> TorchBackend:
    """A tiny random model on torch's kernels (its module: `.module`)."""
    return TorchBackend(tiny_module(arch, seed, **overrides))


def tiny_native(arch: str, seed: int, weights: str = "f32", scale: float = 0.3, **overrides):
    """A random model whose shapes the native engine takes (widths multiples of 32), on torch's
    backend (the reference) and on the native engine: (reference, native). scale: the weights'
    (a smaller one spreads the next-token distributions)."""
    from vocabspec.runtime import formats
    from vocabspec.runtime.native_backend import NativeBackend

    shapes = dict(vocab_size=200, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=96)
    args = tiny_args(arch, **{**shapes, **overrides})
    torch.manual_seed(seed)
    reference = Transformer(args)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if name.endswith("norm.weight")
                    else torch.randn_like(p) * scale)
    reference.eval().requires_grad_(False)
    norms = {name: p for name, p in reference.named_parameters() if name.endswith("norm.weight")}
    return TorchBackend(reference), NativeBackend(args, formats.pack_module_weights(reference, weights), norms, weights)


@pytest.fixture(autouse=True)
def _busy_machine_never_retimes(monkeypatch):
    """A cached timing taken beside other work is timed again once the machine is quiet
    (machine_load.py); the other test worker makes every timing here look busy and its pauses
    quiet, so no test's cache would stay put. The one test of that rule sets the machine's state."""
    import vocabspec.tuning.autotune as autotune

    monkeypatch.setattr(autotune, "machine_is_quiet", lambda seconds=None: False)
