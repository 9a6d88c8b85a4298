"""Chat with the released checkpoint: the Gemma 4 chat format, thinking-channel parsing, and the
`ChatSampler` (a conversation that keeps its KV cache between turns)."""

from diffusiongemma.chat.format import EMPTY_THOUGHT
from diffusiongemma.chat.format import render_ids
from diffusiongemma.chat.format import render_prompt
from diffusiongemma.chat.format import ReplyParts
from diffusiongemma.chat.format import ReplyStream
from diffusiongemma.chat.format import split_reply
from diffusiongemma.chat.format import split_reply_text
from diffusiongemma.chat.format import strip_thought
from diffusiongemma.chat.format import template_prefills_empty_thought
from diffusiongemma.chat.sampler import ChatSampler
from diffusiongemma.chat.sampler import Draft
from diffusiongemma.chat.sampler import Reply

__all__ = ["ChatSampler", "Draft", "EMPTY_THOUGHT", "Reply", "ReplyParts", "ReplyStream", "render_ids",
           "render_prompt", "split_reply", "split_reply_text", "strip_thought", "template_prefills_empty_thought"]
