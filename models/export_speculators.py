"""Export a P-EAGLE / EAGLE-3 head to vLLM's speculators layout and read one back, ours or a peer's
(models.checkpoint.load_draft dispatches here, so `draft.init_from` and `head:DIR` take them). Shared helpers and the
CLI (python -m models.export) are in models/export.py; SGLang's layout is in models/export_sglang.py.

speculators (checked against speculators 0.9.0's loader, SpeculatorModel.from_pretrained, and vLLM 0.32's):
  config.json   speculators_model_type "eagle3" | "peagle", transformer_layer_config (a Llama config with the head's
                num_layers; "qwen3" when the layers norm q and k), draft_vocab_size, norm_before_residual,
                eagle_aux_hidden_state_layer_ids, speculators_config (proposal_methods[0].speculative_tokens = K,
                verifier.name_or_path: a local path or hub id both loaders open, so never our short target names);
                P-EAGLE adds parallel_drafting: true and mask_token_id.
  model.safetensors  fc.weight [H, 3H], layers.{i}.* (q_norm / k_norm [head_dim] in Qwen3 layers), norm.weight,
                lm_head.weight [N, H], d2t/t2d when N < V, embed_tokens.weight [V, H] (always: speculators 0.9
                leaves a missing one uninitialised; vLLM shares the target's when they are equal), and P-EAGLE's
                mask_hidden [1, 1, 3H] (speculators refuses [3H]; vLLM reads either). P-EAGLE's embedding is the
                target's with row mask_token_id holding the learned mask embedding (vLLM embeds mask_token_id for
                slots 2..K), unless the head has its own.
Our tensor names already match (no "model." prefix), so export is a copy plus the shared target tensors. Reading
back, an embedding or LM head equal to the target's (up to the mask row) stays shared; a trained one (speculators
trains P-EAGLE's embedding) becomes the head's own. Layer ids: aux hidden state i = the input of decoder layer i.
"""

from __future__ import annotations

import json
from pathlib import Path

from models.checkpoint import head_from_state, read_weights
from models.errors import DraftheadsError
from models.export import _check_engine_layers, _exportable, _head_tensors, _layer_config, _provenance, _summary
from models.files import save_tensors
from models.peagle import PEagleDrafter
from models.target import DEFAULT_TARGET

SPECULATORS_VERSION = "0.9.0"  # the release whose loader these files were checked against
HUB_IDS = {DEFAULT_TARGET: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # built-in target names -> what loaders can open


def export_speculators(head_dir, target, out_dir, verifier_path: str | None = None,
                       mask_token_id: int | None = None) -> Path:
    """Write the speculators directory for the draft checkpoint `head_dir` (trained for `target`).

    verifier_path: recorded as verifier.name_or_path (default: see verifier_name). mask_token_id (P-EAGLE sharing the
    target's embedding): the id whose embedding row carries the learned mask embedding; default: a special token the
    chat template never uses (`unused_special_token`), else V-1. A head with its own embedding keeps its own id.
    """
    head = _exportable(head_dir, target, "speculators", "the speculators layout holds EAGLE-3 / P-EAGLE heads only "
                                                        "(draft.family=peagle or eagle3)")
    c = head.config
    _check_engine_layers(head_dir, target, c["num_aux_layers"], "vLLM")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _head_tensors(head)
    if "lm_head.weight" not in tensors:  # full vocabulary through the target's LM head: vLLM wants the rows
        tensors["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().float().cpu().contiguous()
    if "embed_tokens.weight" not in tensors:  # speculators 0.9 leaves a missing one uninitialised (seen: 1e32 values)
        tensors["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().float().cpu().clone()
    config = {
        "architectures": ["PEagleDraftModel" if head.parallel else "Eagle3DraftModel"],  # as speculators saves them
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_config(target, c),
        "draft_vocab_size": int(head.d2t.numel()) if "d2t" in tensors else c["vocab_size"],
        "norm_before_residual": c["norm_before_residual"],
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(target.layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": head.k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_name(target, verifier_path),
                         "architectures": list(getattr(target.model.config, "architectures", None)
                                               or ["LlamaForCausalLM"])},
        },
        "draftheads": _provenance(head, target),
    }
    if head.parallel:
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
        if head.mask_token_id is not None:  # its own embedding: row mask_token_id already is the trained slot
            if mask_token_id is not None and int(mask_token_id) != head.mask_token_id:
                raise DraftheadsError(f"'{head_dir}' embeds its mask slot as token {head.mask_token_id} (its own "
                                      f"embedding row); drop mask_token_id={mask_token_id} or pass that id")
            mask_id = head.mask_token_id
        else:
            mask_id = (unused_special_token(target.tokenizer, c["vocab_size"]) if mask_token_id is None
                       else int(mask_token_id))
            if not 0 <= mask_id < c["vocab_size"]:
                raise DraftheadsError(f"mask_token_id={mask_id} is outside the target vocabulary "
                                      f"0..{c['vocab_size'] - 1}")
            tensors["embed_tokens.weight"][mask_id] = head.mask_embedding.detach().float().cpu()
        # vLLM reads mask_token_id only from a "peagle" config; under "eagle3" it drops it and serves a chain head
        config.update(speculators_model_type="peagle", parallel_drafting=True, mask_token_id=mask_id)
        config["speculators_config"]["algorithm"] = "peagle"
    save_tensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def verifier_name(target, verifier_path: str | None = None) -> str:
    """verifier.name_or_path: `verifier_path`, else the target's hub id (built-in names), its absolute path (a local
    directory) or its name as given (a hub id). speculators' loader and vLLM both open it."""
    if verifier_path:
        return str(verifier_path)
    local = Path(target.name).expanduser()
    return HUB_IDS.get(target.name) or (str(local.resolve()) if local.exists() else target.name)


def import_speculators(directory, target) -> PEagleDrafter:
    """Read a speculators EAGLE-3 / P-EAGLE directory (ours, or a peer's such as speculators 0.9's Qwen3-style
    layers with trained embeddings) into a head attached to `target` (eval mode)."""
    d = Path(directory)
    summary = _summary(d, "speculators", target)
    sizes, state = dict(summary["sizes"]), read_weights(d)
    embed = state.pop("embed_tokens.weight", None)
    mask_row = summary["mask_token_id"] if sizes["parallel"] else None
    if sizes["parallel"] and not (isinstance(mask_row, int) and 0 <= mask_row < sizes["vocab_size"]):
        raise DraftheadsError(f"'{d}/config.json' is a P-EAGLE draft with mask_token_id={mask_row!r}; it needs the "
                              "token (0..V-1) its depths 2..K embed: add the id it was trained with")
    if sizes["parallel"] and "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(-1)  # [1, 1, 3H] in speculators, [3H] here
    own_embedding = embed is not None and not _is_targets(embed, target.model.get_input_embeddings().weight, mask_row)
    if own_embedding:
        state["embed_tokens.weight"] = embed
        sizes.update(own_embedding=True, mask_token_id=mask_row)
    elif sizes["parallel"]:  # the target's embedding; its mask row (if any) is the learned mask embedding
        state["mask_embedding"] = (embed if embed is not None else target.model.get_input_embeddings().weight)[mask_row]
    full_vocab_lm_head(state, sizes, target)
    return head_from_state(summary["family"], sizes, state, target, f"speculators directory '{d}'",
                           fix="the directory is damaged or from another layout; export it again")


def unused_special_token(tokenizer, vocab_size: int) -> int:
    """The highest special token id that is not bos/eos/pad/unk and not in the chat template (SmolLM2: 16,
    <empty_output>): real text never embeds it, so it can carry the mask embedding. V-1 when there is none."""
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    free = [i for i, tok in added.items()
            if getattr(tok, "special", False) and i not in taken and i < vocab_size and str(tok) not in template]
    return max(free) if free else vocab_size - 1


def full_vocab_lm_head(state: dict, sizes: dict, target) -> None:
    """A full-vocabulary head's lm_head.weight in `state`: the target's own is dropped (shared, not copied), another
    one is kept as the head's own (sizes["own_lm_head"]); identity d2t / t2d maps of a full vocabulary are dropped."""
    if sizes["draft_vocab_size"] is not None:
        return
    if "d2t" in state and not state["d2t"].any():  # offsets 0: the identity map of a full vocabulary
        del state["d2t"]
    if "t2d" in state and state["t2d"].all():
        del state["t2d"]
    if "lm_head.weight" in state:
        if _is_targets(state["lm_head.weight"], target.model.get_output_embeddings().weight):
            del state["lm_head.weight"]
        else:
            sizes["own_lm_head"] = True


def _is_targets(tensor, ref, skip_row: int | None = None) -> bool:
    """Whether an exported embedding / LM head [V, H] is the target's own `ref` (but for the row that carries
    P-EAGLE's mask embedding): then the head shares the target's, else it keeps its own (trained) copy."""
    if tensor.shape != ref.shape:
        return False
    same = (tensor.to(device=ref.device, dtype=ref.dtype) == ref).all(-1)
    if skip_row is not None:
        same[skip_row] = True
    return bool(same.all())
