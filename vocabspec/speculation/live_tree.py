"""The live tree-size rule: each step's EAGLE-2 tree sized from the drafter's calibrated
confidence and this machine's measured costs, as they are now.

The tuner (autotune.py) measures once which tree decodes fastest; that choice is only as good
as the machine was quiet when it ran, and one tree serves every prompt. Here it is a prior.
Each step:

- Before drafting: draft only where drafting has been paying, the speed of the last drafted
  steps against plain decoding's (the tokens each expects, scaled by this request's accepted
  over expected, over its costs; a running mean started from the tuner's measured speedup).
  A stretch of drafting starts where that speed reaches plain's and stops only below
  KEEP_DRAFTING of it, its steps weighed lightly (STEADY_WEIGHT): one step's speed swings
  with its drafter's confidence (a step that keeps the root alone still paid its drafting),
  and a gate that turned on the last few steps' mean spent half a prompt the drafter guesses
  well decoding plainly, waiting for probes. A request starts from the drafter's typical
  advantage (a running mean of the last requests' closing ones, the tuner's speedup its start),
  not the last request's: a prompt the drafter guessed badly says little of the next. Its
  first drafted steps weigh more, as a mean of their own with that start counted as
  REQUEST_STEPS steps: a prompt the drafter cannot guess, after one it guessed well, drafted at
  a loss for half its answer while a verdict from other text wore off. A step of steady drafting
  sets it to this request's speed as it stands (its drafted steps' drafts at the accepted over
  expected ratio it has now, over their costs, older steps fading) against that start: a mean
  of speeds each taken at its own step's ratio kept the first steps' optimism long after.
  Where it has not been paying, a step drafts anyway after PROBE_EVERY plain ones, so a
  verdict reached on a busy machine, or on a stretch the drafter could not guess, is tried
  again; each probe that does not pay doubles that wait, up to MOST_PROBE_EVERY steps (where
  no tree pays on this machine probes cost little), and one that pays is followed by another
  at the next step (text the drafter guesses drafts after two or three probes, not after
  PROBE_EVERY plain steps for each).
  A request's first step is a probe too. A probe verifies at least its best node, so that
  what it measures (this request's acceptance, the calibration) can move.
  Within a stretch whose advantage is below CHECK_BELOW, every CHECK_EVERY-th step is plain (a
  check, the stretch kept): the speed a drafted step is weighed against is a 1-row step's
  inside decoding, which a stretch never times otherwise (until then the curve's own 1-row
  time stands in, times the running scale), and where drafting barely pays a few per cent of
  error there decides it.
  At that longest wait the rule is `dormant`: the drafter reads only the last tokens before a
  probe (and of a prompt), so a drafter that does not pay here costs close to nothing.
- While drafting: a level expands only the frontier nodes that may pay (`TreeStop`): each
  node's calibrated chance, less the chance of the node a new one would push out of a tree
  already as large as it keeps (a bound on what its children can add), against what its row
  costs to draft and to verify, and the nodes together against the level's own drafting, all
  at the rate the last steps expected. A sure drafter drafts deep, a lost one stops after its
  first level, a level holds only the nodes whose children could pay, and a level that could
  only trade a kept node for one about as likely is not drafted.
- After drafting (a tree of up to `most` nodes): its nodes in value order (EAGLE-2's
  reranking: the best m nodes are a tree), each with its calibrated chance to be on the
  accepted path. The tree kept is the m that maximises the step's expected tokens per second,
  (1 + sum of the first m chances) / (c(1 + m) + a second head pass's chance times its cost
  + the step's drafting), m = 0 (the root alone) included. The drafting is spent by then, but
  it is part of the step whatever m is: weighed without it, a row had to pay at a rate no step
  reaches, and the trees kept were smaller than the speed of whole steps wants. The rate the
  step expects sets the next step's stop and room (m + 2 nodes). What a drafted step costs
  is its tree's growth plus the drafter's read of
  the tokens it accepts, as a step of steady drafting reads them (from the reads' running
  cost line): a probe after a run of plain steps reads them all at once, a catch-up that
  steady drafting would not pay, and charging it to the probe would keep a drafter that pays
  from ever being tried again.
- After verification: each verified node's outcome (on the accepted path or not) trains the
  calibration, a count per depth and confidence bin, starting from the drafter's raw
  confidence as a prior of PRIOR_WEIGHT observations, or from the counts an earlier run kept
  in the tuner's cache (autotune.keep_calibration); the step's time updates the costs; and a
  drafted step's speed against a plain step's (its expected drafts scaled by this request's
  accepted over expected) moves the advantage that decides whether drafting pays, and a
  probe's wait.

Each prior (the tuner's curve, its drafting level, the rate its speedup sets) counts as one
observation: a mean of the first steps, then a running one, so that figures the tuner took on
a busy machine wear off within a few steps of a quiet one.

Costs: c(rows) is the tuner's measured forward curve times that row count's own factor (what
its steps show it costs inside decoding, against the curve's: their mean, then a slow running
mean; one slope over every count swung with the mix of sizes), times a running scale (every
step's time, from one verification to the next less its drafting, over the model's at its rows,
so a busy spell raises every size alike and a quiet one lowers them again); drafting a tree of L
levels over R rows costs a line c + a L + b R fitted to the trees grown, and the drafter's read
of n accepted tokens a line a + b n fitted to the reads it made.

Exactness does not depend on any of it: any tree of the drafted nodes verifies exactly, and
greedy verification gives plain decoding's tokens whatever its size. A sampled request keeps
the fixed tree (`EagleProposer.size_live`): its tree must not depend on timing, so that a seed
gives the same tokens in a batch and alone.
"""

from __future__ import annotations

import array
import bisect
import math
import time

import torch

from .tree import Tree

BINS = 10                 # confidence bins per depth
PRIOR_WEIGHT = 4.0        # the raw confidence counts as this many observations of a bin
PATH_PRIOR = 0.5          # a grafted path's token's chance before any was verified
REQUEST_PRIOR = 2.0       # drafts a request's acceptance ratio starts from, as if accepted as expected
PROBE_EVERY = 8           # plain steps between drafted probes where drafting has not paid,
MOST_PROBE_EVERY = 64     # doubled by each probe that does not pay, up to this
WEIGHT = 0.1              # running means' weight of the latest step
GROWTH_WEIGHT = 0.02      # the drafting cost line's: a fit to one tree in ten swings with each
GROWTH_FIT_AFTER = 20     # trees grown before the line is fitted (a level's mean time until then)
ADVANTAGE_WEIGHT = 0.3    # the drafting advantage's: a probe moves it quickly; steady steps
STEADY_WEIGHT = 0.04      # weigh their request's drafted steps, older ones fading by this a step,
REQUEST_STEPS = 2         # against the request's start counted as this many steps (a new prompt
                          # is new text: what other text said is worth a couple of its steps)
TYPICAL_WEIGHT = 0.25     # a request's closing advantage in the drafter's typical one (a new
                          # request's start): a mean of the last few requests, not the last alone
KEEP_DRAFTING = 0.93      # a stretch stops where the advantage falls below this; starts at 1
CHECK_EVERY = 32          # drafted steps of a stretch between plain ones that time a 1-row step,
CHECK_BELOW = 1.25        # while its advantage is below this (above, no error in c(1) flips it)
KEEP_SEEN = 200.0         # observations a bin keeps from a previous run's calibration
SAVE_EVERY = 4096         # outcomes learned between saves of the calibration (and one at exit):
                          # a save rewrites the tuner's cache, milliseconds a small model's step
                          # should not pay every other request
FACTOR_WEIGHT = 0.01      # a row count's own cost over the curve's, learnt slowly: one step is
                          # noisy, and a busy spell should move the scale, hardly the factors
FACTOR_PRIOR = 4.0        # what a row count's price starts from counts as this many of its steps
MOST_FACTOR = 4.0         # a row count's cost stays within [1 / this, this] times the curve's
LOG_MOST_FACTOR = math.log(MOST_FACTOR)


def confidence_bin(value: float, bins: int) -> int:
    """The bin of a node's value (the log of its path confidence) among `bins` equal ones of
    confidence; NaN (a grafted row: no drafter's value) the lowest. native.c bins alike."""
    confidence = math.exp(value) if value == value else 0.0
    return min(bins - 1, int(confidence * bins))


class Calibration:
    """P(a drafted node is on the accepted path) by depth and by its path confidence."""

    def __init__(self, max_depth: int):
        self.hits = [[0.0] * BINS for _ in range(max_depth + 1)]
        self.seen = [[0.0] * BINS for _ in range(max_depth + 1)]
        # Every bin's chance (depth by depth), kept current as bins learn: each step reads them
        # all (`table`, a tensor over the same memory, made once).
        self._flat = array.array("d", [self._bin_chance(d, b) for d in range(max_depth + 1) for b in range(BINS)])
        self._table = torch.frombuffer(self._flat, dtype=torch.float64).view(max_depth + 1, BINS)

    def chance(self, depth: int, value: float) -> float:
        return self._flat[min(depth, len(self.seen) - 1) * BINS + confidence_bin(value, BINS)]

    def _bin_chance(self, depth: int, b: int) -> float:
        prior = (b + 0.5) / BINS
        return (self.hits[depth][b] + PRIOR_WEIGHT * prior) / (self.seen[depth][b] + PRIOR_WEIGHT)

    def learn(self, depths: list[int], values: list[float], on_path: list[bool]) -> None:
        for depth, value, hit in zip(depths, values, on_path):
            depth, b = min(depth, len(self.seen) - 1), confidence_bin(value, BINS)
            self.seen[depth][b] += 1
            self.hits[depth][b] += hit
            self._set(depth, b)

    def _set(self, depth: int, b: int) -> None:
        self._flat[depth * BINS + b] = self._bin_chance(depth, b)

    def table(self) -> torch.Tensor:
        """(depths, BINS) float64: every bin's chance, what TreeStop reads; it follows what the
        bins learn (a step's tree has grown before its outcomes are learnt)."""
        return self._table

    def state(self) -> dict:
        """The counts, as the tuner's cache keeps them (autotune.calibration_cache)."""
        return {"hits": [[round(h, 2) for h in row] for row in self.hits],
                "seen": [[round(n, 2) for n in row] for row in self.seen]}

    def load(self, state: dict | None) -> None:
        """Start from counts a previous run kept (`state`), each bin's scaled down to at most
        KEEP_SEEN observations, so the new run's outcomes still move it; a state of another
        shape, or none, leaves the drafter's raw confidence as the prior."""
        if not state:
            return
        hits, seen = state.get("hits"), state.get("seen")
        shape = [len(row) for row in self.seen]
        if not hits or not seen or [len(row) for row in seen] != shape or [len(row) for row in hits] != shape:
            return
        for d, (hits_d, seen_d) in enumerate(zip(hits, seen)):
            for b, (h, n) in enumerate(zip(hits_d, seen_d)):
                if n > 0 and 0 <= h <= n:
                    scale = min(1.0, KEEP_SEEN / n)
                    self.hits[d][b], self.seen[d][b] = h * scale, n * scale
                    self._set(d, b)


class PathChances:
    """P(a grafted path's i-th token is right, those before it right too): prompt lookup's path
    on EAGLE's tree, scored by its own measured acceptance, not by a drafter's confidence. Per
    position, the steps whose path reached it and those where it was right, from a prior of
    PRIOR_WEIGHT observations at PATH_PRIOR."""

    def __init__(self):
        self.hits: list[float] = []
        self.seen: list[float] = []

    def chances(self, length: int) -> list[float]:
        """The chance that the path's first 1, 2, ..., `length` tokens are all right."""
        out, chance = [], 1.0
        for i in range(length):
            hits, seen = (self.hits[i], self.seen[i]) if i < len(self.seen) else (0.0, 0.0)
            chance *= (hits + PRIOR_WEIGHT * PATH_PRIOR) / (seen + PRIOR_WEIGHT)
            out.append(chance)
        return out

    def learn(self, length: int, followed: int) -> None:
        """A verified path of `length` tokens whose first `followed` were right."""
        while len(self.seen) < length:
            self.hits.append(0.0)
            self.seen.append(0.0)
        for i in range(min(followed + 1, length)):
            self.seen[i] += 1
            self.hits[i] += i < followed


class TreeStop:
    """How far a step's EAGLE-2 tree grows (native.h's vs_tree_stop): each level expands the
    first w nodes of its frontier (value order), w maximising what they can add less
    `node_cost` each, and only where that reaches `min_gain` (expected tokens: a node's row and
    drafting, and a level's own drafting, at the rule's rate); w = 0 ends the tree. A child's
    chance to be on the accepted path is never above its parent's, and siblings' chances sum to
    at most their parent's, so a frontier node's chance bounds what its children can add; where
    the tree already holds the nodes it keeps, a child kept pushes out the last of them, and each
    can add at most its chance less that node's. Pricing each node's row keeps a level from
    drafting nodes whose children could not pay for theirs, the rows whole levels were dropped
    for. The tree's builder sets `levels` and `rows`: the levels it drafted, the root's children
    counted, and the rows its head scored over them."""

    def __init__(self, table: torch.Tensor, min_gain: float, node_cost: float = 0.0):
        self.table, self.min_gain, self.node_cost = table, min_gain, node_cost
        self.levels = self.rows = 0
        self._rows = None                   # the table on the host, read where Python grows the tree

    def width(self, depths: list[int], values: list[float], displaced: tuple[int, float] | None = None) -> int:
        """How many of the frontier's nodes (depths, values, in frontier order) the next level
        expands, `displaced` the (depth, value) of the node a new one would push out (None: room
        is left); summed in that order, as native.c's eagle_tree_level_width sums it."""
        if self._rows is None:
            self._rows = self.table.tolist()
        floor = self._chance(*displaced) if displaced else 0.0
        gain, best, width = 0.0, 0.0, 0
        for r, (depth, value) in enumerate(zip(depths, values)):
            more = self._chance(depth, value) - floor
            gain += (more if more > 0.0 else 0.0) - self.node_cost
            if gain > best:
                best, width = gain, r + 1
        return width if width and best >= self.min_gain else 0

    def _chance(self, depth: int, value: float) -> float:
        rows = self._rows
        return rows[min(depth, len(rows) - 1)][confidence_bin(value, len(rows[0]))]


class LiveCosts:
    """c(rows): a step's forward and verification over `rows` rows, now. The tuner's curve, timed
    on forwards back to back, is the prior; inside decoding, between the drafter's calls, the
    rows cost otherwise (the drafter's work leaves the caches cold, and the 2- and 4-row
    forwards are not the curve's distance apart), and one slope on the curve's extra rows,
    learnt from steps of several sizes, swung with their mix. So c(rows) is the curve times a
    factor of that row count's own (`log_factor`: what its steps cost over the scaled curve,
    their mean at first, then a slow running mean; a count not yet seen takes the nearest seen
    one's), all times the machine's running scale (a running mean of every step's log ratio: a
    busy spell raises every size alike, a quiet one lowers them again). Drafting is a line over
    a tree's levels and rows (`drafting`), and the drafter's read of n tokens (`read`) a line
    over n, each fitted to what was drafted and read."""

    def __init__(self, forward: dict[int, float], draft_level: float, head_pass: float = 0.0,
                 head_rows: int = 1 << 30):
        self.head_pass, self.head_rows = head_pass, head_rows     # a second head pass, its rows
        self.rows = sorted(forward)
        self.curve = [forward[n] for n in self.rows]
        # Read a few dozen times a step: the curve at each row count, the scale and the factors
        # kept as their values too, not their logs.
        self._priors = [self._curve_at(n) for n in range(2 * self.rows[-1] + 2)]
        self.log_scale, self._scale = 0.0, 1.0
        self._steps = 0                     # steps timed
        self.log_factor: dict[int, float] = {}  # rows -> log of its steps' cost over the scaled curve
        self._factor: dict[int, float] = {}     # rows -> exp(log_factor)
        self._seen: list[int] = []          # the row counts in `log_factor`, sorted
        self._count: dict[int, float] = {}  # rows -> its steps seen, FACTOR_PRIOR counted
        # Running sums of 1, L, R, t, L L, L R, R R, L t, R t over the trees grown (L levels, R
        # rows, t seconds), started as one tree of one level and row at the tuner's time.
        self._growth = [1.0, 1.0, 1.0, draft_level, 1.0, 1.0, 1.0, draft_level, draft_level]
        self._trees = 0
        self._reads = [0.0] * 5         # running sums of 1, n, t, n n, n t over the reads

    def prior(self, rows: int) -> float:
        """The tuner's curve at `rows`, linear between its sizes and beyond its largest."""
        return self._priors[rows] if rows < len(self._priors) else self._curve_at(rows)

    def _curve_at(self, rows: int) -> float:
        xs, ys = self.rows, self.curve
        if rows <= xs[0] or len(xs) == 1:
            return ys[0]
        for i in range(1, len(xs)):
            if rows <= xs[i]:
                return ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (rows - xs[-1])

    def _shape(self, rows: int) -> float:
        factor = self._factor.get(rows)
        if factor is not None:
            return self.prior(rows) * factor
        seen = self._seen
        if not seen or rows == 1:
            # A plain step is what the curve timed (forwards back to back, no drafter between
            # them): its factor starts at the curve's own, not a drafted count's.
            return self.prior(rows)
        i = bisect.bisect_left(seen, rows)
        near = seen[i] if i < len(seen) and (i == 0 or seen[i] - rows < rows - seen[i - 1]) else seen[i - 1]
        return self.prior(rows) * self._factor[near]

    def __call__(self, rows: int) -> float:
        return self._shape(rows) * self._scale

    def read(self, tokens: float) -> float:
        """Seconds the drafter's read of `tokens` tokens takes: the fitted line, or while its
        reads have all been of one length, their mean time per token."""
        ones, n, t, nn, nt = self._reads
        if not ones:
            return 0.0
        spread = ones * nn - n * n
        if spread <= 1e-9 * ones * ones:
            return t / n * tokens if n else 0.0
        slope = max(0.0, (ones * nt - n * t) / spread)
        return max(0.0, (t - slope * n) / ones + slope * tokens)

    def drafting(self) -> tuple[float, float]:
        """(a drafting level's seconds, a drafted row's): the line t = c + a L + b R fitted to
        the trees grown (c, what any tree costs, is spent before a level is weighed). A level
        runs the drafter and its head once over its frontier's rows, and a wide level costs
        more than a narrow one (the head's rows are most of it). Where the trees' rows have
        not varied apart from their levels, or that fit is not a cost, t = c + a L, nothing a
        row; where their levels have not varied either, or too few trees have grown to fit a
        line to, a level's mean time."""
        _, l, r, t, ll, lr, rr, lt, rt = (v / self._growth[0] for v in self._growth)   # means
        if self._trees < GROWTH_FIT_AFTER:
            return lt / ll, 0.0
        var_l, var_r, cov = ll - l * l, rr - r * r, lr - l * r
        cov_lt, cov_rt = lt - l * t, rt - r * t
        det = var_l * var_r - cov * cov
        if var_l > 0.0 and var_r > 0.0 and det > 0.01 * var_l * var_r:
            a, b = (var_r * cov_lt - cov * cov_rt) / det, (var_l * cov_rt - cov * cov_lt) / det
            if a >= 0.0 and b >= 0.0:
                return a, b
        if var_l > 1e-6 * ll and cov_lt >= 0.0:
            return cov_lt / var_l, 0.0
        return lt / ll, 0.0

    def grew(self, levels: int, rows: int, seconds: float) -> None:
        """A tree grew `levels` levels over `rows` rows in `seconds`."""
        if levels > 0 and seconds > 0.0:
            self._trees += 1
            values = (1.0, levels, rows, seconds, levels * levels, levels * rows, rows * rows,
                      levels * seconds, rows * seconds)
            # The prior counts as one tree: a mean of the trees grown at first (a prior the
            # tuner timed on a busy machine wears off in a few trees), then a running one.
            weight = max(GROWTH_WEIGHT, 1.0 / (1 + self._trees))
            for i, value in enumerate(values):
                self._growth[i] += weight * (value - self._growth[i])

    def read_took(self, tokens: int, seconds: float) -> None:
        """The drafter read `tokens` tokens in `seconds`."""
        if tokens > 0 and seconds > 0.0:
            for i, value in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
                self._reads[i] += WEIGHT * (value - self._reads[i])

    def step(self, rows: int, seconds: float) -> None:
        """A step's forward and verification over `rows` rows took `seconds`."""
        if seconds <= 0.0:
            return
        prior = self.prior(rows)
        self._steps += 1        # the curve counts as one step: a mean of the first ones, then running
        weight = max(WEIGHT, 1.0 / (1 + self._steps))
        self.log_scale += weight * (math.log(seconds / self._shape(rows)) - self.log_scale)
        self._scale = math.exp(self.log_scale)
        shown = min(LOG_MOST_FACTOR, max(-LOG_MOST_FACTOR, math.log(seconds / prior) - self.log_scale))
        if rows not in self.log_factor:      # from the nearest seen count's, as it was priced
            self.log_factor[rows] = math.log(self._shape(rows) / prior)
            self._count[rows] = FACTOR_PRIOR
            bisect.insort(self._seen, rows)
        self._count[rows] += 1          # a mean of its steps at first, then a running one
        self.log_factor[rows] += max(FACTOR_WEIGHT, 1.0 / self._count[rows]) * (shown - self.log_factor[rows])
        self._factor[rows] = math.exp(self.log_factor[rows])


class LiveSizing:
    """The rule for one proposer (see the module docstring). `forward`: the tuner's forward
    curve (rows -> seconds); `draft_level`: its seconds a drafting level; `prior_speedup`: the
    tuner's measured speedup of its tree; `total`: its tree's nodes (0 where none paid);
    `most_depth`, `most`: the largest tree a step drafts. `persist(state)`, where set, keeps
    the calibration (the tuner's cache) every SAVE_EVERY outcomes and at `save`."""

    def __init__(self, forward: dict[int, float], draft_level: float, prior_speedup: float,
                 total: int, most_depth: int, most: int, head_pass: float = 0.0,
                 head_rows: int = 1 << 30):
        self.costs = LiveCosts(forward, draft_level, head_pass, head_rows)
        self.calibration = Calibration(most_depth)
        self.most_depth, self.most = most_depth, most
        self.advantage = prior_speedup          # drafted steps' speed over plain's, running
        self.typical = prior_speedup            # the advantage a request starts from
        self.stretch = False                    # whether the last step drafted as a stretch's step
        self.rate = prior_speedup / self.costs(1)   # expected tokens a second of the trees kept
        self._chosen = 0                        # trees chosen (the rate's prior counts as one)
        self.total = max(1, min(total or 3, most))      # the nodes a step drafts to choose from
        self.plain_steps = 0
        self.drafted_steps = 0                  # drafted steps since the last plain one
        self._checking = False                  # whether this step is a stretch's plain check
        self.probe_every = PROBE_EVERY          # plain steps before a probe, while drafting does not pay
        self._probing = False                   # whether this step drafts as a probe
        self._drafting = False                  # whether this step drafted (`plan` said so)
        self._grow_seconds = 0.0
        self._expected = 0.0                    # the drafts this step's tree expects accepted
        self._accepted = self._expected_sum = 0.0   # this request's drafts accepted, and expected
        # This request's drafted steps, fading: their count and their cost in plain steps.
        self._request_weight = self._request_cost = 0.0
        self.stop: TreeStop | None = None       # where this step's tree stops growing
        self.tree: Tree | None = None           # the tree verified this step (drafted nodes)
        self.extra_rows = 0                     # rows grafted onto it (prompt lookup's path)
        self._observed = None                   # when the last step's verification was seen
        self._draft_seconds = 0.0
        self.sizes: list[tuple[float, int]] = []    # (root's best child confidence, size) a step
        self.keep_sizes = False
        self.persist = None
        self._unsaved = 0
        self.path = PathChances()               # a grafted path's tokens' measured chances

    # ---- before drafting

    def start(self) -> None:
        """A new request: its first step's time would hold its prefill, and where drafting has
        not been paying its first step is a probe (a new prompt is a new stretch of text: what
        the drafter guesses there is worth one probe, not a wait the last prompt set)."""
        self._observed, self.tree, self.extra_rows, self._draft_seconds = None, None, 0, 0.0
        self.plain_steps = max(self.plain_steps, self.probe_every)
        if self._request_weight:    # the last request drafted: its verdict joins the typical one it started from
            self.typical += TYPICAL_WEIGHT * (self.advantage - self.typical)
        self.advantage, self.stretch = self.typical, False
        self._accepted = self._expected_sum = self._request_weight = self._request_cost = 0.0
        if self._unsaved >= SAVE_EVERY:
            self.save()

    def save(self) -> None:
        """Keep the calibration where `persist` keeps it (nothing without one)."""
        if self.persist is not None and self._unsaved:
            self.persist(self.calibration.state())
        self._unsaved = 0

    @property
    def paying(self) -> bool:
        """Whether drafting pays: its advantage reaches plain decoding's speed, or, within a
        stretch of drafting, has not fallen below KEEP_DRAFTING of it."""
        return self.advantage >= (KEEP_DRAFTING if self.stretch else 1.0)

    def drafts(self) -> bool:
        """Whether the next step drafts: where drafting has been paying (but for a stretch's
        plain checks), and every `probe_every`-th step where it has not."""
        if self.paying:
            return not self._checks()
        return self.plain_steps >= self.probe_every

    def _checks(self) -> bool:
        """Whether the next step is a stretch's plain check (see the module docstring)."""
        return self.stretch and self.advantage < CHECK_BELOW and self.drafted_steps >= CHECK_EVERY

    @property
    def dormant(self) -> bool:
        """Whether drafting has not paid for long: probes have waited their longest and the
        last did not pay. The proposer then keeps its drafter's context short (`EagleProposer`)."""
        return not self.paying and self.probe_every >= MOST_PROBE_EVERY

    def plan(self) -> tuple[int, int]:
        """The tree to draft this step, (depth, nodes kept to choose from), and where it stops
        growing (`stop`): a level is drafted while it may pay at the rate the rule expects,
        its drafting and a row's forward counted; (0, 0): the root alone."""
        self.tree = None
        if not self.drafts():
            self._checking = self.paying
            return 0, 0
        self.plain_steps = 0
        self.drafted_steps += 1
        self._probing = not self.paying
        self._drafting = True
        costs = self.costs
        row = (costs(1 + self.total) - costs(1)) / self.total
        level, drafted_row = costs.drafting()
        self.stop = TreeStop(self.calibration.table(), self.rate * level, self.rate * (drafted_row + row))
        return self.most_depth, self.total

    def next_size(self) -> int:
        """The next proposal's drafted rows, as far as known before drafting (a batch's budget)."""
        return self.total if self.drafts() else 0

    def path_rows(self, length: int) -> int:
        """How many of a grafted path's `length` tokens to verify: while each one's chance to be
        right with those before it (`path`, measured) pays for its row at the rule's rate, the
        rows counted after the tree this step may keep; none on a stretch's plain check, which
        times a 1-row step."""
        if self.paying and self._checks():
            return 0
        costs, rows, kept = self.costs, 1 + (self.total if self.drafts() else 0), 0
        for chance in self.path.chances(length):
            if chance < self.rate * (costs(rows + 1) - costs(rows)):
                break
            rows, kept = rows + 1, kept + 1
        return kept

    # ---- after drafting

    def choose(self, tree: Tree, drafted_levels: int, grow_seconds: float, read_seconds: float = 0.0,
               read_tokens: int = 0, started: float | None = None) -> Tree:
        """The best tree of `tree`'s drafts (see the module docstring), and the running means
        of drafting's costs and rate updated. `grow_seconds`: the tree's growth over
        `drafted_levels` levels; `read_seconds`: the drafter's read of `read_tokens` accepted
        tokens before it; `started`: when the proposal began, where the proposer knows it (what
        it spends past the growth and the read, this choice and its trees' conversions, is the
        step's drafting too: a tenth of a millisecond that a small model's step of a few
        pays)."""
        self.costs.read_took(read_tokens, read_seconds)
        if drafted_levels:
            rows = self.stop.rows if self.stop is not None and self.stop.rows else drafted_levels
            self.costs.grew(drafted_levels, rows, grow_seconds)
        host = tree.rows()
        ranks, values, depths = host.ranks, host.values, host.depths
        order = sorted(range(1, len(ranks)), key=ranks.__getitem__)
        chance = self.calibration.chance
        chances = [chance(depths[row], values[row]) for row in order]
        costs = self.costs
        # What the step spent drafting is spent, but it is part of every choice's step: a
        # choice weighed without it weighs rows against a rate the step cannot reach, and keeps
        # nodes only where they pay more than they do.
        rates = self._rates(order, chances, grow_seconds)
        best_m, best_rate = 0, 1.0 / (costs(1 + self.extra_rows) + grow_seconds + costs.read(1.0))
        for m, rate in enumerate(rates, 1):
            if rate > best_rate:
                best_m, best_rate = m, rate
        if self._probing and not best_m and order:
            # A probe verifies at least its best node: one that verifies nothing measures
            # nothing, and neither this request's acceptance nor the calibration could move.
            best_m, best_rate = 1, rates[0]
        if self.keep_sizes:
            first = max((math.exp(values[row]) for row in order if depths[row] == 1), default=0.0)
            self.sizes.append((first, best_m))
        self.tree = tree.best(best_m)
        grown = grow_seconds
        if started is not None:
            grow_seconds = max(grow_seconds, time.perf_counter() - started - read_seconds)
        self._draft_seconds, self._grow_seconds = grow_seconds + read_seconds, grow_seconds
        # The rate the step expects sets the next step's stop and room: its growth and this
        # choice, and the read of the tokens it accepts as steady drafting would read them.
        self._expected = sum(chances[:best_m])
        gain = 1.0 + self._expected
        rate = gain / (gain / best_rate + grow_seconds - grown)
        self._chosen += 1
        self.rate += max(WEIGHT, 1.0 / (1 + self._chosen)) * (rate - self.rate)
        # The next step drafts room for two nodes more than this one kept: a forward's cost is
        # not convex in its rows (on the native engine 3 rows can cost more than 4), and room
        # for one more would offer a tree that kept one node only the dearer next size.
        self.total = max(2, min(self.most, best_m + 2))
        return self.tree

    def _rates(self, order: list[int], chances: list[float], drafting: float) -> list[float]:
        """Expected tokens per second of the trees of the first 1, 2, ... nodes of `order` (rows
        in value order, with their chances), `drafting` seconds on top and the drafter's read of
        the tokens each expects accepted, as steady drafting reads them. Greedy verification
        scores the head over a tree's first `head_rows` rows; a path that goes past them costs
        another pass (on Gemma's 262k-row head a quarter of a step): the chance of that is
        the summed chances of the kept nodes placed past the first pass."""
        costs, extra, first = self.costs, self.extra_rows, self.costs.head_rows
        kept: list[int] = []
        chance_of = dict(zip(order, chances))
        rates, gain = [], 1.0
        for m, (row, p) in enumerate(zip(order, chances), 1):
            gain += p
            bisect.insort(kept, row)        # the kept tree's rows keep the drafted tree's order
            second = min(1.0, sum(chance_of[r] for r in kept[first - 1:])) if m >= first else 0.0
            rates.append(gain / (costs(1 + m + extra) + drafting + costs.read(gain) + second * costs.head_pass))
        return rates

    # ---- after verification

    def observe(self, accepted: list[int]) -> None:
        """The step verified (its accepted tokens, the root first): outcomes and costs. A
        step's cost is the time since the last step's verification less its drafting: the
        forward, verification and the loop's own work, whether the step drafted or not. A
        drafted step's speed against a plain step's sets whether drafting pays: the drafts its
        tree's calibrated chances expect, scaled by what this request's drafted steps have
        accepted of what they expected (the calibration is every prompt's; a prompt the drafter
        guesses well or badly shows in its own steps), over what its rows, its growth and the
        read of its tokens cost now."""
        now = time.perf_counter()
        tree = self.tree
        rows = 1 + (tree.size if tree is not None else 0) + self.extra_rows
        step = now - self._observed - self._draft_seconds if self._observed is not None else None
        if step is not None:
            self.costs.step(rows, step)
        if self._drafting:       # what it expects, as this request has been accepting, at what it costs now
            costs = self.costs
            # This request's drafted steps, the older ones fading (by STEADY_WEIGHT a step): the
            # drafts they accepted and expected, and what they cost in plain steps.
            fade = 1.0 - STEADY_WEIGHT
            self._accepted = fade * self._accepted + len(accepted) - 1
            self._expected_sum = fade * self._expected_sum + self._expected
            ratio = (self._accepted + REQUEST_PRIOR) / (self._expected_sum + REQUEST_PRIOR)
            gain = 1.0 + self._expected * ratio
            cost = (costs(rows) + self._grow_seconds + costs.read(gain)) / costs(1)
            self._request_weight = fade * self._request_weight + 1.0
            self._request_cost = fade * self._request_cost + cost
            if self._probing:    # a probe that paid is followed by another; one that did not waits
                speed = gain / cost
                self.probe_every = 0 if speed > 1.0 else min(MOST_PROBE_EVERY, max(PROBE_EVERY, 2 * self.probe_every))
                self.advantage += ADVANTAGE_WEIGHT * (speed - self.advantage)      # moved quickly
            else:
                # A step of steady drafting: this request's speed as it stands, its steps' drafts
                # at the ratio it has now over their costs, against the start counted as
                # REQUEST_STEPS steps. (A mean of speeds each taken at its own step's ratio kept
                # the first steps' optimism long after the ratio had fallen.)
                n = self._request_weight
                request = (n + ratio * self._expected_sum) / self._request_cost
                self.advantage = (REQUEST_STEPS * self.typical + n * request) / (REQUEST_STEPS + n)
            self.stretch = not self._probing or self.advantage >= 1.0
            self._drafting, self._grow_seconds = False, 0.0
        else:
            self.stretch = self.stretch and self._checking
            self.drafted_steps, self._checking = 0, False
        if tree is not None and tree.size:
            self.plain_steps = 0
            on_path, host = path_rows(tree, accepted), tree.rows()
            self.calibration.learn(host.depths[1:], host.values[1:],
                                   [row in on_path for row in range(1, tree.size + 1)])
            self._unsaved += tree.size
        else:
            self.plain_steps += 1
        self.tree, self.extra_rows, self._draft_seconds = None, 0, 0.0
        self._observed = time.perf_counter()


def path_rows(tree: Tree, accepted: list[int]) -> set[int]:
    """The tree's rows on the accepted path (tokens after the root, followed from the root)."""
    children, tokens = tree.children, tree.rows().tokens
    row, rows = 0, set()
    for token in accepted[1:]:
        row = next((child for child in children[row] if tokens[child] == token), None)
        if row is None:
            break
        rows.add(row)
    return rows
