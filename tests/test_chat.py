import copy

import pytest

from data.chat import prompt_ids, tokenize_chat

CONV = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo!"},
        {"role": "user", "content": "ok"}, {"role": "assistant", "content": "Sure."}]


def _masked_text(tok, tc):
    return [tok.decode(tc.input_ids[s:e]) for s, e in _runs(tc.loss_mask.tolist())]


def _runs(mask):
    runs, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_assistant_only_mask_tiny_template(tiny_target):
    tok = tiny_target.tokenizer
    tc = tokenize_chat(tok, CONV)
    # exactly the assistant contents plus their end-of-turn marker; never the role header or user text
    assert _masked_text(tok, tc) == ["Yo!<|im_end|>", "Sure.<|im_end|>"]
    first = _runs(tc.loss_mask.tolist())[0][0]
    assert tok.decode(tc.input_ids[first - 10:first]) == "assistant\n"  # boundary: mask starts right after header


def test_turns_cut_by_the_token_limit_train_no_end_marker(tiny_target):
    tok = tiny_target.tokenizer
    tc = tokenize_chat(tok, CONV, open_turns=[False, True])  # the last turn was cut: the sequence ends after it
    assert _masked_text(tok, tc) == ["Yo!<|im_end|>", "Sure."]
    assert tok.decode(tc.input_ids[-5:]) == "Sure."
    tc = tokenize_chat(tok, CONV, open_turns=[True, False])  # an earlier cut turn keeps its marker, untrained
    assert _masked_text(tok, tc) == ["Yo!", "Sure.<|im_end|>"]
    assert tc.input_ids.tolist() == tokenize_chat(tok, CONV).input_ids.tolist()


def test_cut_turns_are_found_under_a_trimming_template(tiny_target):
    """Llama 3's template trims contents: a cut answer ending in whitespace is rendered without it."""
    tok = copy.deepcopy(tiny_target.tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conv = CONV[:3] + [{"role": "assistant", "content": "Sure. \n"}]
    assert _masked_text(tok, tokenize_chat(tok, conv, open_turns=[True, True])) == ["Yo!", "Sure."]
    assert _masked_text(tok, tokenize_chat(tok, conv)) == ["Yo!<|im_end|>", "Sure.<|im_end|>"]


def test_overlong_truncate_or_skip(tiny_target):
    tok = tiny_target.tokenizer
    full = tokenize_chat(tok, CONV)
    cut = tokenize_chat(tok, CONV, max_length=30)
    assert cut.truncated and len(cut.input_ids) == 30 and (cut.input_ids == full.input_ids[:30]).all()
    assert tokenize_chat(tok, CONV, max_length=30, overlong="skip") is None


def test_prompt_ids_end_with_generation_prompt(tiny_target):
    tok = tiny_target.tokenizer
    assert tok.decode(prompt_ids(tok, CONV[:1])).endswith("Hi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_assistant_mask_boundaries_real_template(smollm2):
    tok = smollm2.tokenizer
    tc = tokenize_chat(tok, CONV)
    ids, runs = tc.input_ids.tolist(), _runs(tc.loss_mask.tolist())
    assert _masked_text(tok, tc) == ["Yo!<|im_end|>", "Sure.<|im_end|>"]
    s, e = runs[0]
    # SmolLM2 ids: '\n' = 198 before the first masked token, '<|im_end|>' = 2 as the last masked token
    assert ids[s - 1] == 198 and ids[e - 1] == 2 and ids[e] == 198
    assert tok.decode(ids[s - 4:s]) == "<|im_start|>assistant\n"  # "assistant" is two tokens here
