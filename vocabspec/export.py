"""Carrying a drafter and its draft vocabulary to a distributed serving engine.

Writes, in one directory:
- config.json + model.safetensors: the drafter in the EAGLE-1/2 checkpoint layout that SGLang
  (--speculative-algorithm EAGLE --speculative-draft-model-path DIR) and vLLM (method "eagle")
  read: fc.weight/fc.bias and layers.0.* in Hugging Face names, no input norm on layer 0,
  features taken after the target's final norm.
- token_map.pt: the static draft vocabulary as SGLang's --speculative-token-map (a torch-saved
  list of target token ids, most frequent first).
- d2t_t2d.safetensors: the same vocabulary as EAGLE-3's d2t / t2d tensors.

An EAGLE-3 drafter (eagle3.py: `vocabspec train --drafter eagle3`, or any checkpoint in either
layout) is written instead in `layout`: speculators' (what vLLM reads) or SGLang's
(LlamaForCausalLMEagle3); its draft vocabulary travels inside it as d2t / t2d, narrowed to
`draft_vocab` (fr:N or trim:N of it) where asked. q8_0: its matrices as Q8_0 groups, the form
the package bundles (vocabspec reads it; other readers take the floats).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def export(model: str, out: str | Path, draft_path: str | None = None, draft_vocab: str | None = None,
           token_map: str | None = None, layout: str | None = None, q8_0: bool = False) -> list[Path]:
    from safetensors.torch import load_file
    from .speculation.config import bundled_drafter_dir
    from .speculation.vocab.draft_vocab import parse_draft_vocab
    from .speculation.families.eagle import EagleDrafter
    from .speculation.families.eagle3 import Eagle3Drafter, is_eagle3
    from .runtime.loading import load_model
    from .speculation.vocab.token_map import load_token_map, save_eagle3, save_token_map

    target, _ = load_model(model, max_seq_len=64)
    source = Path(draft_path) if draft_path else bundled_drafter_dir(model)
    if source is None:
        raise ValueError(f"no drafter bundled for {model!r}: pass --draft-path")
    if is_eagle3(source):
        drafter = Eagle3Drafter.load(source, target, dtype=torch.bfloat16)
        if draft_vocab:       # a subset of its own vocabulary, from the bundled token maps or --token-map
            drafter = drafter.narrowed(draft_vocab, bundled_drafter_dir(model), token_map)
        elif token_map:
            raise ValueError("--token-map cuts --draft-vocab fr:N or trim:N; give both")
        drafter.save(out, layout=layout or "speculators", q8_0=q8_0)
        return [Path(out) / "config.json", Path(out) / "model.safetensors"]
    if q8_0:
        raise ValueError("--q8-0 writes an EAGLE-3 drafter's matrices as Q8_0 groups; an EAGLE-1/2 drafter "
                         "is exported in the floats its readers take")
    if layout is not None:
        raise ValueError(f"--layout chooses an EAGLE-3 drafter's layout; {source} is an EAGLE-1/2 drafter")
    drafter = EagleDrafter.load(source, target)
    if drafter.taps or len(drafter.layers) > 1:
        raise ValueError(f"drafter {source} has {len(drafter.layers)} layers and taps "
                         f"{list(drafter.taps)}: the EAGLE-1/2 layout exported here is one layer "
                         "reading the last-layer feature alone")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    # A drafter shipped as Q8_0 groups exports as bfloat16 (what EAGLE's readers take).
    weights_dtype = torch.bfloat16 if any(k.endswith("_scale") for k in tensors) else \
        next(iter(tensors.values())).dtype
    drafter.to(weights_dtype).save(out)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = str(weights_dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    written = [out / "config.json", out / "model.safetensors"]
    if draft_vocab:
        kind, size = parse_draft_vocab(draft_vocab)
        if kind not in ("fr", "trim"):
            raise ValueError(f"--draft-vocab {draft_vocab}: only static vocabularies (fr:N, trim:N) "
                             "have a token map; SGLang and vLLM have no SpecVocab ranker")
        path = Path(token_map) if token_map else source / f"token_map_{kind}.pt"
        ids = load_token_map(path, target.args.vocab_size)
        if size > ids.numel():
            raise ValueError(f"token map {path} ranks only {ids.numel()} tokens, {size} asked for")
        ids = ids[:size]
        save_token_map(ids, out / "token_map.pt")
        save_eagle3(ids, target.args.vocab_size, out / "d2t_t2d.safetensors")
        written += [out / "token_map.pt", out / "d2t_t2d.safetensors"]
    return written
