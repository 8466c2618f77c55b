"""Export a P-EAGLE / EAGLE-3 head to vLLM's speculators layout or SGLang's EAGLE-3 draft, and read both back, ours
or a peer's (models.checkpoint.load_draft dispatches here, so `draft.init_from` and `head:DIR` take them).

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

SGLang (export_sglang; loader python/sglang/srt/models/llama_eagle3.py, LlamaForCausalLMEagle3), EAGLE-3 chain only:
  config.json   a Llama config, architectures ["LlamaForCausalLMEagle3"], draft_vocab_size (null = full vocabulary:
                SGLang takes the LM head from the target), tie_word_embeddings false, and
                eagle_config {eagle_aux_hidden_state_layer_ids: ours - 1, use_aux_hidden_state: true}.
  model.safetensors  fc.weight, midlayer.* (our layers.0), additional_layers.{i-1}.* (our layers.i, whose
                input_layernorm SGLang names hidden_norm), norm.weight, lm_head.weight (draft vocab only), d2t, t2d.
                No embed_tokens: SGLang shares the target's embedding (one in a peer's draft is ignored, as there).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from safetensors.torch import save_file

from models.checkpoint import LAYOUTS, head_from_state, load_draft, read_draft_config, read_weights
from models.errors import DraftheadsError, exit_on_error
from models.peagle import PEagleDrafter, decoder_sizes
from models.target import DEFAULT_TARGET

SPECULATORS_VERSION = "0.9.0"  # the release whose loader these files were checked against
HUB_IDS = {DEFAULT_TARGET: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # built-in target names -> what loaders can open
SGLANG_DEFAULT_K = 5  # an SGLang draft does not record its length (the server's --speculative-num-steps sets it)
UNSUPPORTED_SPECULATORS_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # input norms draftheads does not have


def export_speculators(head_dir, target, out_dir, verifier_path: str | None = None, mask_token_id: int | None = None) -> Path:
    """Write the speculators directory for the draft checkpoint `head_dir` (trained for `target`).

    verifier_path: recorded as verifier.name_or_path (default: see verifier_name). mask_token_id (P-EAGLE sharing the
    target's embedding): the id whose embedding row carries the learned mask embedding; default: a special token the
    chat template never uses (`unused_special_token`), else V-1. A head with its own embedding keeps its own id.
    """
    head = _exportable(head_dir, target, "speculators", "the speculators layout holds EAGLE-3 / P-EAGLE heads only "
                                                        "(draft.family=peagle or eagle3)")
    c = head.config
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
                         "architectures": list(getattr(target.model.config, "architectures", None) or ["LlamaForCausalLM"])},
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
            mask_id = unused_special_token(target.tokenizer, c["vocab_size"]) if mask_token_id is None else int(mask_token_id)
            if not 0 <= mask_id < c["vocab_size"]:
                raise DraftheadsError(f"mask_token_id={mask_id} is outside the target vocabulary 0..{c['vocab_size'] - 1}")
            tensors["embed_tokens.weight"][mask_id] = head.mask_embedding.detach().float().cpu()
        # vLLM reads mask_token_id only from a "peagle" config; under "eagle3" it drops it and serves a chain head
        config.update(speculators_model_type="peagle", parallel_drafting=True, mask_token_id=mask_id)
        config["speculators_config"]["algorithm"] = "peagle"
    save_file(tensors, out / "model.safetensors")
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
    if sizes["draft_vocab_size"] is None and "lm_head.weight" in state:
        if _is_targets(state["lm_head.weight"], target.model.get_output_embeddings().weight):
            del state["lm_head.weight"]  # the target's own: shared, not copied
        else:
            sizes["own_lm_head"] = True
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


def export_sglang(head_dir, target, out_dir, verifier_path: str | None = None) -> Path:
    """Write the SGLang EAGLE-3 draft directory (LlamaForCausalLMEagle3) for the checkpoint `head_dir`.

    Serve with --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT; the draft length is SGLang's
    --speculative-num-steps (the head's K is recorded under "draftheads" only). verifier_path is recorded there too.
    More than one layer: SGLang's additional layers (BasicDecoderLayer, read at sgl-project/sglang 03d5a77) restart
    the residual stream from the previous layer's MLP output, so such a head drafts differently there than here
    and in vLLM (older SGLang refuses num_hidden_layers != 1); a warning says so.
    """
    head = _exportable(head_dir, target, "sglang", "SGLang's EAGLE-3 draft holds EAGLE-3 chain heads only "
                                                   "(draft.family=eagle3)")
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
    own = [piece for piece in ("qk_norm", "own_embedding", "own_lm_head") if c.get(piece)]
    if own:
        raise DraftheadsError(f"'{head_dir}' has {own}; SGLang's LlamaForCausalLMEagle3 has plain Llama layers and the "
                              "target's embedding and LM head, so it would serve another head. Export it with "
                              "export_speculators for vLLM")
    if c["num_layers"] > 1:
        warnings.warn(f"'{head_dir}' has {c['num_layers']} layers: SGLang's additional EAGLE-3 layers drop the "
                      "residual stream of the layer before them, so SGLang will draft differently from this head; "
                      "measure acceptance there, or use a 1-layer head", stacklevel=2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {_sglang_name(k): v for k, v in _head_tensors(head).items()}
    config = {
        **_layer_config(target, c),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": int(head.d2t.numel()) if "d2t" in tensors else None,  # must be present, null or not
        # SGLang captures layer id + 1 (ids = ours - 1); without eagle_config it captures [2, L//2, L-3] directly
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in target.layer_ids],
                         "use_aux_hidden_state": True},
        # no target_hidden_size: our fc reads 3 x hidden_size of the target, which is also the head's width
        "draftheads": {**_provenance(head, target), "k": head.k, "verifier": verifier_name(target, verifier_path)},
    }
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def import_sglang(directory, target, k: int | None = None) -> PEagleDrafter:
    """Read an SGLang EAGLE-3 draft directory (ours or a peer's) into a chain head attached to `target` (eval mode).
    K: `k`, else the one export_sglang recorded, else SGLANG_DEFAULT_K with a warning."""
    d = Path(directory)
    summary = _summary(d, "sglang", target)
    sizes = dict(summary["sizes"], k=k or summary["k"] or SGLANG_DEFAULT_K)
    if not (k or summary["k"]):
        warnings.warn(f"'{d}' does not record its draft length (SGLang's --speculative-num-steps sets it); using "
                      f"K={SGLANG_DEFAULT_K}. Choose it with head:DIR,k=N", stacklevel=2)
    state = {_our_name(name): v for name, v in read_weights(d).items() if name != "embed_tokens.weight"}
    if sizes["draft_vocab_size"] is None:  # full vocabulary: the target's LM head
        state.pop("lm_head.weight", None)
    return head_from_state("eagle3", sizes, state, target, f"SGLang draft '{d}'",
                           fix="the directory is damaged or from another layout; export it again")


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
        norm_before_residual = bool(config.get("norm_before_residual", False))
    else:
        layer, parallel, norm_before_residual = {"model_type": "llama", **config}, False, False
        ids = [i + 1 for i in (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []]
        if not ids:  # SGLang's own default then: layers (2, L//2, L-3) of a target it does not name
            raise DraftheadsError(f"'{d}/config.json' has no eagle_config.eagle_aux_hidden_state_layer_ids, so the "
                                  "target layers it reads are unknown; add the ids it was trained with")
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
    sizes = dict(decoder_sizes(lc), num_aux_layers=len(ids), num_layers=lc.num_hidden_layers, vocab_size=vocab, k=k,
                 parallel=parallel, draft_vocab_size=draft_vocab if draft_vocab and draft_vocab < vocab else None,
                 norm_before_residual=norm_before_residual, qk_norm=lc.model_type == "qwen3")
    return {"layout": layout, "family": "peagle" if parallel else "eagle3", "k": k, "sizes": sizes,
            "mask_token_id": config.get("mask_token_id"),
            "target": {"name": verifier, "vocab_size": vocab, "layer_ids": list(ids),
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
    if fp["layer_ids"] != list(target.layer_ids):
        raise DraftheadsError(f"'{d}' reads target layers {fp['layer_ids']} but the target captures "
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


def _is_targets(tensor, ref, skip_row: int | None = None) -> bool:
    """Whether an exported embedding / LM head [V, H] is the target's own `ref` (but for the row that carries
    P-EAGLE's mask embedding): then the head shares the target's, else it keeps its own (trained) copy."""
    if tensor.shape != ref.shape:
        return False
    same = (tensor.to(device=ref.device, dtype=ref.dtype) == ref).all(-1)
    if skip_row is not None:
        same[skip_row] = True
    return bool(same.all())


def _exportable(head_dir, target, layout: str, holds: str) -> PEagleDrafter:
    """The head at head_dir when its family exports to `layout` (models.families), else a clear error."""
    from models.families import family

    head = load_draft(head_dir, target)
    if layout not in family(head.family_name).exports and not (layout == "sglang" and head.family_name == "peagle"):
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
