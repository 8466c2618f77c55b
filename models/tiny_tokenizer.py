"""A byte-level tokenizer with the ChatML chat template, built in memory.

Tests and the `smoke` experiment use it with tiny random targets, so nothing is downloaded.
Ids 0..255 stand for the 256 bytes (in the order of the GPT-2 byte-to-unicode alphabet); specials follow.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins for the bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok
