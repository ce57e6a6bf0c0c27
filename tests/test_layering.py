"""The package's layers, one folder each: the runtime (model, formats, caches, backends)
imports no other part; speculation (the core: trees, verification, sampling, the proposer
interface, the drafting config; the draft vocabularies; the drafting families) only the runtime;
decoding (the loop) those two; tuning (the timed tree sizes, the proposer a config builds)
those three; serving (the server, the API) the four below it; training and benchmarking, which
the core never imports, any of those but not each other. Inside speculation the families
import only the core, and neither the core nor the loop imports a family. No two modules import
each other in a cycle (function-level imports included), and loading a model with a drafter and
generating loads no training module."""

import ast
import subprocess
import sys
from pathlib import Path

import vocabspec

PACKAGE = Path(vocabspec.__file__).parent
# Each part and the parts it may import (besides itself). The root's modules (the CLI, export,
# the package's __init__) are entry points: they may import any part.
MAY_IMPORT = {
    "runtime": set(),
    "speculation": {"runtime"},
    "decoding": {"runtime", "speculation"},
    "tuning": {"runtime", "speculation", "decoding"},
    "serving": {"runtime", "speculation", "decoding", "tuning"},
    "training": {"runtime", "speculation", "decoding", "tuning", "serving"},
    "benchmarks": {"runtime", "speculation", "decoding", "tuning", "serving"},
}
FAMILIES = "speculation.families"
ROOT_MODULES = 12          # at most, at the package's root


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def imports() -> dict[str, set[str]]:
    """Each vocabspec module ("part.module", or "module" at the root) -> the vocabspec modules it
    imports, at any depth of the file."""
    paths = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent == PACKAGE]
    names = {module_name(p) for p in paths}
    graph = {}
    for path in paths:
        package = module_name(path).split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[:len(package) - node.level + 1]
            elif (node.module or "").startswith("vocabspec."):
                base = []
            else:
                continue
            module = (node.module or "").removeprefix("vocabspec.").split(".") if node.module else []
            stem = base + [m for m in module if m]
            found.add(".".join(stem))
            found.update(".".join(stem + [alias.name]) for alias in node.names)
        graph[module_name(path)] = found & names
    return graph


def part(module: str) -> str | None:
    return module.split(".")[0] if "." in module else None


def test_the_root_holds_few_modules_and_every_module_a_part():
    root = [p.name for p in PACKAGE.glob("*.py")]
    assert len(root) <= ROOT_MODULES, root
    assert {part(m) for m in imports()} - {None} == set(MAY_IMPORT)


def test_each_part_imports_only_the_parts_below_it():
    graph = imports()
    assert {"runtime.model", "decoding.generate", "speculation.families.eagle", "runtime.native"} <= set(graph)
    bad = sorted((m, d) for m in graph for d in graph[m]
                 if part(m) and part(d) != part(m) and part(d) not in MAY_IMPORT[part(m)])
    assert not bad, f"imports across the layers: {bad}"


def test_the_core_and_the_loop_import_no_drafting_family():
    graph = imports()
    families = {m for m in graph if m.startswith(FAMILIES + ".")}
    assert {"speculation.families.eagle", "speculation.families.pld", "speculation.families.medusa"} <= families
    core = [m for m in graph if (part(m) == "speculation" and m not in families) or part(m) == "decoding"]
    assert {"speculation.tree", "speculation.config", "speculation.vocab.draft_vocab", "decoding.batch"} <= set(core)
    bad = sorted((m, d) for m in core for d in graph[m] if d == FAMILIES or d.startswith(FAMILIES + "."))
    assert not bad, f"the core or the loop imports a drafting family: {bad}"


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
    assert {"speculation", "runtime", "serving"} <= loaded
    assert not loaded & {"training", "benchmarks"}, sorted(loaded)
