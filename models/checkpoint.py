"""The ONE draft checkpoint format (every drafter family): a directory with

  config.json           family, constructor sizes (K, layers, draft vocab size...), target fingerprint
                        (name, vocab, hidden size, layer ids, tokenizer hash, hidden-state convention)
  model.safetensors     the head's own tensors (shared frozen target embedding / LM head are NOT stored;
                        d2t / t2d draft-vocab maps are)
  resolved_config.yaml  the composed Hydra config the head was trained with
  metrics.json          final training metrics

`load_draft(dir, target)` refuses a head built for another target (vocab, hidden size, tokenizer, layer ids).
It also reads the serving layouts models/export.py writes, from us or from anyone (a peer's head to fine-tune or
draft with): a vLLM speculators EAGLE-3 / P-EAGLE directory and an SGLang EAGLE-3 draft; `read_draft_config`
tells them apart by their config.json and summarises theirs in the same shape (layout, family, k, target).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from models.errors import DraftheadsError
from models.families import FAMILIES, family, family_options
from models.files import save_tensors, write_atomic

FORMAT = "draftheads-draft"
FORMAT_VERSION = 1
CHECKED_KEYS = ("vocab_size", "hidden_size", "tokenizer_hash", "layer_ids")


def save_draft(head, out_dir, target, resolved_config: str | None = None, metrics: dict | None = None) -> Path:
    out = Path(out_dir)
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "family": head.family_name,
        "k": head.k,
        "sizes": head.config,
        "feature": head.feature,
        "target": target.fingerprint,
        "hidden_state_convention": target.fingerprint["hidden_state_convention"],
        "draft_vocab": None if getattr(head, "draft_ids", None) is None
        else {"size": int(head.d2t.numel()), "maps": "d2t (target id = i + d2t[i]), t2d in model.safetensors"},
    }
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise DraftheadsError(f"the {head.family_name} head has non-finite values in {bad[:3]}; it was not saved to "
                              f"'{out}'. Lower train.lr or check the features")
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(out / "model.safetensors", state)
    if resolved_config is not None:
        (out / "resolved_config.yaml").write_text(resolved_config)
    (out / "metrics.json").write_text(json.dumps(metrics or {}, indent=2))
    write_atomic(out / "config.json", json.dumps(config, indent=2))  # last: a directory with config.json is complete
    return out


def read_metrics(directory) -> dict:
    """The metrics a head directory was saved with (save_draft's metrics.json; {} when absent)."""
    path = Path(directory) / "metrics.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def target_for_head(directory, target_path: str | None = None):
    """The target a draft checkpoint was trained for (its recorded name and feature layers); target_path overrides
    where the weights come from."""
    from models.target import load_target

    fp = read_draft_config(directory)["target"]
    if fp["name"] is None and target_path is None:
        raise DraftheadsError(f"'{directory}' does not name the target it drafts for (SGLang drafts do not); pass "
                              "the target's directory (--target-path)")
    return load_target(fp["name"] or target_path, target_path, fp["layer_ids"])


LAYOUTS = {"draftheads": "a draftheads checkpoint (out_dir/head)",
           "speculators": "a vLLM speculators EAGLE-3 / P-EAGLE directory (speculators_model_type in config.json)",
           "sglang": "an SGLang EAGLE-3 draft (architectures [\"LlamaForCausalLMEagle3\"])"}


def read_draft_config(directory) -> dict:
    """config.json of a draft checkpoint plus "layout"; for a speculators or SGLang directory, its summary in our
    shape: layout, family, k and target (name, vocab_size, hidden_size, layer_ids)."""
    d = Path(directory)
    if not (d / "config.json").is_file() or not weight_files(d):
        raise DraftheadsError(f"'{d}' is not a draft checkpoint (needs config.json and model.safetensors); pass "
                              f"{' or '.join(LAYOUTS.values())}")
    try:
        config = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise DraftheadsError(f"'{d}/config.json' is not valid JSON ({e}); the directory is damaged, copy it "
                              "again") from None
    layout = draft_layout(config, d)
    if layout != "draftheads":
        from models.export import serving_layout_summary  # export imports this module: import on use

        return serving_layout_summary(d, config, layout)
    if config.get("format") != FORMAT or config.get("format_version", 0) > FORMAT_VERSION:
        raise DraftheadsError(f"'{d}/config.json' is not a draftheads draft v<={FORMAT_VERSION} "
                              f"(format={config.get('format')!r}, version={config.get('format_version')!r}); "
                              "re-export it with this version of draftheads")
    missing = [k for k in ("family", "k", "sizes", "target") if not config.get(k)]
    if missing:
        raise DraftheadsError(f"'{d}/config.json' lacks {missing}; the checkpoint is damaged: retrain it or copy it "
                              "again")
    if config["family"] not in FAMILIES:
        raise DraftheadsError(f"draft checkpoint '{d}' has family '{config['family']}'; known: {sorted(FAMILIES)}")
    return {**config, "layout": "draftheads"}


def draft_layout(config: dict, d: Path) -> str:
    """Which of LAYOUTS a config.json describes (a draftheads config of another version is ours, refused later)."""
    if "format" in config:
        return "draftheads"
    if "speculators_model_type" in config:
        return "speculators"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        return "sglang"
    raise DraftheadsError(f"'{d}/config.json' is no draft head layout draftheads reads (architectures="
                          f"{config.get('architectures')}, model_type={config.get('model_type')!r}); pass "
                          f"{' or '.join(LAYOUTS.values())}")


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of a directory: model.safetensors, or the shards its index names."""
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        return []
    shards = [d / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return shards if all(f.is_file() for f in shards) else []


def read_weights(d: Path) -> dict:
    """Every tensor of the directory's safetensors file(s), by name; a damaged file is a clear error naming it."""
    state = {}
    for f in weight_files(Path(d)):
        try:
            state.update(load_file(f))
        except Exception as e:  # safetensors' own error type for a truncated, empty or garbled file
            raise DraftheadsError(f"'{f}' cannot be read ({type(e).__name__}: {e}); the head is damaged: retrain it "
                                  "or copy it again") from None
    return state


def load_draft(directory, target, device=None, k: int | None = None):
    """The head in eval mode, attached to `target`'s frozen embedding / LM head, from any of LAYOUTS (k: the draft
    length of an SGLang draft that does not record one). Refuses a foreign target."""
    config = read_draft_config(directory)
    if config["layout"] != "draftheads":
        from models.export_sglang import import_sglang
        from models.export_speculators import import_speculators

        head = import_speculators(directory, target) if config["layout"] == "speculators" else \
            import_sglang(directory, target, k)
        return head.to(device=device or target.device)
    target.check_fingerprint(config["target"], f"draft head '{directory}'", keys=CHECKED_KEYS)
    if config["target"].get("name") != target.name:  # same vocabulary and sizes: another fine-tune, or a moved path
        warnings.warn(f"draft head '{directory}' was trained on target '{config['target'].get('name')}' and is loaded "
                      f"onto '{target.name}' (same tokenizer and sizes): acceptance may be lower; retrain or fine-tune "
                      "it on this target (draft.init_from) if this is another model")
    state = read_weights(Path(directory))
    return head_from_state(config["family"], config["sizes"], state, target, f"draft checkpoint '{directory}'", device)


def head_from_state(family_name: str, sizes: dict, state: dict, target, what: str, device=None,
                    fix: str = "the file is damaged, retrain or re-save it"):
    """Build `family` from its recorded constructor sizes, load `state` strictly, attach to `target`, eval mode."""
    head = family(family_name).head(**sizes)
    want = head.state_dict()
    missing = [n for n in want if n not in state]
    unexpected = [n for n in state if n not in want]
    misshapen = [f"{n} {list(state[n].shape)}, expected {list(v.shape)}" for n, v in want.items()
                 if n in state and state[n].shape != v.shape]
    if missing or unexpected or misshapen:
        raise DraftheadsError(f"{what} does not match its config.json (missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}, wrong shapes {misshapen[:4]}); {fix}")
    head.load_state_dict(state, strict=True)
    head = head.to(device=device or target.device, dtype=target.dtype).attach_target(target)
    return head.eval().requires_grad_(False)


def build_draft(family_name: str, target, k: int, num_layers: int = 1, parallel: bool = True, draft_vocab=None,
                share_lm_head: bool = True, extra: dict | None = None):
    """A fresh head of `family_name` sized for `target` (flat parameters; the trainer maps cfg.draft onto these).
    `extra` (draft.extra) is parsed into the family's typed options (models.families.family_options)."""
    options = asdict(family_options(family_name, extra))
    return family(family_name).build(target, k, num_layers, draft_vocab, parallel, share_lm_head, **options)