"""Scaled RoPE (Llama 3.1+ 'llama3') in the draft heads: cos/sin equal the target's own, every head family and format
carries rope_scaling, old checkpoints without it still load, and the default RoPE is unchanged bit for bit."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.checkpoint import load_draft, save_draft
from models.dspark import dspark_for_target
from models.errors import DraftheadsError
from models.export_sglang import export_sglang, import_sglang
from models.export_speculators import export_speculators, import_speculators
from models.peagle import DraftCache, PEagleDrafter, peagle_for_target, rotary, target_layer_sizes
from models.target import Target
from models.tiny_tokenizer import tiny_byte_tokenizer
from tests.test_export import _randomise

# Llama 3.1's recipe at a tiny scale: head_dim 16, theta 5e5 -> wavelengths 6.3, 32.5, 168, ... against
# high/low-frequency cut-offs 64/4 = 16 and 64/1 = 64, so one frequency is kept, one smoothed, six divided by 8
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def llama3_target():
    tok = tiny_byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=500000.0, rope_scaling=dict(LLAMA3), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return Target(model, tok, "tiny-llama3-rope")


def _target_cos_sin(target, positions):
    x = torch.zeros(1, positions.shape[-1], target.hidden_size)
    return target.model.model.rotary_emb(x, positions)  # [1, N, hd] each


def test_head_cos_sin_equal_the_targets_beyond_the_original_context(llama3_target):
    sizes = target_layer_sizes(llama3_target)
    assert sizes["rope_scaling"] == LLAMA3 and sizes["rope_theta"] == 500000.0
    positions = torch.arange(301)[None]  # past original_max_position_embeddings = 64
    want_cos, want_sin = _target_cos_sin(llama3_target, positions)
    for head in (peagle_for_target(llama3_target, k=3, parallel=False), dspark_for_target(llama3_target, k=3, rank=8)):
        assert head.config["rope_scaling"] == LLAMA3
        cos, sin = rotary(positions, head.head_dim, head.rope_theta, head.rope_scaling)
        assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    plain_cos, _ = rotary(positions, sizes["head_dim"], sizes["rope_theta"])  # what heads did before
    assert (plain_cos[:, 0] - want_cos).abs().max() > 1.0


def test_default_rope_is_unchanged(tiny_target):
    assert target_layer_sizes(tiny_target)["rope_scaling"] is None
    positions = torch.arange(300)[None]
    cos, sin = rotary(positions, 16, 10000.0)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)  # the formula heads always used
    angles = torch.cat([positions.float()[..., None] * inv_freq] * 2, -1)[:, None]
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    assert all(torch.equal(a, b) for a, b in zip(rotary(positions, 16, 10000.0, {"rope_type": "default"}), (cos, sin)))
    want_cos, _ = _target_cos_sin(tiny_target, positions)
    torch.testing.assert_close(cos[:, 0], want_cos)
    head = PEagleDrafter(64, 3, 1, 4, 2, 16, 128, 259, k=2, rope_scaling={"rope_type": "default", "rope_theta": 1e4})
    assert head.config["rope_scaling"] is None


def test_yarn_attention_factor_scales_cos_sin():
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    reference = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                                 rope_theta=10000.0, rope_scaling=dict(rope)))
    assert reference.attention_scaling > 1.0
    positions = torch.arange(200)[None]
    want_cos, want_sin = reference(torch.zeros(1, 200, 64), positions)
    cos, sin = rotary(positions, 16, 10000.0, rope)
    assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)


def test_sequence_dependent_rope_is_refused():
    with pytest.raises(DraftheadsError, match="rope_type 'dynamic'.*heads support 'default' and .*'llama3'"):
        PEagleDrafter(64, 3, 1, 4, 2, 16, 128, 259, k=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})


def _logits(head, target, T=14, seed=2):
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(seed))
    aux = target(ids[None]).aux_hidden[0, :T - 1]
    return head.draft_logits(ids, aux, DraftCache(), 3, lambda lg: lg.argmax())


def test_scaled_heads_round_trip_through_checkpoint_and_exports(llama3_target, tmp_path):
    head = _randomise(peagle_for_target(llama3_target, k=3, num_layers=2, parallel=False)).eval()
    want = _logits(head, llama3_target)
    unscaled = PEagleDrafter(**{**head.config, "rope_scaling": None})
    unscaled.load_state_dict(head.state_dict())
    assert not torch.allclose(_logits(unscaled.attach_target(llama3_target).eval(), llama3_target), want)

    save_draft(head, tmp_path / "head", llama3_target)
    loaded = load_draft(tmp_path / "head", llama3_target)
    assert loaded.rope_scaling == LLAMA3 and torch.equal(_logits(loaded, llama3_target), want)

    spec = export_speculators(tmp_path / "head", llama3_target, tmp_path / "spec")
    assert json.loads((spec / "config.json").read_text())["transformer_layer_config"]["rope_scaling"] == LLAMA3
    with pytest.warns(UserWarning):  # 2 layers: SGLang's residual caveat
        sgl = export_sglang(tmp_path / "head", llama3_target, tmp_path / "sgl")
    assert json.loads((sgl / "config.json").read_text())["rope_scaling"] == LLAMA3
    for back in (import_speculators(spec, llama3_target), import_sglang(sgl, llama3_target)):
        assert back.rope_scaling == LLAMA3 and torch.equal(_logits(back, llama3_target), want)


def test_dspark_uses_the_scaled_rope(llama3_target, tmp_path):
    torch.manual_seed(0)
    head = dspark_for_target(llama3_target, k=3, num_layers=1, rank=8).eval()
    save_draft(head, tmp_path / "d", llama3_target)
    loaded = load_draft(tmp_path / "d", llama3_target)
    assert loaded.rope_scaling == LLAMA3 and torch.equal(_logits(loaded, llama3_target), _logits(head, llama3_target))
    unscaled = type(head)(**{**head.config, "rope_scaling": None})
    unscaled.load_state_dict(head.state_dict())
    assert not torch.allclose(_logits(unscaled.attach_target(llama3_target).eval(), llama3_target),
                              _logits(head, llama3_target))


def test_checkpoint_without_rope_scaling_still_loads(tiny_target, tmp_path):
    head = _randomise(peagle_for_target(tiny_target, k=3, parallel=False)).eval()
    save_draft(head, tmp_path / "old", tiny_target)
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["sizes"]["rope_scaling"]  # as written before heads recorded it
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    loaded = load_draft(tmp_path / "old", tiny_target)
    assert loaded.rope_scaling is None and torch.equal(_logits(loaded, tiny_target), _logits(head, tiny_target))
