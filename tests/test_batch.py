"""Serving many requests at once, each answer bit-identical to serving it alone.

- The batched forward: rows of several sequences in one native call, each over its own cache,
  get the bits their sequence gets alone: every format, both models, sequences of different
  lengths, trees and single rows, and Gemma past its 512-token sliding window.
- A single request is a batch of one: the engine's one-slot batch steps it.
- Continuous batching: requests joining and leaving a running batch, greedy and seeded
  sampling, drafted and plain, get exactly the tokens `generate` gives each alone; a cancelled
  request frees its slot; a full engine refuses with Busy; the speculation budget keeps
  greedy answers and never touches sampled ones; a request whose drafting fails ends alone, and
  so does one that cannot start; a loop that fails anyway answers every request with its error.
"""

import time

import pytest
import torch

import vocabspec
from vocabspec.decoding.batch import BatchEngine, BatchLimits, Busy, Engine, Stopped
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.runtime.loading import load_model
from vocabspec.runtime.step_rows import StepRows
from vocabspec.speculation.sampling import SamplingParams
from vocabspec.speculation.tree import chain

from test_native import random_tree

FORMATS = ["gguf", "gguf-a8", "bf16", "f32"]


def committed(model, context: list[int], max_len: int):
    cache = model.new_cache(max_len)
    with torch.inference_mode():
        model.tree_forward(torch.tensor(context), torch.arange(len(context)), cache)
    cache.commit()
    return cache


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("weights", FORMATS)
def test_batched_rows_have_the_bits_of_each_sequence_alone(name, weights):
    from vocabspec.runtime import native

    if weights == "gguf-a8" and not native.has_int8():
        pytest.skip("gguf-a8 needs 8-bit dot products")
    model, _ = load_model(name, weights=weights)
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(5)
    # Contexts of different lengths (Gemma's 600 past its window), each followed by a tree, a
    # single row, or a causal run of rows.
    lengths = [37, 600, 5, 180] if name == "gemma3" else [37, 250, 5, 180]
    items = []
    for index, length in enumerate(lengths):
        cache = committed(model, torch.randint(3, 20000, (length,), generator=g).tolist(), 1024)
        if index % 2 == 0:
            tree = random_tree(vocab, 6 + 3 * index, seed=index)
            items.append((tree.tokens, tree.positions(length), cache, tree.parents))
        else:
            tree = chain(int(torch.randint(vocab, (1,), generator=g)), [])
            items.append((tree.tokens, tree.positions(length), cache, None))
    taps = (1, model.args.n_layers // 2)            # a fused-feature drafter's layers, too

    def step(order):
        rows = StepRows(taps=taps)
        for tokens, positions, cache, parents in order:
            rows.add(tokens, cache, parents, positions)
        model.forward(rows)
        for span in rows.spans:
            span.cache.discard()
        return [(rows.hidden_of(span), rows.tapped_of(span, taps)[0]) for span in rows.spans]

    with torch.inference_mode():
        together = step(items)
        for (tokens, positions, cache, parents), (rows, layers) in zip(items, together):
            alone = model.run(tokens, cache, taps, parents)
            cache.discard()
            assert torch.equal(alone.hidden, rows), (name, weights, tokens.numel())
            assert torch.equal(alone.tapped, layers), (name, weights, tokens.numel())
        # And in another order, beside other items: still the same bits.
        for (rows, _), (want, _) in zip(step(items[::-1]), together[::-1]):
            assert torch.equal(rows, want)


@pytest.fixture(scope="module")
def lms():
    """SmolLM2 drafting with EAGLE-2 on a small fixed tree and with prompt lookup."""
    return {"eagle": vocabspec.load("smollm2", draft="eagle", depth=2, total_tokens=3, max_seq_len=1024),
            "pld": vocabspec.load("smollm2", draft="pld", max_seq_len=1024)}


PROMPTS = ["Name three colours of the rainbow.", "Write a haiku about rain.",
           "What is the capital of Italy? Answer in one sentence.", "Count from one to ten in words.",
           "Explain why the sea is salty.", "List two uses of copper."]


def requests():
    """Greedy and seeded sampling, drafted and plain, of several lengths."""
    out = []
    for index, prompt in enumerate(PROMPTS):
        sampling = SamplingParams() if index % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9, seed=index)
        out.append((prompt, GenerationConfig(max_new_tokens=12 + 9 * index, sampling=sampling), index % 3 != 2))
    return out


@pytest.mark.parametrize("method", ["eagle", "pld"])
def test_continuous_batching_gives_each_request_its_tokens_alone(lms, method):
    lm = lms[method]
    batch = BatchEngine(lm.engine.model, lm.tokenizer, lambda: vocabspec.tuning.proposers.make_proposer(
        lm.engine.model, lm.draft, "smollm2", tokenizer=lm.tokenizer),
        BatchLimits(max_batch=3, window=1024, tree_rows=8))
    try:
        submitted = []
        for prompt, config, draft in requests():     # six requests for three slots: joins and leaves
            ids = lm.encode_prompt(prompt, chat=True)
            submitted.append((ids, config, draft, batch.submit(ids, config, draft)))
        for ids, config, draft, request in submitted:
            result = request.wait(120)
            # Alone on the calling thread while the batch may still run: the model's lock
            # keeps their steps apart.
            plain = Engine(lm.engine.model, lm.tokenizer)
            alone = (lm.engine if draft else plain).generate(ids, GenerationConfig(
                max_new_tokens=config.max_new_tokens, sampling=config.sampling))
            assert result.tokens == alone.tokens, (method, config.sampling, draft)
            assert result.stop_reason in ("length", "eos")
        assert batch.steps < sum(len(r.result.steps) for *_, r in submitted)     # steps were shared
        drafted = [r.result for _, c, d, r in submitted if d]
        assert max(s.tree_size for result in drafted for s in result.steps) > 0
    finally:
        batch.close()


def test_a_single_request_is_a_batch_of_one(lms):
    """`generate` and `stream` step the engine's one-slot batch (the one loop), with the tree
    the user chose at every step; a stream abandoned part way frees the slot; a second stream
    while one runs is refused."""
    lm = lms["eagle"]
    ids = lm.encode_prompt(PROMPTS[0], chat=True)
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    before = lm.engine.steps
    result = lm.engine.generate(ids, config)
    assert lm.engine.steps - before == len(result.steps)
    assert all(step.tree_size > 0 for step in result.steps)
    # Each step's verification time holds its target forward's, timed on its own.
    assert all(0 < step.forward_seconds < step.verify_seconds for step in result.steps)
    pieces = iter(lm.engine.stream(ids, config))
    assert next(pieces)
    with pytest.raises(RuntimeError, match="another generation"):
        next(iter(lm.engine.stream(ids, GenerationConfig(max_new_tokens=3))))
    pieces.close()
    assert lm.engine.generate(ids, config).tokens == result.tokens


def test_a_cancelled_request_frees_its_slot_and_a_full_engine_refuses(lms):
    lm = lms["pld"]
    batch = BatchEngine(lm.engine.model, lm.tokenizer, None, BatchLimits(max_batch=1, max_waiting=1, window=512))
    try:
        ids = lm.encode_prompt("Tell me a long story about a lighthouse.", chat=True)
        config = GenerationConfig(max_new_tokens=400, stop_on_eos=False)
        first = batch.submit(ids, config)
        deadline = time.monotonic() + 30
        while not batch.waiting.empty() and time.monotonic() < deadline:     # until it holds the slot
            time.sleep(0.01)
        second = batch.submit(ids, GenerationConfig(max_new_tokens=3))
        with pytest.raises(Busy, match="slots"):
            batch.submit(ids, GenerationConfig(max_new_tokens=3))
        first.cancel.set()
        assert first.wait(30).stop_reason == "cancelled"
        assert second.wait(30).new_tokens == 3          # took the freed slot
        with pytest.raises(ValueError, match="window"):
            batch.submit(ids, GenerationConfig(max_new_tokens=500))
        with pytest.raises(ValueError, match="empty"):
            batch.submit([], GenerationConfig(max_new_tokens=3))
    finally:
        batch.close()


def test_generate_batch_and_the_jsonl_command(lms, tmp_path):
    import json

    from vocabspec.cli import main

    lm = lms["pld"]
    results = lm.generate_batch(PROMPTS[:3], chat=True, max_new_tokens=10)
    assert [r.tokens for r in results] == [lm.generate(p, chat=True, max_new_tokens=10).tokens for p in PROMPTS[:3]]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(item) for item in [
        {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_new_tokens": 6},
        {"prompt": "Once upon a time", "max_new_tokens": 5, "temperature": 0.7, "seed": 3}]))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--input", str(source), "--output", str(out), "--max-batch", "2",
                 "--max-seq-len", "1024"]) == 0
    # Lines come in finish order, each with its request's index.
    answers = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda a: a["index"])
    assert [a["index"] for a in answers] == [0, 1] and answers[0]["new_tokens"] == 6
    assert answers[0]["tokens"] == lm.generate(PROMPTS[0], chat=True, max_new_tokens=6).tokens
    assert answers[1]["tokens"] == lm.generate("Once upon a time", max_new_tokens=5, temperature=0.7,
                                               seed=3).tokens
    source.write_text(json.dumps({"prompt": "hi", "frobnicate": 1}))
    assert main(["generate", "--input", str(source)]) == 2


def test_the_serving_benchmark_measures_batches_with_the_openai_client(tmp_path):
    """`vocabspec bench --throughput`: concurrent official-openai clients against the server,
    every answer compared with the same request answered by one client alone."""
    import json

    from vocabspec.cli import main

    out = tmp_path / "serving"
    assert main(["bench", "--model", "smollm2", "--methods", "vanilla,pld", "--throughput", "1,3",
                 "--requests-per-client", "2", "--max-new-tokens", "12", "--per-category", "1",
                 "--out", str(out)]) == 0
    result = json.loads((out / "throughput.json").read_text())
    assert set(result["methods"]) == {"vanilla", "pld"}
    for data in result["methods"].values():
        assert [row["concurrency"] for row in data["points"]] == [1, 3]
        assert all(row["tokens"] > 0 and row["answers_differing_from_alone"] == 0 for row in data["points"])
        assert data["points"][1]["requests"] >= 6
    assert (out / "throughput.png").stat().st_size > 1000
    assert "| pld | 3 |" in (out / "report.md").read_text()


def test_the_draft_budget_follows_the_cost_curve(lms):
    """Rows nearly free (a GPU's curve): every greedy request drafts. Each row a whole forward's
    cost: none does, a drafted tree never paying for its rows. Rows free but each head row a
    forward's cost (a huge vocabulary's head): none does either, a tree's head rows counted
    beside the plain requests' one each. Tokens as alone either way."""
    from vocabspec.decoding.cost_curve import Costs

    lm = lms["eagle"]
    batch = BatchEngine(lm.engine.model, lm.tokenizer, lambda: vocabspec.tuning.proposers.make_proposer(
        lm.engine.model, lm.draft, "smollm2", tokenizer=lm.tokenizer), BatchLimits(max_batch=3, window=1024),
        thread=False)
    assert batch.costs is not None and batch.costs(1) > 0      # measured on this machine
    ids = [lm.encode_prompt(p, chat=True) for p in PROMPTS[:3]]
    config = GenerationConfig(max_new_tokens=16)
    alone = [lm.engine.generate(i, config).tokens for i in ids]
    try:
        free_rows_costly_head = Costs({1: 1.0, 64: 1.0}, head={1: 1.0, 64: 64.0}, head_rows=4)
        # c(rows, head rows): the forward's curve less the head rows it scored, plus the batch's.
        assert free_rows_costly_head(9, 8) == 1.0 - 4.0 + 8.0 and free_rows_costly_head(9) == 1.0
        assert free_rows_costly_head.head_pass() == 4.0 and Costs({1: 1.0}).head_pass() == 0.0
        for curve, drafts in ((Costs({1: 1.0, 64: 1.0}), True), (Costs({1: 1.0, 2: 2.0}), False),
                              (free_rows_costly_head, False)):
            batch.costs = curve
            before = batch.stats()
            assert [r.tokens for r in batch.generate(ids, config)] == alone
            after = batch.stats()
            assert (after["drafted"] > before["drafted"]) == drafts
            if drafts:     # every request, every step while the three run together
                assert after["rows"] - before["rows"] > after["steps"] - before["steps"]
    finally:
        batch.close()


def test_a_request_whose_drafting_fails_ends_alone():
    """A proposer that raises or drafts a tree that cannot be verified (a token outside the
    vocabulary, another root, a parent after its child, more rows than the cache holds) ends
    its own request with DraftingFailed naming the fault; the requests beside it in the same
    steps get plain decoding's tokens. Tiny native target, EAGLE-2 drafters."""
    from dataclasses import replace as swap

    from conftest import tiny_native
    from vocabspec.speculation.vocab.draft_vocab import FullVocab
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer
    from vocabspec.speculation.proposer import DraftingFailed

    _, model = tiny_native("llama", seed=3)
    drafter = EagleDrafter.random(model, seed=2)
    drafter.pack("f32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 30, 4)]
    config = GenerationConfig(max_new_tokens=20)
    plain = [Engine(model).generate(p, config).tokens for p in prompts]

    def boom(tree):
        raise RuntimeError("the drafter broke")

    faults = {"raises": (boom, "the drafter broke"),
              "token": (lambda t: swap(t, tokens=torch.cat([t.tokens[:-1], torch.tensor([999])])),
                        "drafted token id 999"),
              "root": (lambda t: swap(t, tokens=torch.cat([(t.tokens[:1] + 1) % 200, t.tokens[1:]])), "root"),
              "parent": (lambda t: swap(t, parents=torch.cat([t.parents[:-1], torch.tensor([t.parents.numel()])])),
                         "is not an earlier row"),
              "rows": (lambda t: chain(int(t.tokens[0]), [1] * 300), "room")}
    for name, (fault, message) in faults.items():
        bad = prompts[1]

        def make():
            proposer = EagleProposer(drafter, FullVocab(model.packed_head), depth=3, top_k=4, total_tokens=8)
            propose, reset = proposer.propose, proposer.reset
            state = {"bad": False, "trees": 0}

            def reset_watching(prompt_ids, hidden, first_token):
                state.update(bad=prompt_ids == bad, trees=0)
                reset(prompt_ids, hidden, first_token)

            def propose_or_break(root):
                tree = propose(root)
                state["trees"] += state["bad"]
                return fault(tree) if state["trees"] == 3 else tree

            proposer.reset, proposer.propose = reset_watching, propose_or_break
            return proposer

        batch = BatchEngine(model, None, make, BatchLimits(max_batch=3, window=256, tree_rows=27), thread=False)
        requests = [batch.submit(p, config) for p in prompts]
        batch.run(until=lambda: all(r.done.is_set() for r in requests))
        batch.close()
        with pytest.raises(DraftingFailed, match=message):
            requests[1].wait(0)
        assert len(requests[1].result.tokens) < 20, name          # it ended early, in its third step
        assert [requests[0].wait(0).tokens, requests[2].wait(0).tokens] == [plain[0], plain[2]], name


def test_a_request_that_cannot_start_ends_alone(monkeypatch):
    """A request whose admission raises (here its sampling generator) ends with that error; the
    requests admitted beside it get their tokens alone, and the loop steps on."""
    from conftest import tiny_native
    from vocabspec.decoding import generate

    _, model = tiny_native("llama", seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 30, 4)]
    configs = [GenerationConfig(max_new_tokens=12),
               GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.8, seed=13)),
               GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.8, seed=14))]
    alone = [Engine(model).generate(p, c).tokens for p, c in zip(prompts, configs)]
    make_generator = generate.make_generator

    def breaking(seed, device):
        if seed == 13:
            raise RuntimeError("no generator for this one")
        return make_generator(seed, device)

    monkeypatch.setattr(generate, "make_generator", breaking)
    batch = BatchEngine(model, None, None, BatchLimits(max_batch=3, window=256), thread=False)
    requests = [batch.submit(p, c) for p, c in zip(prompts, configs)]
    batch.run(until=lambda: all(r.done.is_set() for r in requests))
    with pytest.raises(RuntimeError, match="no generator"):
        requests[1].wait(0)
    assert [requests[0].wait(0).tokens, requests[2].wait(0).tokens] == [alone[0], alone[2]]
    assert batch.died is None and not batch.unanswered
    later = batch.submit(prompts[0], configs[0])
    batch.run(until=later.done.is_set)
    assert later.wait(0).tokens == alone[0]
    batch.close()


def test_a_loop_that_fails_answers_every_request_and_stops():
    """Should the loop itself raise, every request gets the error (the one decoding, one taken
    from the queue into no slot, one still queued), `run` raises it, and the engine refuses
    more: nobody waits for an answer that will not come."""
    from conftest import tiny_native

    _, model = tiny_native("llama", seed=3)
    batch = BatchEngine(model, None, None, BatchLimits(max_batch=1, max_waiting=4, window=256), thread=False)
    take = batch._take_waiting
    admissions = []

    def take_then_break():
        admissions.append(len(admissions))
        if len(admissions) == 1:
            return take()                   # the first request takes the slot
        batch.waiting.get_nowait()          # the next leaves the queue and sits in no slot...
        raise SystemError("the loop broke")  # ...as the loop fails

    batch._take_waiting = take_then_break
    config = GenerationConfig(max_new_tokens=50, stop_on_eos=False)
    requests = [batch.submit([5, 6, 7], config) for _ in range(3)]
    with pytest.raises(SystemError, match="the loop broke"):
        batch.run()
    assert all(r.done.is_set() for r in requests)
    for request in requests:
        with pytest.raises(Stopped, match="loop failed: SystemError"):
            request.wait(0)
    assert isinstance(batch.died, SystemError) and not batch.unanswered
    with pytest.raises(Stopped, match="loop failed"):
        batch.submit([5, 6, 7], config)
