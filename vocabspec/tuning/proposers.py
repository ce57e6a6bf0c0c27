"""The proposer a DraftConfig builds, its tree sized for this machine where it is "auto".

The family builds its drafter first (its own module's parts), then the tuner sizes its tree
over them, so a drafter is loaded once whatever is measured: a family that declares `sizes`
has each measured against plain decoding (autotune.choose_size); EAGLE's tree is sized each
step by the live rule (live_tree.py) from the tuner's prior, or chosen once where graph steps
run, and so are a draft model's chain (the length that paid most when timed its prior) and
Medusa's tree (the best of its ordered nodes each step; a prefix of that order where static
steps run). Where no size beats plain decoding (a family's `sizes`, graph steps) the
proposer is None (eagle+pld: prompt lookup alone), and the log says so.
"""

from __future__ import annotations

from dataclasses import replace

from ..decoding.cost_curve import head_seconds
from ..speculation import families  # noqa: F401  (importing them registers them)
from ..speculation.config import FAMILIES, DraftConfig, weights_key
from ..speculation.live_tree import LiveSizing


def make_proposer(model, config: DraftConfig, model_name: str, tokenizer=None, log=None):
    """The proposer `config` asks for, for the loaded target `model` (None for plain decoding).
    `vocab="auto"` resolves to the shipped drafter's own default head."""
    family = FAMILIES[config.method]
    if config.total_tokens != "auto":
        return family.build(model, config, model_name, tokenizer, log)
    if family.sizes:
        from .autotune import choose_size

        _need_tokenizer(tokenizer)
        size = choose_size(model, tokenizer, f"{model_name}|{family.name}|{config}", family.sizes,
                           lambda n: family.build(model, replace(config, total_tokens=n), model_name,
                                                  tokenizer, None), log=log)
        if not size:
            if log:
                log(f"{family.name}: decoding plainly")
            return None
        return family.build(model, replace(config, total_tokens=size), model_name, tokenizer, log)
    tune = _TUNED.get(family.name)
    if tune is None:
        return family.build(model, config, model_name, tokenizer, log)
    return tune(model, config, model_name, tokenizer, log)


def _need_tokenizer(tokenizer) -> None:
    """The tuner times generations: a tree chosen for this machine needs the model's tokenizer
    (checked once the drafter exists, so a missing drafter is what a config without one hears)."""
    if tokenizer is None:
        raise ValueError("total_tokens='auto' needs the model's tokenizer")


def _tuned_eagle(model, config: DraftConfig, model_name: str, tokenizer, log):
    """EAGLE-2's tree over the config's drafter: sized each step by the live rule, the tuner's
    choice its prior; where an Engine runs graph steps (a GPU), chosen once by their costs."""
    from ..decoding.generate import graphs_by_default
    from ..speculation.families.eagle import drafts_in_graphs
    from ..speculation.families.eagle_family import eagle_parts, tree_proposer
    from ..speculation.families.hybrid import EagleLookupProposer
    from ..speculation.families.pld import PromptLookupProposer
    from .autotune import choose_graph_tree, keep_calibration, tree_choice

    parts = eagle_parts(model, config, model_name, log)
    _need_tokenizer(tokenizer)
    kind = EagleLookupProposer if config.method == "eagle+pld" else None
    key = f"{model_name}|{weights_key(parts.path)}|{parts.draft_vocab.name}|{parts.dtype}"
    depth = config.depth
    if graphs_by_default(model) and drafts_in_graphs(parts.draft_vocab):
        depth, total = choose_graph_tree(model, parts.drafter, parts.draft_vocab, tokenizer, depth=depth,
                                          top_k=config.top_k, key=key, log=log)
        if not total:            # measured: no tree beats plain decoding on this device
            if config.method == "eagle+pld":
                if log:
                    log("eagle+pld: drafting with prompt lookup alone")
                return PromptLookupProposer(device=model.device)
            if log:
                log("eagle: decoding plainly")
            return None
        return tree_proposer(parts, config, depth, total, kind=kind)
    # Elsewhere each step sizes its tree: the tuner's choice is the prior, never a verdict;
    # depth and the sizing's `most` are the largest tree a step drafts.
    chosen, forward = tree_choice(model, parts.drafter, parts.draft_vocab, tokenizer, depth=depth, top_k=config.top_k,
                                  key=key, log=log)
    sizing = sizing_prior(model, chosen, forward, depth)
    keep_calibration(sizing, key)
    return tree_proposer(parts, config, depth, sizing.most, sizing, kind=kind)


def _tuned_medusa(model, config: DraftConfig, model_name: str, tokenizer, log):
    """Medusa's heads, their tree's nodes in the order verification accepted them: sized each
    step by the live rule (live_tree.py), the prefix that paid most when the machine was timed
    its prior; where an Engine runs graph steps (a GPU), that prefix, or plain decoding where
    none paid."""
    from ..decoding.generate import graphs_by_default
    from ..speculation.families.medusa import MedusaProposer, medusa_parts
    from .autotune import choose_medusa_tree, forward_curve, keep_calibration

    heads, draft_vocab, path = medusa_parts(model, config, model_name, log)
    _need_tokenizer(tokenizer)
    key = f"{model_name}|medusa|{weights_key(path)}|{draft_vocab.name}"
    choices, chosen = choose_medusa_tree(model, heads, draft_vocab, tokenizer, key=key, log=log)
    total = int(chosen["size"])
    if graphs_by_default(model):
        if not total:
            if log:
                log("medusa: decoding plainly")
            return None
        return MedusaProposer(model, heads, draft_vocab, choices=choices, total_tokens=total)
    # A sampled request keeps a fixed tree: the tuned prefix, or the rule's own start where none paid.
    proposer = MedusaProposer(model, heads, draft_vocab, choices=choices, total_tokens=total or 3)
    sizing = live_sizing(model, forward_curve(model, log), proposer.level_seconds(),
                         max(chosen["measured_speedup"].values(), default=1.0), total, max(map(len, choices)),
                         len(choices))
    keep_calibration(sizing, key)
    proposer.sizing = sizing
    return proposer


def _tuned_draft_model(model, config: DraftConfig, model_name: str, tokenizer, log):
    """A draft model's chain sized each step by the live rule (live_tree.py), the chain length
    that paid most when the machine was timed its prior, the draft loaded once."""
    from ..decoding.cost_curve import forward_seconds
    from ..speculation.families.draft_model import DraftModelProposer, draft_model_parts
    from .autotune import CHAIN_LENGTHS, forward_curve, keep_calibration, size_choice

    draft, draft_vocab = draft_model_parts(model, config, model_name, tokenizer, log)
    _need_tokenizer(tokenizer)
    key = f"{model_name}|model|{config.draft_model}|{draft.weights}|{draft_vocab.name}"
    chosen = size_choice(model, tokenizer, key, CHAIN_LENGTHS,
                         lambda n: DraftModelProposer(draft, draft_vocab, depth=n, top_k=1, total_tokens=n), log=log)
    most = max(CHAIN_LENGTHS)
    # A drafting level is one forward of the draft over the chain's one row (its head's pass).
    level = forward_seconds(draft, [0], repeats=3)[0]
    sizing = live_sizing(model, forward_curve(model, log), level, max(chosen["measured_speedup"].values(), default=1.0),
                         int(chosen["size"]), most, most)
    keep_calibration(sizing, key)
    proposer = DraftModelProposer(draft, draft_vocab, depth=most, top_k=1, total_tokens=sizing.most)
    proposer.sizing = sizing
    return proposer


_TUNED = {"eagle": _tuned_eagle, "eagle3": _tuned_eagle, "eagle+pld": _tuned_eagle, "medusa": _tuned_medusa,
          "model": _tuned_draft_model}


def sizing_prior(model, chosen: dict, forward: dict[int, float], most_depth: int) -> LiveSizing:
    """A LiveSizing for `model` from the tuner's cached choice (autotune.choose_tree's entry)
    and forward curve: its tree, measured speedup and drafting time a level as the priors, and
    a second pass of the LM head timed now (milliseconds)."""
    table = chosen.get("table", {})
    total = int(chosen["total_tokens"])
    levels = [row["draft_s"] / (row["depth"] + 1) for row in table.values() if row.get("draft_s")]
    draft_level = sorted(levels)[len(levels) // 2] if levels else 0.0
    return live_sizing(model, forward, draft_level, float(chosen.get("measured_speedup", 1.0)), total, most_depth,
                       2 * max(total, 4))


def live_sizing(model, forward: dict[int, float], draft_level: float, speedup: float, total: int,
                most_depth: int, most: int) -> LiveSizing:
    """The live rule for a proposer over `model`: the forward curve, a drafting level's seconds,
    the measured speedup of its tuned tree of `total` nodes as priors, and a second pass of the
    LM head timed now (milliseconds). Its largest tree: `most_depth` levels, and at most `most`
    nodes, where the curve's forward stays within 2.5 plain steps (no drafter's 1 + sum of
    chances pays more rows on a CPU), 32 at most."""
    base = forward[min(forward)]
    within = max([n for n in forward if forward[n] <= 2.5 * base] + [3])
    most = max(2, min(32, within - 1, most))
    head_rows = model.head_rows
    head_pass = head_seconds(model, [head_rows], repeats=3)[head_rows]
    return LiveSizing(forward, draft_level, speedup, total, most_depth, most, head_pass, head_rows)
