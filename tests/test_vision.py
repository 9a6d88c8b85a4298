"""Images and video in the prompt: preprocessing, the Gemma 4 vision encoder, encoding with images.

The `hf` tests compare with transformers on a tiny random DiffusionGemma whose vision tower is real and
randomized too (benchmarks/hf_reference.py: 2 layers, width 24, 4 heads over 2 KV heads, 4-pixel patches,
standardised), with bidirectional image attention (`use_bidirectional_attention="vision"`, as released).
Tolerance 1e-4 in float32.
"""

import dataclasses
import functools
import json
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import safetensors
from flax import traverse_util

import diffusiongemma as dg
from diffusiongemma.data import images
from diffusiongemma.model import vision

ATOL = 1e-4
IMAGE, BEGIN, END = 94, 95, 96  # image token ids of the tiny models (vocabulary 97)
HF_VISION = dict(hidden_size=24, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=3,
                 position_embedding_size=256, standardize=True)
PATCH = HF_VISION["patch_size"]


def _tiny_config(**vision_changes) -> dg.ModelConfig:
  vision_config = dg.model.VisionConfig(hidden_size=24, intermediate_size=20, num_layers=2, num_heads=4,
                                        num_kv_heads=2, head_dim=8, patch_size=PATCH, position_embedding_size=64,
                                        **vision_changes)
  return dg.ModelConfig(vocab_size=97, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
                        num_full_kv_heads=1, full_head_dim=16, intermediate_size=40, num_experts=5, top_k=2,
                        moe_intermediate_size=24, canvas_length=8, sliding_window=5, vision=vision_config,
                        image_id=IMAGE, begin_image_id=BEGIN, end_image_id=END)


def _pixels(seed, height, width, channels=3):
  return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


def _text(seed, length):
  return [int(t) for t in np.random.default_rng(seed).integers(3, IMAGE, length)]  # no image-token ids


# --- preprocessing and prompt layout (no torch) ---


def test_preprocess_pads_to_the_budget_and_counts_soft_tokens():
  image = images.preprocess(_pixels(0, 40, 90), 70, patch_size=PATCH)
  assert image.pixel_values.shape == (630, 3 * PATCH * PATCH) and image.pixel_values.dtype == np.float32
  assert image.num_soft_tokens == 60  # 40x90 pixels -> 60x144 -> 15x36 patches of 4 -> 540 / 3^2
  real = image.position_ids[:, 0] >= 0
  assert real.sum() == image.num_soft_tokens * 9 and not real[real.sum():].any()  # padding comes last
  assert (image.pixel_values[~real] == 0).all() and (image.position_ids[~real] == -1).all()
  width = image.position_ids[real, 0].max() + 1
  np.testing.assert_array_equal(image.position_ids[:width + 1], [[x, 0] for x in range(width)] + [[0, 1]])
  pixel_values, position_ids, counts = images.stack([image, images.preprocess(_pixels(1, 70, 30), 140,
                                                                               patch_size=PATCH)])
  assert pixel_values.shape[:2] == position_ids.shape[:2] == (2, 1260) and counts[0] == 60


def test_bad_images_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match=r"budget 100 .*\(70, 140, 280, 560, 1120\)"):
    images.preprocess(_pixels(0, 32, 32), 100)
  garbage = tmp_path / "garbage.png"
  garbage.write_bytes(b"not an image at all")
  with pytest.raises(ValueError, match="Cannot read image .*garbage.png"):
    images.preprocess(garbage)
  empty_file = tmp_path / "empty.jpg"
  empty_file.write_bytes(b"")
  with pytest.raises(ValueError, match="Cannot read image .*empty.jpg"):
    images.preprocess(empty_file)
  with pytest.raises(FileNotFoundError, match="missing.png"):
    images.preprocess(tmp_path / "missing.png")
  with pytest.raises(ValueError, match=r"empty \(5x0 pixels\)"):
    images.preprocess(np.zeros((0, 5, 3), np.uint8))
  with pytest.raises(ValueError, match="empty"):
    images.preprocess(PIL.Image.new("RGB", (0, 0)))
  with pytest.raises(ValueError, match="must be uint8"):
    images.preprocess(np.zeros((8, 8, 3), np.float32))


def test_expand_image_placeholders():
  cfg = _tiny_config()
  assert images.expand_image_placeholders([5, IMAGE, 6, IMAGE], [2, 1], cfg) == [
      5, BEGIN, IMAGE, IMAGE, END, 6, BEGIN, IMAGE, END]
  with pytest.raises(ValueError, match=r"2 image placeholder\(s\) \(token 94\) but 1 image\(s\)"):
    images.expand_image_placeholders([IMAGE, 5, IMAGE], [3], cfg)
  with pytest.raises(ValueError, match=r"0 image placeholder\(s\)"):
    images.expand_image_placeholders([5, 6], [3], cfg)


def test_video_frames_at_one_per_second_with_timestamps():
  frames = np.stack([_pixels(i, 20, 36) for i in range(10)])  # 2.5 s at 4 fps
  video = images.sample_video(frames, fps=4, patch_size=PATCH)
  assert video.timestamps == [0.0, 1.25]  # int(10 / 4) = 2 frames, at 0 and 10 // 2 = 5
  np.testing.assert_array_equal(video.frames[1].pixel_values,
                                images.preprocess(frames[5], 70, patch_size=PATCH).pixel_values)
  assert images.video_prompt_text([0.0, 1.25, 61.0]) == "00:00 <|image|> 00:01 <|image|> 01:01 <|image|>"
  long = np.zeros((61, 4, 4, 3), np.uint8)
  with pytest.raises(ValueError, match=r"lasts 61.0 s \(61 frames at 1 fps\); at most 60 s"):
    images.sample_video(long, fps=1)
  with pytest.raises(ValueError, match="fps=None"):
    images.sample_video(frames)
  with pytest.raises(ValueError, match="no frames"):
    images.sample_video(frames[:0], fps=4)
  with pytest.raises(ValueError, match="budget 50"):
    images.sample_video(frames, fps=4, budget=50)


def test_video_file_is_read_with_pyav(tmp_path):
  iio = pytest.importorskip("imageio.v3")
  pytest.importorskip("av")
  frames = np.stack([_pixels(i, 48, 64) for i in range(25)])
  path = tmp_path / "clip.mp4"
  iio.imwrite(path, frames, plugin="pyav", fps=10, codec="libx264")
  video = images.sample_video(path, patch_size=PATCH)
  assert video.timestamps == [0.0, 1.2]  # 25 frames at 10 fps: int(2.5) = 2 frames, at 0 and 25 // 2 = 12
  assert len(video.frames) == 2 and video.frames[0].num_soft_tokens > 0
  with pytest.raises(ValueError, match="Cannot read video"):
    (tmp_path / "bad.mp4").write_bytes(b"nope")
    images.sample_video(tmp_path / "bad.mp4")


# --- the model (no torch) ---


@pytest.fixture(scope="module")
def tiny():
  cfg = _tiny_config()
  model = dg.DiffusionGemma(cfg)
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), tokens, tokens)["params"]
  return cfg, model, nn.unbox(params)


def _prompt(cfg, pieces, seed=0):
  """Token list from pieces: an int n is n text tokens; an image is one placeholder (to be expanded)."""
  tokens, found = [], []
  for i, piece in enumerate(pieces):
    if isinstance(piece, int):
      tokens += _text(seed + i, piece)
    else:
      tokens.append(cfg.image_id)
      found.append(piece)
  pixel_values, position_ids, counts = images.stack(found)
  return images.expand_image_placeholders(tokens, counts, cfg), pixel_values, position_ids


def test_text_only_encoding_is_unchanged_by_a_vision_encoder(tiny):
  cfg, model, params = tiny
  text_params = {k: v for k, v in params.items() if k not in ("vision_tower", "embed_vision")}
  text_model = dg.DiffusionGemma(cfg.replace(vision=None))
  tokens = jnp.asarray([_text(0, 11), _text(1, 11)])
  ours = jax.jit(functools.partial(model.apply, method=model.encode))({"params": params}, tokens)
  text = jax.jit(functools.partial(text_model.apply, method=text_model.encode))({"params": text_params}, tokens)
  jax.tree.map(np.testing.assert_array_equal, ours, text)


def test_encode_with_images_jits_and_checks_placeholders(tiny):
  cfg, model, params = tiny
  image = images.preprocess(_pixels(0, 40, 90), 70, patch_size=PATCH)
  tokens, pixel_values, position_ids = _prompt(cfg, [3, image, 4])
  tokens = jnp.asarray([tokens])
  encode = lambda t, p, q: model.apply({"params": params}, t, pixel_values=p, image_position_ids=q,
                                       method=model.encode)
  run = jax.jit(encode)
  logits, cache = run(tokens, pixel_values, position_ids)
  assert logits.shape == (1, tokens.shape[1], cfg.vocab_size) and int(cache.length[0]) == tokens.shape[1]
  # The pixels reach the positions from the image on, and only those (the text before it is causal).
  other, _ = run(tokens, pixel_values[..., ::-1], position_ids)
  first = int(np.flatnonzero(np.asarray(tokens[0]) == cfg.begin_image_id)[0])
  np.testing.assert_array_equal(other[:, :first], logits[:, :first])
  assert np.abs(np.asarray(other[:, first + 1:] - logits[:, first + 1:])).max(-1).min() > 1e-4
  with pytest.raises(ValueError, match="has 59 image soft-token placeholders but the 1 images have 60"):
    encode(tokens[:, :-6], pixel_values, position_ids)  # outside jit the counts are checked first
  text_model = dg.DiffusionGemma(cfg.replace(vision=None))
  with pytest.raises(ValueError, match="no vision encoder"):
    text_model.apply({"params": params}, tokens, pixel_values=pixel_values, image_position_ids=position_ids,
                     method=text_model.encode)


def test_vision_config_is_validated_and_round_trips():
  with pytest.raises(ValueError, match="VisionConfig.head_dim=6 is invalid: must be a multiple of 4"):
    dg.model.VisionConfig(head_dim=6)
  with pytest.raises(ValueError, match="VisionConfig.num_kv_heads=5 is invalid"):
    dg.model.VisionConfig(num_kv_heads=5)
  with pytest.raises(ValueError, match="VisionConfig.patch_size=0 is invalid"):
    dg.model.VisionConfig(patch_size=0)
  with pytest.raises(ValueError, match="ModelConfig.image_id=258880 is invalid"):
    _tiny_config().replace(image_id=258_880)
  cfg = _tiny_config()
  assert dg.ModelConfig.from_dict(cfg.to_dict()) == cfg
  assert dg.ModelConfig().vision is None  # text only by default


def test_vision_parameters_carry_logical_axes(tiny):
  cfg, model, _ = tiny
  tokens = jnp.zeros((1, 4), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)["params"]
  for name in ("vision_tower", "embed_vision"):
    leaves = jax.tree.leaves(boxed[name], is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(leaf, nn.Partitioned) for leaf in leaves), name
  specs = dg.parallel.param_specs(boxed, {"data": 1, "fsdp": 2, "expert": 1, "tensor": 2})
  assert specs["vision_tower"]["layer_0"]["attn"]["q_einsum"] == jax.sharding.PartitionSpec("tensor", "fsdp", None)
  assert specs["embed_vision"]["embedding_projection"] == jax.sharding.PartitionSpec(None, "fsdp")


def _released_vision_count(vision_config: dg.model.VisionConfig, text_hidden: int) -> int:
  v = vision_config
  attention = (2 * v.num_heads + 2 * v.num_kv_heads) * v.hidden_size * v.head_dim + 2 * v.head_dim
  layer = attention + 3 * v.hidden_size * v.intermediate_size + 4 * v.hidden_size
  embedder = v.patch_pixels * v.hidden_size + 2 * v.position_embedding_size * v.hidden_size
  return v.num_layers * layer + embedder + 2 * v.hidden_size + v.hidden_size * text_hidden


def test_released_vision_parameter_count():
  cfg = dg.ModelConfig(vision=dg.model.VisionConfig())
  counts = dg.model.count_parameters(cfg)
  print(f"\n26B-A4B vision encoder (eval_shape): {counts['vision']:,} parameters "
        f"({counts['vision'] / 1e6:.1f}M); whole model {counts['total'] / 1e9:.2f}B")
  assert counts["vision"] == _released_vision_count(cfg.vision, cfg.hidden_size)


# --- against transformers ---


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  pytest.importorskip("torch")
  hf_reference = pytest.importorskip("benchmarks.hf_reference")  # pylint: disable=redefined-outer-name
  path = tmp_path_factory.mktemp("hf_vision")
  model = hf_reference.make_tiny_hf(path, seed=3, vision_config=HF_VISION, image_token_ids=(IMAGE, BEGIN, END),
                                    use_bidirectional_attention="vision")
  cfg, params = dg.convert.load_hf(path)
  return hf_reference, path, model, cfg, params


@functools.partial(jax.jit, static_argnames="config")
def _encode_and_denoise(params, tokens, num_tokens, pixel_values, position_ids, canvas, config):
  model = dg.DiffusionGemma(config)
  logits, cache = model.apply({"params": params}, tokens, num_tokens=num_tokens, pixel_values=pixel_values,
                              image_position_ids=position_ids, method=model.encode)
  return logits, model.apply({"params": params}, canvas, cache, method=model.denoise)


@pytest.mark.hf
@pytest.mark.parametrize("budget", [70, 280])
def test_preprocessing_matches_transformers(budget):
  pytest.importorskip("torch")
  processor_module = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
  processor = processor_module.Gemma4ImageProcessorPil(max_soft_tokens=budget)
  rgba = np.concatenate([_pixels(2, 500, 200), _pixels(3, 500, 200, 1)], axis=-1)
  for image in (PIL.Image.fromarray(_pixels(1, 300, 500)), rgba, PIL.Image.fromarray(rgba)):  # wide; tall
    theirs = processor(image, return_tensors="np")
    ours = images.preprocess(image, budget)
    np.testing.assert_allclose(ours.pixel_values, theirs["pixel_values"][0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(ours.position_ids, theirs["image_position_ids"][0])
    assert ours.num_soft_tokens == theirs["num_soft_tokens_per_image"][0]


@pytest.mark.hf
def test_image_features_match_transformers(reference):
  hf_reference, _, model, cfg, params = reference
  assert cfg.vision.bidirectional_attention and cfg.vision.standardize and cfg.vision.num_kv_heads == 2
  pixel_values, position_ids, counts = images.stack(
      [images.preprocess(_pixels(i, *shape), 70, patch_size=PATCH) for i, shape in enumerate([(40, 90), (70, 30)])])
  ours = dg.DiffusionGemma(cfg)
  features, valid = ours.apply({"params": params}, pixel_values, position_ids, method=ours.image_embeddings)
  assert list(np.asarray(valid).sum(axis=1)) == counts
  theirs = hf_reference.image_features(model, pixel_values, position_ids)
  np.testing.assert_allclose(np.asarray(features)[np.asarray(valid)], theirs, atol=ATOL)


@pytest.mark.hf
def test_logits_with_images_match_transformers(reference):
  """Three rows in one batch: two images, one image of another budget, none; each row is compared with
  transformers run on that row alone (unpadded, with its own images)."""
  hf_reference, _, model, cfg, params = reference
  a, b = (images.preprocess(_pixels(i, *shape), 70, patch_size=PATCH) for i, shape in [(10, (40, 90)), (11, (70, 30))])
  c = images.preprocess(_pixels(12, 50, 50), 140, patch_size=PATCH)
  rows = [_prompt(cfg, [4, a, 3, b, 5], seed=20), _prompt(cfg, [6, c, 2], seed=30), (_text(40, 9), None, None)]
  length = max(len(tokens) for tokens, _, _ in rows)
  tokens = np.asarray([t + [cfg.pad_id] * (length - len(t)) for t, _, _ in rows])
  num_tokens = np.asarray([len(t) for t, _, _ in rows])
  pixel_values, position_ids, _ = images.stack([a, b, c])
  canvas = np.random.default_rng(5).integers(3, IMAGE, (3, cfg.canvas_length))
  encoder, decoder = _encode_and_denoise(params, tokens, num_tokens, pixel_values, position_ids, canvas, cfg)
  for i, (row, row_pixels, row_positions) in enumerate(rows):
    n = len(row)
    np.testing.assert_allclose(
        encoder[i, :n], hf_reference.encoder_logits(model, [row], row_pixels, row_positions)[0], atol=ATOL)
    np.testing.assert_allclose(
        decoder[i], hf_reference.decoder_logits(model, [row], canvas[i:i + 1], pixel_values=row_pixels,
                                                image_position_ids=row_positions)[0], atol=ATOL)
  causal = cfg.replace(vision=dataclasses.replace(cfg.vision, bidirectional_attention=False))
  causal_encoder, _ = _encode_and_denoise(params, tokens, num_tokens, pixel_values, position_ids, canvas, causal)
  assert np.abs(causal_encoder[0] - encoder[0]).max() > 1e-2  # the image attention pattern matters here


@pytest.mark.hf
def test_video_matches_transformers(reference):
  hf_reference, _, model, cfg, params = reference
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
  from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
  from transformers.video_utils import VideoMetadata, default_sample_indices_fn
  frames = np.stack([_pixels(50 + i, 30, 50) for i in range(7)])  # 3.5 s at 2 fps
  video = images.sample_video(frames, fps=2, patch_size=PATCH)

  metadata = VideoMetadata(total_num_frames=len(frames), fps=2)
  metadata.frames_indices = default_sample_indices_fn(metadata, fps=1)
  assert video.timestamps == metadata.timestamps == [0.0, 1.0, 2.0]
  processor = object.__new__(Gemma4Processor)  # only its text layout is used: no tokenizer needed
  processor.boi_token, processor.eoi_token, processor.video_token = "<|image>", "<image|>", "<|video|>"
  n = video.frames[0].num_soft_tokens
  layout = processor.replace_video_token({"num_soft_tokens_per_video": [n], "video_metadata": [metadata]}, 0)
  ours_text = images.video_prompt_text(video.timestamps)
  assert ours_text.replace("<|image|>", "<|image>" + "<|video|>" * n + "<image|>") == layout
  frame_processor = Gemma4ImageProcessorPil(max_soft_tokens=70, patch_size=PATCH)
  for frame, index in zip(video.frames, metadata.frames_indices):
    theirs = frame_processor(frames[index], return_tensors="np")
    np.testing.assert_allclose(frame.pixel_values, theirs["pixel_values"][0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(frame.position_ids, theirs["image_position_ids"][0])

  tokens = []  # a toy tokenizer: one token per character of the timestamp text, the placeholder as itself
  for piece in ours_text.split("<|image|>")[:-1]:
    tokens += [3 + ord(ch) % 80 for ch in piece] + [cfg.image_id]
  pixel_values, position_ids, counts = images.stack(video.frames)
  tokens = images.expand_image_placeholders(tokens + _text(60, 4), counts, cfg)
  canvas = np.random.default_rng(6).integers(3, IMAGE, (1, cfg.canvas_length))
  encoder, decoder = _encode_and_denoise(params, np.asarray([tokens]), None, pixel_values, position_ids, canvas,
                                         cfg)
  np.testing.assert_allclose(encoder, hf_reference.encoder_logits(model, [tokens], pixel_values, position_ids),
                             atol=ATOL)
  np.testing.assert_allclose(decoder, hf_reference.decoder_logits(model, [tokens], canvas,
                                                                  pixel_values=pixel_values,
                                                                  image_position_ids=position_ids), atol=ATOL)


@pytest.mark.hf
def test_vision_weights_round_trip_through_save_hf(reference, tmp_path):
  hf_reference, path, _, cfg, params = reference
  dg.convert.save_hf(cfg, params, tmp_path / "out", max_shard_bytes=200_000)
  exported = hf_reference.load_hf(tmp_path / "out")
  tokens, pixel_values, position_ids = _prompt(cfg, [3, images.preprocess(_pixels(7, 60, 40), 70,
                                                                          patch_size=PATCH), 5], seed=70)
  canvas = np.random.default_rng(8).integers(3, IMAGE, (1, cfg.canvas_length))
  encoder, decoder = _encode_and_denoise(params, np.asarray([tokens]), None, pixel_values, position_ids, canvas,
                                         cfg)
  np.testing.assert_allclose(hf_reference.encoder_logits(exported, [tokens], pixel_values, position_ids), encoder,
                             atol=ATOL)
  np.testing.assert_allclose(hf_reference.decoder_logits(exported, [tokens], canvas, pixel_values=pixel_values,
                                                         image_position_ids=position_ids), decoder, atol=ATOL)
  round_trip_config, round_trip = dg.convert.load_hf(tmp_path / "out")
  assert round_trip_config == cfg
  jax.tree.map(np.testing.assert_array_equal, round_trip, params)
  with pytest.raises(ValueError, match="vision_from=.* is for a text-only model"):
    dg.convert.save_hf(cfg, params, tmp_path / "bad", vision_from=path)


@pytest.mark.hf
def test_vision_model_exports_as_gemma4_and_loads_back_with_its_tower(reference, tmp_path):
  """Issue 38: the encoder of a DiffusionGemma with a vision encoder, written as Gemma4ForConditionalGeneration:
  transformers' Gemma 4 runs a prompt with an image to our encoder's logits, and read back the vision tower is
  carried over (every parameter but the denoiser's own equal). Attention both ways over an image means other
  masks in the two models (Gemma 4: sliding layers only), so it is refused both ways, naming the field; the
  export is of the same model with images attended causally."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  _, _, _, bidirectional_cfg, params = reference
  with pytest.raises(ValueError, match="bidirectional_attention=True, which Gemma 4 cannot hold"):
    dg.convert.save_hf(bidirectional_cfg, params, tmp_path / "bad", architecture="Gemma4ForConditionalGeneration")
  assert not (tmp_path / "bad").exists()
  cfg = bidirectional_cfg.replace(vision=dataclasses.replace(bidirectional_cfg.vision, bidirectional_attention=False))
  dg.convert.save_hf(cfg, params, tmp_path / "g4", architecture="Gemma4ForConditionalGeneration")
  exported = transformers.Gemma4ForConditionalGeneration.from_pretrained(
      tmp_path / "g4", dtype=torch.float32, attn_implementation="eager").eval()
  tokens, pixel_values, position_ids = _prompt(cfg, [3, images.preprocess(_pixels(7, 60, 40), 70,
                                                                          patch_size=PATCH), 5], seed=70)
  canvas = np.random.default_rng(8).integers(3, IMAGE, (1, cfg.canvas_length))
  encoder, _ = _encode_and_denoise(params, np.asarray([tokens]), None, pixel_values, position_ids, canvas, cfg)
  ids = torch.as_tensor(np.asarray([tokens]), dtype=torch.long)
  with torch.no_grad():
    theirs = exported(input_ids=ids, pixel_values=torch.as_tensor(np.asarray(pixel_values), dtype=torch.float32),
                      image_position_ids=torch.as_tensor(np.asarray(position_ids), dtype=torch.long),
                      mm_token_type_ids=(ids == cfg.image_id).long()).logits
  np.testing.assert_allclose(theirs.float().numpy(), encoder, atol=ATOL)

  back_cfg, back = dg.convert.load_hf(tmp_path / "g4")
  assert back_cfg == cfg.replace(canvas_length=256)
  flat, back_flat = traverse_util.flatten_dict(params), traverse_util.flatten_dict(back)
  assert any(key[0] == "vision_tower" for key in back_flat)
  for key, value in flat.items():
    if key[0] != "self_conditioning" and key[-1] != "decoder_scalar":
      np.testing.assert_array_equal(back_flat[key], value, err_msg=str(key))

  config = json.loads((tmp_path / "g4" / "config.json").read_text())
  config["text_config"]["use_bidirectional_attention"] = "vision"
  (tmp_path / "g4" / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"text_config.use_bidirectional_attention='vision' \(Gemma 4 lets"):
    dg.convert.load_hf(tmp_path / "g4")
  text_cfg, _ = dg.convert.load_hf(tmp_path / "g4", vision=None)  # the text model alone is exact
  assert text_cfg == back_cfg.replace(vision=None)


@pytest.mark.hf
def test_load_hf_text_only_skips_the_vision_weights(reference, caplog):
  _, path, _, cfg, _ = reference
  with caplog.at_level(logging.INFO):
    text_cfg, text_params = dg.convert.load_hf(path, vision=None)
  assert text_cfg == cfg.replace(vision=None)
  assert "vision_tower" not in text_params and "embed_vision" not in text_params
  with safetensors.safe_open(path / "model.safetensors", "np") as file:  # what the log must count
    skipped = sum(k.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head."))
                  for k in file.keys())
  messages = [record.getMessage() for record in caplog.records]
  assert f"load_hf: skipped {skipped} vision-tower / lm_head tensors (text model only)." in messages, messages
  assert skipped > 0


@pytest.mark.hf
def test_released_vision_parameter_count_matches_transformers():
  torch = pytest.importorskip("torch")
  from transformers import Gemma4VisionConfig
  from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel
  ours = dg.model.VisionConfig()
  hf_config = Gemma4VisionConfig(**{k: v for k, v in dg.convert.vision.config_to_hf(ours).items()
                                    if k != "model_type"})
  with torch.device("meta"):
    tower = Gemma4VisionModel(hf_config)
  theirs = sum(p.numel() for p in tower.parameters()) + sum(
      b.numel() for name, b in tower.named_buffers() if name.startswith("std_"))
  theirs += ours.hidden_size * dg.ModelConfig().hidden_size  # embed_vision.embedding_projection
  assert dg.model.count_parameters(dg.ModelConfig(vision=ours))["vision"] == theirs
