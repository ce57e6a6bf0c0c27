"""The live tree-size rule (speculation/live_tree.py): whatever sizes it picks, greedy decoding
gives plain decoding's tokens; a verdict that no tree pays is tried again; its calibration and
costs follow what the steps show; a tree cut to its best m nodes is the tree a drafter keeping
m nodes builds."""

import random
import time

import pytest
import torch

import vocabspec
from vocabspec.speculation.live_tree import (CHECK_BELOW, CHECK_EVERY, KEEP_DRAFTING, MOST_PROBE_EVERY, PROBE_EVERY, Calibration, LiveCosts,
                                            LiveSizing, path_rows)
from vocabspec.speculation.tree import TreeBuilder

PROMPTS = ["Explain how a bicycle's gears make it easier to ride uphill.",
           "Translate to French: The weather is lovely today and we will walk to the river."]
CURVE = {n: 0.004 + 0.0004 * n for n in range(1, 34)}       # rows -> seconds, a CPU's shape


@pytest.fixture(scope="module")
def plain():
    return vocabspec.load("smollm2", max_seq_len=1024)


def live_model(prior_speedup: float, fixed_costs: bool = False):
    """SmolLM2 drafting with its rule over CURVE; fixed_costs: the costs stay CURVE's, whatever
    this machine's steps take (what the rule then does depends on its logic, not on the host)."""
    lm = vocabspec.load("smollm2", draft="eagle", depth=4, total_tokens=8, max_seq_len=1024)
    sizing = LiveSizing(CURVE, draft_level=0.0003, prior_speedup=prior_speedup, total=3,
                        most_depth=4, most=8)
    sizing.keep_sizes = True
    if fixed_costs:
        sizing.costs.step = sizing.costs.read_took = sizing.costs.grew = lambda *_: None
        # A step's own growth and read are taken at those costs too, not at what the wall clock
        # gave them (a host busy with other tests stretches them many times over).
        choose = sizing.choose
        sizing.choose = lambda tree, levels, grow_seconds, read_seconds=0.0, read_tokens=0, started=None: \
            choose(tree, levels, levels * sizing.costs.drafting()[0], 0.0, read_tokens)
    lm.engine.proposer.sizing = sizing
    return lm, sizing


@pytest.mark.parametrize("prior", [1.2, 0.5], ids=["drafting-prior", "busy-verdict"])
def test_live_sizes_give_plain_decodings_tokens(plain, prior):
    lm, sizing = live_model(prior, fixed_costs=True)
    accepted = []
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=48, chat=True).tokens
        got = lm.generate(prompt, max_new_tokens=48, chat=True)
        assert got.tokens == want
        accepted += [step.accept_length - 1 for step in got.steps]
    sizes = [size for _, size in sizing.sizes]
    # The rule drafted (a busy verdict included: its probes found drafting pays) at more than
    # one size, and accepted drafts.
    assert len(set(sizes)) > 1, sizes
    assert sum(accepted) >= 10, accepted


def test_a_dormant_drafter_reads_only_the_tail_and_gives_plain_decodings_tokens(plain):
    """Where drafting has not paid for long the drafter reads only the prompt's last
    DORMANT_CONTEXT tokens and, before a probe, the last ones since: its cache holds far fewer
    than the context, and greedy output is still plain decoding's."""
    lm, sizing = live_model(0.5)
    proposer = lm.engine.proposer
    reads = []
    read = proposer.drafting.read
    proposer.drafting.read = lambda tokens, rows, **kw: (reads.append(len(tokens)), read(tokens, rows, **kw))[1]
    prompt = PROMPTS[0]
    awake = lm.generate(prompt, max_new_tokens=40, chat=True)
    assert max(reads) > proposer.DORMANT_CONTEXT        # not dormant: the whole prompt is read
    # As after probes that did not pay: the longest wait, no advantage, none of it waited yet.
    sizing.probe_every, sizing.advantage, sizing.plain_steps = MOST_PROBE_EVERY, 0.0, 0
    assert sizing.dormant
    reads.clear()
    tapped = []                 # per forward of a step: the taps it computed
    forward = lm.engine.model.forward
    lm.engine.model.forward = lambda rows: (tapped.append(rows.taps), forward(rows))[1]
    try:
        got = lm.generate(prompt, max_new_tokens=40, chat=True)
    finally:
        del lm.engine.model.forward
    assert got.tokens == plain.generate(prompt, max_new_tokens=40, chat=True).tokens == awake.tokens
    # The prefill's forward computed them (the drafter reads the prompt's tail), and so did the
    # first step's (a request's first step is a probe); later steps' only within
    # DORMANT_CONTEXT steps of the next probe (MOST_PROBE_EVERY steps after that one).
    prefill, steps = tapped[0], tapped[1:]
    first = MOST_PROBE_EVERY - proposer.DORMANT_CONTEXT
    assert proposer.taps and prefill == proposer.taps and len(steps) == len(got.steps) > first + 1, tapped
    again = steps.index(proposer.taps, 1)     # (the probe's own step counts as plain where it kept no node)
    assert steps[0] == proposer.taps and again in (first, first + 1), steps
    assert not any(steps[1:again]) and all(t == proposer.taps for t in steps[again:]), steps
    # the prompt's tail alone, and nothing since (no probe came within 40 tokens); a read
    # before it holds what the last request left unread, into the cache the prompt resets
    assert reads[-1] == proposer.DORMANT_CONTEXT == max(reads) == proposer.cache.length, reads
    for _ in range(MOST_PROBE_EVERY + 1):              # a probe's read: the last tokens alone
        proposer.observe([5], torch.zeros(1, got_width(proposer)), 6)
    proposer.propose(6)
    assert reads[-1] == proposer.DORMANT_CONTEXT and proposer.cache.length == 2 * proposer.DORMANT_CONTEXT


def got_width(proposer) -> int:
    """The width of the target's rows the proposer's drafter reads (its taps' too)."""
    return (len(proposer.taps) + 1) * proposer.target.args.dim


def test_a_sampled_request_keeps_the_fixed_tree(plain):
    lm, sizing = live_model(1.2)
    lm.generate(PROMPTS[0], max_new_tokens=16, chat=True, temperature=0.8, seed=3)
    assert sizing.sizes == []            # never consulted: its trees must not follow timing
    assert lm.engine.proposer.size_live is False


def test_a_verdict_that_drafting_loses_is_probed_again():
    """A rule that starts from "drafting loses" still probes, again and again: its probes (the
    root alone, nothing gained) wait longer each time, never past MOST_PROBE_EVERY steps."""
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=0.5, total=0, most_depth=4, most=8)
    plans = []
    for _ in range(4 * MOST_PROBE_EVERY):
        plans.append(sizing.plan())
        sizing.observe([1])           # a plain step (the rule drafted nothing) or a probe's root
    drafted = [i for i, plan in enumerate(plans) if plan != (0, 0)]
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert drafted[0] == PROBE_EVERY and len(drafted) >= 5, drafted
    assert gaps == sorted(gaps) and gaps[0] == 2 * PROBE_EVERY and gaps[-1] == MOST_PROBE_EVERY, gaps


def test_probes_that_do_not_pay_wait_longer_and_one_that_pays_is_followed_by_another():
    """Where no tree pays, each probe doubles the plain steps before the next (to
    MOST_PROBE_EVERY); a probe whose tree paid (what it accepted, at what its rows and drafting
    cost) is followed by another at the next step, and one that does not pay after it waits
    PROBE_EVERY steps or more."""
    builder = TreeBuilder(1, 1, 1)
    builder.add_children([0], torch.tensor([[5]]), torch.tensor([[-0.05]]))
    sure = builder.build()                   # one node the drafter is 95% sure of
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=0.5, total=0, most_depth=2, most=4)

    def probes(draft_seconds, count):
        """(plain steps before each probe, the wait set after it) for `count` probes."""
        gaps, waits, plain = [], [], 0
        while len(gaps) < count:
            depth, _ = sizing.plan()
            if not depth:
                plain += 1
                sizing.observe([1])
                continue
            gaps.append(plain)
            plain = 0
            sizing.choose(sure, 1, draft_seconds)
            sizing.observe([1])
            waits.append(sizing.probe_every)
        return gaps, waits

    # Drafting that takes a second never pays: the waits double to the cap, and are kept
    # (a probe verifies its best node, so it restarts the count of plain steps).
    gaps, waits = probes(1.0, 6)
    assert waits == [2 * PROBE_EVERY, 4 * PROBE_EVERY, MOST_PROBE_EVERY, MOST_PROBE_EVERY, MOST_PROBE_EVERY,
                     MOST_PROBE_EVERY]
    assert gaps[0] == PROBE_EVERY and all(wait - 1 <= gap <= wait for wait, gap in zip(waits, gaps[1:])), gaps
    # Free drafting of a likely node that is accepted pays: the next step probes again (a
    # fresh rule at the longest wait, its calibration and costs untouched by the probes above).
    # Where this request's sure nodes keep being wrong, its probes stop paying: what it accepted
    # of what it expected scales what the next expects, and the waits grow again.
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=0.5, total=0, most_depth=2, most=4)
    sizing.probe_every = sizing.plain_steps = MOST_PROBE_EVERY
    assert sizing.plan()[0]
    sizing.choose(sure, 1, 0.002)           # drafting that pays only where the node is right
    sizing.observe([1, 5])
    assert sizing.probe_every == 0 and sizing.plan()[0] and sizing._probing
    sizing.choose(sure, 1, 0.002)
    sizing.observe([1, 5])
    waits = []
    for _ in range(6):
        sizing.plain_steps = sizing.probe_every
        assert sizing.plan()[0]
        sizing.choose(sure, 1, 0.002)
        sizing.observe([1])
        waits.append(sizing.probe_every)
    assert waits[-1] > waits[0] and waits[-1] >= 4 * PROBE_EVERY, waits
    assert min(wait for wait in waits if wait) >= PROBE_EVERY, waits


def test_a_request_starts_from_the_typical_advantage_not_the_last_requests():
    """A new prompt is new text: a request starts from the advantage the last few requests
    closed on (a running mean, the tuner's prior its start), not from the last one's alone, so
    a request the drafter guessed badly leaves the next one drafting from its first step, and
    several leave it probing."""
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=1.3, total=3, most_depth=2, most=4)
    sizing.start()
    assert sizing.advantage == 1.3 and sizing.plan()[0] and not sizing._probing
    sizing.observe([1])
    sizing.advantage = 0.5                   # the drafter guessed this request badly
    sizing.start()
    assert 1.0 < sizing.advantage < 1.3 and sizing.drafts() and not sizing.stretch
    for _ in range(3):                       # three more such requests
        assert sizing.plan()[0]
        sizing.observe([1])
        sizing.advantage = 0.5
        sizing.start()
    assert sizing.advantage < 1.0 and sizing.plan()[0] and sizing._probing    # its first step probes


def test_a_probe_verifies_its_best_node_even_where_none_pays():
    """A probe whose nodes the calibration says will not pay for their rows still verifies its
    best one, so that what it measures can move: the node's outcome trains the calibration,
    while a step of steady drafting keeps the root alone."""
    builder = TreeBuilder(1, 2, 2)
    builder.add_children([0], torch.tensor([[5, 6]]), torch.tensor([[-3.0, -4.0]]))
    unlikely = builder.build()               # two nodes the drafter gives 5% and 2%
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=0.5, total=0, most_depth=2, most=4)
    sizing.plain_steps = sizing.probe_every
    assert sizing.plan()[0] and sizing._probing
    kept = sizing.choose(unlikely, 1, 0.001)
    assert kept.size == 1 and kept.tokens.tolist() == [1, 5]
    before = sizing.calibration.chance(1, -3.0)
    sizing.observe([1, 5])                   # the node was right
    assert sizing.calibration.chance(1, -3.0) > before
    steady = LiveSizing(CURVE, 0.0003, prior_speedup=2.0, total=0, most_depth=2, most=4)
    assert steady.plan()[0] and not steady._probing      # steady drafting: the root alone pays best
    assert steady.choose(unlikely, 1, 0.001).size == 0


def test_a_proposals_time_past_its_growth_counts_as_drafting():
    """What a proposal spends past its tree's growth and read (the choice, the trees'
    conversions) is drafting's cost too: the same step, its proposal begun 20 ms before the
    choice's end, shows drafting paying less than one timed from its growth alone."""
    builder = TreeBuilder(1, 2, 2)
    builder.add_children([0], torch.tensor([[5, 6]]), torch.tensor([[-0.1, -3.0]]))
    sure = builder.build()
    advantages = []
    for started in (None, time.perf_counter() - 0.02):
        sizing = LiveSizing(CURVE, 0.0003, prior_speedup=1.2, total=2, most_depth=2, most=4)
        assert sizing.plan()[0]
        sizing.choose(sure, 1, 0.0003, started=started)
        sizing.observe([1, 5])
        advantages.append(sizing.advantage)
    assert advantages[1] < advantages[0] - 0.03, advantages


def test_each_row_counts_cost_follows_what_its_steps_show():
    """Where drafted steps show their extra rows costing twice the curve's (a forward between the
    drafter's calls), c(4) learns their true cost and c(1) what plain steps show; a count not
    seen is priced as the nearest seen one; a busy spell after scales every count alike (nearly:
    the spell's own count takes a little of it into its shape)."""
    costs = LiveCosts(CURVE, 0.0003)
    one, extra = CURVE[1], CURVE[4] - CURVE[1]
    for _ in range(300):
        costs.step(1, one)
        costs.step(4, one + 2 * extra)
    assert costs(1) == pytest.approx(one, rel=0.05)
    assert costs(4) == pytest.approx(one + 2 * extra, rel=0.05)
    assert costs(5) / CURVE[5] == pytest.approx(costs(4) / CURVE[4])
    for _ in range(60):
        costs.step(1, 3 * one)
    assert costs(1) == pytest.approx(3 * one, rel=0.05)
    assert costs(4) == pytest.approx(3 * (one + 2 * extra), rel=0.12)


def test_noisy_steps_of_a_changing_mix_leave_each_row_counts_cost_steady():
    """Steps of 2 and 4 rows in a changing mix, each one's time off by up to 30%: what 4 rows
    cost over 2, which decides a tree's size, stays near the truth, and so does each price
    within the fast scale's swing (one scalar slope on the curve, fitted to such a mix, priced
    them 0.6x to 1.9x)."""
    rng = random.Random(3)
    costs = LiveCosts(CURVE, 0.0003)
    true = {2: CURVE[2] * 1.3, 4: CURVE[4] * 0.9}
    prices = []
    for step in range(600):
        rows = 2 if rng.random() < (0.8 if step // 50 % 2 else 0.2) else 4
        costs.step(rows, true[rows] * rng.uniform(0.7, 1.3))
        if step >= 200:
            prices.append((costs(2) / true[2], costs(4) / true[4]))
    for ratios in zip(*prices):
        assert 0.8 < min(ratios) and max(ratios) < 1.2
    assert all(0.92 < four / two < 1.08 for two, four in prices)


def test_calibration_follows_the_outcomes():
    calibration = Calibration(max_depth=3)
    value = torch.log(torch.tensor(0.85)).item()           # the drafter says 85%
    assert calibration.chance(1, value) == pytest.approx(0.85)
    calibration.learn([1] * 200, [value] * 200, [i % 4 == 0 for i in range(200)])   # 25% were right
    assert calibration.chance(1, value) == pytest.approx(0.25, abs=0.03)
    assert calibration.chance(2, value) == pytest.approx(0.85)   # another depth: its own bins


def test_costs_follow_a_busy_spell_and_recover():
    costs = LiveCosts(CURVE, 0.0003)
    quiet = costs(1)
    for _ in range(60):
        costs.step(1, 3 * CURVE[2])              # a busy neighbour: every step three times as slow
    assert costs(1) == pytest.approx(3 * quiet, rel=0.1) and costs(6) > 2.5 * CURVE[6]
    for _ in range(60):
        costs.step(1, CURVE[2])
    assert costs(1) == pytest.approx(quiet, rel=0.1) and costs(6) == pytest.approx(CURVE[6], rel=0.15)


def test_the_best_m_nodes_are_the_tree_a_builder_keeping_m_builds():
    rng = random.Random(5)
    for trial in range(30):
        top_k, depth, seed = rng.randint(1, 4), rng.randint(1, 4), rng.randrange(10 ** 6)

        def children(builder, node):
            """A node's drafted children, fixed by its path (whatever else the tree expands)."""
            path, at = [], node
            while at != -1:
                path.append(builder.token[at])
                at = builder.parent[at]
            g = torch.Generator().manual_seed(hash((seed, *path)) % 2 ** 31)
            return torch.randperm(50, generator=g)[:top_k], torch.rand(top_k, generator=g).log().sort(descending=True).values

        def grown(total):
            builder = TreeBuilder(7, top_k, total)
            tokens, log_probs = children(builder, 0)
            builder.add_children([0], tokens[None], log_probs[None])
            for _ in range(depth):
                frontier = builder.frontier()
                if not frontier:
                    break
                drafted = [children(builder, node) for node in frontier]
                builder.add_children(frontier, torch.stack([t for t, _ in drafted]),
                                     torch.stack([lp for _, lp in drafted]))
            return builder.build()

        big = grown(40)
        for m in range(1, big.size + 1):
            small, cut = grown(m), big.best(m)
            assert torch.equal(cut.tokens, small.tokens) and torch.equal(cut.parents, small.parents), (trial, m)
            assert torch.equal(cut.ranks, small.ranks) and torch.equal(cut.values, small.values)


def test_the_accepted_path_is_followed_by_tokens():
    builder = TreeBuilder(1, 2, 10)
    builder.add_children([0], torch.tensor([[5, 6]]), torch.tensor([[-0.1, -0.2]]))
    builder.add_children([1, 2], torch.tensor([[7, 8], [7, 9]]), torch.tensor([[-0.1, -0.3], [-0.1, -0.2]]))
    tree = builder.build()
    tokens = tree.tokens.tolist()
    rows = path_rows(tree, [1, 6, 7, 3])
    assert [tokens[r] for r in sorted(rows)] == [6, 7]


def test_the_calibration_is_kept_in_the_tuners_cache(tmp_path, monkeypatch):
    """What one run learned is the next run's start (scaled to KEEP_SEEN a bin, so it still
    moves), kept every SAVE_EVERY outcomes and at `save`; a kept state of another shape is
    not read."""
    import json

    from vocabspec.tuning.autotune import keep_calibration
    from vocabspec.speculation.live_tree import KEEP_SEEN, SAVE_EVERY

    monkeypatch.setenv("VOCABSPEC_CACHE", str(tmp_path))
    value = torch.log(torch.tensor(0.85)).item()
    first = LiveSizing(CURVE, 0.0003, prior_speedup=1.2, total=3, most_depth=4, most=8)
    keep_calibration(first, "test|drafter")
    first.calibration.learn([1] * 1000, [value] * 1000, [i % 4 == 0 for i in range(1000)])
    first._unsaved = SAVE_EVERY - 1
    first.start()                                     # under SAVE_EVERY outcomes: not yet kept
    assert not (tmp_path / "autotune.json").exists()
    first._unsaved = SAVE_EVERY
    first.start()
    kept = json.loads((tmp_path / "autotune.json").read_text())["calibration|test|drafter|v1"]
    assert kept["seen"][1][8] == 1000
    second = LiveSizing(CURVE, 0.0003, prior_speedup=1.2, total=3, most_depth=4, most=8)
    keep_calibration(second, "test|drafter")
    assert second.calibration.chance(1, value) == pytest.approx(0.25, abs=0.03)
    assert second.calibration.seen[1][8] == KEEP_SEEN
    other = LiveSizing(CURVE, 0.0003, prior_speedup=1.2, total=3, most_depth=6, most=8)   # 7 depths, not 5
    keep_calibration(other, "test|drafter")
    assert other.calibration.chance(1, value) == pytest.approx(0.85)


def test_a_tree_stops_growing_where_its_frontier_cannot_pay():
    """TreeStop: the frontier's summed chances against min_gain, each node's bin from its
    confidence, depths past the table's last read from its last row."""
    from vocabspec.speculation.live_tree import TreeStop

    calibration = Calibration(max_depth=2)
    stop = TreeStop(calibration.table(), 0.55)
    log = torch.log(torch.tensor([0.33, 0.12, 0.97, 0.62, 0.42], dtype=torch.float64)).tolist()
    assert stop.width([1, 1], log[:2]) == 0          # the raw prior's bins: 0.35 + 0.15 < 0.55
    assert stop.width([1, 1, 1], log[:3]) == 3       # and a sure node's 0.95
    assert stop.width([7], [log[3]]) == 1 and stop.width([7], [log[4]]) == 0   # depth 7: depth 2's bins
    # A tree as large as it keeps: each node adds only what its chance exceeds the node it would
    # push out (0.65 at depth 1): 0.95 - 0.65 = 0.3 < 0.55, and a less likely node adds nothing.
    assert stop.width([1, 1, 1], log[:3], displaced=(1, log[3])) == 0
    assert stop.width([1, 1], [log[2], log[2]], displaced=(1, log[3])) == 2     # 2 x 0.3
    assert stop.width([1, 1, 1, 1], [log[2], log[4], log[4], log[4]], displaced=(1, log[3])) == 0


def test_a_level_expands_only_the_frontier_nodes_whose_rows_pay():
    """With a price on each node's row, a level expands the frontier's first w nodes, w the
    best of what they add less that price each, and none where even that misses min_gain."""
    from vocabspec.speculation.live_tree import TreeStop

    table = Calibration(max_depth=2).table()
    frontier = torch.log(torch.tensor([0.97, 0.62, 0.33, 0.12], dtype=torch.float64)).tolist()  # 0.95 .. 0.15
    depths = [1] * 4
    assert TreeStop(table, 0.2, node_cost=0.3).width(depths, frontier) == 3     # 0.65 + 0.35 + 0.05
    assert TreeStop(table, 0.2, node_cost=0.4).width(depths, frontier) == 2     # 0.55 + 0.25, then -0.05
    assert TreeStop(table, 0.9, node_cost=0.4).width(depths, frontier) == 0     # 0.8 < 0.9
    assert TreeStop(table, 0.2, node_cost=1.0).width(depths, frontier) == 0     # no node pays its row


def test_drafting_is_priced_by_its_levels_and_rows():
    """LiveCosts.drafting: the line c + a levels + b rows through the trees grown; trees whose
    rows only follow their levels, c + a levels and nothing a row."""
    from vocabspec.speculation.live_tree import LiveCosts

    costs = LiveCosts(CURVE, draft_level=0.001)
    assert costs.drafting() == pytest.approx((0.001, 0.0))
    for levels, rows in [(1, 1), (2, 4), (3, 5), (2, 2), (4, 10), (3, 9)] * 100:
        costs.grew(levels, rows, 0.0001 + 0.0002 * levels + 0.00005 * rows)
    assert costs.drafting() == pytest.approx((0.0002, 0.00005), rel=1e-3)
    alike = LiveCosts(CURVE, draft_level=0.001)      # one row a level: t = c + a L
    for levels in [1, 2, 3] * 200:
        alike.grew(levels, levels, 0.0002 + 0.0003 * levels)
    assert alike.drafting() == pytest.approx((0.0003, 0.0), rel=1e-3)


def test_a_full_trees_cut_node_is_the_one_its_build_would_drop_first():
    """TreeBuilder.cut_node: the total_tokens-th node of build()'s ranking (value, then the
    shallower, then the earlier drafted), None while the tree holds no more nodes than it keeps."""
    builder = TreeBuilder(1, 3, 3)
    builder.add_children([0], torch.tensor([[5, 6, 7]]), torch.tensor([[-0.1, -0.5, -0.5]]))
    assert builder.cut_node() == (1, -0.5)
    builder = TreeBuilder(1, 3, 4)
    builder.add_children([0], torch.tensor([[5, 6, 7]]), torch.tensor([[-0.1, -0.5, -0.5]]))
    assert builder.cut_node() is None
    builder.add_children([1], torch.tensor([[8, 9, 10]]), torch.tensor([[-0.4, -1.0, -2.0]]))
    depth, value = builder.cut_node()           # -0.1, -0.5 (id 2), -0.5 (id 3), then -0.5 at depth 2
    assert depth == 2 and value == pytest.approx(-0.5)
    kept = builder.build()
    assert kept.depths.tolist()[1:].count(2) == 1 and kept.size == 4


def test_a_probe_is_charged_the_read_steady_drafting_makes_not_its_catch_up():
    """The drafter's reads follow a line a + b n (LiveCosts.read); a probe after a long run of
    plain steps reads all their tokens at once, but what it gained is set against the read a
    step of steady drafting makes (of the tokens it accepted): the same probe with a
    catch-up twenty times its steady read still pays, where charging the catch-up would not."""
    costs = LiveCosts(CURVE, 0.0003)
    for tokens in (1, 2, 4, 8, 16, 40):
        costs.read_took(tokens, 0.00025 + 0.000035 * tokens)
    assert costs.read(2) == pytest.approx(0.00032, rel=0.02)
    assert costs.read(40) == pytest.approx(0.00165, rel=0.02)
    builder = TreeBuilder(1, 1, 1)
    builder.add_children([0], torch.tensor([[5]]), torch.tensor([[-0.05]]))
    sure = builder.build()                   # one node the drafter is 95% sure of
    paid = {}
    for name, read_seconds in (("steady", 0.0004), ("catch-up", 0.008)):
        sizing = LiveSizing(CURVE, 0.0003, prior_speedup=0.5, total=0, most_depth=2, most=4)
        sizing.probe_every = sizing.plain_steps = 2 * PROBE_EVERY
        assert sizing.plan()[0]
        sizing.choose(sure, 1, 0.0002, read_seconds, 2 if name == "steady" else 40)
        sizing.observe([1, 5])               # its node accepted
        paid[name] = sizing.probe_every == 0      # another probe follows at once
    assert paid == {"steady": True, "catch-up": True}
    # Charged whole, the catch-up read would have sunk the probe.
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=0.5, total=0, most_depth=2, most=4)
    sizing.probe_every = sizing.plain_steps = 2 * PROBE_EVERY
    sizing.plan()
    sizing.choose(sure, 1, 0.0002 + 0.008)
    sizing.observe([1, 5])
    assert sizing.probe_every == 4 * PROBE_EVERY


def test_a_grafted_paths_tokens_are_kept_while_their_measured_chances_pay():
    """Prompt lookup's path on the tree is scored by its own acceptance: while its tokens are
    right the whole path pays for its rows; once paths are wrong after their first two tokens,
    only those two are kept (their chances measured per position)."""
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=1.5, total=3, most_depth=4, most=8)
    for _ in range(40):
        sizing.path.learn(6, 6)
    assert sizing.path_rows(6) == 6
    for _ in range(400):
        sizing.path.learn(6, 2)
    assert sizing.path_rows(6) == 2
    chances = sizing.path.chances(4)
    assert chances[0] > 0.95 and chances[1] > 0.95 and chances[2] < 0.1 and chances[3] <= chances[2]
    row = sizing.costs(6) - sizing.costs(5)
    assert chances[2] < sizing.rate * row < chances[1]      # the third token no longer pays its row


def test_a_drafting_stretch_outlasts_a_dip_and_a_plain_step_does_not_start_one():
    """A stretch of drafting starts where the advantage reaches plain decoding's speed and goes
    on while it stays above KEEP_DRAFTING (one step's speed is a noisy sample); below that the
    next step is plain, and from plain steps only an advantage of 1 (or a probe) drafts again.
    A step of a stretch that keeps the root alone (no node pays) lowers the advantage only a
    little: it was one step."""
    builder = TreeBuilder(1, 2, 2)
    builder.add_children([0], torch.tensor([[5, 6]]), torch.tensor([[-3.0, -4.0]]))
    unlikely = builder.build()
    sizing = LiveSizing(CURVE, 0.0003, prior_speedup=1.05, total=3, most_depth=2, most=4)
    assert sizing.plan()[0] and not sizing._probing
    assert sizing.choose(unlikely, 1, 0.0005).size == 0
    sizing.observe([1])
    assert sizing.stretch and KEEP_DRAFTING < sizing.advantage < 1.05 and sizing.drafts()
    sizing.advantage = (KEEP_DRAFTING + 1.0) / 2
    assert sizing.drafts() and not sizing.dormant
    sizing.advantage = KEEP_DRAFTING - 0.01
    assert sizing.plan() == (0, 0)
    sizing.observe([1])                      # a plain step ends the stretch
    assert not sizing.stretch
    sizing.advantage = (KEEP_DRAFTING + 1.0) / 2
    assert not sizing.drafts()
    sizing.advantage = 1.0
    assert sizing.drafts()


def test_a_stretch_that_barely_pays_times_a_plain_step_now_and_then():
    """Within a stretch whose advantage is below CHECK_BELOW, every CHECK_EVERY-th step is plain
    and keeps the stretch: its time is what the 1-row count costs inside decoding (the factor the
    stretch's drafted steps are weighed against), with no prompt lookup path grafted on it. A
    stretch that pays well drafts every step."""
    builder = TreeBuilder(1, 1, 1)
    builder.add_children([0], torch.tensor([[5]]), torch.tensor([[-0.05]]))
    sure = builder.build()

    def steps(advantage, count):
        sizing = LiveSizing(CURVE, 0.0003, prior_speedup=advantage, total=3, most_depth=2, most=4)
        sizing.costs.read_took = sizing.costs.grew = lambda *_: None
        plain = []
        for i in range(count):
            sizing.advantage = advantage
            sizing.path.learn(4, 4)             # a grafted path that is always right
            grafted = sizing.path_rows(4)       # prompt lookup's rows: none on a plain check
            if sizing.plan()[0]:
                assert grafted
                sizing.choose(sure, 1, 0.0003)
                sizing.observe([1, 5])
            else:
                assert not grafted
                plain.append(i)
                sizing.observe([1])
            assert sizing.stretch
        return plain, sizing

    plain, sizing = steps((1.0 + CHECK_BELOW) / 2, 3 * (CHECK_EVERY + 1))
    assert plain == [CHECK_EVERY, 2 * CHECK_EVERY + 1, 3 * CHECK_EVERY + 2], plain
    assert 1 in sizing.costs.log_factor         # the 1-row count timed as decoding saw it
    assert steps(CHECK_BELOW + 0.1, 3 * (CHECK_EVERY + 1))[0] == []


def test_a_prompt_the_drafter_cannot_guess_stops_drafting_soon_after_one_it_guessed_well():
    """After a request whose drafting paid well, a new request whose sure nodes are never right
    (and whose drafting costs half a step) stops drafting within a dozen steps: its steps weigh
    as the request's speed as it stands, the start counted as REQUEST_STEPS steps. One whose
    sure nodes are always right drafts on."""
    builder = TreeBuilder(1, 1, 1)
    builder.add_children([0], torch.tensor([[5]]), torch.tensor([[-0.05]]))
    sure = builder.build()

    def steps_until_plain(accepted):
        sizing = LiveSizing(CURVE, 0.0003, prior_speedup=1.5, total=3, most_depth=2, most=4)
        sizing.costs.step = sizing.costs.read_took = sizing.costs.grew = lambda *_: None
        sizing.stretch = True
        sizing.start()
        for step in range(400):
            if not sizing.paying:
                return step
            if sizing.plan()[0]:             # else a plain check (CHECK_EVERY)
                sizing.choose(sure, 1, 0.002)
            sizing.observe(accepted)
        return 400

    assert steps_until_plain([1]) <= 12
    assert steps_until_plain([1, 5]) == 400
