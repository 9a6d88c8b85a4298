"""Images and video for the Gemma 4 vision encoder, without torch: the arrays transformers' processor makes.

`preprocess(image, budget)` does what `Gemma4ImageProcessorPil` does for one image and a soft-token
budget (`max_soft_tokens`, one of `BUDGETS`):
  1. to RGB (transparency composited onto white);
  2. resize, keeping the aspect ratio, to the largest size whose sides are multiples of
     k * patch_size (k = pooling kernel) and that has at most budget * k^2 patches (PIL bicubic; no
     resize when the size is already right);
  3. rescale to [0, 1] (float64 * 1/255, then float32);
  4. cut into patch_size squares, row-major, each flattened as (row, column, channel);
  5. position ids (x, y) per patch, and padding to budget * k^2 patches with zeros at (-1, -1).
The image then becomes num_soft_tokens = patches / k^2 soft tokens.

A prompt holds one `image_id` placeholder per image; `expand_image_placeholders` turns each into
`begin_image_id`, num_soft_tokens x `image_id`, `end_image_id` (transformers' `Gemma4Processor`).

Video (`sample_video`): frames at 1 per second (transformers' `default_sample_indices_fn` with fps=1),
at most `MAX_VIDEO_SECONDS` long, each frame an image at a small budget (default 70), each announced by
its "mm:ss" timestamp (`video_prompt_text`). Files are read with imageio's PyAV plugin (the `video`
extra); a list or array of frames with their `fps` needs no codec. transformers' DiffusionGemma encoder
has no video input of its own: frames go in as images, in the Gemma 4 processor's video layout.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import PIL.Image

BUDGETS = (70, 140, 280, 560, 1120)  # soft tokens per image the released model was trained with
PATCH_SIZE = 16
POOLING_KERNEL_SIZE = 3
VIDEO_BUDGET = 70
VIDEO_FPS = 1.0
MAX_VIDEO_SECONDS = 60.0


class ProcessedImage(NamedTuple):
  """One image for the vision encoder."""

  pixel_values: np.ndarray  # [budget * k^2, 3 * patch^2] float32 in [0, 1]; zeros for padding
  position_ids: np.ndarray  # [budget * k^2, 2] int32 (x, y) of each patch; (-1, -1) for padding
  num_soft_tokens: int  # real patches / k^2


class VideoFrames(NamedTuple):
  frames: list[ProcessedImage]
  timestamps: list[float]  # seconds, one per frame


def _check_budget(budget) -> None:
  if budget not in BUDGETS:
    raise ValueError(f"Image budget {budget!r} is not supported: the soft tokens per image must be one of "
                     f"{BUDGETS}.")


def target_size(height: int, width: int, budget: int, patch_size: int = PATCH_SIZE,
                pooling_kernel_size: int = POOLING_KERNEL_SIZE) -> tuple[int, int]:
  """(height, width) an image is resized to: the largest with sides multiple of k * patch_size and at
  most budget * k^2 patches, keeping the aspect ratio; a side that would be 0 becomes one multiple."""
  max_patches = budget * pooling_kernel_size**2
  target_pixels = max_patches * patch_size**2
  factor = math.sqrt(target_pixels / (height * width))
  side = pooling_kernel_size * patch_size
  new_height = int(math.floor(factor * height / side)) * side
  new_width = int(math.floor(factor * width / side)) * side
  if new_height == 0 and new_width == 0:
    raise ValueError(f"Cannot resize a {height}x{width} image to a multiple of {side} pixels per side.")
  longest = (max_patches // pooling_kernel_size**2) * side
  if new_height == 0:
    new_height, new_width = side, min(int(math.floor(width / height)) * side, longest)
  elif new_width == 0:
    new_width, new_height = side, min(int(math.floor(height / width)) * side, longest)
  if new_height * new_width > target_pixels:
    raise ValueError(f"A {height}x{width} image would be resized to {new_height}x{new_width}, more than "
                     f"{max_patches} patches of {patch_size} pixels.")
  return new_height, new_width


def _describe(image) -> str:
  return repr(os.fspath(image)) if isinstance(image, (str, os.PathLike)) else type(image).__name__


def load_rgb(image: Any) -> np.ndarray:
  """An image file path, a PIL image, or a uint8 array [H, W], [H, W, 1|3|4] -> uint8 RGB [H, W, 3]."""
  if isinstance(image, (str, os.PathLike)):
    path = pathlib.Path(image)
    if not path.is_file():
      raise FileNotFoundError(f"No image file {str(path)!r}.")
    try:
      with PIL.Image.open(path) as opened:
        opened.load()
        image = opened.copy()
    except (OSError, SyntaxError, ValueError) as e:  # PIL.UnidentifiedImageError is an OSError
      raise ValueError(f"Cannot read image {str(path)!r}: {e}") from e
  if isinstance(image, PIL.Image.Image):
    if image.width == 0 or image.height == 0:
      raise ValueError(f"The image is empty ({image.width}x{image.height} pixels).")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
      rgba = image.convert("RGBA")
      image = PIL.Image.alpha_composite(PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"))
  if not isinstance(image, np.ndarray):
    raise TypeError(f"An image is a file path, a PIL image or a uint8 numpy array, not {type(image).__name__}.")
  if image.dtype != np.uint8:
    raise ValueError(f"Image arrays must be uint8 (0-255), got {image.dtype}.")
  if image.ndim == 2:
    image = image[..., None]
  if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
    raise ValueError(f"Image arrays are [height, width] or [height, width, 1|3|4 channels], got shape "
                     f"{image.shape}.")
  if image.shape[0] == 0 or image.shape[1] == 0:
    raise ValueError(f"The image is empty ({image.shape[1]}x{image.shape[0]} pixels).")
  if image.shape[-1] == 1:
    return np.repeat(image, 3, axis=-1)
  if image.shape[-1] == 4:  # onto white, rounded, as transformers' convert_to_rgb does for arrays
    alpha = image[..., 3:] / 255
    return np.round(alpha * image[..., :3] + (1 - alpha) * 255).astype(np.uint8)
  return image


def preprocess(image: Any, budget: int = 280, *, patch_size: int = PATCH_SIZE,
               pooling_kernel_size: int = POOLING_KERNEL_SIZE) -> ProcessedImage:
  """(pixel_values, position_ids, num_soft_tokens) of one image at a soft-token budget (see the module
  docstring); `image` is a file path, a PIL image or a uint8 array [H, W(, C)]."""
  _check_budget(budget)
  rgb = load_rgb(image)
  height, width = rgb.shape[:2]
  new_height, new_width = target_size(height, width, budget, patch_size, pooling_kernel_size)
  if (new_height, new_width) != (height, width):
    rgb = np.asarray(PIL.Image.fromarray(rgb).resize((new_width, new_height), PIL.Image.Resampling.BICUBIC))
  pixels = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)  # [H, W, 3]
  rows, cols = new_height // patch_size, new_width // patch_size
  patches = pixels.reshape(rows, patch_size, cols, patch_size, 3).transpose(0, 2, 1, 3, 4)
  patches = patches.reshape(rows * cols, patch_size * patch_size * 3)
  x, y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
  positions = np.stack([x, y], axis=-1).reshape(rows * cols, 2).astype(np.int32)
  pad = budget * pooling_kernel_size**2 - rows * cols
  patches = np.pad(patches, ((0, pad), (0, 0)))
  positions = np.pad(positions, ((0, pad), (0, 0)), constant_values=-1)
  return ProcessedImage(patches, positions, rows * cols // pooling_kernel_size**2)


def stack(images: Sequence[ProcessedImage]) -> tuple[np.ndarray, np.ndarray, list[int]]:
  """(pixel_values [N, P, C], position_ids [N, P, 2], num_soft_tokens) of several images, padded to the
  largest patch count (images of different budgets batch together; padding changes no soft token)."""
  if not images:
    raise ValueError("No images to stack.")
  patches = max(image.pixel_values.shape[0] for image in images)
  pixel_values = np.stack([np.pad(image.pixel_values, ((0, patches - image.pixel_values.shape[0]), (0, 0)))
                           for image in images])
  position_ids = np.stack([np.pad(image.position_ids, ((0, patches - image.position_ids.shape[0]), (0, 0)),
                                  constant_values=-1) for image in images])
  return pixel_values, position_ids, [image.num_soft_tokens for image in images]


def expand_image_placeholders(tokens: Sequence[int], num_soft_tokens: Sequence[int], config) -> list[int]:
  """Each `config.image_id` in `tokens` (one placeholder per image, in order) becomes
  `begin_image_id`, num_soft_tokens[i] x `image_id`, `end_image_id`. `config`: a ModelConfig."""
  tokens = [int(t) for t in tokens]
  count = tokens.count(config.image_id)
  if count != len(num_soft_tokens):
    raise ValueError(f"The prompt has {count} image placeholder(s) (token {config.image_id}) but "
                     f"{len(num_soft_tokens)} image(s) were given: put one placeholder per image.")
  expanded, images = [], iter(num_soft_tokens)
  for token in tokens:
    if token == config.image_id:
      expanded += [config.begin_image_id] + [config.image_id] * int(next(images)) + [config.end_image_id]
    else:
      expanded.append(token)
  return expanded


def timestamp_text(seconds: float) -> str:
  """mm:ss, as the Gemma 4 processor writes a frame's time."""
  return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def video_prompt_text(timestamps: Sequence[float], image_placeholder: str = "<|image|>") -> str:
  """The text standing for a video: per frame its timestamp then one image placeholder, space separated
  ("00:00 <|image|> 00:01 <|image|>"). Once tokenized and expanded, the tokens are the Gemma 4
  processor's video layout with the image token for the frames' soft tokens."""
  return " ".join(f"{timestamp_text(t)} {image_placeholder}" for t in timestamps)


def frame_indices(num_frames: int, fps: float, sample_fps: float = VIDEO_FPS) -> np.ndarray:
  """Frames sampled at `sample_fps`: n = max(1, int(num_frames / fps * sample_fps)) frames at
  arange(n) * num_frames // n (transformers' `default_sample_indices_fn`, which refuses n > num_frames;
  here a video slower than `sample_fps` gives each of its frames once)."""
  n = min(max(1, int(num_frames / fps * sample_fps)), num_frames)  # below 1 fps: every frame once
  return np.arange(n, dtype=np.int64) * num_frames // n


def read_video(path: os.PathLike | str) -> tuple[int, float, Any]:
  """(frame count, fps, an iterator of uint8 frames [H, W, 3]) of a video file, via imageio + PyAV."""
  try:
    import imageio.v3 as iio  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Reading video files needs imageio and av: pip install 'diffusiongemma[video]' (or pass "
                      "the frames as arrays with their fps).") from e
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"No video file {str(path)!r}.")
  try:
    num_frames = int(iio.improps(path, plugin="pyav").shape[0])
    fps = float(iio.immeta(path, plugin="pyav")["fps"])
  except Exception as e:  # pylint: disable=broad-except  (each codec fails in its own way)
    raise ValueError(f"Cannot read video {str(path)!r}: {e}") from e
  return num_frames, fps, iio.imiter(path, plugin="pyav")


def sample_video(video: Any, *, fps: float | None = None, budget: int = VIDEO_BUDGET,
                 max_seconds: float = MAX_VIDEO_SECONDS, patch_size: int = PATCH_SIZE,
                 pooling_kernel_size: int = POOLING_KERNEL_SIZE) -> VideoFrames:
  """Frames at 1 per second, each preprocessed at `budget`, and their timestamps.

  `video`: a file path (read with imageio/PyAV; its own fps), or a sequence / array [T, H, W(, C)] of
  frames (anything `preprocess` takes) with their `fps`. Longer than `max_seconds`: an error.
  """
  _check_budget(budget)
  if isinstance(video, (str, os.PathLike)):
    num_frames, fps, frames = read_video(video)
  else:
    if fps is None or not fps > 0:
      raise ValueError(f"Frames given as arrays need their positive frame rate: fps={fps!r}.")
    num_frames, frames = len(video), iter(video)
  if num_frames == 0:
    raise ValueError("The video has no frames.")
  seconds = num_frames / fps
  if seconds > max_seconds:
    raise ValueError(f"The video lasts {seconds:.1f} s ({num_frames} frames at {fps:g} fps); at most "
                     f"{max_seconds:g} s are supported.")
  wanted = [int(i) for i in frame_indices(num_frames, fps)]
  wanted_set, picked = set(wanted), {}
  with contextlib.closing(frames) if hasattr(frames, "close") else contextlib.nullcontext():
    for index, frame in enumerate(frames):
      if index in wanted_set:
        frame = frame if isinstance(frame, PIL.Image.Image) else np.asarray(frame)
        picked[index] = preprocess(frame, budget, patch_size=patch_size, pooling_kernel_size=pooling_kernel_size)
      if index >= wanted[-1]:
        break
  missing = [i for i in wanted if i not in picked]
  if missing:
    raise ValueError(f"The video ended before frames {missing[:5]} (it announced {num_frames} frames).")
  return VideoFrames([picked[i] for i in wanted], [i / fps for i in wanted])
