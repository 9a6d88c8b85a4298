"""The parameter table that loading and saving both read: one `_Entry` per parameter (our path, the
checkpoint keys to try, the layout maps both ways) and the maps the text model (`hf.py`) and the vision
encoder (`vision.py`) share: linears (whole or split into heads), output projections, GeGLU MLPs. Both
import it; neither imports the other's table."""

from __future__ import annotations

from collections.abc import Callable, Iterator

# Where transformers' DiffusionGemma keeps the text weights: the decoder's copy (saved), the encoder's (tied to
# it, so not saved, except the encoder's own `layer_scalar` buffers).
DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."


class _Entry:
  """One parameter: our path, checkpoint keys to try, and the layout maps both ways."""

  def __init__(self, path: tuple[str, ...], keys: tuple[str, ...], to_ours: Callable, to_hf: Callable):
    self.path, self.keys, self.to_ours, self.to_hf = path, keys, to_ours, to_hf


def _identity(x):
  return x


def _linear(heads: int | None = None):
  """torch Linear [out, in] <-> ours: [in, out], or [heads, in, head_dim] when split into heads."""
  if heads is None:
    return (lambda w: w.T), (lambda w: w.T)
  return ((lambda w: w.reshape(heads, -1, w.shape[-1]).transpose(0, 2, 1)),
          (lambda w: w.transpose(0, 2, 1).reshape(-1, w.shape[1])))


def _output_projection(heads: int):
  """torch o_proj [D, N*H] <-> ours [N, H, D]."""
  return ((lambda w: w.reshape(w.shape[0], heads, -1).transpose(1, 2, 0)),
          (lambda w: w.transpose(2, 0, 1).reshape(w.shape[2], -1)))


def _mlp(path: tuple[str, ...], key: Callable[[str], tuple[str, ...]]) -> Iterator[_Entry]:
  """A GeGLU's gate and up [F, D] stack into gating_einsum [2, F, D]; down [D, F] is linear [F, D]."""
  for i, name in enumerate(("gate_proj", "up_proj")):
    yield _Entry(path + ("gating_einsum", str(i)), key(name + ".weight"), _identity, _identity)
  yield _Entry(path + ("linear",), key("down_proj.weight"), *_linear())
