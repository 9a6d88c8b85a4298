r"""Chat with a DiffusionGemma model in the Gemma 4 chat format: one turn, or a conversation from stdin.

  python scripts/chat.py --hf_checkpoint=/path/to/diffusiongemma --message="Why is the sky blue?"
  python scripts/chat.py --hf_checkpoint=DIR --thinking --system="Be brief." --message="What is 17 * 23?"
  python scripts/chat.py --hf_checkpoint=DIR --image=photo.jpg --message="What is in this picture?"
  python scripts/chat.py --hf_checkpoint=DIR --preset=code        # interactive: one turn per line
  python scripts/chat.py --workdir=W --tokenizer=DIR              # a model fine-tuned from the released one
  python scripts/chat.py --hf_checkpoint=DIR --json_schema=person.json --message="Describe Ada Lovelace."
  python scripts/chat.py --hf_checkpoint=DIR --regex="(yes|no)" --message="Is 91 prime?"

--hf_checkpoint is a transformers checkpoint folder: its weights (cast to --dtype, placed over every local
device), its tokenizer, its generation defaults and chat template; no --config or --workdir is needed.
--workdir (with --config, or the config the run saved) chats with a training checkpoint; its own
sentencepiece tokenizer has no Gemma 4 control tokens, so it needs --tokenizer=<checkpoint folder>
(see `dg.build.chat_sampler`).

Without --message, turns are read from stdin, one per line; `/reset` starts a new conversation, `/exit`
(or end of input) quits. The conversation keeps its KV cache: each turn encodes only what it adds.
--image / --video go with the first turn. In a terminal the reply is drawn live while it denoises,
then the thought (under its own heading), the answer and the statistics; when stdout is not a terminal,
the same as plain text, with nothing redrawn. --json_schema=FILE / --regex: every reply is JSON valid under
the schema, or text matching the regex (`sampling.constrained`), then the end of turn.
"""

import sys

from absl import app
from absl import flags

import diffusiongemma as dg
from diffusiongemma.chat import display
from diffusiongemma import build

_HF = flags.DEFINE_string("hf_checkpoint", None, "A transformers DiffusionGemma checkpoint folder.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (instead of --hf_checkpoint).")
_COMPILATION_CACHE = dg.parallel.define_compilation_cache_flag()
_CONFIG = build.cli.define_config("config", None, "With --workdir: the run's config (default: the "
                                "one it saved).", lock_config=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "With --workdir: a checkpoint folder whose tokenizer to use.")
_MESSAGE = flags.DEFINE_string("message", None, "Answer this one message and exit (default: read stdin).")
_SYSTEM = flags.DEFINE_string("system", None, "The system prompt.")
_THINKING = flags.DEFINE_bool("thinking", False, "Let the model think first (its thought is shown apart).")
_PRESET = flags.DEFINE_string("preset", "default", "Sampler preset: default, code or creative.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "New tokens per reply; 0: the checkpoint's default.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (turn n uses fold_in(seed, n)).")
_SHOW_PROMPT = flags.DEFINE_bool("show_prompt", False, "Print each turn's exact prompt text first.")
_IMAGE = flags.DEFINE_multi_string("image", [], "An image file for the first turn (repeatable).")
_VIDEO = flags.DEFINE_string("video", None, "A video file for the first turn (1 frame per second).")
_IMAGE_BUDGET = flags.DEFINE_integer("image_budget", 280, "Soft tokens per image: 70, 140, 280, 560 or 1120.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "With --hf_checkpoint: weight and compute dtype.")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "With --hf_checkpoint: int8 attention, MLP "
                               "and expert weights, quantised as they are read (docs/quantization.md).")
_JSON_SCHEMA = flags.DEFINE_string("json_schema", None, "A JSON schema file every reply is valid under.")
_REGEX = flags.DEFINE_string("regex", None, "Every reply matches this regex (in full).")


def _chat() -> dg.ChatSampler:
  max_new = _MAX_NEW.value or None
  if _HF.value:
    return dg.ChatSampler.from_pretrained(_HF.value, _PRESET.value, dtype=_DTYPE.value, max_new_tokens=max_new,
                                          model_overrides={"quantize": _QUANTIZE.value},
                                          image_budget=_IMAGE_BUDGET.value, seed=_SEED.value)
  if _WORKDIR.value:
    return dg.build.chat_sampler(_WORKDIR.value, _CONFIG.value, tokenizer=_TOKENIZER.value,
                                       preset=_PRESET.value, max_new_tokens=max_new, seed=_SEED.value)
  raise app.UsageError("Pass --hf_checkpoint=DIR (a transformers checkpoint folder), or --workdir=DIR.")


def _constraint(chat: dg.ChatSampler):
  """The --json_schema / --regex constraint, built once (one compiled program for every turn), or None."""
  if _JSON_SCHEMA.value and _REGEX.value is not None:
    raise ValueError("Pass --json_schema or --regex, not both.")
  if _JSON_SCHEMA.value:
    with open(_JSON_SCHEMA.value, encoding="utf-8") as f:
      return chat.constraint(json_schema=f.read())
  if _REGEX.value is not None:
    return chat.constraint(regex=_REGEX.value)
  return None


def _turn(chat: dg.ChatSampler, message: str, media: dict, terminal: bool, constraint=None) -> None:
  on_prompt = (lambda text: print(display.format_prompt(text, style=terminal), flush=True)
               if _SHOW_PROMPT.value else None)
  live = display.LiveDraft() if terminal else None
  try:
    reply = chat.send(message, system=_SYSTEM.value, thinking=_THINKING.value, on_step=live,
                      on_prompt=on_prompt, constraint=constraint, **media)
  finally:
    if live is not None:
      live.clear()
  print(display.format_reply(reply, style=terminal), flush=True)


def _fail(error: Exception) -> None:
  print(f"error: {error}", file=sys.stderr, flush=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  dg.parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  try:
    chat = _chat()
    constraint = _constraint(chat)
  except (ValueError, FileNotFoundError) as error:  # bad folders, tokenizers, presets, budgets: said plainly
    _fail(error)
    sys.exit(1)
  terminal = sys.stdout.isatty()
  media = {"images": list(_IMAGE.value), "video": _VIDEO.value}
  if _MESSAGE.value is not None:
    try:
      _turn(chat, _MESSAGE.value, media, terminal, constraint)
    except (ValueError, FileNotFoundError) as error:
      _fail(error)
      sys.exit(1)
    return
  if sys.stdin.isatty():
    print("One turn per line; /reset starts a new conversation, /exit quits.")
  while True:
    if sys.stdin.isatty():
      print("> ", end="", flush=True)
    line = sys.stdin.readline()
    if not line or line.strip() == "/exit":
      break
    if line.strip() == "/reset":
      chat.reset()
      continue
    if line.strip():
      try:
        _turn(chat, line.rstrip("\n"), media, terminal, constraint)
        media = {}
      except (ValueError, FileNotFoundError) as error:  # e.g. a conversation too long: the next turn may fit
        _fail(error)


if __name__ == "__main__":
  build.cli.run(main)
