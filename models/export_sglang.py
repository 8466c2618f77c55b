"""Export an EAGLE-3 chain head to SGLang's EAGLE-3 draft and read one back, ours or a peer's
(models.checkpoint.load_draft dispatches here, so `draft.init_from` and `head:DIR` take them). Shared helpers and the
CLI (python -m models.export) are in models/export.py; vLLM's speculators layout is in models/export_speculators.py.

SGLang (export_sglang; loader python/sglang/srt/models/llama_eagle3.py, LlamaForCausalLMEagle3), EAGLE-3 chain only:
  config.json   a Llama config, architectures ["LlamaForCausalLMEagle3"], draft_vocab_size (null = full vocabulary:
                SGLang takes the LM head from the target), tie_word_embeddings false, and
                eagle_config {eagle_aux_hidden_state_layer_ids: ours - 1, use_aux_hidden_state: true}.
  model.safetensors  fc.weight, midlayer.* (our layers.0), additional_layers.{i-1}.* (our layers.i, whose
                input_layernorm SGLang names hidden_norm), norm.weight, lm_head.weight (draft vocab only), d2t, t2d.
                No embed_tokens: SGLang shares the target's embedding (one in a peer's draft is ignored, as there).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from models.checkpoint import head_from_state, read_weights
from models.errors import DraftheadsError
from models.export import _check_engine_layers, _exportable, _head_tensors, _layer_config, _provenance, _summary
from models.export_speculators import full_vocab_lm_head, verifier_name
from models.files import save_tensors
from models.peagle import PEagleDrafter

SGLANG_DEFAULT_K = 5  # an SGLang draft does not record its length (the server's --speculative-num-steps sets it)


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
    _check_engine_layers(head_dir, target, c["num_aux_layers"], "SGLang")
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
    save_tensors(out / "model.safetensors", tensors)
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
    if json.loads((d / "config.json").read_text()).get("draft_vocab_size") is None:  # SGLang: the target's LM head
        state.pop("lm_head.weight", None)
    full_vocab_lm_head(state, sizes, target)  # draft_vocab_size = V: SGLang runs the file's own lm_head
    return head_from_state("eagle3", sizes, state, target, f"SGLang draft '{d}'",
                           fix="the directory is damaged or from another layout; export it again")


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
