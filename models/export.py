"""Export a P-EAGLE / EAGLE-3 head to vLLM's speculators layout or SGLang's EAGLE-3 draft (and read both back,
for the round-trip tests).

Layout (what vLLM loads as an EAGLE-3 draft, see DESIGN.md "Interoperability facts"):
  config.json   speculators_model_type "eagle3", transformer_layer_config (a Llama config with the head's
                num_layers), draft_vocab_size, norm_before_residual, eagle_aux_hidden_state_layer_ids,
                speculators_config (proposal_methods[0].speculative_tokens = K, verifier.name_or_path);
                P-EAGLE adds parallel_drafting: true and mask_token_id.
  model.safetensors  fc.weight [H, 3H], layers.{i}.*, norm.weight, lm_head.weight [N, H], d2t/t2d when N < V,
                mask_hidden [3H] and embed_tokens.weight (P-EAGLE: the target's embedding whose row
                mask_token_id holds the learned mask embedding, since vLLM embeds mask_token_id for slots 2..K).
Our tensor names already match (no "model." prefix), so export is a copy plus the shared target tensors.
Layer ids follow vLLM's convention: aux hidden state i = the residual stream entering decoder layer i (ours too).

SGLang (export_sglang; loader python/sglang/srt/models/llama_eagle3.py, LlamaForCausalLMEagle3), EAGLE-3 chain only:
  config.json   a Llama config, architectures ["LlamaForCausalLMEagle3"], draft_vocab_size (null = full vocabulary:
                SGLang takes the LM head from the target), tie_word_embeddings false, and
                eagle_config {eagle_aux_hidden_state_layer_ids: ours - 1, use_aux_hidden_state: true}.
  model.safetensors  fc.weight, midlayer.* (our layers.0), additional_layers.{i-1}.* (our layers.i, whose
                input_layernorm SGLang names hidden_norm), norm.weight, lm_head.weight (draft vocab only), d2t, t2d.
                No embed_tokens: SGLang shares the target's embedding.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from safetensors.torch import load_file, save_file

from models.checkpoint import load_draft
from models.errors import DraftheadsError, exit_on_error
from models.peagle import PEagleDrafter

SPECULATORS_VERSION = "0.3.0"


def export_speculators(head_dir, target, out_dir, verifier_path: str | None = None, mask_token_id: int | None = None) -> Path:
    """Write the speculators directory for the draft checkpoint `head_dir` (trained for `target`).

    mask_token_id (P-EAGLE): the id whose embedding row carries the learned mask embedding (vLLM embeds it for slots
    2..K); default: a special token the chat template never uses (`unused_special_token`), else V-1.
    """
    head = _eagle_head(head_dir, target, "the speculators layout holds EAGLE-3 / P-EAGLE heads only "
                                         "(draft.family=peagle or eagle3)")
    c = head.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _head_tensors(head)
    if "d2t" in tensors:
        draft_vocab = int(head.d2t.numel())
    else:
        tensors["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().float().cpu().contiguous()
        draft_vocab = c["vocab_size"]
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _llama_config(target, c),
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": c["norm_before_residual"],
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(target.layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": head.k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_path or target.name,
                         "architectures": list(getattr(target.model.config, "architectures", None) or ["LlamaForCausalLM"])},
        },
        "draftheads": _provenance(head, target),
    }
    if head.parallel:
        mask_id = unused_special_token(target.tokenizer, c["vocab_size"]) if mask_token_id is None else int(mask_token_id)
        if not 0 <= mask_id < c["vocab_size"]:
            raise DraftheadsError(f"mask_token_id={mask_id} is outside the target vocabulary 0..{c['vocab_size'] - 1}")
        embed = target.model.get_input_embeddings().weight.detach().float().cpu().clone()
        embed[mask_id] = head.mask_embedding.detach().float().cpu()
        tensors["embed_tokens.weight"] = embed
        # vLLM reads mask_token_id only from a "peagle" config; under "eagle3" it drops it and serves a chain head
        config.update(speculators_model_type="peagle", parallel_drafting=True, mask_token_id=mask_id)
        config["speculators_config"]["algorithm"] = "peagle"
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def import_speculators(directory, target) -> PEagleDrafter:
    """Read a speculators EAGLE-3 / P-EAGLE directory back into a head attached to `target` (eval mode)."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise DraftheadsError(f"'{d}' has no config.json; pass a directory written by export_speculators")
    config = json.loads((d / "config.json").read_text())
    if config.get("speculators_model_type") not in ("eagle3", "peagle"):
        raise DraftheadsError(f"'{d}' is not a speculators EAGLE-3 draft (speculators_model_type="
                              f"{config.get('speculators_model_type')!r})")
    _check_layer_ids(d, config["eagle_aux_hidden_state_layer_ids"], target)
    tensors = load_file(d / "model.safetensors")
    parallel = config["speculators_model_type"] == "peagle" or bool(config.get("parallel_drafting", False))
    state = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
    if parallel:
        state["mask_embedding"] = tensors["embed_tokens.weight"][config["mask_token_id"]]
    return _head_from_llama_config(config["transformer_layer_config"], state, target,
                                   k=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
                                   parallel=parallel, draft_vocab=config["draft_vocab_size"],
                                   norm_before_residual=config["norm_before_residual"])


def unused_special_token(tokenizer, vocab_size: int) -> int:
    """The highest special token id that is not bos/eos/pad/unk and not in the chat template (SmolLM2: 16,
    <empty_output>): real text never embeds it, so it can carry the mask embedding. V-1 when there is none."""
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    free = [i for i, tok in added.items()
            if getattr(tok, "special", False) and i not in taken and i < vocab_size and str(tok) not in template]
    return max(free) if free else vocab_size - 1


def export_sglang(head_dir, target, out_dir, verifier_path: str | None = None) -> Path:
    """Write the SGLang EAGLE-3 draft directory (LlamaForCausalLMEagle3) for the checkpoint `head_dir`.

    Serve with --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT; the draft length is SGLang's
    --speculative-num-steps (the head's K is recorded under "draftheads" only). verifier_path is recorded there too.
    More than one layer: SGLang's additional layers (BasicDecoderLayer, read at sgl-project/sglang 03d5a77) restart
    the residual stream from the previous layer's MLP output, so such a head drafts differently there than here
    and in vLLM (older SGLang refuses num_hidden_layers != 1); a warning says so.
    """
    head = _eagle_head(head_dir, target, "SGLang's EAGLE-3 draft holds EAGLE-3 chain heads only (draft.family=eagle3)")
    c = head.config
    if head.parallel:
        raise DraftheadsError(f"'{head_dir}' is a P-EAGLE (parallel drafting) head; SGLang has no parallel drafting. "
                              "Export it with export_speculators for vLLM, or train a chain head (draft.family=eagle3)")
    if c["norm_before_residual"]:
        raise DraftheadsError(f"'{head_dir}' was trained with norm_before_residual=True; SGLang's first draft layer "
                              "adds the un-normed fc output to the residual stream, so only norm_before_residual=False "
                              "heads export to SGLang (export_speculators keeps the flag for vLLM)")
    if c["num_aux_layers"] != 3:
        raise DraftheadsError(f"'{head_dir}' fuses {c['num_aux_layers']} target layers; SGLang's EAGLE-3 fc reads "
                              "exactly 3 (train with three target.layer_ids)")
    if min(target.layer_ids) < 1:
        raise DraftheadsError(f"'{head_dir}' reads target layers {list(target.layer_ids)}; layer 0 (the embedding "
                              "output) has no SGLang id, which captures the input of decoder layer id + 1. Retrain "
                              "with target.layer_ids >= 1")
    if c["num_layers"] > 1:
        warnings.warn(f"'{head_dir}' has {c['num_layers']} layers: SGLang's additional EAGLE-3 layers drop the "
                      "residual stream of the layer before them, so SGLang will draft differently from this head; "
                      "measure acceptance there, or use a 1-layer head", stacklevel=2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {_sglang_name(k): v for k, v in _head_tensors(head).items()}
    config = {
        **_llama_config(target, c),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": int(head.d2t.numel()) if "d2t" in tensors else None,  # must be present, null or not
        # SGLang captures layer id + 1 (ids = ours - 1); without eagle_config it captures [2, L//2, L-3] directly
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in target.layer_ids],
                         "use_aux_hidden_state": True},
        # no target_hidden_size: our fc reads 3 x hidden_size of the target, which is also the head's width
        "draftheads": {**_provenance(head, target), "k": head.k, "verifier": verifier_path or target.name},
    }
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def import_sglang(directory, target, k: int | None = None) -> PEagleDrafter:
    """Read an SGLang EAGLE-3 draft directory back into a chain head attached to `target` (eval mode). K: `k`, else
    the one export_sglang recorded."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise DraftheadsError(f"'{d}' has no config.json; pass a directory written by export_sglang")
    config = json.loads((d / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise DraftheadsError(f"'{d}' is not an SGLang EAGLE-3 draft (architectures={config.get('architectures')})")
    ids = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    _check_layer_ids(d, ids, target)
    k = k or config.get("draftheads", {}).get("k")
    if not k:
        raise DraftheadsError(f"'{d}' does not record the draft length; pass k=")
    state = {_our_name(name): v for name, v in load_file(d / "model.safetensors").items()}
    return _head_from_llama_config(config, state, target, k=k, parallel=False,
                                   draft_vocab=config.get("draft_vocab_size"), norm_before_residual=False)


def _eagle_head(head_dir, target, holds: str) -> PEagleDrafter:
    head = load_draft(head_dir, target)
    if not isinstance(head, PEagleDrafter):
        raise DraftheadsError(f"'{head_dir}' is a {head.family_name} head; {holds}")
    return head


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


def _sglang_name(name: str) -> str:
    """Our tensor name -> SGLang's: layers.0 is the midlayer, layers.i (i >= 1) additional_layers.{i-1} whose
    pre-attention norm SGLang calls hidden_norm."""
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    if i == "0":
        return f"midlayer.{rest}"
    return f"additional_layers.{int(i) - 1}.{rest.replace('input_layernorm.', 'hidden_norm.')}"


def _our_name(name: str) -> str:
    if name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    if name.startswith("additional_layers."):
        _, i, rest = name.split(".", 2)
        return f"layers.{int(i) + 1}.{rest.replace('hidden_norm.', 'input_layernorm.')}"
    return name


def _llama_config(target, c: dict) -> dict:
    tc = target.model.config
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c["hidden_size"],
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


def _check_layer_ids(d: Path, layer_ids: list, target) -> None:
    if list(layer_ids) != list(target.layer_ids):
        raise DraftheadsError(f"'{d}' reads target layers {list(layer_ids)} but the target captures "
                              f"{list(target.layer_ids)}; load the target with target.layer_ids set to match")


def _head_from_llama_config(lc: dict, state: dict, target, k: int, parallel: bool, draft_vocab: int | None,
                            norm_before_residual: bool) -> PEagleDrafter:
    """A head built from an exported Llama config, `state` loaded strictly, attached to `target`, eval mode."""
    head = PEagleDrafter(
        hidden_size=lc["hidden_size"], num_aux_layers=state["fc.weight"].shape[1] // lc["hidden_size"],
        num_layers=lc["num_hidden_layers"], num_heads=lc["num_attention_heads"], num_kv_heads=lc["num_key_value_heads"],
        head_dim=lc["head_dim"], intermediate_size=lc["intermediate_size"], vocab_size=lc["vocab_size"], k=k,
        parallel=parallel, draft_vocab_size=draft_vocab if draft_vocab and draft_vocab < lc["vocab_size"] else None,
        rms_norm_eps=lc["rms_norm_eps"], rope_theta=lc["rope_theta"], norm_before_residual=norm_before_residual,
        rope_scaling=lc.get("rope_scaling"))
    if "d2t" not in state:
        state = {n: v for n, v in state.items() if n != "lm_head.weight"}  # full vocabulary: the target's LM head
    head.load_state_dict(state, strict=True)
    return head.to(device=target.device, dtype=target.dtype).attach_target(target).eval().requires_grad_(False)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m models.export", description="export a P-EAGLE / EAGLE-3 head for serving")
    ap.add_argument("--head", required=True, help="draft checkpoint directory (out_dir/head)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--format", choices=["speculators", "sglang"], default="speculators",
                    help="speculators: vLLM (EAGLE-3 and P-EAGLE); sglang: SGLang EAGLE-3 (chain heads)")
    ap.add_argument("--target-path", default=None, help="target weights (default: the name recorded in the head)")
    ap.add_argument("--verifier", default=None, help="verifier name or path recorded in the config")
    args = ap.parse_args(argv)
    from models.checkpoint import target_for_head

    target = target_for_head(args.head, args.target_path)
    export = export_sglang if args.format == "sglang" else export_speculators
    out = export(args.head, target, args.out, verifier_path=args.verifier)
    report = {"out": str(out), "format": args.format, "config": json.loads((out / "config.json").read_text())}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    exit_on_error(main)
