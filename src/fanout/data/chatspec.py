"""ChatSpec: what a worker needs to render, tokenize and mask one tokenizer's chats.

    from fanout.data.chatspec import ChatSpec
    from fanout.data.template import load_chat_spec
    spec = load_chat_spec(tok_dir, cache_root)   # builds it once, cached
    spec.template_for(has_tools=False)           # the Jinja source to render with

A small picklable value shared by fanout.data.template (which builds it and renders
with it) and fanout.data.masks (which picks the mask path from it); it lives below
both so neither imports the other for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fanout.errors import ConfigError
from fanout.hashing import hexdigest


@dataclass(frozen=True)
class ChatSpec:
    """Everything a worker needs to render + tokenize + mask; small and picklable."""

    tokenizer_json: str
    fingerprint: str  # tokenizer fingerprint
    templates: dict[str, str]  # name -> Jinja source ("default", maybe "tool_use")
    special_tokens: dict[str, str]  # passed to the template like transformers does
    added_tokens: dict[str, int] = field(default_factory=dict)
    pad_token_id: int = 0
    special_added: tuple[str, ...] = ()  # added tokens flagged special (control tokens)
    generation_eos: tuple[str, ...] = ()  # generation_config.json eos ids, as token texts
    mask_path: str = "auto"  # masks.PATHS or auto (--mask-path, DataOptions.mask_path)
    template_source: str = ""  # "tokenizer" or the --chat-template file

    def template_fingerprint(self) -> str:
        """The template, its variables and the end-of-turn tokens (what the mask reads)."""
        blob = json.dumps(
            [self.templates, self.special_tokens, self.generation_eos], sort_keys=True
        )
        return hexdigest(blob.encode())

    def template_for(self, has_tools: bool) -> str:
        # Same choice as PreTrainedTokenizerBase.get_chat_template for a dict of templates.
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ConfigError(f"tokenizer has no default chat template (has {sorted(self.templates)})")
