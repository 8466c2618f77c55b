"""A draft head embedded in its target's checkpoint: one directory, one load, target + drafter.

`embed_draft(target_or_dir, head, out_dir)` writes a copy of the target checkpoint (config.json, tokenizer,
safetensors) plus
  tensors  draft.*                 the head's own state (NOT the embedding / LM head: shared with the target;
                                   a draft-vocab lm_head and d2t / t2d are the head's own and are stored)
  config   "draft_head": {family, config (constructor sizes), fingerprint (the target's), format_version}
The draft.* tensors live in their own draft.safetensors next to the target's (single or sharded) weights, which
are copied untouched: `transformers` loads the directory as the plain target without "unexpected key" noise, and a
70B checkpoint is not rewritten to add a few hundred MB.

`load_embedded(dir, enable_draft_head=True) -> (Target, head)`.

    python -m models.embedded --head DIR --out DIR [--target-path PATH]      (one JSON line last)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from models.checkpoint import CHECKED_KEYS, head_from_state
from models.families import FAMILIES
from models.errors import DraftheadsError, exit_on_error
from models.files import save_tensors

PREFIX = "draft."
CONFIG_KEY = "draft_head"
EMBED_VERSION = 1
DRAFT_FILE = "draft.safetensors"


def embed_draft(target_or_dir, head, out_dir, layer_ids=None, name: str | None = None,
                built_for: dict | None = None) -> Path:
    """Copy the target checkpoint to out_dir with the head's tensors and config added. A directory is loaded
    (as target `name`, with `layer_ids` = the target layers the head reads) only to fingerprint it; its files
    are copied as they are. `built_for`: the target fingerprint the head's checkpoint records, checked against the
    destination (vocabulary, hidden size, tokenizer, layer ids); without it, the head's sizes are."""
    from models.checkpoint import CHECKED_KEYS
    from models.target import Target, load_target, save_model_directory

    out = Path(out_dir)
    if isinstance(target_or_dir, Target):
        target = target_or_dir
    else:
        src = Path(target_or_dir)
        if not (src / "config.json").is_file():
            raise DraftheadsError(f"target directory '{src}' has no config.json; pass a saved model directory")
        if layer_ids is None:
            raise DraftheadsError(f"embedding into '{src}' needs the target layer ids the head reads (layer_ids=...)")
        target = load_target(name or src.name, str(src), list(layer_ids))
    if built_for is not None:
        target.check_fingerprint(built_for, f"the {head.family_name} head", keys=CHECKED_KEYS)
    sizes = {"hidden_size": target.hidden_size, "num_aux_layers": len(target.layer_ids)}
    wrong = {k: (head.config.get(k), v) for k, v in sizes.items() if head.config.get(k, v) != v}
    if wrong:
        raise DraftheadsError(f"the {head.family_name} head does not fit target '{target.name}' "
                              f"({'; '.join(f'{k}: {a} in the head, {b} here' for k, (a, b) in wrong.items())}); "
                              "embed it into the target it was trained for")
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(target_or_dir, Target):
        save_model_directory(target.model, target.tokenizer, out)
    else:
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)
    state = {PREFIX + k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_tensors(out / DRAFT_FILE, state, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config[CONFIG_KEY] = {"family": head.family_name, "config": head.config, "fingerprint": target.fingerprint,
                          "format_version": EMBED_VERSION}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def draft_tensors(directory: Path) -> dict:
    """The draft.* tensors of the checkpoint, without the prefix ({} when there are none)."""
    if not (directory / DRAFT_FILE).is_file():
        return {}
    return {k[len(PREFIX):]: v for k, v in load_file(directory / DRAFT_FILE).items() if k.startswith(PREFIX)}


def load_embedded(directory, enable_draft_head: bool = True, dtype: str = "float32", device: str = "cpu"):
    """(Target, head) from one directory; head is None when enable_draft_head=False."""
    from models.target import load_target

    d = Path(directory)
    if not (d / "config.json").is_file():
        raise DraftheadsError(f"'{d}' is not a model checkpoint (no config.json); pass a directory written by "
                              "models.embedded.embed_draft")
    recorded = json.loads((d / "config.json").read_text()).get(CONFIG_KEY)
    if not enable_draft_head:
        fp = (recorded or {}).get("fingerprint", {})
        return load_target(fp.get("name", str(d)), str(d), fp.get("layer_ids"), dtype, device), None
    fix = (f"embed a head with `python -m models.embedded --head HEAD_DIR --out {d}`, or load the plain target "
           "with enable_draft_head=False")
    if recorded is None:
        raise DraftheadsError(f"'{d}' has no embedded draft head (config.json has no '{CONFIG_KEY}'); {fix}")
    if recorded.get("family") not in FAMILIES or recorded.get("format_version", 0) > EMBED_VERSION:
        raise DraftheadsError(f"'{d}' embeds draft family {recorded.get('family')!r} (version "
                              f"{recorded.get('format_version')!r}), unknown to this draftheads; re-embed it")
    fp = recorded["fingerprint"]
    target = load_target(fp["name"], str(d), fp["layer_ids"], dtype, device)
    target.check_fingerprint(fp, f"the draft head embedded in '{d}'", keys=CHECKED_KEYS)
    state = draft_tensors(d)
    if not state:
        raise DraftheadsError(f"'{d}/config.json' records a draft head but '{d}/{DRAFT_FILE}' is missing or has "
                              f"no {PREFIX}* tensors; {fix}")
    head = head_from_state(recorded["family"], recorded["config"], state, target, f"the draft head embedded in '{d}'")
    return target, head


def same_drafts(head, target, loaded_target, loaded_head, n_contexts: int = 8) -> bool:
    """Greedy draft tokens and confidences of `head` on `target` == those of the loaded pair, on the contexts
    x[:t] of one chat prompt for n_contexts cut points (features from each target's own forward)."""
    import torch

    from models.peagle import DraftCache
    from models.target import prompt_ids

    ids = prompt_ids(target.tokenizer, [{"role": "user", "content": "Explain speculative decoding in two sentences."}])
    drafts = []
    for t, h in ((target, head), (loaded_target, loaded_head)):
        with torch.no_grad():
            aux = t(ids[None].to(t.device), compute_logits=False).aux_hidden[0]
        cuts = torch.linspace(4, len(ids), n_contexts).long().tolist()
        drafts.append([h.draft(ids[:c].to(t.device), aux[: c - 1], DraftCache(), h.k) for c in cuts])
    return all(torch.equal(a[0].argmax(-1), b[0].argmax(-1)) and torch.equal(a[1], b[1]) for a, b in zip(*drafts))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m models.embedded", description="embed a draft head into its target")
    ap.add_argument("--head", required=True, help="draft checkpoint directory (out_dir/head)")
    ap.add_argument("--out", required=True, help="output model directory (target + draft.* tensors)")
    ap.add_argument("--target-path", default=None, help="target weights (default: the name recorded in the head)")
    args = ap.parse_args(argv)
    from models.checkpoint import load_draft, read_draft_config, target_for_head
    from models.target import resolve_target_dir

    fp = read_draft_config(args.head)["target"]
    target = target_for_head(args.head, args.target_path)
    head = load_draft(args.head, target)
    source = resolve_target_dir(fp["name"], args.target_path) if fp["name"] != "tiny-random-llama" else target
    out = embed_draft(source, head, args.out, fp["layer_ids"], fp["name"], built_for=fp)
    report = {"out": str(out), "family": head.family_name, "draft_tensors": len(head.state_dict()),
              "draft_params": sum(p.numel() for p in head.parameters()),
              "round_trip_identical_drafts":
                  same_drafts(head, target, *load_embedded(out)) if hasattr(head, "draft") else None}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    exit_on_error(main)
