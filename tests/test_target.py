import pytest
import torch

from models.errors import DraftheadsError
from models.target import default_layer_ids, load_target


def test_hooks_capture_the_layer_inputs_and_lm_head_input(tiny_target):
    ids = torch.randint(0, tiny_target.vocab_size, (2, 9))
    out = tiny_target(ids)
    ref = tiny_target.model(ids, output_hidden_states=True)
    H = tiny_target.hidden_size
    for j, i in enumerate(tiny_target.layer_ids):  # hidden state i = input of decoder layer i
        assert torch.equal(out.aux_hidden[..., j * H:(j + 1) * H], ref.hidden_states[i])
    assert torch.equal(tiny_target.lm_head(out.final_hidden), ref.logits)
    assert torch.equal(out.logits, ref.logits)


def test_target_is_frozen(tiny_target):
    assert not any(p.requires_grad for p in tiny_target.model.parameters())
    assert not tiny_target.model.training


def test_default_layer_ids_match_vllm():
    assert default_layer_ids(30) == (2, 15, 27)
    assert default_layer_ids(80) == (2, 40, 77)


def test_fingerprint_mismatch_is_a_clear_error(tiny_target):
    other = dict(tiny_target.fingerprint, name="big-model", vocab_size=151936)
    with pytest.raises(DraftheadsError, match=r"built for target 'big-model'.*vocab_size: 151936 there, 259 here.*rebuild"):
        tiny_target.check_fingerprint(other, "draft head 'x'")


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "x", "path": "/no/such/model.gguf"}, "does not exist; check target.path"),
    ({"name": "x", "path": "/no/such/dir"}, "does not exist"),
    ({"name": "tiny-random-llama", "layer_ids": [1, 99]}, r"\[99\] outside 0..4"),
    ({"name": "tiny-random-llama", "dtype": "fp8"}, "target.dtype 'fp8'"),
])
def test_bad_target_inputs(kwargs, message):
    with pytest.raises(DraftheadsError, match=message):
        load_target(**kwargs)


def test_hub_id_without_network_names_the_model_and_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DraftheadsError, match=r"'org/not-here' is not available.*target.path="):
        load_target("org/not-here")


@pytest.mark.slow
def test_smollm2_loads_with_the_expected_shape(smollm2):
    fp = smollm2.fingerprint
    assert (fp["num_layers"], fp["hidden_size"], fp["vocab_size"], fp["layer_ids"]) == (30, 576, 49152, [2, 15, 27])
