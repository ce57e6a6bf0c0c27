"""What runs a target model: one object per backend, behind one interface the loop, the drafters
and the tuner share.

A `Backend` is chosen when the model loads (loading.load_model) and never asked which it is:
- `NativeBackend` (native_backend.py): the native CPU engine over the GGUF's own blocks, every
  row in one fixed order, so a tree's rows and a batch's carry the bits of one-token decoding;
- `TorchBackend` (torch_backend.py): the flag-free reference `Transformer` on torch's kernels,
  any device; `KernelBackend` the same weights on the row-invariant Triton kernels (exact on a
  GPU); either over slot caches when a batch runs its requests as rows of one forward;
- `GraphBackend` (decoding/graph_step.py): greedy steps captured as CUDA graphs.

Each takes a step's rows (`StepRows`) through `forward`, fills in greedy verdicts with
`verify_greedy`, and offers what drafters and verification read: the embedding, the LM head,
the final norm, the RoPE tables, a KV cache. The layer, the tree forward and greedy
verification are written once per backend; nothing outside a backend's module branches on
which one runs.
"""

from __future__ import annotations

import threading

import torch

from .model import check_sequence
from .step_rows import RowSpan, StepRows

HEAD_ROWS = 4           # rows torch's kernels send through the LM head at a time (verify.TreeLogits)
PREFILL_CHUNK = 512     # prompt tokens a prefill forward takes at once (and a proposer's read)


def greedy_walk(tokens: list[int], parents: list[int], best: list[int]) -> tuple[list[int], int]:
    """Greedy verification on the host: from the root, the first child (in row order) whose
    token is its parent's argmax `best`, while there is one; (the accepted rows, the argmax at
    the last). The native engine's verifier walks the same way."""
    children: dict[int, list[int]] = {}
    for row in range(1, len(parents)):
        children.setdefault(parents[row], []).append(row)
    node, path = 0, [0]
    while True:
        match = next((c for c in children.get(node, ()) if tokens[c] == best[node]), None)
        if match is None:
            return path, best[node]
        node = match
        path.append(node)


class Backend:
    """The interface every backend implements (see the module docstring). Attributes:
    `args` (model.ModelArgs), `runs_on` (what runs it, and why), `weights` (the run-time weight
    format), `exact` (whether a row's bits never depend on the rows beside it), `memory`
    (loading.MemoryNeed), `head_rows` (rows the LM head scores at a time for about one row's
    cost), `lock` (held by whoever steps it: its scratch serves one caller at a time),
    `packed_head` (the LM head in the engine's own format, where draft heads may score with
    it; None elsewhere) and `drafter_format` (the format a drafter beside it packs its weights
    in, to draft on the same engine; None where drafters run on torch)."""

    runs_on = ""
    weights = ""
    exact = False
    memory = None
    head_rows = HEAD_ROWS
    packed_head = None
    drafter_format: str | None = None
    device_steps = False    # whether its forwards run over a device cache (graph steps)

    def __init__(self, args):
        self.args = args
        self.lock = threading.RLock()

    # ------------------------------------------------------------ what each backend provides

    device: torch.device
    dtype: torch.dtype
    rope: dict          # "global" (and "local" where sliding layers rotate their own way): (cos, sin)
    norm: torch.nn.Module   # the final norm (drafters read the target's features through it)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight as floats (training and SpecVocab's exact head read it)."""
        raise NotImplementedError

    @property
    def scoring_head(self):
        """What a full draft head scores with: the head in the engine's own format where it has
        one (`packed_head`), else its floats."""
        return self.head_weight if self.packed_head is None else self.packed_head

    def new_cache(self, max_len: int | None = None):
        raise NotImplementedError

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embedding_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' rows of the embedding table as they are (unscaled: EAGLE-3 drafters read
        them so)."""
        raise NotImplementedError

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (rows, vocab), float32, from pre-norm hidden states (rows, dim)."""
        raise NotImplementedError

    def forward(self, rows: StepRows) -> StepRows:
        """Every span's rows after its cache's committed tokens (left pending there): the
        hidden states before the final norm, and the `taps` layers' outputs, set on `rows`."""
        raise NotImplementedError

    def tree_forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, tree_mask=None,
                     taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence's rows after `cache`'s committed and pending slots (a draft model's tree
        growing level by level): causal after every pending slot, or as `tree_mask` (n, pending
        + n) shows them; (hidden states before the final norm, the taps' outputs or None)."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (the first index on ties) from pre-norm hidden states."""
        return self.lm_head(hidden).argmax(-1)

    def verify_greedy(self, rows: StepRows, spans: list[RowSpan]) -> None:
        """Greedy verification of `spans` (trees of a forward `rows` has run): each span's
        `path` and `next_token`."""
        if not spans:
            return
        hidden = torch.cat([rows.hidden_of(span) for span in spans])
        trees = [(span.tokens, span.parents if span.parents is not None else torch.arange(-1, span.rows - 1))
                 for span in spans]
        for span, (path, following) in zip(spans, self.verify_greedy_trees(hidden, trees)):
            span.path, span.next_token = path, following

    def verify_greedy_trees(self, hidden: torch.Tensor, trees: list[tuple[torch.Tensor, torch.Tensor]]
                            ) -> list[tuple[list[int], int]]:
        """Greedy verification of trees (tokens, parents) whose rows follow one another in
        `hidden`: per tree, the accepted rows (root first) and the target's token after them.
        Here every row is scored; the native engine scores rows as the walk reaches them."""
        best = self.greedy_tokens(hidden).tolist()
        verdicts, first = [], 0
        for tokens, parents in trees:
            verdicts.append(greedy_walk(tokens.tolist(), parents.tolist(), best[first:first + tokens.numel()]))
            first += tokens.numel()
        return verdicts

    def check(self, rows: StepRows) -> None:
        """ValueError unless every span can run: after committed tokens, within the model's
        positions and its cache's room; taps among the model's layers."""
        for span in rows.spans:
            if span.cache.pending:
                raise ValueError("a step's rows go after committed tokens: commit first")
            check_sequence(self.args, span.rows, span.cache, rows.taps)

    def together(self, allow_inexact: bool, asked: bool | None = None) -> bool:
        """Whether a batch runs its requests as rows of one forward over a slot table
        (`caches(together=True)`): as `asked`, or by default where None; ValueError where asked
        and this backend may not. Here never: a step is one call already."""
        if asked:
            raise ValueError("batched rows run on torch's kernels or the row-invariant ones; the native "
                             "engine steps every request's rows in one call already")
        return False

    def caches(self, count: int, window: int, together: bool = False) -> list:
        """`count` KV caches of `window` tokens, for a batch's slots; together: where its
        requests' rows run as one forward over them (a backend that batches so overrides)."""
        return [self.new_cache(window) for _ in range(count)]

    def run(self, tokens: torch.Tensor, cache, taps: tuple[int, ...] = (),
            parents: torch.Tensor | None = None) -> StepRows:
        """One sequence's rows through `forward` (causal, or a tree with `parents`)."""
        rows = StepRows(taps=taps)
        rows.add(tokens, cache, parents)
        self.check(rows)
        return self.forward(rows)

    def prefill(self, prompts: list[tuple[list[int], object, tuple[int, ...]]]) -> list[tuple]:
        """Commit each (prompt ids, cache, taps) prompt to its cache: per prompt, (the rows its
        proposer reads: each token's tapped outputs then its hidden state; its last row's
        logits). A prompt runs in chunks of PREFILL_CHUNK tokens, fixed whatever else runs;
        several prompts' chunks share a forward while it holds at most PREFILL_CHUNK rows."""
        chunks = [[(start, min(start + PREFILL_CHUNK, len(ids))) for start in range(0, len(ids), PREFILL_CHUNK)]
                  for ids, _, _ in prompts]
        tokens = [torch.tensor(ids, dtype=torch.long, device=self.device) for ids, _, _ in prompts]
        states: list[list[torch.Tensor]] = [[] for _ in prompts]
        last: list[torch.Tensor | None] = [None] * len(prompts)
        taps = tuple(sorted({t for _, _, wanted in prompts for t in wanted}))
        while any(chunks):
            rows, members = StepRows(taps=taps), []
            for i, todo in enumerate(chunks):
                if todo and (not rows.spans or rows.rows + todo[0][1] - todo[0][0] <= PREFILL_CHUNK):
                    start, end = todo.pop(0)
                    rows.add(tokens[i][start:end], prompts[i][1])
                    members.append(i)
            self.check(rows)
            self.forward(rows)
            for i, span in zip(members, rows.spans):
                span.cache.commit()
                hidden = rows.hidden_of(span)
                states[i].append(torch.cat([*rows.tapped_of(span, prompts[i][2]), hidden], dim=-1))
                last[i] = hidden[-1:]
        return [(torch.cat(rows) if len(rows) > 1 else rows[0], self.lm_head(end)) for rows, end in zip(states, last)]

    def prepare(self, generation) -> None:
        """Before a request's prefill: give it the cache and proposer this backend steps it with
        where they are its own (the graph decoder's, for a greedy request); nothing here."""
