"""A training run's settings, one dataclass per concern, and the run's `TrainConfig` over them.

`vocabspec train` builds each option from its field (cli.field_option), so a default is
declared once, here. An option's name is its field's, with the group's prefix where the group
has one (`RankerConfig.lr` is --ranker-lr); `TrainConfig.of` takes settings by those names.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields


@dataclass(slots=True)
class DataConfig:
    """The data stage: the conversations, prompts and answers a drafter learns from."""
    prefix = ""
    conversations: int = 1200       # training conversations (after the held-out ones)
    heldout: int = 48
    max_len: int = 1024             # tokens per sequence (longer conversations are cut)
    self_distill: int = 0           # ShareGPT prompts the target answers itself (0: none)
    distill_start: int = -1         # those prompts come after this many training conversations
                                    # (-1: after all of them); fixing it lets --conversations
                                    # grow without asking for new answers
    task_prompts: int = 0           # and task-style prompts built from ShareGPT text (task_prompts.py)
    later_turns: int = 0            # and later user turns of ShareGPT conversations, the turns
                                    # before them (ShareGPT's answers too) as their context
    later_turns_start: int = 0      # those later turns come after the first this many (the ones
                                    # an earlier run answered: a continued run's fresh slice)
    self_prompts: int = 0           # and user prompts the target writes itself (self_prompts.py),
                                    # at most this many: the seeds from self_prompts_start on
    self_prompts_start: int = 0
    distill_new_tokens: int = 256   # tokens per self-distilled answer, at most
    answers: str = ""               # answer archive directory (answers.py): its answers are
                                    # used instead of generating them, new ones are added to it
    generate_answers: bool = False  # with an archive: generate the answers it lacks (without
                                    # this a run that would generate any refuses, saying how many)
    distill_batch: int = 32         # answers the batch engine decodes together
    archive_sequences: int = 0      # also train on this many prompt + answer sequences taken
                                    # from the answer archive (--answers) as they are


@dataclass(slots=True)
class FeatureConfig:
    """The features stage: what a shard keeps of the target's forward."""
    prefix = ""
    feature_dtype: str = "auto"     # target dtype for feature extraction on torch's kernels; auto:
                                    # bfloat16 where the device has fast bfloat16 matmuls (AVX-512
                                    # bf16), else float32; runtime: the engine and format a user
                                    # decodes with, whose states the drafter reads at inference
    shard_tokens: int = 65536
    top_candidates: int = 32        # target top ids stored per position
    taps: str = ""                  # target layers fused into the drafter's input, EAGLE-3's
                                    # way (e.g. "1,14"; empty: the last layer's feature alone)
    online_features: bool = False   # compute each sequence's features as training draws it
                                    # (OnlineFeatures) instead of storing feature shards


@dataclass(slots=True)
class OptimConfig:
    """The optimizer and its schedule, whichever drafter trains."""
    prefix = ""
    epochs: int = 2
    lr: float = 1e-3
    warmup_steps: int = 40
    accumulate: int = 2             # sequences per optimizer step
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 200     # optimizer steps
    max_steps: int = 0              # stop early (0: run all epochs)
    train_dtype: str = "float32"    # the drafter's matmuls in training: float32, or bfloat16
                                    # under autocast (float32 weights and optimizer), or auto:
                                    # bfloat16 where the CPU has fast bfloat16 matmuls


@dataclass(slots=True)
class EagleConfig:
    """EAGLE-2's drafter and loss (train.py)."""
    prefix = ""
    layers: int = 1                 # drafter layers (EAGLE: 1); layers beyond --init's start
                                    # as the identity
    unroll: int = 1                 # drafting steps trained per position (1: EAGLE's loss)
    cls_weight: float = 0.1         # EAGLE's weight of the token loss
    noise: float = 0.2              # uniform noise on input features, in units of each dim's std
    negatives: int = 1024           # random negatives added to each sequence's candidate set
    full_vocab_loss: bool = False   # exact cross-entropy over the whole vocabulary instead


@dataclass(slots=True)
class RankerConfig:
    """SpecVocab's ranker, trained jointly with an EAGLE-2 drafter (ranker.py)."""
    prefix = "ranker_"
    weight: float = 0.0             # its loss's weight against the token loss (the paper's
                                    # lambda, 0.1); 0: no ranker
    init: str = ""                  # ranker file to start from (default: the head's truncated SVD)
    rank: int = 0                   # d' (0: d/16)
    positions: int = 128            # positions per sequence and step in the ranker's loss
    lr: float = 2e-3


@dataclass(slots=True)
class Eagle3TrainConfig:
    """EAGLE-3's recipe (eagle3_train.py)."""
    prefix = ""
    ttt_steps: int = 3              # draft steps trained per position (training-time test)
    ttt_decay: float = 1.0          # step k's loss weighs ttt_decay**k (normalized; EAGLE-3's code: 0.8)
    labels: str = "soft"            # soft (the target's distribution over the draft vocabulary)
                                    # or hard (the target's choice)
    draft_vocab: str = "trim:8k"    # the draft vocabulary (a bundled token map's first N)
    snapshot_tokens: str = ""       # keep the run as it stood after these many training tokens
                                    # (e.g. "1.9M,5.7M"): checkpoint-eagle3-at-1.9M.pt, ...


@dataclass(slots=True)
class MedusaConfig:
    """Medusa's heads (medusa_train.py)."""
    prefix = "medusa_"
    heads: int = 4                  # heads (tokens t+2 .. t+K+1)
    positions: int = 256            # positions sampled per sequence and step


@dataclass(slots=True)
class TrainConfig:
    """One training run: what it trains, for which model, where, and each concern's settings."""
    model: str = "smollm2"
    out: str = "runs/train-smollm2"
    drafter: str = "eagle"          # what to train: a trainable drafting family (eagle, eagle3, medusa)
    init: str = ""                  # drafter directory to start from (default: random start)
    seed: int = 0
    device: str = "cpu"             # where answers are generated, features computed and an
                                    # EAGLE-3 drafter trained (cpu, cuda, cuda:N): the same recipe
    data: DataConfig = field(default_factory=DataConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)
    ranker: RankerConfig = field(default_factory=RankerConfig)
    eagle3: Eagle3TrainConfig = field(default_factory=Eagle3TrainConfig)
    medusa: MedusaConfig = field(default_factory=MedusaConfig)

    @classmethod
    def _groups(cls) -> dict[str, type]:
        """The concerns' dataclasses by their field here."""
        return {f.name: f.default_factory for f in fields(cls) if f.default_factory is not MISSING}

    @classmethod
    def options(cls) -> dict[str, tuple[type, str, str | None]]:
        """Every setting by its option name: (the dataclass holding it, its field, its group
        in TrainConfig or None for the run's own)."""
        groups = cls._groups()
        found = {f.name: (cls, f.name, None) for f in fields(cls) if f.name not in groups}
        for group, kind in groups.items():
            found.update({kind.prefix + f.name: (kind, f.name, group) for f in fields(kind)})
        return found

    @classmethod
    def of(cls, **settings) -> "TrainConfig":
        """A run from settings named as the options are (`conversations`, `ranker_lr`, ...);
        TypeError for a name no option has."""
        options = cls.options()
        unknown = sorted(set(settings) - set(options))
        if unknown:
            raise TypeError(f"no training setting named {', '.join(unknown)}")
        run, groups = {}, {group: {} for group in cls._groups()}
        for name, value in settings.items():
            _, attribute, group = options[name]
            (run if group is None else groups[group])[attribute] = value
        return cls(**run, **{group: kind(**groups[group]) for group, kind in cls._groups().items()})

    def settings(self) -> dict:
        """Every setting by its option name (what `of` takes)."""
        return {name: getattr(self, attribute) if group is None else getattr(getattr(self, group), attribute)
                for name, (_, attribute, group) in self.options().items()}

    def but(self, **settings) -> "TrainConfig":
        """This run with `settings` (named as the options are) changed."""
        return self.of(**{**self.settings(), **settings})

    def record(self) -> dict:
        """The run as checkpoints and reports record it (each concern's settings a dict)."""
        return asdict(self)

    @classmethod
    def settings_of(cls, record: dict) -> dict:
        """A record's settings by option name, whether `record` wrote it or it predates the
        split by concern (one flat dict)."""
        groups, flat = cls._groups(), {}
        for key, value in record.items():
            if key in groups and isinstance(value, dict):
                flat.update({groups[key].prefix + name: v for name, v in value.items()})
            else:
                flat[key] = value
        return flat
