"""Data: text corpora, tokenizers (ours and a checkpoint's), grain pipelines of packed examples, images
and video."""

from diffusiongemma.data import images
from diffusiongemma.data import sft
from diffusiongemma.data.corpus import load_corpus
from diffusiongemma.data.corpus import read_text_files
from diffusiongemma.data.corpus import split_files
from diffusiongemma.data.corpus import stdlib_files
from diffusiongemma.data.hf_tokenizer import CheckpointTokenizer
from diffusiongemma.data.hf_tokenizer import load_tokenizer
from diffusiongemma.data.hf_tokenizer import TokenizerLike
from diffusiongemma.data.pipeline import make_dataset
from diffusiongemma.data.pipeline import tokenize_corpus
from diffusiongemma.data.tokenizer import get_tokenizer
from diffusiongemma.data.tokenizer import Tokenizer
from diffusiongemma.data.tokenizer import TOKENIZER_FILENAME

__all__ = [
    "CheckpointTokenizer",
    "TOKENIZER_FILENAME",
    "Tokenizer",
    "TokenizerLike",
    "get_tokenizer",
    "images",
    "load_corpus",
    "load_tokenizer",
    "make_dataset",
    "read_text_files",
    "sft",
    "split_files",
    "stdlib_files",
    "tokenize_corpus",
]
