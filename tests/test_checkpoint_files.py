"""A released checkpoint's files besides the weights: its tokenizer (tokenizer.json or tokenizer.model),
its generation defaults (generation_config.json) and the task presets; the tiny complete checkpoint folder
that chat tests use; bad folders give clear errors."""

import json

import pytest

import chat_fixtures
import diffusiongemma as dg
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.sampling import presets


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("checkpoint_files")
  chat_fixtures.write_tokenizer(path)
  chat_fixtures.write_generation_config(path)
  return path


def test_tokenizer_ids_and_control_tokens(folder):
  tok = hf_tokenizer.CheckpointTokenizer(folder)
  pieces = chat_fixtures.tokenizer_pieces()
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 1, 2, chat_fixtures.VOCAB_SIZE)
  for text in hf_tokenizer.REQUIRED_CONTROL_TOKENS + ("<|audio|>", "<|tool_response>"):
    assert tok.control_ids[text] == pieces.index(text) == tok.token_id(text)
    assert tok.encode(text) == [tok.control_ids[text]]
  assert "<|audio>" not in tok.control_ids  # optional, absent here
  assert isinstance(tok, hf_tokenizer.TokenizerLike)


def test_tokenizer_encode_decode(folder):
  tok = hf_tokenizer.CheckpointTokenizer(folder)
  text = "<|turn>user\nHello, wörld 你好<turn|>\n"
  ids = tok.encode(text)
  assert ids[0] == tok.control_ids["<|turn>"] and tok.control_ids["<turn|>"] in ids
  assert tok.encode(text, add_bos=True) == [tok.bos_id] + ids
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == "user\nHello, wörld 你好\n"
  with pytest.raises(ValueError, match="no token '<nope>'"):
    tok.token_id("<nope>")


@pytest.mark.hf
def test_tokenizer_matches_transformers(folder):
  transformers = pytest.importorskip("transformers")
  reference = transformers.AutoTokenizer.from_pretrained(folder)
  ours = hf_tokenizer.CheckpointTokenizer(folder)
  text = "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nÇa va? <|image|>\t2+2<turn|>\n"
  ids = reference(text, add_special_tokens=False).input_ids
  assert ours.encode(text) == ids
  assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)
  assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_control_tokens_listed_only_as_vocabulary_pieces_still_encode_to_one_id(tmp_path):
  chat_fixtures.write_tokenizer(tmp_path, added=False)
  raw = json.loads((tmp_path / "tokenizer.json").read_text())
  assert "<|channel>" not in {t["content"] for t in raw["added_tokens"]}
  tok = hf_tokenizer.CheckpointTokenizer(tmp_path)
  assert tok.encode("a<|channel>b") == [tok.encode("a")[0], tok.control_ids["<|channel>"], tok.encode("b")[0]]
  assert tok.decode(tok.encode("a<|channel>b")) == "ab"


def test_sentencepiece_tokenizer_model(tmp_path):
  """tokenizer.model alone: control tokens (sentencepiece CONTROL pieces, which its encoder would spell
  out) still encode to their ids, and decode kept or dropped."""
  spm = pytest.importorskip("sentencepiece")
  text = "the quick brown fox jumps over the lazy dog\n" * 20
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(text.splitlines()), model_prefix=str(tmp_path / "tokenizer"), vocab_size=300,
      model_type="bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
      add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, hard_vocab_limit=False,
      control_symbols=list(hf_tokenizer.REQUIRED_CONTROL_TOKENS), minloglevel=2)
  (tmp_path / "tokenizer.vocab").unlink()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>", "eos_token": "</s>",
                                                              "bos_token": "<s>"}))
  tok = hf_tokenizer.CheckpointTokenizer(tmp_path)
  assert tok.path.name == "tokenizer.model" and (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  ids = tok.encode("<|turn>user\nthe fox<turn|>")
  assert ids[0] == tok.control_ids["<|turn>"] and ids[-1] == tok.control_ids["<turn|>"]
  assert tok.decode(ids, skip_special_tokens=False) == "<|turn>user\nthe fox<turn|>"
  assert tok.decode(ids) == "user\nthe fox"
  parts = dg.chat.split_reply(tok.encode("<|channel>thought\nhmm<channel|>the dog<turn|>"), tok)
  assert (parts.thought, parts.text) == ("hmm", "the dog")


def test_load_tokenizer_picks_the_folder_kind(folder, tmp_path):
  assert isinstance(hf_tokenizer.load_tokenizer(folder), hf_tokenizer.CheckpointTokenizer)
  workdir = tmp_path / "workdir"
  workdir.mkdir()
  dg.data.Tokenizer.train(["def f(x):\n  return x + 1\n" * 50], workdir / "tokenizer.model", vocab_size=300)
  (workdir / "config.json").write_text(json.dumps({"model": {}, "data": {"tokenizer_path": ""}}))
  tok = hf_tokenizer.load_tokenizer(workdir)
  assert isinstance(tok, dg.data.Tokenizer) and isinstance(tok, hf_tokenizer.TokenizerLike)
  assert tok.decode(tok.encode("return x")) == "return x"


def test_folder_without_a_tokenizer(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "diffusion_gemma"}))
  with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no tokenizer: neither tokenizer.json nor"):
    hf_tokenizer.load_tokenizer(tmp_path)
  with pytest.raises(FileNotFoundError, match="has no tokenizer: none of"):
    hf_tokenizer.load_tokenizer(tmp_path / "..")
  with pytest.raises(FileNotFoundError, match="is not a folder"):
    hf_tokenizer.load_tokenizer(tmp_path / "missing")


def test_tokenizer_without_control_tokens(tmp_path):
  control = tuple(t for t in chat_fixtures.CONTROL if t != "<|channel>")
  chat_fixtures.write_tokenizer(tmp_path, control=control)
  with pytest.raises(ValueError, match=r"tokenizer\.json has no control token '<\|channel>'"):
    hf_tokenizer.CheckpointTokenizer(tmp_path)


def test_generation_config_to_sampler_settings(folder):
  overrides, max_new_tokens = presets.read_generation_config(folder)
  pieces = chat_fixtures.tokenizer_pieces()
  assert overrides == dict(max_denoising_steps=12, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability_threshold=1,
                           confidence_threshold=0.005, stop_tokens=(1, pieces.index("<turn|>")))
  assert max_new_tokens == 16
  config, max_new = presets.sampler_config(folder)
  assert config == dg.SamplerConfig(**overrides) and max_new == 16


@pytest.mark.hf
def test_generation_config_fixture_reads_in_transformers(folder):
  pytest.importorskip("torch")
  generation = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
  reference = generation.DiffusionGemmaGenerationConfig.from_pretrained(folder)
  overrides, max_new_tokens = presets.read_generation_config(folder)
  assert reference.sampler_config.entropy_bound == overrides["entropy_bound"]
  assert (reference.t_min, reference.t_max, reference.max_denoising_steps, reference.max_new_tokens) == (
      overrides["t_min"], overrides["t_max"], overrides["max_denoising_steps"], max_new_tokens)
  assert tuple(reference.eos_token_id) == overrides["stop_tokens"]


def test_presets_apply_on_top_of_the_checkpoint(folder):
  code, _ = presets.sampler_config(folder, "code")
  assert (code.t_min, code.confidence_threshold, code.t_max, code.max_denoising_steps) == (0.3, 0.001, 0.8, 12)
  creative, max_new = presets.sampler_config(folder, "creative", max_denoising_steps=20, t_min=None,
                                             max_new_tokens=64)
  assert (creative.t_max, creative.entropy_bound, creative.t_min, creative.max_denoising_steps, max_new) == (
      1.0, 0.15, 0.4, 20, 64)
  default, max_new = presets.sampler_config(None, "default")
  assert default == dg.SamplerConfig() and max_new is None


def test_unknown_preset():
  with pytest.raises(ValueError, match=r"Unknown sampler preset 'poetry'; known presets: \['code', 'creative', "
                                       r"'default'\]"):
    presets.sampler_config(None, "poetry")


@pytest.mark.parametrize("fields, match", [
    (dict(t_min=0.9), r"generation_config\.json: SamplerConfig\.t_min=0\.9 is invalid"),
    (dict(sampler_config={"_cls_name": "TopKSampler", "k": 3}), "TopKSampler.*not supported"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be a positive integer"),
])
def test_bad_generation_config(tmp_path, fields, match):
  chat_fixtures.write_generation_config(tmp_path, **fields)
  with pytest.raises(ValueError, match=match):
    presets.read_generation_config(tmp_path)


def test_folder_without_generation_config_keeps_the_defaults(tmp_path):
  assert presets.read_generation_config(tmp_path) == ({}, None)
  with pytest.raises(FileNotFoundError, match="No generation config"):
    presets.read_generation_config(tmp_path / "generation_config.json")


@pytest.mark.hf
def test_complete_tiny_checkpoint(tmp_path):
  """The phase-2 fixture: one folder that load_hf, the tokenizer and the generation defaults all read."""
  pytest.importorskip("torch")
  chat_fixtures.write_chat_checkpoint(tmp_path)
  cfg, params = dg.convert.load_hf(tmp_path)
  tok = hf_tokenizer.load_tokenizer(tmp_path)
  config, max_new_tokens = presets.sampler_config(tmp_path, "code")
  assert tok.vocab_size == cfg.vocab_size == params["embedder"]["input_embedding"].shape[0]
  assert (cfg.bos_id, cfg.eos_id, cfg.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
  assert all(t in tok.special_tokens for t in config.stop_tokens) and max_new_tokens == 16
  ids = dg.chat.render_ids([{"role": "user", "content": "Hi"}], tok, thinking=True)
  assert max(ids) < cfg.vocab_size

  for weights in tmp_path.glob("*.safetensors"):
    weights.unlink()
  with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no weights: no \\*.safetensors files"):
    dg.convert.load_hf(tmp_path)
  (tmp_path / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    dg.convert.load_hf(tmp_path)
