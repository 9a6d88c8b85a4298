"""A complete tiny transformers checkpoint folder for chat tests: weights, tokenizer, generation defaults.

Imported by tests (it contains none). `write_tokenizer` and `write_generation_config` need no torch;
`write_chat_checkpoint` adds the tiny random DiffusionGemma of `hf_reference.make_tiny_hf` (torch).

The tokenizer is built here with the `tokenizers` library the way Gemma's tokenizer.json is laid out: a
BPE model with byte fallback (no merges: one piece per character of printable ASCII, a byte piece for
anything else, so every text round-trips), a normalizer that writes spaces as U+2581 and a decoder that
undoes it; pad/eos/bos/unk/mask at Gemma's ids 0-4; the Gemma 4 control tokens as *special added tokens*
(as the real tokenizer.json marks them), at ids inside the tiny vocabulary.
"""

import json
import pathlib

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
CONTROL = ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|image|>", "<|image>", "<image|>",
           "<|audio|>", "<|tool_response>")
VOCAB_SIZE = 384  # the tiny model's vocabulary; the tokenizer fills it exactly (<unusedN> at the end)
_SPACE = "\u2581"


def tokenizer_pieces(control=CONTROL, vocab_size=VOCAB_SIZE):
  """The vocabulary in id order: special, control, the space marker, printable ASCII, bytes, unused."""
  chars = [chr(c) for c in range(33, 127)]
  pieces = list(SPECIAL) + list(control) + [_SPACE] + chars + [f"<0x{b:02X}>" for b in range(256)]
  if len(pieces) > vocab_size:
    raise ValueError(f"The fixture tokenizer needs {len(pieces)} ids, more than vocab_size={vocab_size}.")
  return pieces + [f"<unused{i}>" for i in range(vocab_size - len(pieces))]


def write_tokenizer(folder, *, control=CONTROL, vocab_size=VOCAB_SIZE, eos_token="<eos>", added=True):
  """Writes tokenizer.json and tokenizer_config.json into `folder`; returns the `tokenizers.Tokenizer`.

  `added=False` leaves the control tokens as ordinary vocabulary pieces (not added special tokens).
  """
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  pieces = tokenizer_pieces(control, vocab_size)
  tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                             byte_fallback=True))
  tok.normalizer = normalizers.Replace(" ", _SPACE)
  tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
  specials = SPECIAL + tuple(control) if added else SPECIAL
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  tok.save(str(folder / "tokenizer.json"))
  config = {"bos_token": "<bos>", "eos_token": eos_token, "pad_token": "<pad>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False, "tokenizer_class": "GemmaTokenizer",
            "model_max_length": 1_000_000}
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
  return tok


def write_generation_config(folder, **fields):
  """Writes generation_config.json as transformers' DiffusionGemmaGenerationConfig saves it."""
  pieces = tokenizer_pieces()
  values = dict(max_new_tokens=16, max_denoising_steps=12, t_min=0.4, t_max=0.8,
                sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
                stability_threshold=1, confidence_threshold=0.005,
                eos_token_id=[pieces.index("<eos>"), pieces.index("<turn|>")], pad_token_id=0, bos_token_id=2,
                return_dict_in_generate=True, transformers_version="5.24.0")
  values.update(fields)
  path = pathlib.Path(folder) / "generation_config.json"
  path.write_text(json.dumps(values, indent=2))
  return path


def write_chat_checkpoint(folder, *, seed=0, **model_kwargs):
  """A complete tiny checkpoint folder: random weights (transformers), tokenizer, generation defaults.

  Returns the reloaded transformers model. `model_kwargs` go to `hf_reference.make_tiny_hf`.
  """
  from benchmarks import hf_reference  # pylint: disable=import-outside-toplevel  (torch)
  model_kwargs.setdefault("vocab_size", VOCAB_SIZE)
  model = hf_reference.make_tiny_hf(folder, seed=seed, **model_kwargs)
  write_tokenizer(folder, vocab_size=model_kwargs["vocab_size"])
  write_generation_config(folder)
  return model
