"""Chat with the released checkpoint: the Gemma 4 chat format and thinking-channel parsing."""

from diffusiongemma.chat.format import EMPTY_THOUGHT
from diffusiongemma.chat.format import render_ids
from diffusiongemma.chat.format import render_prompt
from diffusiongemma.chat.format import ReplyParts
from diffusiongemma.chat.format import ReplyStream
from diffusiongemma.chat.format import split_reply
from diffusiongemma.chat.format import split_reply_text
from diffusiongemma.chat.format import strip_thought
from diffusiongemma.chat.format import template_prefills_empty_thought

__all__ = ["EMPTY_THOUGHT", "ReplyParts", "ReplyStream", "render_ids", "render_prompt", "split_reply",
           "split_reply_text", "strip_thought", "template_prefills_empty_thought"]
