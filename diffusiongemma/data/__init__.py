"""Data: text corpora, the sentencepiece tokenizer, and grain pipelines of packed examples."""

from diffusiongemma.data import sft
from diffusiongemma.data import sudoku
from diffusiongemma.data.corpus import load_corpus
from diffusiongemma.data.corpus import read_text_files
from diffusiongemma.data.corpus import split_files
from diffusiongemma.data.corpus import stdlib_files
from diffusiongemma.data.pipeline import make_dataset
from diffusiongemma.data.pipeline import tokenize_corpus
from diffusiongemma.data.tokenizer import get_tokenizer
from diffusiongemma.data.tokenizer import Tokenizer

__all__ = [
    "Tokenizer",
    "get_tokenizer",
    "load_corpus",
    "make_dataset",
    "read_text_files",
    "sft",
    "split_files",
    "stdlib_files",
    "sudoku",
    "tokenize_corpus",
]
