"""SGLang EAGLE-3 export: the layout LlamaForCausalLMEagle3 loads, lossless round trip, and every refusal."""

import json

import pytest
import torch
from safetensors.torch import load_file

from models.checkpoint import load_draft, save_draft
from models.draft_vocab import DraftVocab
from models.errors import DraftheadsError
from models.export_sglang import export_sglang, import_sglang
from models.export_speculators import export_speculators
from models.peagle import DraftCache, peagle_for_target
from models.target import Target, tiny_random_llama
from tests.test_export import _randomise

LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def _export(target, tmp_path, num_layers=1, vocab=None, **kw):
    dv = None if vocab is None else DraftVocab(
        torch.randperm(259, generator=torch.Generator().manual_seed(1))[:vocab].sort().values, 259)
    head = _randomise(peagle_for_target(target, k=4, num_layers=num_layers, parallel=False, draft_vocab=dv, **kw))
    save_draft(head, tmp_path / "head", target)
    return dv


@pytest.mark.parametrize("num_layers,vocab", [(1, None), (2, None), (1, 100), (2, 100)])
def test_round_trip_is_lossless(tiny_target, tmp_path, num_layers, vocab):
    dv = _export(tiny_target, tmp_path, num_layers, vocab)
    if num_layers > 1:  # SGLang's additional layers restart the residual stream: the export says so
        with pytest.warns(UserWarning, match="drop the residual stream"):
            out = export_sglang(tmp_path / "head", tiny_target, tmp_path / "sgl", verifier_path="/models/tiny")
    else:
        out = export_sglang(tmp_path / "head", tiny_target, tmp_path / "sgl", verifier_path="/models/tiny")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    H = tiny_target.hidden_size

    assert tiny_target.layer_ids == (1, 3, 5)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "use_aux_hidden_state": True}
    assert config["num_hidden_layers"] == num_layers and config["tie_word_embeddings"] is False
    assert "draft_vocab_size" in config and config["draft_vocab_size"] == vocab  # null = LM head from the target
    assert "target_hidden_size" not in config and "rope_scaling" not in config  # default RoPE, same width
    assert config["draftheads"]["k"] == 4 and config["draftheads"]["verifier"] == "/models/tiny"

    want_names = {"fc.weight", "norm.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"}
    want_names |= {f"midlayer.{n}" for n in LAYER}
    for i in range(num_layers - 1):
        want_names |= {f"additional_layers.{i}.hidden_norm.weight"} | {f"additional_layers.{i}.{n}" for n in LAYER}
    if vocab:
        want_names |= {"lm_head.weight", "d2t", "t2d"}
    assert set(tensors) == want_names  # no embed_tokens, no "model." prefix, no input_layernorm past the midlayer
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H  # [embeds; hidden]
    if num_layers > 1:
        assert tensors["additional_layers.0.self_attn.q_proj.weight"].shape[1] == H
    if vocab:
        assert tensors["lm_head.weight"].shape == (vocab, H)
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        assert torch.equal(torch.arange(vocab) + tensors["d2t"], dv.draft_ids) and int(tensors["t2d"].sum()) == vocab

    back = import_sglang(out, tiny_target)
    assert back.k == 4 and not back.parallel
    head = load_draft(tmp_path / "head", tiny_target)
    sample = lambda lg: lg.argmax()  # noqa: E731
    for seed, T in ((2, 6), (3, 11), (4, 17)):
        ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(seed))
        aux = tiny_target(ids[None]).aux_hidden[0, :T - 1]
        want = head.draft_logits(ids, aux, DraftCache(), 4, sample)
        got = back.draft_logits(ids, aux, DraftCache(), 4, sample)
        assert got.shape == (4, vocab or 259) and torch.equal(got, want)


def test_refuses_parallel_head(tiny_target, tmp_path):
    save_draft(peagle_for_target(tiny_target, k=3, parallel=True), tmp_path / "p", tiny_target)
    with pytest.raises(DraftheadsError, match="parallel drafting.*export_speculators for vLLM"):
        export_sglang(tmp_path / "p", tiny_target, tmp_path / "out")


def test_refuses_norm_before_residual(tiny_target, tmp_path):
    _export(tiny_target, tmp_path, norm_before_residual=True)
    with pytest.raises(DraftheadsError, match="norm_before_residual=True"):
        export_sglang(tmp_path / "head", tiny_target, tmp_path / "out")


@pytest.mark.parametrize("family", ["medusa", "dspark"])
def test_refuses_other_families(tiny_target, tmp_path, family):
    from models.dspark import dspark_for_target
    from models.medusa import medusa_for_target

    head = medusa_for_target(tiny_target, k=2) if family == "medusa" else dspark_for_target(tiny_target, k=2, rank=8)
    save_draft(head, tmp_path / "h", tiny_target)
    with pytest.raises(DraftheadsError, match=f"is a {family} head; SGLang's EAGLE-3 draft holds EAGLE-3 chain"):
        export_sglang(tmp_path / "h", tiny_target, tmp_path / "out")


def test_both_engines_refuse_layers_they_do_not_capture_as_trained(tmp_path):
    model, tok = tiny_random_llama(num_layers=6)
    reads_embedding = Target(model, tok, "tiny-random-llama", layer_ids=(0, 3, 5))
    _export(reads_embedding, tmp_path / "a")
    with pytest.raises(DraftheadsError, match=r"\[0, 3, 5\].*target.layer_ids >= 1 and <= 5"):
        export_sglang(tmp_path / "a" / "head", reads_embedding, tmp_path / "out")
    model, tok = tiny_random_llama(num_layers=6)
    last = Target(model, tok, "tiny-random-llama", layer_ids=(1, 3, 6))  # 6: the last layer's output
    _export(last, tmp_path / "c")
    for export in (export_sglang, export_speculators):
        with pytest.raises(DraftheadsError, match=r"\[1, 3, 6\]; .* captures the input of decoder layers 1..5 only"):
            export(tmp_path / "c" / "head", last, tmp_path / "out")
    with pytest.raises(DraftheadsError, match=r"\[5, 1, 3\] must be ascending and distinct.*use \[1, 3, 5\]"):
        Target(model, tok, "tiny-random-llama", layer_ids=(5, 1, 3))

    model, tok = tiny_random_llama(num_layers=6)
    four = Target(model, tok, "tiny-random-llama", layer_ids=(1, 2, 3, 5))
    _export(four, tmp_path / "b")
    with pytest.raises(DraftheadsError, match="fuses 4 target layers; SGLang's EAGLE-3 fc reads exactly 3"):
        export_sglang(tmp_path / "b" / "head", four, tmp_path / "out")
    with pytest.raises(DraftheadsError, match="fuses 4 target layers; vLLM's EAGLE-3 fc reads exactly 3"):
        export_speculators(tmp_path / "b" / "head", four, tmp_path / "out")


def test_import_checks_layer_ids(tiny_target, tmp_path):
    _export(tiny_target, tmp_path)
    out = export_sglang(tmp_path / "head", tiny_target, tmp_path / "sgl")
    model, tok = tiny_random_llama(num_layers=6)
    other = Target(model, tok, "tiny-random-llama", layer_ids=(2, 3, 5))
    with pytest.raises(DraftheadsError, match=r"reads target layers \[1, 3, 5\] but the target captures \[2, 3, 5\]"):
        import_sglang(out, other)


def test_cli_writes_either_layout(tmp_path):
    from models.export import main
    from models.target import load_target

    _export(load_target("tiny-random-llama"), tmp_path)  # the CLI loads the target the head names
    sglang = main(["--head", str(tmp_path / "head"), "--out", str(tmp_path / "sg"), "--format", "sglang"])
    assert sglang["config"]["architectures"] == ["LlamaForCausalLMEagle3"]
    vllm = main(["--head", str(tmp_path / "head"), "--out", str(tmp_path / "sp")])
    assert vllm["config"]["speculators_model_type"] == "eagle3"


def test_peer_drafts_without_layer_ids_or_with_their_own_full_vocab_lm_head(tmp_path):
    """What vLLM and SGLang load, we load alike: no layer ids means the engines' default (2, L//2, L-3); an SGLang
    draft with draft_vocab_size = V runs its own lm_head (null: the target's), identity d2t / t2d included."""
    from safetensors.torch import save_file

    model, tok = tiny_random_llama(num_layers=8)
    target = Target(model, tok, "tiny-random-llama")  # layers (2, 4, 5): the engines' default for 8
    _export(target, tmp_path)
    head = load_draft(tmp_path / "head", target)
    spec = export_speculators(tmp_path / "head", target, tmp_path / "spec")
    config = json.loads((spec / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = None
    (spec / "config.json").write_text(json.dumps(config))
    assert load_draft(spec, target).k == head.k
    sgl = export_sglang(tmp_path / "head", target, tmp_path / "sgl")
    config = json.loads((sgl / "config.json").read_text())
    del config["eagle_config"]
    config["draft_vocab_size"] = config["vocab_size"]
    (sgl / "config.json").write_text(json.dumps(config))
    weights = load_file(sgl / "model.safetensors")
    own = torch.randn(target.vocab_size, target.hidden_size)
    save_file({**weights, "lm_head.weight": own, "d2t": torch.zeros(target.vocab_size, dtype=torch.long),
               "t2d": torch.ones(target.vocab_size, dtype=torch.bool)}, str(sgl / "model.safetensors"))
    peer = import_sglang(sgl, target)
    assert torch.equal(peer.lm_head.weight.float(), own)
    config["draft_vocab_size"] = None
    (sgl / "config.json").write_text(json.dumps(config))
    assert not hasattr(import_sglang(sgl, target), "lm_head")
    other = Target(model, tok, "tiny-random-llama", layer_ids=(1, 4, 7))
    with pytest.raises(DraftheadsError, match=r"reads the engines' default target layers \[2, 4, 5\] but the target "
                                              r"captures \[1, 4, 7\]"):
        import_sglang(sgl, other)
