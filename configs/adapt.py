r"""Adapt weights you have to block diffusion, in one command: a Gemma 4 causal LM, a DiffusionGemma (transformers
folders) or a training workdir becomes a DiffusionGemma trained with the block-diffusion loss plus the AR loss.

  python scripts/train.py --config=configs/adapt.py --config.model.init_from=FOLDER --workdir=W \
      [--config.train.lora_rank=16] [--config.model.canvas_length=64] [--config.train.time_budget_s=1800]

The model config comes from FOLDER (`build.init_from`: its dimensions, its tokenizer unless
`--config.data.tokenizer_path` names one); the `model` fields declared below (None: the folder's) override it.
A Gemma 4 starts as the DiffusionGemma whose causal encoder it is (`convert/gemma4.py`: the denoiser shares its
weights, its layer scalars are the encoder's, self-conditioning adds nothing until trained). Full fine-tuning by
default; `train.lora_rank` > 0 trains adapters on the frozen weights. The released noise (uniform), the AR loss
beside the diffusion loss so the encoder keeps what it knows; running the command again resumes exactly.
"""

from ml_collections.config_dict import placeholder

from diffusiongemma.build.config import base_config


def get_config(arg=None):
  del arg
  config = base_config()
  config.model.init_from = ""  # the weights to adapt (also config.train.init_from)
  # Settings that do not change the weights' shapes, None meaning the folder's (a Gemma 4: canvas 256).
  config.model.canvas_length = placeholder(int)
  config.model.max_positions = placeholder(int)
  config.model.sliding_window = placeholder(int)
  config.model.remat = placeholder(bool)
  config.model.moe_impl = placeholder(str)
  config.data.prompt_length = 64
  config.data.num_canvases = 2
  config.diffusion.noise = "uniform"
  config.diffusion.ar_loss_weight = 1.0
  config.diffusion.diffusion_loss_weight = 1.0
  config.train.num_steps = 1000
  config.train.batch_size = 16
  config.train.learning_rate = 3e-4  # fine-tuning: well below a from-scratch run's
  config.train.warmup_steps = 50
  config.train.eval_every = 200
  config.train.checkpoint_every = 200
  config.sampler.max_new_tokens = 128
  return config
