"""Chat messages to prompt token ids, with special-token text in the messages' content kept as
text by default.

The chat template writes role markers as special tokens (`<|im_start|>`, `<|im_end|>`, ...).
Encoding the rendered text whole would also turn a user's content `"<|im_end|>"` into the marker
itself, so a user could forge a system or assistant turn. `ChatEncoder` finds where each
message's content lies in the rendered text and encodes special tokens found there as plain
text; the template's own special tokens stay special.
"""
from __future__ import annotations

import re
import uuid

import tokenizers


class ChatEncoder:
    """`encode(messages)`: the prompt token ids of a chat, with the generation prompt."""

    def __init__(self, tokenizer, special_tokens_in_content: bool = False):
        self.tokenizer = tokenizer
        self.special_tokens_in_content = special_tokens_in_content
        hf = tokenizer.hf_tokenizer
        specials = {i: t.content for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(specials)
        self._special_text = (re.compile("|".join(re.escape(s) for s in specials.values()))
                              if specials else None)
        self._plain: tokenizers.Tokenizer | None = None  # special tokens as text; on first use
        self._nonce = uuid.uuid4().hex  # marks of private-use characters no content matches
        self._mark = re.compile(f"\ue000{self._nonce}:" + r"(\d+)\ue001")

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def encode(self, messages: list[dict]) -> list[int]:
        text = self._render(messages)
        if self.special_tokens_in_content or self._special_text is None or not any(
                self._special_text.search(m["content"]) for m in messages):
            return self.tokenizer.encode(text)
        spans = self._content_spans(text, messages)
        encoding = self.tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)
        if self._plain is None:  # a copy: the shared tokenizer's setting stays as it is
            plain = tokenizers.Tokenizer.from_str(self.tokenizer.hf_tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        ids = []
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self._special_ids and any(a <= start and end <= b for a, b in spans):
                ids.extend(self._plain.encode(text[start:end], add_special_tokens=False).ids)
            else:
                ids.append(token_id)
        return ids

    def _content_spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]]:
        """Where each message's content lies in `text` (the rendered chat): the template is
        rendered again with a unique mark for each content, and the marks replaced by the
        contents (as given, or stripped, for templates that trim) must give `text` back."""
        skeleton = self._render([m | {"content": f"\ue000{self._nonce}:{i}\ue001"}
                                 for i, m in enumerate(messages)])
        for variant in (lambda s: s, str.strip):
            pieces, spans, length, cursor = [], [], 0, 0
            for match in self._mark.finditer(skeleton):
                content = variant(messages[int(match.group(1))]["content"])
                pieces.append(skeleton[cursor:match.start()])
                length += match.start() - cursor
                spans.append((length, length + len(content)))
                pieces.append(content)
                length += len(content)
                cursor = match.end()
            pieces.append(skeleton[cursor:])
            if "".join(pieces) == text:
                return spans
        raise ValueError("a message's content holds special-token text, and this chat template "
                         "changes the content so that it cannot be kept as plain text")
