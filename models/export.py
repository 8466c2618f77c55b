"""Export a P-EAGLE / EAGLE-3 head to vLLM's speculators layout (and read it back, for the round-trip test).

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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import load_draft
from models.errors import DraftheadsError
from models.peagle import PEagleDrafter

SPECULATORS_VERSION = "0.3.0"


def export_speculators(head_dir, target, out_dir, verifier_path: str | None = None, mask_token_id: int | None = None) -> Path:
    """Write the speculators directory for the draft checkpoint `head_dir` (trained for `target`).

    mask_token_id (P-EAGLE): the id whose embedding row carries the learned mask embedding (vLLM embeds it for slots
    2..K); default: a special token the chat template never uses (`unused_special_token`), else V-1.
    """
    head = load_draft(head_dir, target)
    if not isinstance(head, PEagleDrafter):
        raise DraftheadsError(f"'{head_dir}' is a {head.family_name} head; the speculators layout holds EAGLE-3 / "
                              "P-EAGLE heads only (draft.family=peagle or eagle3)")
    c = head.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()
               if k not in ("mask_embedding",)}
    if "d2t" in tensors:
        tensors["d2t"] = head.d2t.cpu().long()
        tensors["t2d"] = head.t2d.cpu().bool()
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
        "draftheads": {"target": target.fingerprint, "family": head.family_name,
                       "hidden_state_convention": target.fingerprint["hidden_state_convention"]},
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


def unused_special_token(tokenizer, vocab_size: int) -> int:
    """The highest special token id that is not bos/eos/pad/unk and not in the chat template (SmolLM2: 16,
    <empty_output>): real text never embeds it, so it can carry the mask embedding. V-1 when there is none."""
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    free = [i for i, tok in added.items()
            if getattr(tok, "special", False) and i not in taken and i < vocab_size and str(tok) not in template]
    return max(free) if free else vocab_size - 1


def _llama_config(target, c: dict) -> dict:
    tc = target.model.config
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"], "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"], "num_key_value_heads": c["num_kv_heads"], "head_dim": c["head_dim"],
        "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"], "hidden_act": "silu",
        "max_position_embeddings": getattr(tc, "max_position_embeddings", 2048), "vocab_size": c["vocab_size"],
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": getattr(tc, "bos_token_id", None), "eos_token_id": getattr(tc, "eos_token_id", None),
    }


def import_speculators(directory, target) -> PEagleDrafter:
    """Read a speculators EAGLE-3 / P-EAGLE directory back into a head attached to `target` (eval mode)."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise DraftheadsError(f"'{d}' has no config.json; pass a directory written by export_speculators")
    config = json.loads((d / "config.json").read_text())
    if config.get("speculators_model_type") not in ("eagle3", "peagle"):
        raise DraftheadsError(f"'{d}' is not a speculators EAGLE-3 draft (speculators_model_type="
                              f"{config.get('speculators_model_type')!r})")
    if list(config["eagle_aux_hidden_state_layer_ids"]) != list(target.layer_ids):
        raise DraftheadsError(f"'{d}' reads target layers {config['eagle_aux_hidden_state_layer_ids']} but the target "
                              f"captures {list(target.layer_ids)}; load the target with target.layer_ids set to match")
    lc = config["transformer_layer_config"]
    tensors = load_file(d / "model.safetensors")
    parallel = config["speculators_model_type"] == "peagle" or bool(config.get("parallel_drafting", False))
    draft_vocab = config["draft_vocab_size"]
    head = PEagleDrafter(
        hidden_size=lc["hidden_size"], num_aux_layers=tensors["fc.weight"].shape[1] // lc["hidden_size"],
        num_layers=lc["num_hidden_layers"], num_heads=lc["num_attention_heads"], num_kv_heads=lc["num_key_value_heads"],
        head_dim=lc["head_dim"], intermediate_size=lc["intermediate_size"], vocab_size=lc["vocab_size"],
        k=config["speculators_config"]["proposal_methods"][0]["speculative_tokens"], parallel=parallel,
        draft_vocab_size=draft_vocab if draft_vocab < lc["vocab_size"] else None, rms_norm_eps=lc["rms_norm_eps"],
        rope_theta=lc["rope_theta"], norm_before_residual=config["norm_before_residual"])
    state = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
    if parallel:
        state["mask_embedding"] = tensors["embed_tokens.weight"][config["mask_token_id"]]
    if "d2t" not in state:
        state.pop("lm_head.weight", None)  # full vocabulary: the target's LM head is shared
    head.load_state_dict(state, strict=True)
    return head.to(device=target.device, dtype=target.dtype).attach_target(target).eval().requires_grad_(False)
