"""Export a P-EAGLE / EAGLE-3 head for serving: what both serving layouts share, and the CLI

    python -m models.export --head DIR --out OUT [--format speculators|sglang] [--target-path P] [--verifier V]

The layouts, each with its export, import and file description, live in models/export_speculators.py (vLLM's
speculators EAGLE-3 / P-EAGLE layout) and models/export_sglang.py (SGLang's EAGLE-3 draft). serving_layout_summary
reads either config.json in read_draft_config's shape (models.checkpoint.read_draft_config dispatches here).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from models.checkpoint import LAYOUTS, load_draft, read_draft_config
from models.errors import DraftheadsError, exit_on_error
from models.peagle import PEagleDrafter, decoder_sizes

UNSUPPORTED_SPECULATORS_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # input norms draftheads does not have


def serving_layout_summary(d: Path, config: dict, layout: str) -> dict:
    """A speculators or SGLang config.json in read_draft_config's shape: layout, family, k, target (name, vocab_size,
    hidden_size, layer_ids), sizes (PEagleDrafter's arguments but the own_* pieces, which the tensors decide) and
    mask_token_id. Refuses what our heads do not implement."""
    if layout == "speculators":
        kind = config.get("speculators_model_type")
        if kind not in ("eagle3", "peagle"):
            raise DraftheadsError(f"'{d}' holds a speculators '{kind}' draft; draftheads reads EAGLE-3 and P-EAGLE "
                                  "heads (speculators_model_type eagle3 or peagle)")
        flags = [f for f in UNSUPPORTED_SPECULATORS_FLAGS if config.get(f)]
        if flags:
            raise DraftheadsError(f"'{d}' was trained with {flags}, input norms draftheads heads do not have; use a "
                                  "head trained without them")
        try:
            layer, ids = config["transformer_layer_config"], config["eagle_aux_hidden_state_layer_ids"]
            spec = config["speculators_config"]
            k, verifier = spec["proposal_methods"][0]["speculative_tokens"], spec["verifier"]["name_or_path"]
        except (KeyError, IndexError, TypeError) as e:
            raise DraftheadsError(f"'{d}/config.json' lacks {e} (with transformer_layer_config, "
                                  "eagle_aux_hidden_state_layer_ids and speculators_config.proposal_methods / verifier "
                                  "every speculators EAGLE-3 config has); export it again") from None
        if "model_type" not in layer:  # speculators would build Qwen3 layers, vLLM Llama ones: ask, do not guess
            raise DraftheadsError(f"'{d}/config.json' has no transformer_layer_config.model_type; add the one the "
                                  "head was trained with ('llama' or 'qwen3')")
        parallel = kind == "peagle" or bool(config.get("parallel_drafting"))
        if "norm_before_residual" not in config:  # engines differ on its default (vLLM: True for eagle3): ask
            raise DraftheadsError(f"'{d}/config.json' has no norm_before_residual; add the one the head was trained "
                                  "with (true: the first layer's residual starts from the normed fused hidden state)")
        norm_before_residual = bool(config["norm_before_residual"])
    else:
        layer, parallel, norm_before_residual = {"model_type": "llama", **config}, False, False
        ids = [i + 1 for i in (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []]
        k, verifier = (config.get("draftheads") or {}).get("k"), (config.get("draftheads") or {}).get("verifier")
    lc = _transformers_config(d, layer)
    plain = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    problems = [f"{name}={getattr(lc, name)!r}" for name, want in plain.items() if getattr(lc, name, want) != want]
    if lc.model_type not in ("llama", "qwen3"):
        problems.append(f"model_type {lc.model_type!r}")
    if "sliding_attention" in (getattr(lc, "layer_types", None) or []):
        problems.append("sliding-window layers")
    if config.get("target_hidden_size") not in (None, lc.hidden_size):
        problems.append(f"width {lc.hidden_size} reading a target of width {config['target_hidden_size']}")
    if problems:
        raise DraftheadsError(f"'{d}' has a draft layer with {problems}; draftheads runs Llama or Qwen3 decoder layers "
                              "as wide as the target, without biases or sliding windows, so it cannot load this head")
    vocab, draft_vocab = lc.vocab_size, config.get("draft_vocab_size")
    ids = list(ids) if ids else None  # none given: the engines capture their default layers (2, L//2, L-3)
    sizes = dict(decoder_sizes(lc), num_aux_layers=len(ids) if ids else 3, num_layers=lc.num_hidden_layers,
                 vocab_size=vocab, k=k,
                 parallel=parallel, draft_vocab_size=draft_vocab if draft_vocab and draft_vocab < vocab else None,
                 norm_before_residual=norm_before_residual, qk_norm=lc.model_type == "qwen3")
    return {"layout": layout, "family": "peagle" if parallel else "eagle3", "k": k, "sizes": sizes,
            "mask_token_id": config.get("mask_token_id"),
            "target": {"name": verifier, "vocab_size": vocab, "layer_ids": ids,
                       "hidden_size": config.get("target_hidden_size") or lc.hidden_size}}


def _summary(d: Path, layout: str, target) -> dict:
    """read_draft_config of a `layout` directory, checked against `target`: vocabulary, width, feature layers."""
    summary = read_draft_config(d)
    if summary["layout"] != layout:
        raise DraftheadsError(f"'{d}' is {LAYOUTS[summary['layout']]}, not {LAYOUTS[layout]}; load it with "
                              "models.checkpoint.load_draft, which reads either")
    fp, name = summary["target"], summary["target"]["name"] or "unnamed"
    for key, mine in (("vocab_size", target.vocab_size), ("hidden_size", target.hidden_size)):
        if fp[key] != mine:
            raise DraftheadsError(f"'{d}' was trained for target '{name}' with {key} {fp[key]}, but target "
                                  f"'{target.name}' has {mine}; load the target it names (or one with its tokenizer "
                                  "and width)")
    L = target.num_layers
    ids, which = fp["layer_ids"] or [2, L // 2, L - 3], "" if fp["layer_ids"] else "the engines' default "
    if ids != list(target.layer_ids):
        raise DraftheadsError(f"'{d}' reads {which}target layers {ids} but the target captures "
                              f"{list(target.layer_ids)}; load the target with target.layer_ids set to match")
    return summary


def _transformers_config(d: Path, layer: dict):
    """The draft layer's config as transformers builds it (speculators does the same), defaults filled in."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**layer)
    except (ValueError, TypeError, KeyError) as e:
        raise DraftheadsError(f"'{d}/config.json' has a draft layer config transformers cannot build ({e}); "
                              "export it again") from None


def _exportable(head_dir, target, layout: str, holds: str) -> PEagleDrafter:
    """The head at head_dir when its family exports to `layout` (models.families), else a clear error."""
    from models.families import family

    head = load_draft(head_dir, target)
    if layout not in family(head.family_name).exports and not (layout == "sglang" and head.family_name == "peagle"):
        raise DraftheadsError(f"'{head_dir}' is a {head.family_name} head; {holds}")
    return head


def _check_engine_layers(head_dir, target, num_aux: int, engine: str) -> None:
    """vLLM's and SGLang's EAGLE-3 fc reads three target layers, captured in one pass over the decoder layers (each
    once, ascending: models.target refuses other orders) as the input of decoder layers 1..L-1 (layer 0, the
    embeddings: SGLang has no id for it and vLLM versions differ; L, the last layer's output: never captured).
    Anything else fails to load or feeds the fc other features than training did."""
    ids, L = list(target.layer_ids), target.num_layers
    if num_aux != 3:
        raise DraftheadsError(f"'{head_dir}' fuses {num_aux} target layers; {engine}'s EAGLE-3 fc reads exactly 3 "
                              "(train with three target.layer_ids)")
    if not 1 <= ids[0] <= ids[-1] <= L - 1:
        raise DraftheadsError(f"'{head_dir}' reads target layers {ids}; {engine} captures the input of decoder layers "
                              f"1..{L - 1} only (not layer 0, the embeddings, nor {L}, the last layer's output). "
                              f"Retrain with target.layer_ids >= 1 and <= {L - 1}")


def _head_tensors(head: PEagleDrafter) -> dict:
    """The head's own tensors in float32 (d2t int64, t2d bool), less P-EAGLE's mask embedding (exported apart)."""
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items() if k != "mask_embedding"}
    if "d2t" in tensors:
        tensors["d2t"] = head.d2t.cpu().long()
        tensors["t2d"] = head.t2d.cpu().bool()
    return tensors


def _provenance(head, target) -> dict:
    return {"target": target.fingerprint, "family": head.family_name,
            "hidden_state_convention": target.fingerprint["hidden_state_convention"]}


def _layer_config(target, c: dict) -> dict:
    """The head's decoder layers as a transformers config: Llama, or Qwen3 when they norm q and k."""
    tc = target.model.config
    qwen3 = c.get("qk_norm", False)
    config = {
        "model_type": "qwen3" if qwen3 else "llama", "hidden_size": c["hidden_size"],
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "intermediate_size": c["intermediate_size"], "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"], "num_key_value_heads": c["num_kv_heads"], "head_dim": c["head_dim"],
        "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"], "hidden_act": "silu",
        "max_position_embeddings": getattr(tc, "max_position_embeddings", 2048), "vocab_size": c["vocab_size"],
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": getattr(tc, "bos_token_id", None), "eos_token_id": getattr(tc, "eos_token_id", None),
    }
    if c.get("rope_scaling"):  # e.g. Llama 3.1+ targets: {"rope_type": "llama3", "factor": 8.0, ...}
        config["rope_scaling"] = dict(c["rope_scaling"])
    return config


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m models.export",
                                 description="export a P-EAGLE / EAGLE-3 head for serving")
    ap.add_argument("--head", required=True, help="draft checkpoint directory (out_dir/head)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--format", choices=["speculators", "sglang"], default="speculators",
                    help="speculators: vLLM (EAGLE-3 and P-EAGLE); sglang: SGLang EAGLE-3 (chain heads)")
    ap.add_argument("--target-path", default=None, help="target weights (default: the name recorded in the head)")
    ap.add_argument("--verifier", default=None, help="verifier name or path recorded in the config")
    args = ap.parse_args(argv)
    from models.checkpoint import target_for_head
    from models.export_sglang import export_sglang  # the layout modules import this one: import on use
    from models.export_speculators import export_speculators

    target = target_for_head(args.head, args.target_path)
    export = export_sglang if args.format == "sglang" else export_speculators
    out = export(args.head, target, args.out, verifier_path=args.verifier)
    report = {"out": str(out), "format": args.format, "config": json.loads((out / "config.json").read_text())}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    exit_on_error(main)
