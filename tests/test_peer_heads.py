"""Start from anyone's head: a speculators 0.9 P-EAGLE directory written elsewhere (Qwen3-style layers with q/k norms,
a trained embedding and full-vocabulary LM head, mask token 2), our own speculators and SGLang exports, all through
load_draft: they draft through head:DIR, fine-tune with draft.init_from, round-trip, and fail clearly when foreign
or damaged. speculators' own loader reads our exports (run when speculators is importable, or SPECULATORS_PYTHON
names a python that has it)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import load_draft, save_draft
from models.draft_vocab import DraftVocab
from models.errors import DraftheadsError
from models.export_sglang import export_sglang
from models.export_speculators import export_speculators
from models.peagle import DecoderLayer, DraftCache, draft_attention_mask, peagle_for_target, rotary
from models.target import Target, tiny_random_llama
from tests.test_export import _randomise

V, H, HD = 259, 64, 16  # the tiny target's vocabulary and width; the peer's head dim


def write_peer_head(d, num_layers=2, parallel=True, seed=0, **config_changes):
    """A P-EAGLE (or EAGLE-3) head as speculators 0.9 saves one (config keys and tensor names as its save_pretrained
    wrote them here), written by hand so our exporter is not what it is checked against. Returns its tensors."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1, mean=0.0):
        return torch.randn(*shape, generator=g) * scale + mean

    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,), "mlp.down_proj.weight": (H, 128),
              "mlp.gate_proj.weight": (128, H), "mlp.up_proj.weight": (128, H), "self_attn.q_proj.weight": (64, H),
              "self_attn.k_proj.weight": (32, H), "self_attn.v_proj.weight": (32, H), "self_attn.o_proj.weight": (H, 64),
              "self_attn.q_norm.weight": (HD,), "self_attn.k_norm.weight": (HD,)}
    tensors = {"embed_tokens.weight": rand(V, H, scale=1.0), "lm_head.weight": rand(V, H), "fc.weight": rand(H, 3 * H),
               "norm.weight": rand(H, mean=1.0), "layers.0.hidden_norm.weight": rand(H, mean=1.0)}
    for i in range(num_layers):
        for name, shape in shapes.items():
            if i == 0 and name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):  # EAGLE-3: [embed; hidden] in
                shape = (shape[0], 2 * H)
            tensors[f"layers.{i}.{name}"] = rand(*shape, mean=1.0 if len(shape) == 1 else 0.0)
    if parallel:
        tensors["mask_hidden"] = rand(1, 1, 3 * H, scale=1.0)
    config = {
        "architectures": ["PEagleDraftModel" if parallel else "Eagle3DraftModel"], "draft_vocab_size": V,
        "dtype": "float32", "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "embed_requires_grad": True, "fc_norm": False,
        "norm_before_fc": False, "norm_before_residual": False, "norm_output": False,
        "speculators_config": {"algorithm": "peagle" if parallel else "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": 4, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "/peers/tiny"}},
        "speculators_model_type": "peagle" if parallel else "eagle3", "speculators_version": "0.9.0",
        "target_hidden_size": None, "tie_word_embeddings": False,
        "transformer_layer_config": {
            "attention_bias": False, "attention_dropout": 0.0, "head_dim": HD, "hidden_act": "silu", "hidden_size": H,
            "intermediate_size": 128, "layer_types": ["full_attention"] * num_layers, "max_position_embeddings": 32768,
            "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": num_layers, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "sliding_window": None, "use_sliding_window": False, "vocab_size": V},
    }
    if parallel:
        config["mask_token_id"] = 2
    config.update(config_changes)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def depth1_logits(head, next_ids, aux):
    """Logits [T, V] of every anchor's depth-1 token: next_ids [T] = x_{t+1}, aux [T, 3H] = the target's features of
    x_t (speculators' EAGLE-3 forward pairs them the same way)."""
    anchors = torch.arange(next_ids.numel())[None]
    depth = torch.ones_like(anchors)
    mask = draft_attention_mask(anchors, depth, anchors, depth, torch.ones_like(anchors, dtype=torch.bool))
    prenorm, _ = head.run_layers(head.embed(next_ids)[None], head.fc(aux)[None], anchors, mask)
    return head.logits(head.norm(prenorm[0]))


def drafts(head, target, seed=2, T=14, k=4):
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(seed))
    aux = target(ids[None]).aux_hidden[0, :T - 1]
    return head.draft_logits(ids, aux, DraftCache(), k, lambda lg: lg.argmax())


def test_a_peer_speculators_head_loads_with_its_own_embedding_lm_head_and_qk_norms(tiny_target, tmp_path):
    file = write_peer_head(tmp_path / "peer")
    head = load_draft(tmp_path / "peer", tiny_target)
    c = head.config
    assert head.family_name == "peagle" and head.k == 4 and c["num_layers"] == 2 and c["rms_norm_eps"] == 1e-6
    assert c["qk_norm"] and c["own_embedding"] and c["own_lm_head"] and c["mask_token_id"] == 2
    assert c["draft_vocab_size"] is None and not head._shared  # nothing taken from the target
    state = head.state_dict()
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.1.self_attn.q_norm.weight", "fc.weight"):
        assert torch.equal(state[name], file[name]), name
    assert torch.equal(state["mask_hidden"], file["mask_hidden"].reshape(-1)) and "mask_embedding" not in state

    before = drafts(head, tiny_target)  # [4, V]: depth 1, then mask slots 2..4
    with torch.no_grad():
        head.embed_tokens.weight[2] += 1.0  # the mask token's row is the slot's input embedding
    after = drafts(head, tiny_target)
    assert torch.equal(after[0], before[0]) and (after[1:] - before[1:]).abs().max() > 1e-3


def test_a_peer_head_round_trips_through_our_checkpoint_and_speculators_export(tiny_target, tmp_path):
    write_peer_head(tmp_path / "peer")
    head = load_draft(tmp_path / "peer", tiny_target)
    save_draft(head, tmp_path / "ours", tiny_target)
    again = load_draft(tmp_path / "ours", tiny_target)
    assert again.config == head.config
    out = export_speculators(tmp_path / "ours", tiny_target, tmp_path / "spec", verifier_path="/peers/tiny")
    config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["transformer_layer_config"]["model_type"] == "qwen3" and config["mask_token_id"] == 2
    assert config["draft_vocab_size"] == V and "d2t" not in tensors and tensors["mask_hidden"].shape == (1, 1, 3 * H)
    assert torch.equal(tensors["embed_tokens.weight"], head.embed_tokens.weight.detach())  # its own, not the target's
    assert torch.equal(tensors["lm_head.weight"], head.lm_head.weight.detach())
    back = load_draft(out, tiny_target)
    want = drafts(head, tiny_target)
    for other in (again, back):
        assert other.state_dict().keys() == head.state_dict().keys()
        assert all(torch.equal(v, head.state_dict()[n]) for n, v in other.state_dict().items())
        assert torch.equal(drafts(other, tiny_target), want)
    with pytest.raises(DraftheadsError, match="embeds its mask slot as token 2"):
        export_speculators(tmp_path / "ours", tiny_target, tmp_path / "x", mask_token_id=5)
    write_peer_head(tmp_path / "chain", parallel=False)  # an EAGLE-3 chain, but with pieces SGLang does not run
    with pytest.raises(DraftheadsError, match=r"\['qk_norm', 'own_embedding', 'own_lm_head'\]; SGLang"):
        export_sglang(tmp_path / "chain", tiny_target, tmp_path / "x")


@pytest.mark.parametrize("parallel,vocab", [(True, None), (False, None), (True, 100), (False, 100)])
def test_our_heads_round_trip_through_speculators_and_sglang_unchanged(tiny_target, tmp_path, parallel, vocab):
    dv = None if vocab is None else DraftVocab(torch.arange(0, 2 * vocab, 2), V)
    head = _randomise(peagle_for_target(tiny_target, k=4, num_layers=1, parallel=parallel, draft_vocab=dv))
    save_draft(head, tmp_path / "head", tiny_target)
    outs = [export_speculators(tmp_path / "head", tiny_target, tmp_path / "spec", mask_token_id=258)]
    if not parallel:
        outs.append(export_sglang(tmp_path / "head", tiny_target, tmp_path / "sgl"))
    want = drafts(head, tiny_target)
    for out in outs:
        back = load_draft(out, tiny_target)  # the layout is read from config.json
        assert back.config == head.config, out  # nothing of the target copied in: embedding and LM head stay shared
        assert all(torch.equal(v, head.state_dict()[n]) for n, v in back.state_dict().items())
        assert torch.equal(drafts(back, tiny_target), want)


def test_qk_norm_layer_matches_transformers_qwen3():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    config = Qwen3Config(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=HD, num_hidden_layers=1, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = Qwen3DecoderLayer(config, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    ours = DecoderLayer(False, H, 4, 2, HD, 128, 1e-6, False, qk_norm=True)
    ours.load_state_dict(ref.state_dict())  # same names: speculators' tensors load as they are
    x, positions = torch.randn(1, 7, H), torch.arange(7)[None]
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    cos_sin_mask = (*rotary(positions, HD, 10000.0), torch.ones(7, 7, dtype=torch.bool).tril()[None, None])
    with torch.no_grad():
        want = ref(x, attention_mask=causal, position_ids=positions,
                   position_embeddings=Qwen3RotaryEmbedding(config)(x, positions))
        got, _ = ours(None, x, *cos_sin_mask, None)
        plain = DecoderLayer(False, H, 4, 2, HD, 128, 1e-6, False)
        plain.load_state_dict({n: v for n, v in ref.state_dict().items() if "self_attn.q_norm" not in n
                               and "self_attn.k_norm" not in n})
        without, _ = plain(None, x, *cos_sin_mask, None)
    assert (got - want).abs().max() < 1e-4  # measured 4.8e-6 (eager vs SDPA summation order)
    assert (without - want).abs().max() > 0.1  # the norms matter here


def test_a_peer_head_drafts_losslessly_through_the_head_source(tiny_target, tmp_path):
    from inference.generate import generate_plain, speculative_generate
    from inference.sampling import SamplingConfig
    from inference.sources import build_source, source_layer_ids

    write_peer_head(tmp_path / "peer")
    spec = f"head:{tmp_path / 'peer'}"
    assert source_layer_ids(spec) == [1, 3, 5]  # the target is loaded with the layers the peer's config names
    source = build_source(spec, tiny_target)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(5))
    result = speculative_generate(tiny_target, source, prompt, 20, 4, SamplingConfig(), eos_ids=[])
    assert result.tokens == [generate_plain(tiny_target, prompt, 20, SamplingConfig(), eos_ids=[])]
    assert result.stats.rounds <= 20 and result.stats.emitted == 20


def test_fine_tuning_a_peer_head_trains_its_own_embedding_and_lm_head(tiny_target, tmp_path):
    from tests.test_trainer import losses, make_cfg, tiny_features
    from train.trainer import train_draft

    peer = write_peer_head(tmp_path / "peer")
    target_embedding = tiny_target.model.get_input_embeddings().weight.clone()
    cfg = make_cfg(tmp_path / "run", steps=20)
    cfg.draft.k, cfg.draft.num_layers, cfg.draft.init_from = 4, 2, str(tmp_path / "peer")
    head_dir = train_draft(cfg, tiny_target, tiny_features(tiny_target), tmp_path / "run")
    curve = losses(tmp_path / "run" / "metrics.jsonl")
    first, last = sum(curve[s] for s in range(1, 6)) / 5, sum(curve[s] for s in range(16, 21)) / 5
    assert last < 0.8 * first, (first, last)
    tuned = load_draft(head_dir, tiny_target)
    assert tuned.config["own_embedding"] and tuned.config["own_lm_head"] and tuned.config["qk_norm"]
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.0.self_attn.q_norm.weight"):
        assert (tuned.state_dict()[name] - peer[name]).abs().max() > 1e-4, name  # trained, not frozen
    assert torch.equal(tiny_target.model.get_input_embeddings().weight, target_embedding)


def test_sglang_draft_without_a_recorded_length_loads_with_the_default(tiny_target, tmp_path):
    head = _randomise(peagle_for_target(tiny_target, k=3, parallel=False))
    save_draft(head, tmp_path / "head", tiny_target)
    out = export_sglang(tmp_path / "head", tiny_target, tmp_path / "sgl")
    config = json.loads((out / "config.json").read_text())
    del config["draftheads"]  # as SGLang's own drafts are
    (out / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="does not record its draft length.*using K=5"):
        assert load_draft(out, tiny_target).k == 5
    assert load_draft(out, tiny_target, k=3).k == 3
    with pytest.raises(DraftheadsError, match="does not name the target it drafts for.*--target-path"):
        from models.checkpoint import target_for_head

        target_for_head(out)


def _damage(d, tensors=None, **config_changes):
    config = json.loads((d / "config.json").read_text())
    config.update(config_changes)
    (d / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, d / "model.safetensors")


def test_foreign_and_damaged_directories_fail_clearly(tiny_target, tmp_path):
    model, tok = tiny_random_llama(num_layers=6)
    model.save_pretrained(tmp_path / "llama")
    with pytest.raises(DraftheadsError, match=r"'.*llama/config.json' is no draft head layout draftheads reads "
                                              r"\(architectures=\['LlamaForCausalLM'\].*speculators.*SGLang"):
        load_draft(tmp_path / "llama", tiny_target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftheadsError, match="not a draft checkpoint"):
        load_draft(tmp_path / "empty", tiny_target)

    cases = {  # what changes in the peer's directory -> what the error says
        "dflash": ({"speculators_model_type": "dflash"}, "speculators 'dflash' draft; draftheads reads EAGLE-3"),
        "flags": ({"norm_before_fc": True}, r"\['norm_before_fc'\], input norms draftheads heads do not have"),
        "layers": ({"eagle_aux_hidden_state_layer_ids": [2, 3, 5]},
                   r"reads target layers \[2, 3, 5\] but the target captures \[1, 3, 5\]"),
        "no_mask": ({"mask_token_id": None}, "P-EAGLE draft with mask_token_id=None; it needs the token"),
        "no_spec": ({"speculators_config": {}}, "lacks 'proposal_methods'"),
        "width": ({"target_hidden_size": 128}, r"width 64 reading a target of width 128"),
    }
    for name, (changes, message) in cases.items():
        write_peer_head(tmp_path / name)
        _damage(tmp_path / name, **changes)
        with pytest.raises(DraftheadsError, match=message):
            load_draft(tmp_path / name, tiny_target)

    write_peer_head(tmp_path / "unsaid")
    config = json.loads((tmp_path / "unsaid" / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "unsaid" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftheadsError, match="has no norm_before_residual; add the one the head was trained with"):
        load_draft(tmp_path / "unsaid", tiny_target)

    tensors = write_peer_head(tmp_path / "vocab")
    layer = json.loads((tmp_path / "vocab" / "config.json").read_text())["transformer_layer_config"]
    _damage(tmp_path / "vocab", transformer_layer_config={**layer, "vocab_size": 300})
    with pytest.raises(DraftheadsError, match="trained for target '/peers/tiny' with vocab_size 300, but target "
                                              "'tiny-random-llama' has 259"):
        load_draft(tmp_path / "vocab", tiny_target)
    _damage(tmp_path / "vocab", transformer_layer_config={k: v for k, v in layer.items() if k != "model_type"})
    with pytest.raises(DraftheadsError, match="no transformer_layer_config.model_type"):
        load_draft(tmp_path / "vocab", tiny_target)
    narrow = Target(*tiny_random_llama(hidden_size=32, num_layers=6), "narrow")
    write_peer_head(tmp_path / "wide")
    with pytest.raises(DraftheadsError, match="with hidden_size 64, but target 'narrow' has 32"):
        load_draft(tmp_path / "wide", narrow)

    del tensors["fc.weight"]
    tensors["layers.1.self_attn.k_norm.weight"] = torch.ones(8)
    write_peer_head(tmp_path / "damaged")
    _damage(tmp_path / "damaged", tensors=tensors)
    with pytest.raises(DraftheadsError, match=r"speculators directory '.*damaged' does not match its config.json "
                                              r"\(missing \['fc.weight'\].*wrong shapes \['layers.1.self_attn.k_norm"
                                              r".weight \[8\], expected \[16\]'\]\); the directory is damaged"):
        load_draft(tmp_path / "damaged", tiny_target)
    (tmp_path / "damaged" / "config.json").write_text("{not json")
    with pytest.raises(DraftheadsError, match="config.json' is not valid JSON"):
        load_draft(tmp_path / "damaged", tiny_target)


# -- speculators' own loader ---------------------------------------------------------------------------------------
LOAD_WITH_SPECULATORS = """
import json, sys, torch
from speculators import SpeculatorModel
from speculators.models.eagle3 import Eagle3DraftModel
out = {}
for d in sys.argv[1:]:
    m = SpeculatorModel.from_pretrained(d).eval()
    job, logits = json.load(open(d + "/probe.json")), []
    m.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[0]))
    with torch.no_grad():  # EAGLE-3's first training-time-test step = every anchor's depth-1 token
        Eagle3DraftModel.forward(m, torch.tensor(job["aux"])[None], torch.tensor(job["ids"])[None],
                                 torch.zeros(1, len(job["ids"]), dtype=torch.long), ttt_steps=1)
    out[d] = {"class": type(m).__name__, "logits": logits[0].tolist()}
print(json.dumps(out))
"""


def speculators_python():
    """A python that imports speculators: this one, or $SPECULATORS_PYTHON (a separate venv), else None."""
    from importlib.util import find_spec

    if find_spec("speculators") is not None:
        return sys.executable
    return os.environ.get("SPECULATORS_PYTHON")


@pytest.mark.skipif(speculators_python() is None, reason="speculators is not installed (set SPECULATORS_PYTHON to a "
                                                         "python that has it)")
def test_speculators_loads_our_exports_and_computes_our_logits(tiny_target, tmp_path):
    tiny_target.model.save_pretrained(tmp_path / "verifier")  # the verifier speculators opens (a local path)
    dirs, heads = [], {}
    for parallel in (True, False):
        head = _randomise(peagle_for_target(tiny_target, k=4, num_layers=2, parallel=parallel))
        save_draft(head, tmp_path / f"head{parallel}", tiny_target)
        dirs.append(export_speculators(tmp_path / f"head{parallel}", tiny_target, tmp_path / f"spec{parallel}",
                                       verifier_path=str(tmp_path / "verifier")))
    write_peer_head(tmp_path / "peer")  # a peer's head (its verifier is elsewhere), exported again by us
    save_draft(load_draft(tmp_path / "peer", tiny_target), tmp_path / "peer_ours", tiny_target)
    dirs.append(export_speculators(tmp_path / "peer_ours", tiny_target, tmp_path / "peer_spec",
                                   verifier_path=str(tmp_path / "verifier")))
    ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(7))
    aux = tiny_target(ids[None]).aux_hidden[0]
    for d in dirs:  # depth-1 pairs: token x_{t+1} with features of x_t
        (d / "probe.json").write_text(json.dumps({"ids": ids[1:].tolist(), "aux": aux[:-1].tolist()}))
        heads[str(d)] = depth1_logits(load_draft(d, tiny_target), ids[1:], aux[:-1]).detach()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([speculators_python(), "-c", LOAD_WITH_SPECULATORS, *map(str, dirs)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert [loaded[str(d)]["class"] for d in dirs] == ["PEagleDraftModel", "Eagle3DraftModel", "PEagleDraftModel"]
    for d in dirs:  # measured: max |diff| 3e-7 (float32 summation order)
        assert (torch.tensor(loaded[str(d)]["logits"]) - heads[str(d)]).abs().max() < 1e-4, d
