"""Chat templates, rendered in a sandbox exactly as transformers renders them.

A model file's template is untrusted code that the server runs on every request. It runs in
jinja2's immutable sandbox with what transformers gives templates (trim_blocks and
lstrip_blocks, loop controls, `{% generation %}`, `raise_exception`, `strftime_now` for the
date the template asks for, transformers' `tojson`, `dict` and `namespace`), and sees messages
rebuilt from plain JSON values. A template that names Python internals (`__globals__`,
`__class__`, an `attr('__init__')`, ...) or trips the sandbox on a sample chat is refused when
the model loads, naming the file; the sandbox stops any other path at render time.

`mark_control_texts` stands each control token's text in the messages in for a private
character before rendering, so the tokenizer can tell the template's control tokens from
text a message holds (tokenizer.py puts the text back before tokenizing it as text).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache

from .vocab import PARSED_ONLY_ON_REQUEST

INTERNAL = {"mro", "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "f_globals",
            "f_locals", "f_builtins", "f_back", "tb_frame", "tb_next", "func_globals", "func_code"}
ATTRIBUTE_FILTERS = {"attr", "map", "selectattr", "rejectattr", "sort", "groupby", "sum", "unique",
                     "min", "max"}
# Conversations tried on a template as it loads: a sandbox violation on any refuses it.
SAMPLE_CHATS = ([{"role": "user", "content": "Hello"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                 {"role": "user", "content": "Bye"}])
# Private-use characters, of which a chat's control-token texts borrow some while it renders.
PRIVATE_USE = [chr(c) for c in range(0xE000, 0xF900)] + [chr(c) for c in range(0xF0000, 0xFFFFE)]


class ChatTemplateError(ValueError):
    """A chat template refused (it reaches Python internals) or failing on a conversation."""


class ChatTemplate:
    def __init__(self, source: str, where: str):
        import jinja2

        self.source, self.where = source, where
        env = _environment()
        try:
            self.compiled = env.from_string(source)
            reach = _internal_access(env.parse(source))
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{where}: its chat template is not valid Jinja (line {exc.lineno}: "
                                    f"{exc.message})") from exc
        if reach is None:
            reach = self._trial()
        if reach is not None:
            raise ChatTemplateError(f"{where}: its chat template reaches Python internals ({reach}); "
                                    "a model file's template is untrusted code, and this one is refused")

    def _trial(self) -> str | None:
        from jinja2.exceptions import SecurityError

        for chat in SAMPLE_CHATS:
            for opening in (True, False):
                try:
                    self.compiled.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=opening, bos_token="", eos_token="")
                except SecurityError as exc:
                    return str(exc)
                except Exception:    # noqa: BLE001 - a template may refuse a sample chat's roles
                    pass
        return None

    def render(self, messages: list[dict], add_generation_prompt: bool, tokens: dict[str, str]) -> str:
        """The rendered chat. tokens: the special tokens' texts by the names templates use
        (bos_token, eos_token, unk_token, pad_token)."""
        import jinja2
        from jinja2.exceptions import SecurityError

        chat = _alias_reasoning(_plain_messages(messages))
        try:
            return self.compiled.render(messages=chat, tools=None, documents=None,
                                        add_generation_prompt=bool(add_generation_prompt), **tokens)
        except SecurityError as exc:
            raise ChatTemplateError(f"{self.where}: its chat template reached Python internals ({exc}); "
                                    "not rendered") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template cannot render this conversation: {exc}") from exc


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6 (earlier sandboxes can be escaped); "
                          f"this is {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers' mark of an assistant's text,
        rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """transformers' namespace: no underscore-prefixed names, which lead to internals."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=Namespace)
    return env


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja's own escapes HTML characters.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the type's attributes."""
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _internal_name(name) -> bool:
    return isinstance(name, str) and any(part.startswith("__") or part in INTERNAL for part in name.split("."))


def _internal_access(tree) -> str | None:
    """The first place a template names a Python internal, or None."""
    from jinja2 import nodes

    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter, nodes.Test, nodes.Call)):
        where = f"line {node.lineno}"
        if isinstance(node, nodes.Getattr) and _internal_name(node.attr):
            return f"attribute {node.attr!r}, {where}"
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and _internal_name(node.arg.value):
            return f"item {node.arg.value!r}, {where}"
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.name in ATTRIBUTE_FILTERS:
            for arg in list(node.args) + [kw.value for kw in node.kwargs]:
                if isinstance(arg, nodes.Const) and _internal_name(arg.value):
                    return f"{node.name}({arg.value!r}), {where}"
        if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and \
                node.node.attr in ("format", "format_map") and isinstance(node.node.node, nodes.Const) and \
                re.search(r"\{[^}]*(\.|\[)_", str(node.node.node.value)):
            return f"format string {node.node.node.value!r}, {where}"
    return None


def _plain_messages(messages) -> list[dict]:
    """The messages as plain JSON values (transformers' rule: nothing with methods of its own
    reaches a template), keys whose value is None dropped."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("chat messages must be a list of objects ({role, content, ...})")
    return [{str(k): _plain(v) for k, v in m.items() if v is not None} for m in messages]


def _plain(value):
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise ValueError(f"a chat message holds a {type(value).__name__}: only JSON values (strings, "
                     "numbers, booleans, lists and objects) are passed to a chat template")


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # transformers fills reasoning_content from its other names, and thinking for gpt-oss's templates.
    out = []
    for message in chat:
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if message.get(k) is not None), None)
        out.append(message if reasoning is None else
                   {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def mark_control_texts(messages, special, avoid: tuple[str, ...] = ()):
    """(messages with every control token's text in them replaced by a private character,
    str.translate's table back), or (messages, None) where no message holds one. `special` is
    the vocabulary's SpecialTokens; the characters used occur in no message, in nothing in
    `avoid` and in no special token."""
    strings = list(_strings(messages))
    found = {special.tokens[i] for s in strings for i in special.present(s)
             if special.attrs[i] & PARSED_ONLY_ON_REQUEST}
    if not found:
        return messages, None
    used = set().union(*map(set, strings), *map(set, avoid), special.characters)
    free = (c for c in PRIVATE_USE if c not in used)
    order = sorted(found, key=lambda t: (-len(t), t))
    marks = dict(zip(order, free))
    if len(marks) < len(order):
        raise ValueError("the chat holds more distinct control tokens than there are free private characters")
    pattern = re.compile("|".join(map(re.escape, order)))
    marked = _map_strings(messages, lambda s: pattern.sub(lambda m: marks[m.group()], s))
    return marked, {ord(mark): text for text, mark in marks.items()}


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _map_strings(value, change):
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, change) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, change) for v in value]
    return value
