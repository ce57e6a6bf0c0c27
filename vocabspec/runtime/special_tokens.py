"""Where a text's special tokens are, found as llama.cpp finds them (tokenizer_st_partition).

Special tokens are the control, unknown and user-defined ones (vocab.py). The longest come
first: each is cut out of every stretch of text still unclaimed, wherever it occurs, and the
text between stays text for the tokenizer's pipeline. User-defined tokens are always cut out;
control and unknown ones only where special tokens are parsed. A token marked to strip spaces
on its left or right (Phi-3's) takes the ASCII spaces there with it.

Which special tokens occur at all is found in one scan of the text (a pattern of every special
token's text, tried at each place a token could start), so a long vocabulary of them (Gemma's
six thousand) costs a text no more than a short one.
"""

from __future__ import annotations

import re

from .vocab import ATTR_LSTRIP, ATTR_RSTRIP, PARSED_ONLY_ON_REQUEST, SPECIAL_ATTRS

ASCII_SPACES = " \t\n\v\f\r"      # C's isspace, which llama.cpp strips with


class SpecialTokens:
    def __init__(self, tokens: list[str], attrs: list[int]):
        self.tokens, self.attrs = tokens, attrs
        special = [i for i, attr in enumerate(attrs) if attr & SPECIAL_ATTRS]
        # llama.cpp sorts them by the length of their text in bytes, longest first.
        order = sorted(special, key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self.rank = {token: place for place, token in enumerate(order)}
        self.ids = {tokens[i]: i for i in special}
        self.characters = set("".join(self.ids))
        # Every special text's special prefixes (itself included): the scan finds the longest
        # token at each place, and these are the shorter ones that start there too.
        self.prefixes = {text: [self.ids[text[:k]] for k in range(1, len(text) + 1) if text[:k] in self.ids]
                         for text in self.ids}
        self.pattern = re.compile(_alternatives(list(self.ids)), re.DOTALL) if self.ids else None

    def present(self, text: str) -> set[int]:
        """The special tokens whose text occurs in `text`."""
        found, pos = set(), 0
        if self.pattern is None:
            return found
        while (match := self.pattern.search(text, pos)) is not None:
            found.update(self.prefixes[match.group()])
            pos = match.start() + 1
        return found

    def split(self, text: str, parse_special: bool) -> list[str | int]:
        """`text` as its pieces in order: stretches of text (str) and special tokens (int)."""
        pieces: list[str | int] = [text] if text else []
        for token in sorted(self.present(text), key=self.rank.__getitem__):
            if not parse_special and self.attrs[token] & PARSED_ONLY_ON_REQUEST:
                continue
            pieces = [part for piece in pieces
                      for part in (self._cut(piece, token) if isinstance(piece, str) else (piece,))]
        return pieces

    def _cut(self, text: str, token: int) -> list[str | int]:
        needle, attr = self.tokens[token], self.attrs[token]
        out: list[str | int] = []
        start = 0
        while (at := text.find(needle, start)) >= 0:
            left = text[start:at]
            if attr & ATTR_LSTRIP:
                left = left.rstrip(ASCII_SPACES)
            if left:
                out.append(left)
            out.append(token)
            start = at + len(needle)
            if attr & ATTR_RSTRIP:
                while start < len(text) and text[start] in ASCII_SPACES:
                    start += 1
        if start < len(text):
            out.append(text[start:])
        return out


def _alternatives(texts: list[str]) -> str:
    """A regular expression matching the longest of `texts` that starts where it is tried: a
    trie of their characters, longer continuations tried before ending."""
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if len(branches) == 1 and len(body) > 1 and "" in node:
            body = "(?:" + body + ")"
        return body + "?" if "" in node else body

    return pattern(trie)
