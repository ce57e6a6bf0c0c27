"""The package's layers: the core (model, formats, cache, tree, verification, heads, proposers,
generation, loading, the API) never imports training or benchmarking, no two modules import
each other in a cycle (function-level imports included), and loading a model with a drafter
and generating loads no training module."""

import ast
import subprocess
import sys
from pathlib import Path

import vocabspec

PACKAGE = Path(vocabspec.__file__).parent
TRAINING = {"train", "medusa_train", "eagle3_train", "ranker", "answers", "task_prompts", "sharegpt"}
BENCHMARKING = {"bench", "throughput"}
COMMANDS = {"cli", "server", "export", "__init__"}   # entry points: may import any layer


def imports() -> dict[str, set[str]]:
    """Each vocabspec module -> the vocabspec modules it imports, at any depth of the file."""
    graph = {}
    for path in PACKAGE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vocabspec."):
                found.add(node.module.split(".")[1])
        graph[path.stem] = found & {p.stem for p in PACKAGE.glob("*.py")}
    return graph


def test_core_imports_no_training_or_benchmarking():
    graph = imports()
    core = set(graph) - TRAINING - BENCHMARKING - COMMANDS
    assert {"model", "generate", "drafter", "draft_vocab", "native"} <= core
    bad = {(m, d) for m in core for d in graph[m] if d in TRAINING | BENCHMARKING}
    assert not bad, f"core modules importing training or benchmarking: {sorted(bad)}"


def test_no_import_cycles():
    graph = imports()
    state, cycles = {}, []

    def visit(module, stack):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_generation_loads_no_training_module():
    code = (
        "import sys, vocabspec\n"
        "lm = vocabspec.load('smollm2', draft='eagle+pld', depth=2, total_tokens=4)\n"
        "lm.generate('Say hi.', chat=True, max_new_tokens=4)\n"
        "print(sorted(m for m in sys.modules if m.startswith('vocabspec.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = {m.split(".")[1] for m in eval(done.stdout.strip().splitlines()[-1])}
    assert "generate" in loaded and "drafter" in loaded
    assert not loaded & (TRAINING | BENCHMARKING), sorted(loaded & (TRAINING | BENCHMARKING))
