"""An untrained EAGLE-3 drafter as vLLM's `speculators` saves it (speculators_layout.py: NaN
head and embedding, zero d2t) drafts at every tree the CLI accepts, up to the largest, and
with `--total-tokens auto`: the output is plain decoding's and the process does not abort.

Its NaN head once made the native tree keep a node without its parent (NaN values broke the
ranking's order), and greedy verification then wrote before its buffer (`free(): invalid
pointer`, exit 134). The runs are subprocesses, so that such an abort fails the test instead
of ending the pytest run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculators_layout import untrained_speculators_checkpoint
from vocabspec.speculation.tree import MAX_DEPTH, MAX_TOP_K, MAX_TOTAL_TOKENS

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a haiku about the sea."

# (depth, top_k, total_tokens): the smallest tree, the (3/8, 6/60, 8/64), and the
# largest the CLI accepts.
TREES = [(1, 1, 1), (3, 10, 8), (6, 10, 60), (MAX_DEPTH, 10, 64), (MAX_DEPTH, MAX_TOP_K, MAX_TOTAL_TOKENS)]
# One subprocess per group: the sanitizer pass (.ci/run) runs the deepest trees alone, the
# whole list costing it minutes.
TREE_GROUPS = {"shallow": TREES[:3], "deepest": TREES[3:]}

RUN_TREES = """
import json, sys
import vocabspec
path, trees = sys.argv[1], json.loads(sys.argv[2])
want = vocabspec.load("smollm2").generate(%(prompt)r, chat=True, max_new_tokens=12).tokens
out = []
for depth, top_k, total in trees:
    lm = vocabspec.load("smollm2", draft="eagle", path=path, depth=depth, top_k=top_k, total_tokens=total)
    out.append([depth, top_k, total, lm.generate(%(prompt)r, chat=True, max_new_tokens=12).tokens == want])
print(json.dumps(out))
""" % {"prompt": PROMPT}


def env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def untrained_eagle3(tmp_path_factory, smollm2):
    return untrained_speculators_checkpoint(tmp_path_factory.mktemp("speculators-untrained"), smollm2.model.args)


@pytest.mark.parametrize("group", list(TREE_GROUPS))
def test_untrained_speculators_drafter_drafts_every_tree_the_cli_accepts(untrained_eagle3, group):
    trees = TREE_GROUPS[group]
    done = subprocess.run([sys.executable, "-c", RUN_TREES, str(untrained_eagle3), json.dumps(trees)],
                          capture_output=True, text=True, env=env(), timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [tuple(r[:3]) for r in results] == trees
    assert all(r[3] for r in results), f"trees whose output is not plain decoding's: {results}"


def test_untrained_speculators_drafter_with_the_tuned_tree(untrained_eagle3, tmp_path):
    """The README's EAGLE-3 example: the CLI's default --total-tokens auto, the deepest tree tried."""
    common = [sys.executable, "-m", "vocabspec.cli", "generate", "--model", "smollm2", "--chat",
              "--max-new-tokens", "12", "--json"]
    plain = subprocess.run(common + [PROMPT], capture_output=True, text=True, env=env(), timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    tuned = subprocess.run(common + ["--draft", "eagle", "--draft-path", str(untrained_eagle3),
                                     "--depth", str(MAX_DEPTH), PROMPT],
                           capture_output=True, text=True, env=env(), timeout=900)
    assert tuned.returncode == 0, f"exit {tuned.returncode}:\n{tuned.stderr[-3000:]}"
    got, want = json.loads(tuned.stdout), json.loads(plain.stdout)
    assert (got["text"], got["new_tokens"]) == (want["text"], want["new_tokens"])


def test_the_cli_refuses_trees_beyond_its_bounds():
    for flag, value in (("--depth", MAX_DEPTH + 1), ("--tree-top-k", MAX_TOP_K + 1),
                        ("--total-tokens", MAX_TOTAL_TOKENS + 1)):
        done = subprocess.run([sys.executable, "-m", "vocabspec.cli", "generate", flag, str(value), "x"],
                              capture_output=True, text=True, env=env(), timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"got {value}" in done.stderr
