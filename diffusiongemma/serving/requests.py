"""OpenAI request bodies (chat completions and completions) checked field by field into a `Request`.

Everything a client can get wrong is refused here with a 400 that names the field (`errors.APIError`),
before any tokenizing, decoding or compiling: malformed or too deeply nested JSON, text that is not
Unicode (a lone surrogate such as "\\ud800" cannot be encoded), unknown or unsupported parameters (`n` > 1,
`logprobs`, `top_p` != 1, penalties, tools), out-of-range values, bad messages, and inputs past the
server's `Limits` (messages, images, prompt bytes), which bound what tokenizing and decoding can cost.

Extensions beyond the OpenAI API (documented in the README):
- `response_format: {"type": "regex", "regex": "..."}`: the output matches the regex in full;
- `stream_canvas: true` (with `stream`): an `event: canvas` SSE event after every denoiser pass;
- thinking: `reasoning_effort` other than "none"/"minimal", or vLLM's
  `chat_template_kwargs: {"enable_thinking": true}`, opens the system turn with `<|think|>`; the thought
  comes back as `reasoning_content`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import numbers
from collections.abc import Mapping
from typing import Any

from diffusiongemma.serving.errors import APIError, invalid, unsupported

MAX_DEPTH = 64  # nesting of a request body (a JSON schema included)
MAX_STOP = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "model"}

_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "stop", "seed", "user", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "metadata",
           "store", "service_tier", "response_format", "stream_canvas"}
CHAT_FIELDS = _COMMON | {"messages", "reasoning_effort", "chat_template_kwargs", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls", "functions", "function_call", "modalities"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one request may hold, checked before anything is tokenized or decoded. `prompt_bytes`: UTF-8
  bytes of all message texts (or the prompt): the engine sets it so that a longer text has more tokens than
  the longest prompt served (`Engine.limits`); `images`: images per request."""

  messages: int = 1024
  images: int = 8
  prompt_bytes: int = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
  """What the output must be: `kind` "text", "json_object", "json_schema" (`value`: the schema) or "regex"."""

  kind: str = "text"
  value: Any = None

  def key(self) -> tuple:
    return (self.kind, json.dumps(self.value, sort_keys=True))


@dataclasses.dataclass(frozen=True)
class Message:
  """One chat turn: role in the chat format's names (system, user, model), text, images (raw bytes)."""

  role: str
  content: str
  images: tuple[bytes, ...] = ()


@dataclasses.dataclass(frozen=True)
class Request:
  """A checked generation request. `messages` for chat, `prompt` for completions; `max_tokens` None
  means the server's default; `seed` None means a fresh one."""

  kind: str  # "chat" | "completion"
  model: str
  messages: tuple[Message, ...] = ()
  prompt: str = ""
  max_tokens: int | None = None
  temperature: float = 1.0
  stop: tuple[str, ...] = ()
  seed: int | None = None
  stream: bool = False
  include_usage: bool = False
  stream_canvas: bool = False
  response_format: ResponseFormat = ResponseFormat()
  thinking: bool = False


def parse_json(raw: bytes) -> dict:
  """The body as a JSON object; malformed, non-object or too deeply nested JSON is a 400."""
  try:
    body = json.loads(raw)
  except RecursionError:
    raise invalid(None, f"The request body is nested too deeply (more than {MAX_DEPTH} levels).",
                  "invalid_json") from None
  except (ValueError, UnicodeDecodeError) as e:
    raise invalid(None, f"The request body is not valid JSON: {e}.", "invalid_json") from None
  if not isinstance(body, dict):
    raise invalid(None, f"The request body must be a JSON object, got {type(body).__name__}.", "invalid_json")
  _check_tree(body)
  return body


def _check_tree(value) -> None:
  """Refuses a JSON value nested deeper than `MAX_DEPTH` or holding a string (key or value) that is not
  valid Unicode (JSON's "\\ud800" escapes parse to lone surrogates, which no text encoding takes), naming
  where; without recursion."""
  stack = [(value, ())]
  while stack:
    item, path = stack.pop()
    if len(path) >= MAX_DEPTH:
      raise invalid(None, f"The request body is nested too deeply (more than {MAX_DEPTH} levels).", "invalid_json")
    pairs = item.items() if isinstance(item, dict) else enumerate(item)
    for key, child in pairs:
      where = path + (key,)
      for text in (key, child):
        if isinstance(text, str) and not _is_unicode(text):
          param = ".".join(str(k).encode("utf-8", "backslashreplace").decode() for k in where)
          raise invalid(param, f"'{param}' holds text that is not valid Unicode (a lone surrogate such as "
                        "\\ud800); send UTF-8 text.", "invalid_unicode")
      if isinstance(child, (dict, list)):
        stack.append((child, where))


def _is_unicode(text: str) -> bool:
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _type_name(value) -> str:
  return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
      type(value), "number")


def _number(body, name, low, high, default):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise invalid(name, f"'{name}' must be a number, got {_type_name(value)}.", "invalid_type")
  if not low <= value <= high:
    raise invalid(name, f"'{name}' must be between {low} and {high}, got {value}.")
  return float(value)


def _integer(body, name, default=None):
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int):
    raise invalid(name, f"'{name}' must be an integer, got {_type_name(value)}.", "invalid_type")
  return value


def _bool(body, name, default=False, param=None):
  value, param = body.get(name), param or name
  if value is None:
    return default
  if not isinstance(value, bool):
    raise invalid(param, f"'{param}' must be a boolean, got {_type_name(value)}.", "invalid_type")
  return value


def _refuse_unsupported(body: dict, kind: str) -> None:
  """Parameters that change sampling in ways this server cannot honour are refused, not ignored."""
  if _integer(body, "n", 1) != 1:
    raise unsupported("n", "Only n=1 is supported (one choice per request).")
  if _number(body, "top_p", 0.0, 1.0, 1.0) != 1.0:
    raise unsupported("top_p", "top_p is not supported by diffusion sampling; use temperature.")
  for name in ("presence_penalty", "frequency_penalty"):
    if _number(body, name, -2.0, 2.0, 0.0) != 0.0:
      raise unsupported(name, f"'{name}' is not supported by diffusion sampling.")
  logprobs = body.get("logprobs")
  if logprobs not in (None, False, 0):
    raise unsupported("logprobs", "logprobs are not supported.")
  if body.get("top_logprobs") not in (None, 0):
    raise unsupported("top_logprobs", "top_logprobs are not supported.")
  if body.get("logit_bias") not in (None, {}):
    raise unsupported("logit_bias", "logit_bias is not supported.")
  for name in ("tools", "functions"):
    if body.get(name) not in (None, []):
      raise unsupported(name, f"'{name}' (tool calling) is not supported.")
  if body.get("tool_choice") not in (None, "none") or body.get("function_call") not in (None, "none"):
    raise unsupported("tool_choice", "Tool calling is not supported.")
  if body.get("modalities") not in (None, ["text"]):
    raise unsupported("modalities", "Only text output is supported.")
  if kind == "completion":
    if body.get("echo") not in (None, False):
      raise unsupported("echo", "echo is not supported.")
    if body.get("suffix") not in (None, ""):
      raise unsupported("suffix", "suffix (insertion) is not supported.")
    if body.get("best_of") not in (None, 1):
      raise unsupported("best_of", "Only best_of=1 is supported.")


def _stop(body) -> tuple[str, ...]:
  value = body.get("stop")
  if value is None:
    return ()
  values = [value] if isinstance(value, str) else value
  if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
    raise invalid("stop", "'stop' must be a string or an array of strings.", "invalid_type")
  if len(values) > MAX_STOP:
    raise invalid("stop", f"'stop' takes at most {MAX_STOP} strings, got {len(values)}.")
  if any(not v for v in values):
    raise invalid("stop", "'stop' strings must not be empty.")
  return tuple(values)


def _response_format(body) -> ResponseFormat:
  value = body.get("response_format")
  if value is None:
    return ResponseFormat()
  if not isinstance(value, dict) or not isinstance(value.get("type"), str):
    raise invalid("response_format", "'response_format' must be an object with a string 'type'.", "invalid_type")
  kind = value["type"]
  if kind == "text":
    return ResponseFormat()
  if kind == "json_object":
    return ResponseFormat("json_object", {"type": "object"})
  if kind == "json_schema":
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
      raise invalid("response_format.json_schema", "'response_format.json_schema' must be an object holding "
                    "'name' and 'schema'.", "invalid_type")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
      raise invalid("response_format.json_schema.schema", "'response_format.json_schema.schema' must be a JSON "
                    f"schema object, got {_type_name(schema)}.", "invalid_type")
    return ResponseFormat("json_schema", schema)
  if kind == "regex":
    if not isinstance(value.get("regex"), str) or not value["regex"]:
      raise invalid("response_format.regex", "'response_format.regex' must be a non-empty string (the regex "
                    "extension).", "invalid_type")
    return ResponseFormat("regex", value["regex"])
  raise invalid("response_format.type", f"Unknown response_format type {kind!r}; expected text, json_object, "
                "json_schema or regex.")


def _data_url(url, param: str) -> bytes:
  if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
    raise invalid(param, "Images must be given as base64 data URLs (data:image/png;base64,...); this server "
                  "fetches nothing.")
  try:
    return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
  except (binascii.Error, ValueError):
    raise invalid(param, "The image data URL is not valid base64.") from None


def _content(content, param: str) -> tuple[str, tuple[bytes, ...]]:
  """A message's text and images: a string, or an array of text and image_url parts (images first)."""
  if content is None:
    return "", ()
  if isinstance(content, str):
    return content, ()
  if not isinstance(content, list):
    raise invalid(param, f"'{param}' must be a string or an array of content parts.", "invalid_type")
  texts, images = [], []
  for j, part in enumerate(content):
    where = f"{param}.{j}"
    if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
      raise invalid(where, f"'{where}' must be a content part of type 'text' or 'image_url'.")
    if part["type"] == "text":
      if not isinstance(part.get("text"), str):
        raise invalid(f"{where}.text", f"'{where}.text' must be a string.", "invalid_type")
      texts.append(part["text"])
    else:
      image = part.get("image_url")
      url = image.get("url") if isinstance(image, dict) else image
      images.append(_data_url(url, f"{where}.image_url"))
  return "".join(texts), tuple(images)


def _messages(body, limits: Limits) -> tuple[Message, ...]:
  messages = body.get("messages")
  if messages is None:
    raise invalid("messages", "'messages' is required.", "missing_required_parameter")
  if not isinstance(messages, list) or not messages:
    raise invalid("messages", "'messages' must be a non-empty array.")
  if len(messages) > limits.messages:
    raise invalid("messages", f"'messages' holds {len(messages)} messages; this server takes at most "
                  f"{limits.messages}.", "too_many_messages")
  images = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image_url")
  if images > limits.images:
    raise invalid("messages", f"The messages hold {images} images; this server takes at most {limits.images} "
                  "per request.", "too_many_images")
  out = []
  for i, message in enumerate(messages):
    where = f"messages.{i}"
    if not isinstance(message, dict):
      raise invalid(where, f"'{where}' must be an object with 'role' and 'content'.", "invalid_type")
    role = message.get("role")
    if role not in ROLES:
      raise invalid(f"{where}.role", f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}.")
    if "content" not in message and role != "assistant":
      raise invalid(f"{where}.content", f"'{where}.content' is required.", "missing_required_parameter")
    if message.get("tool_calls"):
      raise unsupported(f"{where}.tool_calls", "Tool calls are not supported.")
    text, images = _content(message.get("content"), f"{where}.content")
    if images and role != "user":
      raise invalid(f"{where}.content", f"Only user messages may hold images ('{where}' is {role}).")
    if ROLES[role] == "system" and i > 0:
      raise invalid(f"{where}.role", "Only the first message may be a system (or developer) message.")
    out.append(Message(ROLES[role], text, images))
  return tuple(out)


def _thinking(body) -> bool:
  effort = body.get("reasoning_effort")
  if effort is not None and effort not in ("none", "minimal", "low", "medium", "high"):
    raise invalid("reasoning_effort", "'reasoning_effort' must be none, minimal, low, medium or high.")
  kwargs = body.get("chat_template_kwargs") or {}
  if not isinstance(kwargs, dict) or not isinstance(kwargs.get("enable_thinking", False), bool):
    raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object; 'enable_thinking' a "
                  "boolean.", "invalid_type")
  return effort in ("low", "medium", "high") or kwargs.get("enable_thinking", False)


def _prompt(body) -> str:
  prompt = body.get("prompt")
  if prompt is None:
    raise invalid("prompt", "'prompt' is required.", "missing_required_parameter")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
    prompt = prompt[0]
  if not isinstance(prompt, str):
    raise unsupported("prompt", "'prompt' must be one string (batches of prompts and token-id prompts are not "
                      "supported; send one request each).")
  return prompt


def _check_prompt_bytes(request: Request, limits: Limits) -> None:
  texts = [m.content for m in request.messages] if request.kind == "chat" else [request.prompt]
  size = sum(len(t.encode("utf-8")) for t in texts)
  if size > limits.prompt_bytes:
    param = "messages" if request.kind == "chat" else "prompt"
    raise invalid(param, f"The prompt is {size} bytes of text; this server takes at most {limits.prompt_bytes} "
                  "(more could only be more tokens than its longest prompt).", "context_length_exceeded")


def parse(body: Mapping, kind: str, models: tuple[str, ...], max_tokens_limit: int,
          limits: Limits = Limits()) -> Request:
  """The checked `Request` of a chat (`kind="chat"`) or completion body, for a server of `models`, within
  `limits`."""
  allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
  unknown = sorted(set(body) - allowed)
  if unknown:
    raise invalid(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}.", "unknown_parameter")
  model = body.get("model")
  if model is None:
    raise invalid("model", "'model' is required.", "missing_required_parameter")
  if model not in models:
    raise APIError(404, f"The model {model!r} does not exist; this server has {list(models)}.", "model",
                   "model_not_found")
  _refuse_unsupported(body, kind)
  names = [n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None]
  max_tokens = _integer(body, names[0]) if names else None
  if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
    raise invalid(names[0], f"'{names[0]}' must be between 1 and {max_tokens_limit} (this server's limit), got "
                  f"{max_tokens}.")
  seed = _integer(body, "seed")
  if seed is not None and not -2**63 <= seed < 2**64:
    raise invalid("seed", "'seed' must fit in 64 bits.")
  stream = _bool(body, "stream")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict):
    raise invalid("stream_options", "'stream_options' must be an object.", "invalid_type")
  include_usage = _bool(options, "include_usage", param="stream_options.include_usage")
  request = Request(
      kind=kind, model=model,
      messages=_messages(body, limits) if kind == "chat" else (),
      prompt=_prompt(body) if kind == "completion" else "",
      max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 2.0, 1.0), stop=_stop(body),
      seed=seed, stream=stream, include_usage=stream and include_usage,
      stream_canvas=stream and _bool(body, "stream_canvas"), response_format=_response_format(body),
      thinking=kind == "chat" and _thinking(body))
  _check_prompt_bytes(request, limits)
  return request
