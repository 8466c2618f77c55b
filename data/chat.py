"""Tokenization with the target's own chat template and an assistant-only loss mask.

loss_mask[t] = 1 means token t is an assistant token (its content and the end-of-turn marker the template puts
after it): the draft is trained to predict it from tokens < t. The role header (`<|im_start|>assistant\\n` in
ChatML) is never in the mask: the runtime always emits it from the template, not from a draft.
Spans are found on the rendered text (render the chat up to each assistant turn with the generation prompt, then
including the turn), so any template that renders prefixes consistently works; one that does not is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from data.readers import Conversation
from models.errors import DraftheadsError
from models.target import prompt_ids  # noqa: F401 (the chat helpers live together for callers; defined below data)


@dataclass
class TokenizedChat:
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] bool
    truncated: bool = False


def assistant_char_spans(tokenizer, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the [start, end) character spans of every assistant turn (content + end marker)."""
    text = tokenizer.apply_chat_template(conv, tokenize=False)
    spans = []
    for i, turn in enumerate(conv):
        if turn["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(conv[: i + 1], tokenize=False)
        if not (text.startswith(head) and text.startswith(upto) and upto.startswith(head)):
            raise DraftheadsError(
                "the target's chat template does not render conversation prefixes consistently, so assistant "
                "spans cannot be located; use a template whose rendering of a prefix is a prefix of the whole"
            )
        end = len(upto.rstrip("\n"))  # keep the end-of-turn marker, not the template's trailing newline
        spans.append((len(head), end))
    return text, spans


def tokenize_chat(tokenizer, conv: Conversation, max_length: int | None = None, overlong: str = "truncate",
                  open_turns: list[bool] | None = None) -> TokenizedChat | None:
    """Token ids and assistant-only loss mask; None when the chat is over max_length and overlong == "skip".

    open_turns: per assistant turn, whether it was cut by a token limit (regeneration's `finished` negated): no
    end-of-turn marker is trained where the target would not have put one. A cut last turn also ends the sequence
    after its content; a cut earlier turn keeps its marker as context for the turns after it, untrained.
    """
    text, spans = assistant_char_spans(tokenizer, conv)
    assistant = [t for t in conv if t["role"] == "assistant"]
    for i, is_open in zip(range(len(spans)), open_turns or []):
        if not is_open:
            continue
        start, end = spans[i]
        content_end = _content_end(text, start, end, assistant[i]["content"])
        spans[i] = (start, content_end)
        if i == len(spans) - 1 and conv[-1]["role"] == "assistant":
            text = text[:content_end]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [any(s <= a and b <= e for s, e in spans) and b > a for a, b in offsets]
    truncated = False
    if max_length is not None and len(ids) > max_length:
        if overlong == "skip":
            return None
        if overlong != "truncate":
            raise DraftheadsError(f"data.overlong must be 'truncate' or 'skip', got '{overlong}'")
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
    return TokenizedChat(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), truncated)


def _content_end(text: str, start: int, end: int, content: str) -> int:
    """Where an assistant turn's content ends in the rendered chat (its span [start, end)), for templates that render
    it as is or trimmed (Llama 3's `| trim`)."""
    if text.startswith(content, start):
        return start + len(content)
    stripped = content.strip()
    if not stripped:
        return start
    at = text.find(stripped, start, end)
    if at < 0:
        raise DraftheadsError("the target's chat template changes an assistant turn's text beyond trimming it, so a "
                              "turn cut by regen_max_new cannot be located to leave its end-of-turn marker untrained; "
                              "use a template that renders contents as given (or raise data.regen_max_new)")
    return at + len(stripped)


def tokenize_text(tokenizer, text: str, max_length: int | None = None, overlong: str = "truncate"
                  ) -> TokenizedChat | None:
    """A plain document (code, text): its tokens without a chat template, every token but the first trained."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    truncated = max_length is not None and len(ids) > max_length
    if truncated and overlong == "skip":
        return None
    ids = ids[:max_length] if truncated else ids
    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[:1] = False
    return TokenizedChat(torch.tensor(ids, dtype=torch.long), mask, truncated)
