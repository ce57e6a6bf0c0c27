"""The batch engine's requests on torch's kernels as rows of one forward over a slot table
(torch_backend.py, runtime/slots.py), in float32 on the CPU: every greedy answer is the one plain
decoding of the request alone gives; every seeded sampled answer the one serving it alone
draws, and the draws follow the target's distribution; slots are sized from free memory, a
request that cannot fit is refused, and `generate --input --backend torch --allow-inexact`
runs here and records how many answers served alone again differ.

In float32 on these models the rows batched together round like rows alone closely enough that
every token agrees, so the tests ask for equal tokens; in bfloat16 (a GPU's run) they need
not agree, which is why the path needs --allow-inexact. On the row-invariant kernels (Triton's
interpreter here) the rows are exact: the same bits as each request's forward alone, and the
batch engine steps them without --allow-inexact.
"""

import json

import pytest
import torch

from conftest import tiny_model
from vocabspec.runtime import kernels
from vocabspec.runtime import slots as slot_forwards
from vocabspec.runtime.kernel_backend import KernelBackend
from vocabspec.decoding.batch import BatchEngine, BatchLimits, Engine
from vocabspec.decoding.generate import GenerationConfig
from vocabspec.speculation.families.pld import PromptLookupProposer
from vocabspec.speculation.sampling import SamplingParams, target_probs


def prompts_of(lengths, seed=0, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_and_seeded_answers_are_each_requests_alone(arch):
    """Six requests through three slots (refilled as answers end, free slots between running
    ones), greedy and seeded sampling with their own settings, an end-of-sequence token, and
    Gemma's sliding window of 6 passed: each answer is the one the request gets served alone."""
    model = tiny_model(arch, seed=4, eos_token_ids=[5])
    engine = Engine(model, allow_inexact=True)
    prompts = prompts_of([3, 17, 9, 12, 5, 8])
    configs = [GenerationConfig(max_new_tokens=n) for n in (8, 3, 10)] + [
        GenerationConfig(max_new_tokens=8, sampling=SamplingParams(temperature=t, top_k=k, top_p=p, seed=s))
        for t, k, p, s in ((1.3, 20, 1.0, 2), (1.0, 0, 0.9, 3), (0.7, 1, 1.0, 4))]
    batch = BatchEngine(model, None, None, BatchLimits(max_batch=3, window=64), allow_inexact=True, thread=False)
    assert batch.together and len(batch.slots) == 3
    together = batch.generate(prompts, configs)
    alone = [engine.generate(p, c) for p, c in zip(prompts, configs)]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.stop_reason for r in together] == [r.stop_reason for r in alone]
    assert batch.rows > 2 * batch.steps   # rows shared steps
    # top_k=1 sampling is greedy decoding, whatever its seed.
    greedy = engine.generate(prompts[5], GenerationConfig(max_new_tokens=8))
    assert together[5].tokens == greedy.tokens


def test_greedy_rows_end_and_refill_as_alone():
    """All greedy: answers ending at end-of-sequence tokens and at their lengths (one of a
    single token), slots refilled: each answer the request's alone, and so when a sampled
    request joins the greedy ones mid-run."""
    model = tiny_model("llama", seed=2, eos_token_ids=[5, 9, 11, 20, 33])
    engine = Engine(model, allow_inexact=True)
    prompts = prompts_of([3, 17, 9, 30, 5, 12, 8, 4], seed=1)
    configs = [GenerationConfig(max_new_tokens=n) for n in (12, 3, 20, 7, 1, 9, 15, 2)]
    batch = BatchEngine(model, None, None, BatchLimits(max_batch=4, window=64), allow_inexact=True, thread=False)
    for configs in (configs, configs[:5] + [GenerationConfig(max_new_tokens=9, sampling=SamplingParams(
            temperature=1.0, seed=3))] + configs[6:]):
        together = batch.generate(prompts, configs)
        alone = [engine.generate(p, c) for p, c in zip(prompts, configs)]
        assert [(r.tokens, r.stop_reason) for r in together] == [(r.tokens, r.stop_reason) for r in alone]
        assert {r.stop_reason for r in together} == {"eos", "length"}


def test_sampled_first_tokens_follow_the_targets_distribution():
    """Four hundred requests of one prompt, each seeded differently, prefilled and sampled
    together: their first tokens' frequencies match the target's probabilities (total variation
    within what 400 draws allow)."""
    model = tiny_model("llama", seed=7)
    prompt = prompts_of([6], seed=3)[0]
    params = SamplingParams(temperature=2.0, seed=0)
    configs = [GenerationConfig(max_new_tokens=1, sampling=SamplingParams(temperature=2.0, seed=s))
               for s in range(400)]
    batch = BatchEngine(model, None, None, BatchLimits(max_batch=400, window=16), allow_inexact=True, thread=False)
    firsts = [r.tokens[0] for r in batch.generate([prompt] * 400, configs)]
    hidden, _ = model.module(torch.tensor(prompt), torch.arange(len(prompt)), model.new_cache(16))
    probs = target_probs(model.lm_head(hidden[-1:]), params)[0]
    counts = torch.bincount(torch.tensor(firsts), minlength=probs.numel()).float() / 400
    assert 0.5 * float((counts - probs).abs().sum()) < 0.2
    assert len(set(firsts)) > 5


def test_slots_fit_free_memory_and_a_request_that_cannot_fit_is_refused(monkeypatch):
    """Memory for two slots: the engine runs two, and five requests wait their turn; memory for
    none: the engine refuses to start, naming the sizes; a prompt and answer longer than a
    slot's window is refused when submitted. Without --allow-inexact, every request keeps the
    per-request step (answers exactly as alone), and a drafted request keeps it beside rows."""
    model = tiny_model("llama", seed=2)
    engine = Engine(model, allow_inexact=True)
    per_slot = slot_forwards.SlotCache.bytes_per_slot(model, 32)
    monkeypatch.setattr(slot_forwards, "free_memory", lambda device: 4 * per_slot + 1)
    batch = BatchEngine(model, None, None, BatchLimits(max_batch=8, window=32), allow_inexact=True, thread=False)
    assert len(batch.slots) == 2
    prompts, config = prompts_of([4, 7, 5, 9, 3], seed=1), GenerationConfig(max_new_tokens=6)
    assert [r.tokens for r in batch.generate(prompts, config)] == \
        [engine.generate(p, config).tokens for p in prompts]
    with pytest.raises(ValueError, match="exceed the context window of 32 tokens"):
        batch.submit(list(range(6, 26)), GenerationConfig(max_new_tokens=20))
    monkeypatch.setattr(slot_forwards, "free_memory", lambda device: per_slot)
    with pytest.raises(ValueError, match=r"a slot of 32 positions needs .* MiB free on cpu holds none"):
        BatchEngine(model, None, None, BatchLimits(max_batch=8, window=32), allow_inexact=True, thread=False)
    monkeypatch.undo()
    assert not BatchEngine(model, None, None, BatchLimits(max_batch=2, window=32), thread=False).together

    mixed = BatchEngine(model, None, PromptLookupProposer, BatchLimits(max_batch=4, window=64, tree_rows=16),
                        allow_inexact=True, thread=False)
    looped = [p * 3 for p in prompts_of([4, 5], seed=6)]           # something to look up
    requests = [mixed.submit(p, GenerationConfig(max_new_tokens=10), draft=d)
                for p, d in zip(looped + looped, (True, True, False, False))]
    while not all(r.done.is_set() for r in requests):
        mixed.run_once()
    assert mixed.drafted > 0 and mixed.together and mixed.rows > mixed.steps
    assert [r.wait().tokens for r in requests[2:]] == \
        [engine.generate(p, GenerationConfig(max_new_tokens=10)).tokens for p in looped]


def test_generate_input_on_torch_runs_rows_together_and_records_the_alone_check(tmp_path, capsys, monkeypatch):
    """`vocabspec generate --input --backend torch --allow-inexact`: the plain requests step
    through batched rows, and the job's record and summary say how many answers served alone
    again differ (none, in float32)."""
    from vocabspec.cli import main
    from vocabspec.runtime.torch_backend import TorchBackend

    rows = []
    step = TorchBackend._forward_slots
    monkeypatch.setattr(TorchBackend, "_forward_slots",
                        lambda self, step_rows, table: rows.append(len(step_rows.spans)) or step(self, step_rows, table))
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    items = [{"prompt": "Say hi."}, {"prompt": "Count to three.", "temperature": 0.8, "seed": 5}]
    source.write_text("".join(json.dumps(item) + "\n" for item in items))
    assert main(["generate", "--input", str(source), "--output", str(out), "--backend", "torch",
                 "--weights", "f32", "--allow-inexact", "--max-seq-len", "128", "--max-new-tokens", "4",
                 "--max-batch", "2", "--progress-every", "0"]) == 0
    assert rows and max(rows) == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == [0, 1]
    assert all("error" not in line and line["runs_on"].startswith("torch") for line in lines)
    record = json.loads((tmp_path / "answers.jsonl.job.json").read_text())
    assert record["alone_check"] == {"answers": 2, "differ": 0, "of": 2}
    assert "0 of 2 answers served alone again differ" in capsys.readouterr().err


def test_the_server_on_torch_steps_concurrent_requests_as_rows_together():
    """`serve` on torch's kernels with inexact answers allowed: concurrent chat requests step
    as batched rows, each answer the one the request gets alone (a tiny random model with
    SmolLM2's tokenizer: the serving path, not the answers' sense, is under test)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from vocabspec.runtime.loading import resolve_model_path
    from vocabspec.runtime.tokenizer import load_tokenizer
    from vocabspec.serving.api import LanguageModel
    from vocabspec.serving.server import HTTPThread, ServerLimits, create_app

    tokenizer = load_tokenizer(resolve_model_path("smollm2"))
    model = tiny_model("llama", seed=3, vocab_size=tokenizer.vocab_size, max_seq_len=256)
    lm = LanguageModel(Engine(model, tokenizer, allow_inexact=True), "tiny")
    app = create_app(lm, "tiny", ServerLimits(max_batch=4, window=128, max_queue=8, max_tokens_cap=16))
    http = HTTPThread(app)
    base = http.wait_ready()
    texts = ["Say hi.", "Name a colour.", "What is 2 + 2?", "Name a fruit."]

    def ask(text):
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 10,
                "temperature": 0}
        return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)

    try:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, texts))
    finally:
        http.stop(10)
        app.state.server.batch.close()
    assert [reply.status_code for reply in replies] == [200] * 4
    assert app.state.server.batch.together and app.state.server.batch.rows > app.state.server.batch.steps
    assert [reply.json()["choices"][0]["message"]["content"] for reply in replies] == \
        [lm.generate(text, chat=True, max_new_tokens=10).text for text in texts]


needs_kernels = pytest.mark.skipif(not kernels.available()[0], reason=kernels.available()[1])


@needs_kernels
def test_on_the_row_invariant_kernels_rows_are_each_requests_alone_bit_for_bit():
    """The row-invariant kernels, a tiny Gemma 3 whose one layer slides over 6 positions: three
    prompts prefilled together into slots out of order (padded to the longest), then decode
    steps of all three rows, every row's logits the bits of its request's own forward alone."""
    model = KernelBackend(tiny_model("gemma3", seed=4, n_layers=1, vocab_size=32, intermediate_size=32).module)
    prompts = prompts_of([3, 11, 8], seed=2, vocab=32)
    cache = slot_forwards.SlotCache(model, slots=4, window=24)
    slots = torch.tensor([2, 0, 3])
    logits = slot_forwards.prefill_slots(model, cache, prompts, slots=slots)
    step = slot_forwards.DecodeStep(model, cache, head=False)
    alone = [model.new_cache(24) for _ in prompts]
    tokens, positions = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        own = model.lm_head(model.tree_forward(torch.tensor(prompt), torch.arange(len(prompt)), alone[i])[0][-1:])
        alone[i].commit()
        assert torch.equal(logits[i], own[0]), f"prompt {i}"
        tokens[slots[i]], positions[slots[i]] = int(own[0].argmax()), len(prompt)
    for _ in range(2):
        logits = model.lm_head(step(tokens, positions, int(positions.max()) + 1))
        for i, slot in enumerate(slots.tolist()):
            own = model.lm_head(model.tree_forward(tokens[slot:slot + 1], positions[slot:slot + 1], alone[i])[0])
            alone[i].commit()
            assert torch.equal(logits[slot], own[0]), f"prompt {i}"
        tokens, positions = logits.argmax(-1), positions + 1


@needs_kernels
def test_on_the_row_invariant_kernels_the_batch_steps_rows_exactly_without_allow_inexact():
    """`--backend triton`'s kernels, no --allow-inexact: plain requests step as batched rows (two
    slots, four requests of different lengths, refilled as answers end, greedy beside sampled),
    and every answer, greedy or seeded sampling, its logprobs included, is the one plain decoding
    of the request alone gives, bit for bit. Asked for batched rows on torch's kernels without
    --allow-inexact, the engine refuses."""
    model = KernelBackend(tiny_model("llama", seed=3, n_layers=1, vocab_size=32, intermediate_size=32).module)
    engine = Engine(model)
    prompts = prompts_of([3, 11, 7, 9], seed=0, vocab=32)
    configs = [GenerationConfig(max_new_tokens=8), GenerationConfig(max_new_tokens=3),
               GenerationConfig(max_new_tokens=6, sampling=SamplingParams(temperature=1.3, top_k=20, seed=2)),
               GenerationConfig(max_new_tokens=5, logprobs=2)]
    batch = BatchEngine(model, None, None, BatchLimits(max_batch=2, window=32), thread=False)
    assert batch.together and model.exact and len(batch.slots) == 2
    together = batch.generate(prompts, configs)
    alone = [engine.generate(p, c) for p, c in zip(prompts, configs)]     # plain decoding, alone
    assert [(r.tokens, r.stop_reason) for r in together] == [(r.tokens, r.stop_reason) for r in alone]
    assert together[3].logprobs == alone[3].logprobs
    assert batch.rows > batch.steps   # rows shared steps

    with pytest.raises(ValueError, match="round each row differently.*--backend triton"):
        BatchEngine(tiny_model("llama", seed=4), None, None, BatchLimits(max_batch=2, window=32, batched=True),
                    thread=False)


@needs_kernels
def test_on_the_row_invariant_kernels_a_tree_in_a_slot_has_the_bits_of_its_forward_alone(monkeypatch):
    """A drafted request keeps its keys in a slot (`SlotSequence`): its prompt run there by the
    model's own forward, then a branching tree beside two plain rows in one forward, a path
    off the tree's first branch committed (its keys moved down in the slot), then its next root
    beside them again. A tiny Gemma 3 whose one layer slides over 6 positions: every row's
    hidden state is the bits of its request's forward alone, tree and commit included. The
    slot rows take the fused kernels a forward alone takes (the query/key norms, rotary and
    cache write in one kernel, each row's key written into its own slot)."""
    from vocabspec.runtime.kv_cache import ancestor_mask

    fused = []
    write = kernels.head_norm_rope_cache
    monkeypatch.setattr(kernels, "head_norm_rope_cache", lambda *a, **kw: fused.append(a[0].shape[0]) or
                        write(*a, **kw))
    model = KernelBackend(tiny_model("gemma3", seed=4, n_layers=1, vocab_size=32, intermediate_size=32).module)
    cache = slot_forwards.SlotCache(model, slots=3, window=24)
    plain = prompts_of([4, 9], seed=1, vocab=32)
    logits = slot_forwards.prefill_slots(model, cache, plain, slots=torch.tensor([0, 2]))
    drafted, own = slot_forwards.SlotSequence(cache, 1), model.new_cache(24)
    prompt = torch.tensor(prompts_of([7], seed=3, vocab=32)[0])
    for where in (drafted, own):
        h, _ = model.tree_forward(prompt, torch.arange(7), where)
        where.commit()
    assert torch.equal(h, model.tree_forward(prompt, torch.arange(7), model.new_cache(24))[0])
    tokens, positions = logits.argmax(-1), torch.tensor([4, 9])
    tree_tokens, parents = torch.tensor([5, 7, 9, 11, 13]), torch.tensor([-1, 0, 0, 1, 2])
    depths = torch.tensor([0, 1, 1, 2, 2])
    for tree_tokens, parents, depths, path in ((tree_tokens, parents, depths, [0, 2, 4]),
                                               (tree_tokens[:1], parents[:1], depths[:1], None)):
        mask = ancestor_mask(parents) if parents.numel() > 1 else None
        tree = slot_forwards.SlotTree(model, drafted, tree_tokens, depths + drafted.length, mask)
        hidden = slot_forwards.forward_with_trees(model, cache, tokens, positions, torch.tensor([0, 2]), [tree])
        alone, _ = model.tree_forward(tree_tokens, depths + own.length, own, mask)
        assert torch.equal(hidden[2:], alone)
        for where in (drafted, own):
            where.commit(path)
        assert drafted.length == own.length
        assert fused[-2] == 2 + tree_tokens.numel()          # the shared forward's rows, fused
        tokens, positions = model.lm_head(hidden[:2]).argmax(-1), positions + 1


def _each_answer_is_its_own_alone(batch, engine, plain, prompts, configs, drafts):
    """Serves the requests through `batch` (stepped here), asserts each answer is the one its
    request gets alone (drafted on `engine`, plain on `plain`), and returns them."""
    requests = [batch.submit(p, c, draft=d) for p, c, d in zip(prompts, configs, drafts)]
    while not all(r.done.is_set() for r in requests):
        batch.run_once()
    together = [r.wait() for r in requests]
    alone = [(engine if d else plain).generate(p, c) for p, c, d in zip(prompts, configs, drafts)]
    assert [(r.tokens, r.stop_reason) for r in together] == [(r.tokens, r.stop_reason) for r in alone]
    return together


def _on(backend, model, **engine):
    """(the model, an Engine over it) on `backend`: the row-invariant kernels (exact batched
    rows), or torch's with inexact answers allowed (which batched rows need there)."""
    if backend == "kernels":
        model = KernelBackend(model.module)
        return model, Engine(model, **engine)
    return model, Engine(model, allow_inexact=True, **engine)


backends = [pytest.param("kernels", marks=needs_kernels), "torch"]


@pytest.mark.parametrize("backend,arch", [pytest.param("kernels", "llama", marks=needs_kernels),
                                          ("torch", "llama"), ("torch", "gemma3")])
def test_drafted_trees_join_the_batched_step(monkeypatch, backend, arch):
    """Plain and prompt-lookup drafted requests, greedy and seeded sampling, through two slots
    refilled as answers end (a drafted one joining while greedy rows run a step ahead). Each
    drafted request's tree runs as rows of the same forward as the plain rows (the step's rows
    counted: plain and tree rows together), and every answer is the one its request gets served
    alone, the greedy ones plain decoding's: on `--backend triton`'s kernels bit for bit, on
    torch's (float32, `TreeRowsOnTorch`) because these rows round alike; Gemma's sliding window
    of 6 is passed by the tree rows."""
    shapes = []         # per step with trees: (plain rows, tree rows)
    forward = slot_forwards.forward_with_trees
    monkeypatch.setattr(slot_forwards, "forward_with_trees", lambda model, cache, tokens, *rest, **kw:
                        shapes.append((sum(t.rows == 1 for t in rest[2]), sum(t.rows for t in rest[2] if t.rows > 1)))
                        or forward(model, cache, tokens, *rest, **kw))
    model = tiny_model(arch, seed=3, n_layers=1, vocab_size=32, intermediate_size=32, max_seq_len=40)
    model, engine = _on(backend, model, proposer=PromptLookupProposer(num_draft=4))
    plain = Engine(model)
    prompts = [p * 3 for p in prompts_of([3, 4, 2, 3, 4], seed=0, vocab=32)]       # something to look up
    configs = [GenerationConfig(max_new_tokens=7), GenerationConfig(max_new_tokens=2),
               GenerationConfig(max_new_tokens=5),
               GenerationConfig(max_new_tokens=5, sampling=SamplingParams(temperature=1.3, top_k=20, seed=2)),
               GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=0.8, seed=5))]
    drafts = [False, False, True, True, False]
    batch = BatchEngine(model, None, lambda: PromptLookupProposer(num_draft=4),
                        BatchLimits(max_batch=2, window=40, tree_rows=12), allow_inexact=engine.allow_inexact,
                        thread=False)
    assert batch.together and len(batch.slots) == 2
    together = _each_answer_is_its_own_alone(batch, engine, plain, prompts, configs, drafts)
    assert together[2].tokens == plain.generate(prompts[2], configs[2]).tokens
    assert batch.drafted > 0
    assert any(rows and tree_rows > 1 for rows, tree_rows in shapes)     # a tree beside plain rows


@pytest.mark.parametrize("backend", backends)
def test_eagle_trees_with_taps_join_the_batched_step(backend):
    """A random fused-feature EAGLE drafter (it reads layer 0's output too), its branching trees
    beside a plain row in the shared steps: every answer the one its request gets alone, greedy
    and seeded sampling."""
    from vocabspec.speculation.families.eagle import EagleDrafter, EagleProposer

    model = tiny_model("llama", seed=3, n_layers=2, vocab_size=32, intermediate_size=32, max_seq_len=32)
    drafter = EagleDrafter.random(model, seed=2, taps=(0,))

    def make():
        return EagleProposer(drafter, depth=2, top_k=2, total_tokens=4)

    model, engine = _on(backend, model, proposer=make())
    plain = Engine(model)
    prompts = prompts_of([5, 4, 6], seed=0, vocab=32)
    configs = [GenerationConfig(max_new_tokens=3), GenerationConfig(max_new_tokens=2),
               GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=1.3, seed=2))]
    drafts = [True, False, True]
    batch = BatchEngine(model, None, make, BatchLimits(max_batch=3, window=32, tree_rows=12),
                        allow_inexact=engine.allow_inexact, thread=False)
    _each_answer_is_its_own_alone(batch, engine, plain, prompts, configs, drafts)
    assert batch.together and batch.drafted > 0 and batch.rows > batch.steps
