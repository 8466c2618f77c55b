"""Speculators export: layout vLLM reads, and lossless round trip (export -> reload -> identical logits)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from models.checkpoint import save_draft, load_draft
from models.draft_vocab import DraftVocab
from models.errors import DraftheadsError
from models.export_speculators import export_speculators, import_speculators
from models.peagle import DraftCache, peagle_for_target


def _randomise(head):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head


@pytest.mark.parametrize("parallel,vocab", [(True, None), (False, None), (True, 100)])
def test_round_trip_is_lossless(tiny_target, tmp_path, parallel, vocab):
    dv = None if vocab is None else DraftVocab(torch.randperm(259, generator=torch.Generator().manual_seed(1))[:vocab].sort().values, 259)
    head = _randomise(peagle_for_target(tiny_target, k=4, num_layers=2, parallel=parallel, draft_vocab=dv))
    save_draft(head, tmp_path / "head", tiny_target)
    out = export_speculators(tmp_path / "head", tiny_target, tmp_path / "spec", mask_token_id=258)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    H = tiny_target.hidden_size
    assert config["speculators_model_type"] == ("peagle" if parallel else "eagle3")
    assert config["eagle_aux_hidden_state_layer_ids"] == list(tiny_target.layer_ids)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H  # [embed; hidden]
    assert "layers.0.hidden_norm.weight" in tensors and "layers.1.hidden_norm.weight" not in tensors
    assert tensors["lm_head.weight"].shape == ((vocab or 259), H)
    assert not any(k.startswith("model.") for k in tensors)
    if vocab:
        assert config["draft_vocab_size"] == vocab and tensors["d2t"].dtype == torch.int64
        assert torch.equal(torch.arange(vocab) + tensors["d2t"], dv.draft_ids) and int(tensors["t2d"].sum()) == vocab
    if parallel:
        assert config["parallel_drafting"] is True and config["mask_token_id"] == 258
        assert tensors["mask_hidden"].shape == (1, 1, 3 * H)  # speculators refuses [3H]; vLLM reads either
        assert torch.equal(tensors["embed_tokens.weight"][258], head.mask_embedding.detach())
    else:
        assert "parallel_drafting" not in config and "mask_hidden" not in tensors

    back = import_speculators(out, tiny_target)
    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(2))
    aux = tiny_target(ids[None]).aux_hidden[0, :13]
    sample = lambda lg: lg.argmax()  # noqa: E731
    want = load_draft(tmp_path / "head", tiny_target).draft_logits(ids, aux, DraftCache(), 4, sample)
    got = back.draft_logits(ids, aux, DraftCache(), 4, sample)
    assert torch.equal(got, want)


def test_export_refuses_medusa(tiny_target, tmp_path):
    from models.medusa import medusa_for_target

    save_draft(medusa_for_target(tiny_target, k=2), tmp_path / "m", tiny_target)
    with pytest.raises(DraftheadsError, match="medusa head"):
        export_speculators(tmp_path / "m", tiny_target, tmp_path / "out")


def test_default_mask_token_is_an_unused_special_token(tiny_target):
    from types import SimpleNamespace

    from models.export_speculators import unused_special_token

    def special(text):
        return type("AddedToken", (), {"special": True, "__str__": lambda self: text})()

    tok = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=2, unk_token_id=None,
                          chat_template="<|im_start|>{{ m }}<|im_end|>",
                          added_tokens_decoder={0: special("<|endoftext|>"), 1: special("<|im_start|>"),
                                                2: special("<|im_end|>"), 7: special("<empty_output>"),
                                                9: special("<|im_start|>")})
    assert unused_special_token(tok, vocab_size=100) == 7  # 9 is in the chat template, 1/2 are bos/eos
    assert unused_special_token(tiny_target.tokenizer, 259) in range(259)


def test_heads_exports_and_features_are_readable_by_a_serving_user(tiny_target, tmp_path):
    """safetensors' save_file makes files owner-only (0600): vLLM or SGLang running as another user could not open an
    exported head. Every tensor file is written with the mode open() gives (0644 under umask 022)."""
    import os

    from data.features import extract_features
    from models.export_sglang import export_sglang

    old = os.umask(0o022)
    try:
        save_draft(peagle_for_target(tiny_target, k=2, parallel=False), tmp_path / "head", tiny_target)
        export_speculators(tmp_path / "head", tiny_target, tmp_path / "spec")
        export_sglang(tmp_path / "head", tiny_target, tmp_path / "sglang")
        ids = torch.arange(1, 40)
        extract_features(tiny_target, [(ids, torch.ones_like(ids))], tmp_path / "features", shard_tokens=16)
    finally:
        os.umask(old)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 4 and not list(tmp_path.rglob("*.tmp"))
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: "0o644" for f in files}
