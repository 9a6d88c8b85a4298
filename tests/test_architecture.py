"""The layout's promises: one way down (no import cycle, `build` imported by nobody in the package), a lazy
public API, and every registered component selectable, with its parameters, from command-line flags."""

import dataclasses
import json
import pathlib
import subprocess
import sys

from absl import flags
from ml_collections import config_flags
import ml_collections
import pytest

import diffusiongemma as dg
from diffusiongemma.build import registry
import import_layers

ROOT = pathlib.Path(__file__).parent.parent


def test_the_package_imports_one_way_down():
  graph = import_layers.import_graph(ROOT, "diffusiongemma")
  assert set(graph) - {""} <= set(import_layers.LAYERS), sorted(graph)
  assert import_layers.violations(graph) == []
  assert not any("build" in targets for unit, targets in graph.items() if unit != "build")


def test_the_tree_imports_one_way_down_and_no_module_is_in_a_cycle():
  """Around the package too: a project imports only the package (never benchmarks/ or another project),
  benchmarks/ the package and projects, and so on up (`import_layers.AREAS`); no two modules anywhere in the
  tree import each other, directly or around a loop (e.g. convert/hf.py and convert/vision.py)."""
  graph = import_layers.area_graph(ROOT)
  assert {"projects.sudoku", "benchmarks", "scripts", "tests"} <= set(graph), sorted(graph)
  assert import_layers.area_violations(graph) == []
  modules = import_layers.module_graph(ROOT, list(import_layers.AREAS))
  assert "diffusiongemma.convert.layout" in modules["diffusiongemma.convert.vision"]
  assert import_layers.cycles(modules) == []


def test_the_tree_checker_catches_an_upward_import_and_a_module_cycle(tmp_path):
  for folder, text in (("diffusiongemma/convert/hf.py", "from diffusiongemma.convert import vision\n"),
                       ("diffusiongemma/convert/vision.py", "def f():\n  from diffusiongemma.convert.hf import g\n"),
                       ("projects/sudoku/report.py", "from benchmarks import measure\n"),
                       ("projects/text/demo.py", "from projects.sudoku import report\n"),
                       ("benchmarks/measure.py", "import diffusiongemma.convert.hf\n"),
                       ("colabs/a.ipynb", json.dumps({"cells": [{"cell_type": "code", "source": [
                           "!pip install x\n", "from projects.text import demo"]}]}))):
    (tmp_path / folder).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / folder).write_text(text)
  graph = import_layers.area_graph(tmp_path)
  assert graph == {"projects.sudoku": {"benchmarks"}, "projects.text": {"projects.sudoku"},
                   "benchmarks": {"diffusiongemma"}, "colabs": {"projects.text"}}
  assert import_layers.area_violations(graph) == ["projects.sudoku (rank 1) imports benchmarks (rank 2)",
                                                  "projects.text (rank 1) imports projects.sudoku (rank 1)"]
  assert import_layers.cycles(import_layers.module_graph(tmp_path, list(import_layers.AREAS))) == [
      ["diffusiongemma.convert.hf", "diffusiongemma.convert.vision", "diffusiongemma.convert.hf"]]


def test_the_checker_catches_a_cycle_through_a_function_local_import(tmp_path):
  package = tmp_path / "pkg"
  for unit in ("model", "sampling"):
    (package / unit).mkdir(parents=True)
    (package / unit / "__init__.py").write_text("")
  (package / "__init__.py").write_text("")
  (package / "model" / "core.py").write_text("def f():\n  from pkg.sampling import loop\n  return loop\n")
  (package / "sampling" / "loop.py").write_text("from pkg import model\n")
  graph = import_layers.import_graph(tmp_path, "pkg")
  assert graph == {"model": {"sampling"}, "sampling": {"model"}}
  found = import_layers.violations(graph)
  assert "model (layer 1) imports sampling (layer 4)" in found
  assert any(v.startswith("cycle: model -> sampling -> model") for v in found)


def test_importing_the_package_loads_nothing_heavy():
  code = ("import sys, diffusiongemma as dg; heavy = {'jax', 'orbax', 'grain', 'PIL', 'sentencepiece', 'flax'};"
          "loaded = lambda: sorted({m.split('.')[0] for m in sys.modules} & heavy); print(loaded());"
          "dg.DiffusionGemma; print(loaded())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
  assert out[0] == "[]"
  assert out[1] == "['flax', 'jax']"  # the model needs JAX and Flax, not checkpoints, data or images


def _config_from_flags(*overrides):
  """`--config=configs/tiny.py` with overrides, parsed by absl as every binary parses them (the config flag
  reads its overrides from sys.argv)."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True)
  argv = ["binary", f"--config={ROOT / 'configs' / 'tiny.py'}", *overrides]
  saved, sys.argv = sys.argv, argv
  try:
    values(argv)
  finally:
    sys.argv = saved
  return values.config


@pytest.mark.parametrize("kind,name", [(kind, name) for kind, table in registry.SAMPLER_COMPONENTS.items()
                                       for name in table])
def test_every_registered_component_is_chosen_and_tuned_from_flags(kind, name):
  entry = registry.SAMPLER_COMPONENTS[kind][name]
  overrides = [f"--config.sampler.{kind}={name}"]
  expected = {}
  for key, arg in entry.params.items():  # a non-default value for every parameter, set from a flag
    default = entry.defaults()[key]
    value = default + 1 if isinstance(default, int) else round(default * 0.5 + 0.25, 4)
    overrides.append(f"--config.sampler.{key}={value}")
    expected[arg] = value
  sampler = dg.build.sampler(_config_from_flags(*overrides))
  component = getattr(sampler, kind)
  assert component == entry.make(**expected)
  assert repr(component) in sampler.settings().values()


def test_unknown_component_names_and_keys_are_clear_errors():
  with pytest.raises(ValueError, match=r"Unknown config.sampler.acceptance 'greedy'; expected one of \('entropy'"):
    dg.build.sampler(_config_from_flags("--config.sampler.acceptance=greedy"))
  config = _config_from_flags()
  with config.unlocked():
    config.sampler.entropy_bund = 0.1
  with pytest.raises(ValueError, match=r"Unknown config.sampler fields \['entropy_bund'\]"):
    dg.build.sampler(config)
  with pytest.raises(ValueError, match=r"config.sampler.margin_accept=1.5: Margin.threshold=1.5 is invalid"):
    dg.build.sampler(_config_from_flags("--config.sampler.acceptance=margin", "--config.sampler.margin_accept=1.5"))
  with pytest.raises(ValueError, match="Unknown config.diffusion.noise 'gaussian'"):
    dg.build.sampler(_config_from_flags("--config.diffusion.noise=gaussian"))


def test_the_base_config_declares_every_component_key_and_sampler_field():
  section = dg.build.config.base_config().sampler
  for kind, table in registry.SAMPLER_COMPONENTS.items():
    assert section[kind] == registry.RELEASED[kind]
    for entry in table.values():
      for key, default in entry.defaults().items():
        assert section[key] == default, key
  for field in dataclasses.fields(dg.SamplerConfig):
    assert field.name in section or field.default is None, field.name


def test_the_model_config_carries_the_trained_noise_to_every_sampler():
  config = _config_from_flags("--config.diffusion.noise=masked", "--config.diffusion.mask_token_id=7")
  assert dg.build.model_config(config).noise == "masked"
  sampler = dg.build.sampler(config)
  assert sampler.noise == dg.diffusion.MaskedNoise(config.model.vocab_size, 7)
  assert dg.build.loss(config).noise == sampler.noise
  plain = dg.Sampler(dg.DiffusionGemma(dg.build.model_config(config)))  # no noise given: the model's own
  assert plain.noise == sampler.noise
  # a model section written from a ModelConfig (with its noise) reads back; alone, or agreeing with
  # config.diffusion; a contradiction is refused by name
  cfg = dg.build.model_config(config)
  assert dg.build.model_config(ml_collections.ConfigDict({"model": cfg.to_dict()})) == cfg
  with config.unlocked():
    config.model.noise, config.model.mask_token_id = "masked", 7
  assert dg.build.model_config(config) == cfg
  config.model.mask_token_id = 8
  with pytest.raises(ValueError, match="config.model.mask_token_id=8 contradicts config.diffusion.mask_token_id=7"):
    dg.build.model_config(config)
