"""No function in vocabspec/ is over MAX_LINES lines: Python functions (nested ones included,
measured from `def` to their last line, decorators left out) and the C engine's top-level
function definitions (from the line that starts one at column 0 to its closing brace)."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vocabspec"
MAX_LINES = 80


def python_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method in `source`, nested ones too."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _blank_comments_and_literals(source: str) -> str:
    """`source` with its comments, strings and character constants blanked out (newlines
    kept), so that the braces left are the code's."""
    pattern = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), source)


# A definition starts at column 0 with a name (a type, a qualifier or a macro such as ALWAYS),
# not with a preprocessor line, a comment or a type declaration, and has a parameter list.
_STARTS = re.compile(r"^(?!typedef\b|struct\b|union\b|enum\b)[A-Za-z_]\w*[^;=]*\(")


def c_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every top-level function definition in C `source`: from
    the column-0 line that starts it to the line of the brace that closes its body."""
    lines = _blank_comments_and_literals(source).split("\n")
    found, i = [], 0
    while i < len(lines):
        if not _STARTS.match(lines[i]):
            i += 1
            continue
        start, depth, end = i, 0, None
        head = ""
        # To the body's '{', unless a ';' comes first, or a line at column 0 that is no '{'
        # (the start was a macro's use, such as VF_2(vf_add, ...), and that line starts anew).
        while i < len(lines) and end is None:
            if i > start and depth == 0 and lines[i][:1].strip() and not lines[i].startswith("{"):
                break
            for char in lines[i]:
                if depth == 0 and char == ";":
                    end = -1
                    break
                if char == "{":
                    depth += 1
                elif char == "}":
                    depth -= 1
                    if depth == 0:
                        end = i
                        break
                elif depth == 0:
                    head += char
            i += 1
        if end is not None and end >= 0:
            name = re.findall(r"(\w+)\s*\(", head)
            found.append((name[0] if name else head.strip(), start + 1, end - start + 1))
    return found


def too_long(lengths, path) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} {name}: {count} lines"
            for name, line, count in lengths if count > MAX_LINES]


def test_no_python_function_is_over_80_lines():
    long = [entry for path in sorted(PACKAGE.rglob("*.py"))
            for entry in too_long(python_lengths(path.read_text()), path)]
    assert not long, f"functions over {MAX_LINES} lines:\n" + "\n".join(long)


def test_no_c_function_is_over_80_lines():
    sources = sorted(PACKAGE.rglob("*.c")) + sorted(PACKAGE.rglob("*.h"))
    assert sources
    long = [entry for path in sources for entry in too_long(c_lengths(path.read_text()), path)]
    assert not long, f"functions over {MAX_LINES} lines:\n" + "\n".join(long)


def test_the_measures_see_long_functions_and_count_them_right():
    """Both scans find what they must: a long function, a nested one, a signature over
    several lines, a one-line body, braces in comments and strings; declarations are no
    definitions."""
    body = "\n".join(f"        x = {i}" for i in range(81))
    python = f"def outer():\n    def inner():\n{body}\n    return inner\n\n\ndef short():\n    pass\n"
    assert python_lengths(python) == [("outer", 1, 84), ("short", 87, 2), ("inner", 2, 82)]
    c = ("/* a { comment */\n"
         "#define TWICE(x) ((x) * 2)\n"
         "typedef struct {\n    int a;\n} pair;\n"
         "int declared(int a);\n"
         "static const int table[2] = {1, 2};\n"
         "int one(void) { return 1; }\n"
         "MACRO_USE(one, other)\n"
         "ALWAYS void two(int a,\n"
         "                int b) {\n"
         "    const char *s = \"}\";\n"
         "    if (a) {\n        b = '{';\n    }\n"
         "}\n")
    assert c_lengths(c) == [("one", 8, 1), ("two", 10, 7)]
    long_c = "void long_one(void) {\n" + "    x++;\n" * 80 + "}\n"
    assert too_long(c_lengths(long_c), PACKAGE / "x.c") == ["vocabspec/x.c:1 long_one: 82 lines"]
