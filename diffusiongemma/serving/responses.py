"""OpenAI response bodies and stream chunks (chat.completion, chat.completion.chunk, text_completion), plus
the `diffusion` extension: denoiser passes, canvases, tokens per pass, the batch and the seed."""

from __future__ import annotations

import json
import time


def usage(prompt_tokens: int, result) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": result.completion_tokens,
          "total_tokens": prompt_tokens + result.completion_tokens}


def diffusion(job, result) -> dict:
  return {"denoiser_passes": result.passes, "canvases": result.canvases,
          "tokens_per_pass": round(result.completion_tokens / max(result.passes, 1), 3),
          "batch_size": job.batch_size, "seed": job.prepared.seed}


class Writer:
  """Bodies and chunks of one request (`kind` "chat" or "completion")."""

  def __init__(self, job, model: str):
    self.job, self.model, self.chat = job, model, job.prepared.request.kind == "chat"
    self.created = int(time.time())

  def _head(self, object_: str) -> dict:
    return {"id": self.job.id, "object": object_, "created": self.created, "model": self.model,
            "system_fingerprint": "diffusiongemma"}

  def body(self, result) -> dict:
    """The whole (non-streamed) response."""
    if self.chat:
      message = {"role": "assistant", "content": result.content,
                 "reasoning_content": result.reasoning or None}
      choice = {"index": 0, "message": message, "finish_reason": result.finish_reason, "logprobs": None}
      out = self._head("chat.completion")
    else:
      choice = {"index": 0, "text": result.content, "finish_reason": result.finish_reason, "logprobs": None}
      out = self._head("text_completion")
    return {**out, "choices": [choice], "usage": usage(len(self.job.prepared.ids), result),
            "diffusion": diffusion(self.job, result)}

  def _chunk(self, delta: dict | None, finish_reason: str | None) -> dict:
    delta = delta or {}
    if self.chat:
      choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
      return {**self._head("chat.completion.chunk"), "choices": [choice]}
    choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason, "logprobs": None}
    return {**self._head("text_completion"), "choices": [choice]}

  def chunk(self, delta: dict) -> str:
    """One SSE `data:` chunk with a text delta (chat: `content` / `reasoning_content` / `role`)."""
    return sse(self._chunk(delta, None))

  def final(self, result, include_usage: bool) -> str:
    """The finishing chunk with the diffusion statistics (and the usage chunk when asked for)."""
    text = sse({**self._chunk(None, result.finish_reason), "diffusion": diffusion(self.job, result)})
    if include_usage:
      head = self._head("chat.completion.chunk" if self.chat else "text_completion")
      text += sse({**head, "choices": [], "usage": usage(len(self.job.prepared.ids), result)})
    return text

  def canvas(self, payload: dict) -> str:
    """The canvas extension event after a denoiser pass (`event: canvas`; no choices, so OpenAI clients that
    iterate choices skip it)."""
    return sse({**self._head("diffusion.canvas"), "choices": [], "canvas": payload}, event="canvas")


def sse(data: dict | str, event: str | None = None) -> str:
  payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
  return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


DONE = "data: [DONE]\n\n"
