r"""Prepares a corpus once into token shards that training reads by window (`--config.data.corpus=DIR`).

  python scripts/prepare_data.py --source=stdlib --output=/data/stdlib --vocab_size=4096 --workers=2
  python scripts/prepare_data.py --source=corpus.jsonl --output=/data/c --tokenizer=/data/stdlib/tokenizer.model
  python scripts/prepare_data.py --source=pairs.jsonl --task=sft --output=/data/pairs --tokenizer=FILE

--source: 'stdlib', a folder of text files, a .jsonl file (--text_field), a .parquet file or a folder of them,
or a folder written by `datasets.save_to_disk` (one split); with --token_field, records of token ids made with
--tokenizer instead of text. --task=sft reads prompt/response pairs instead.
Without --tokenizer, a sentencepiece tokenizer of --vocab_size pieces is trained on a sample of the source
first (as training does) and saved in the output. Running it again resumes: finished pieces are kept.
The folder's layout: diffusiongemma/data/prepared.py; docs/training.md "Data at scale".
"""

import pathlib
import sys

from absl import app
from absl import flags

from diffusiongemma import data as data_lib
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.data import prepared
from diffusiongemma.data import sources
from diffusiongemma import build

_SOURCE = flags.DEFINE_string("source", None, "The corpus: 'stdlib', a folder, a .jsonl/.parquet/.arrow file, "
                              "or a datasets save_to_disk folder.")
_OUTPUT = flags.DEFINE_string("output", None, "The prepared folder to write (or resume).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "A tokenizer.model (sentencepiece) or a checkpoint's "
                                 "tokenizer.json; default: train one on a sample of the source.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 4096, "Pieces of the tokenizer trained without --tokenizer.")
_WORKERS = flags.DEFINE_integer("workers", 1, "Tokenizing processes.")
_TASK = flags.DEFINE_enum("task", "lm", ["lm", "sft"], "lm: text documents; sft: prompt/response pairs.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "The text field of JSONL, parquet and datasets sources.")
_TOKEN_FIELD = flags.DEFINE_string("token_field", "", "A field of already tokenized documents (lists of ids made "
                                   "with --tokenizer), read instead of --text_field.")
_PROMPT_FIELD = flags.DEFINE_string("prompt_field", "prompt", "--task=sft: the prompt field.")
_RESPONSE_FIELD = flags.DEFINE_string("response_field", "response", "--task=sft: the response field.")
_VALIDATION = flags.DEFINE_float("validation_fraction", 0.02, "Share of documents held out for validation.")
_SEED = flags.DEFINE_integer("seed", 0, "Which documents land in validation, and the tokenizer's sample.")
_PIECE_BYTES = flags.DEFINE_integer("piece_bytes", 0, "Input bytes per piece (a worker's unit of work and one "
                                    "shard per split); 0: about 8 pieces per worker, 1-32 MB each.")
flags.mark_flags_as_required(["source", "output"])


def _tokenizer(source: sources.Source, output: pathlib.Path):
  if _TOKENIZER.value:
    path = pathlib.Path(_TOKENIZER.value)
    if path.name == hf_tokenizer.TOKENIZER_JSON:
      return data_lib.CheckpointTokenizer(path.parent)
    return data_lib.Tokenizer(path)
  path = output / data_lib.TOKENIZER_FILENAME
  if path.is_file():  # trained by an earlier, interrupted run
    return data_lib.Tokenizer(path)
  texts = sources.sample_documents(source, seed=_SEED.value, validation_fraction=_VALIDATION.value)
  return data_lib.Tokenizer.train(texts, path, _VOCAB_SIZE.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    pairs = (_PROMPT_FIELD.value, _RESPONSE_FIELD.value) if _TASK.value == "sft" else None
    source = sources.open_source(_SOURCE.value, text_field=_TEXT_FIELD.value, pairs=pairs,
                                 token_field=_TOKEN_FIELD.value)
    output = pathlib.Path(_OUTPUT.value)
    manifest = prepared.prepare(source, output, _tokenizer(source, output),
                                kind="pairs" if pairs else "text", workers=_WORKERS.value,
                                validation_fraction=_VALIDATION.value, seed=_SEED.value,
                                piece_bytes=_PIECE_BYTES.value, progress=True)
  except (ValueError, ImportError, OSError) as e:
    sys.exit(f"prepare_data: {e}")
  splits = ", ".join(f"{name} {s['tokens']:,} tokens in {s['documents']:,} documents ({len(s['shards'])} shards)"
                     for name, s in manifest["splits"].items())
  print(f"{output}: {splits}; {manifest['skipped_documents']} skipped (not UTF-8 text)")


if __name__ == "__main__":
  build.cli.run(main)
