"""The mutation check: deliberate one-line bugs in the core rules, each of which the suite must catch.

    python tests/mutations.py                 # every mutation (about 15 minutes on 2 busy cores)
    python tests/mutations.py --only softcap  # the mutations whose name contains "softcap"
    python tests/mutations.py --list          # the list, without running anything

For each mutation: copy the repository's files (tracked and untracked, not ignored) to a temporary folder,
replace the one line, run the tests that guard it there (`python -m pytest -x`, with the copy first on
PYTHONPATH) and record whether they fail. Before that, all the tests run once on an unmutated copy: a
mutation whose tests do not all pass without it is NOT RUN (it could not be caught meaningfully), one
whose line is no longer found exactly once is STALE (the code moved: update the list). Prints a Markdown table;
exits 1 if any mutation is missed or stale. Run by hand before a release, not in CI (docs/performance.md, "The
mutation check", has the last run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
  name: str
  path: str  # relative to the repository root
  old: str  # found exactly once in the file
  new: str
  tests: tuple[str, ...]  # pytest node ids that must fail


MUTATIONS = (
    Mutation("entropy bound off by one (the k-th entropy counted in its own sum)",
             "diffusiongemma/diffusion/acceptance.py",
             "selected = (cumulative - sorted_entropy <= self.bound) & sorted_eligible",
             "selected = (cumulative <= self.bound) & sorted_eligible",
             ("tests/test_sampling.py::test_entropy_bound_on_hand_written_entropies",
              "tests/test_sampling.py::test_entropy_bound_ties_and_eligibility",
              "tests/test_sampling.py::test_token_stats_and_acceptance_from_logits")),
    Mutation("acceptance ignoring the bound (every eligible position accepted)",
             "diffusiongemma/diffusion/acceptance.py",
             "selected = (cumulative - sorted_entropy <= self.bound) & sorted_eligible",
             "selected = (cumulative - sorted_entropy <= math.inf) & sorted_eligible",
             ("tests/test_sampling.py::test_entropy_bound_on_hand_written_entropies",
              "tests/test_sampling.py::test_token_stats_and_acceptance_from_logits")),
    Mutation("margin acceptance using the confidence",
             "diffusiongemma/diffusion/acceptance.py",
             "return _best_or_above(stats.margin, self.threshold, eligible)",
             "return _best_or_above(stats.confidence, self.threshold, eligible)",
             ("tests/test_sampling.py::test_margin_rule_on_hand_written_margins",)),
    Mutation("final logit softcap removed",
             "diffusiongemma/model/layers.py",
             "logits = softcap * jnp.tanh(logits / softcap)",
             "logits = logits",
             ("tests/test_model.py::test_final_logits_are_softcapped",
              "tests/test_convert_hf.py::test_logits_match_reference")),
    Mutation("rope base wrong (sliding layers rotate with the full layers' theta)",
             "diffusiongemma/model/attention.py",
             "self.inv_freq = layers.rope_inv_freq(head_dim, cfg.rope_theta)",
             "self.inv_freq = layers.rope_inv_freq(head_dim, cfg.full_rope_theta)",
             ("tests/test_convert_hf.py::test_logits_match_reference",)),
    Mutation("constraint restriction a no-op",
             "diffusiongemma/sampling/constrained.py",
             "restrict = lambda scaled, first: jnp.where(allowed, scaled, NEVER_LOGIT)",
             "restrict = lambda scaled, first: scaled",
             ("tests/test_constrained_sampling.py::"
              "test_each_step_keeps_statistics_draws_and_acceptance_inside_the_allowed_set",)),
    Mutation("infill not holding a given token",
             "diffusiongemma/sampling/steps.py",
             "rules.noise.initial_fixed(canvas) | given",
             "rules.noise.initial_fixed(canvas)",
             ("tests/test_constrained_sampling.py::test_infilling_holds_the_given_positions_in_every_step",
              "tests/test_sudoku.py::test_solve_counts_passes_and_checks_solutions")),
    Mutation("LoRA merge without its alpha / rank scale",  # was "writing into the base's tree": an equivalent
             "diffusiongemma/training/lora.py",              # mutant since merge's nn.unbox returns fresh containers
             "update = config.scale * delta(layout, adapter[\"lora_a\"], adapter[\"lora_b\"])",
             "update = delta(layout, adapter[\"lora_a\"], adapter[\"lora_b\"])",
             ("tests/test_finetuning.py::test_lora_training_freezes_the_base_and_optimizes_only_adapters",
              "tests/test_finetuning.py::test_merged_model_logits")),
    Mutation("held Sudoku clues noised in the loss",
             "diffusiongemma/diffusion/loss.py",
             "noisy, corrupted = jnp.where(held, clean, noisy), corrupted & ~held",
             "noisy, corrupted = noisy, corrupted & ~held",
             ("tests/test_finetuning.py::test_given_positions_are_held_clean_and_never_targets",)),
    Mutation("the sampler ignoring on_pass listeners' ids (events to the first listener registered)",
             "diffusiongemma/sampling/sampler.py",
             "listener = self._listeners.get(int(key))",
             "listener = next(iter(self._listeners.values()), None)",
             ("tests/test_sampling.py::test_on_pass_events_reach_only_their_own_listener",)),
    Mutation("transformers cross-checks skipped again (the hf guard a no-op)",
             "tests/hf_guard.py",
             "if not report.skipped or not hf_installed():",
             "if True:",
             ("tests/test_hf_guard.py::test_reference_import_skips_fail_when_the_extra_is_installed",)),
    Mutation("time budget counting only this process's training (a resumed run gets a fresh budget)",
             "diffusiongemma/training/loop.py",
             'stop = None if last else stop_rule.reason(step, clock.totals()["train_s"])',
             "stop = None if last else stop_rule.reason(step, clock.seconds())",
             ("tests/test_training.py::test_the_time_budget_counts_the_whole_run_across_resumes",)),
    Mutation("the Sudoku solver's warm-up run streaming to the caller (the demo draws every pass twice)",
             "projects/sudoku/solve.py",
             "stream = _ignore if warm_up and on_pass is not None else on_pass",
             "stream = on_pass",
             ("tests/test_sudoku.py::test_the_demo_draws_each_pass_once_within_a_screen",)),
    Mutation("lm-eval harness computing every checkpoint in bfloat16 by default",
             "diffusiongemma/build/harness.py",
             "dtype=checkpoint_dtype(folder) if auto else dtype,",
             'dtype="bfloat16" if auto else dtype,',
             ("tests/test_harness.py::test_loglikelihood_equals_transformers_and_an_off_by_one_boundary_fails",)),
    Mutation("conflict-marker check blind to '>>>>>>>'",
             "tests/test_conflict_markers.py",
             'MARKER = re.compile(rb"^(<{7}|\\|{7}|>{7})(?: |$)", re.M)',
             'MARKER = re.compile(rb"^(<{7}|\\|{7})(?: |$)", re.M)',
             ("tests/test_conflict_markers.py",)),
    Mutation("a Gemma 4's fresh self-conditioning left at its random output projection (changes the denoiser)",
             "diffusiongemma/convert/gemma4.py",
             'params[("mlp", "linear")] = np.zeros_like(params[("mlp", "linear")])',
             "pass",
             ("tests/test_convert_gemma4.py::test_what_gemma4_lacks_is_made_as_documented",)),
    Mutation("a Gemma 4 with KV sharing loaded without it",
             "diffusiongemma/convert/gemma4.py",
             "  if shared:",
             "  if False:",
             ("tests/test_convert_gemma4.py::test_a_feature_diffusiongemma_lacks_is_refused_naming_the_field",)),
    Mutation("a Gemma 4's bidirectional image attention loaded as DiffusionGemma's (other masks)",
             "diffusiongemma/convert/gemma4.py",
             "  if vision is not None and vision.bidirectional_attention:",
             "  if False:",
             ("tests/test_vision.py::test_vision_model_exports_as_gemma4_and_loads_back_with_its_tower",)),
    Mutation("README checker ignoring the written decimals",
             "tests/check_readme_numbers.py",
             "return math.isfinite(value) and abs(written - value) <= 0.5 * 10.0 ** -decimals * (1 + 1e-9) + 1e-12",
             "return math.isfinite(value) and abs(written - value) <= 0.5 * (1 + 1e-9) + 1e-12",
             ("tests/test_readme_numbers.py",)),
    Mutation("training order not shuffled (consecutive windows in a global batch)",
             "diffusiongemma/data/batching.py",
             "return np.array([grain.experimental.index_shuffle(int(k), max_index=self.num_items - 1,",
             "return np.array([int(k) + 0 * grain.experimental.index_shuffle(int(k), max_index=self.num_items - 1,",
             ("tests/test_data.py::test_a_global_shuffle_mixes_windows_from_all_over_the_corpus",)),
    Mutation("every process reading the first rows of a global batch",
             "diffusiongemma/data/batching.py",
             "start = step * self.global_batch_size + self.process_index * self.rows",
             "start = step * self.global_batch_size",
             ("tests/test_data.py::test_processes_read_their_rows_of_one_global_order",)),
    Mutation("a truncated shard accepted",
             "diffusiongemma/data/prepared.py",
             "if path.stat().length != size:",
             "if False:",
             ("tests/test_prepared_data.py::test_damaged_or_foreign_preparations_are_refused_naming_the_file",)),
    Mutation("a JSONL range re-reading the line cut at its start",
             "diffusiongemma/data/sources.py",
             '      if f.read(1) != b"\\n":',
             "      if False:",
             ("tests/test_prepared_data.py::test_every_source_kind_prepares_the_stream_that_reading_it_gives",)),
    Mutation("micro-batches normalised by their own counts (accumulation off by the batch split)",
             "diffusiongemma/training/step.py",
             "      return loss_lib.loss_terms(model, variables, rows, norms, loss_config)",
             "      return loss_lib.loss_terms(model, variables, rows, loss_lib.normalizers(rows, loss_config), loss_config)",
             ("tests/test_train_step.py::test_gradient_accumulation_is_the_whole_batch_update",)),
    Mutation("the released config training bfloat16 master weights",
             "diffusiongemma/build/tasks.py",
             '  return model_cfg if config.train.get("lora_rank", 0) else model_cfg.replace(param_dtype=dtype)',
             "  return model_cfg",
             ("tests/test_train_step.py::test_every_config_trains_float32_master_weights_and_moments",)),
    Mutation("a workdir loaded with a config that contradicts its saved one (LoRA rank not checked)",
             "diffusiongemma/build/weights.py",
             '  fields["train.lora_rank"] = rank',
             "  pass",
             ("tests/test_training.py::test_fine_tuning_from_a_workdir_full_and_lora",)),
    Mutation("the wait for a batch counted as the step's compute",
             "diffusiongemma/training/loop.py",
             "          meter.add(computed - waited, time.perf_counter() - computed)",
             "          meter.add(0.0, time.perf_counter() - waited)",
             ("tests/test_training.py::test_step_accounting_splits_the_wall_time_and_a_profile_covers_its_steps",)),
    Mutation("every canvas's denoiser pass counted once per step though only one is graded",
             "diffusiongemma/model/flops.py",
             "  share = 1.0 if all_canvases else 1.0 / num_canvases",
             "  share = 1.0",
             ("tests/test_train_step.py::test_the_analytic_flops_of_a_step_are_what_xla_counts",)),
    Mutation("a run's tokenizer replaced by another file without a word",
             "diffusiongemma/build/weights.py",
             "  if ours != theirs and _files.present(ours) and _files.present(theirs) and (",
             "  if False and (",
             ("tests/test_cli.py::test_released_weights_load_as_a_workdir_with_their_own_tokenizer",)),
    Mutation("a mistyped --config override as a traceback",
             "diffusiongemma/build/cli.py",
             "    except (KeyError, AttributeError) as error:",
             "    except ZeroDivisionError as error:",
             ("tests/test_cli.py::test_config_takes_a_saved_config_json_and_names_a_mistyped_override",)),
    Mutation("a bug inside a config file's get_config reported as an override naming no field",
             "diffusiongemma/build/cli.py",
             "        except (AttributeError, KeyError, NameError, ImportError, SyntaxError) as error:",
             "        except ZeroDivisionError as error:",
             ("tests/test_cli.py::test_config_takes_a_saved_config_json_and_names_a_mistyped_override",)),
    Mutation("convert.py exporting a LoRA workdir's checkpoint without merging its adapters",
             "scripts/convert.py",
             "    cfg, variables = weights.model_config, weights.variables",
             "    cfg, variables = weights.model_config, training.load_params(source_path)[0]",
             ("tests/test_adapt.py::test_adapt_with_lora_keeps_the_gemma4_weights_frozen",)),
    Mutation("the training plan keeping Adam's first moment in the master dtype whatever mu_dtype says",
             "diffusiongemma/build/plan.py",
             '    plan["optimizer_state"] = elements * (jnp.dtype(mu_dtype or cfg.param_dtype).itemsize + master)',
             '    plan["optimizer_state"] = elements * 2 * master',
             ("tests/test_parallel.py::test_the_training_plan_reads_the_precision_remat_accumulation_and_objective_"
              "of_the_config",)),
    Mutation("the server's default prompt limit a flat 1024 whatever the model's context",
             "diffusiongemma/serving/engine.py",
             "             and max_prompt_tokens * PROMPT_BUCKET_GROWTH + reply <= self.config.max_positions):",
             "             and True):",
             ("tests/test_serving_engine.py::test_the_default_prompt_limit_fits_the_models_context",)),
    Mutation("a text tokenizer in a checkpoint folder without its own bos/eos/pad",
             "diffusiongemma/data/hf_tokenizer.py",
             "      if token_id is None and name not in configured and (own := self._backend.role_id(name)) is not "
             "None:",
             "      if False:",
             ("tests/test_cli.py::test_a_text_tokenizer_in_a_checkpoint_folder_completes_text_and_cannot_chat",)),
    Mutation("the server's default reply not shrunk to the model's context",
             "diffusiongemma/serving/engine.py",
             "      while max_tokens > self.canvas and (self.canvas_bucket(max_tokens) * self.canvas",
             "      while False and (self.canvas_bucket(max_tokens) * self.canvas",
             ("tests/test_serving_engine.py::test_the_default_prompt_limit_fits_the_models_context",)),
    Mutation("speculative sampling accepting a draft with probability min(1, q / p)",
             "diffusiongemma/sampling/speculative.py",
             "ratio = at(log_p[:, :-1], block[:, 1:]) - at(log_q[:, 1:], block[:, 1:])  # log p(x) / q(x) per draft",
             "ratio = at(log_q[:, 1:], block[:, 1:]) - at(log_p[:, :-1], block[:, 1:])",
             ("tests/test_sampling.py::test_self_speculative_sampling_is_distributed_as_ar_sampling",)),
    Mutation("speculative sampling drawing a rejected draft's replacement from p, not the residual",
             "diffusiongemma/sampling/speculative.py",
             "residual = jnp.maximum(p - q, 0.0)  # where the first draft was rejected (none: p, the bonus token)",
             "residual = p",
             ("tests/test_sampling.py::test_self_speculative_sampling_is_distributed_as_ar_sampling",)),
    Mutation("speculative sampling's drafts always accepted (the denoiser's distribution)",
             "diffusiongemma/sampling/speculative.py",
             "accepted = jnp.cumprod(jnp.log(uniform) < ratio, axis=1).sum(1)  # each with probability min(1, p / q)",
             "accepted = jnp.cumprod(jnp.log(uniform) < jnp.inf, axis=1).sum(1)",
             ("tests/test_sampling.py::test_self_speculative_sampling_is_distributed_as_ar_sampling",)),
)


def repository_files(root: pathlib.Path) -> list[str]:
  """Tracked and untracked-but-not-ignored files (what a clean clone plus your edits holds)."""
  out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                       capture_output=True, text=True).stdout
  return [f for f in out.split("\0") if f and (root / f).is_file()]


def copy_repository(root: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
  for name in repository_files(root):
    (target / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / name, target / name)
  return target


def apply(mutation: Mutation, copy: pathlib.Path) -> bool:
  """Applies `mutation` to the copy; False (nothing changed) when its line is not found exactly once."""
  path = copy / mutation.path
  text = path.read_text()
  if text.count(mutation.old) != 1:
    return False
  path.write_text(text.replace(mutation.old, mutation.new))
  return True


def run_tests(copy: pathlib.Path, tests, cache: pathlib.Path, timeout: float, *options) -> tuple[int, str]:
  """(pytest's exit code, its output) for `tests` in `copy`; 124 when it timed out."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]),
             JAX_COMPILATION_CACHE_DIR=str(cache))
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, *tests]
  try:
    result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout,
                            check=False)
  except subprocess.TimeoutExpired:
    return 124, "timed out"
  return result.returncode, result.stdout


def tail(output: str) -> str:
  lines = [line for line in output.splitlines() if line.strip()]
  return " / ".join(lines[-2:])[-300:]


def failing_guards(mutation: Mutation, baseline_output: str) -> list[str]:
  """The mutation's tests that did not pass on the unmutated copy (`-rA` summary lines)."""
  outcomes = [line.split(" ", 2)[:2] for line in baseline_output.splitlines()
              if line.startswith(("PASSED ", "FAILED ", "ERROR ", "SKIPPED "))]
  return [test for test in mutation.tests
          if not any(node.startswith(test) for outcome, node in outcomes if outcome == "PASSED")
          or any(node.startswith(test) for outcome, node in outcomes if outcome != "PASSED")]


def verdict(code: int) -> str:
  return {0: "MISSED", 1: "caught"}.get(code, f"error (pytest exit {code})")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", default="", help="run the mutations whose name contains this")
  parser.add_argument("--list", action="store_true", help="print the mutations and exit")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
  args = parser.parse_args(argv)
  chosen = [m for m in MUTATIONS if args.only in m.name]
  if args.list:
    for m in chosen:
      print(f"{m.name}: {m.path}\n  - {m.old}\n  + {m.new}\n  tests: {' '.join(m.tests)}")
    return 0
  rows, bad = [], 0
  with tempfile.TemporaryDirectory(prefix="dg_mutations_") as tmp:
    tmp = pathlib.Path(tmp)
    cache = tmp / "compilation_cache"
    baseline = copy_repository(ROOT, tmp / "baseline")
    tests = sorted({t for m in chosen for t in m.tests})
    _, baseline_output = run_tests(baseline, tests, cache, args.timeout * 2, "-rA")
    for mutation in chosen:
      copy = tmp / "mutant"
      shutil.rmtree(copy, ignore_errors=True)
      copy_repository(ROOT, copy)
      start = time.monotonic()
      output = ""
      if failing := failing_guards(mutation, baseline_output):
        result = f"NOT RUN: {', '.join(t.split('::')[-1] for t in failing)} fails unmutated"
      elif not apply(mutation, copy):
        result = "STALE (line not found once)"
      else:
        code, output = run_tests(copy, mutation.tests, cache, args.timeout, "-x")
        result = verdict(code)
      bad += result != "caught"
      rows.append((mutation, result))
      print(f"{result}  {mutation.name}  ({time.monotonic() - start:.0f} s)  {tail(output)}", flush=True)
  print("\n| mutation | file | guarded by | result |\n|---|---|---|---|")
  for mutation, result in rows:
    guards = ", ".join(f"`{t.split('::')[-1]}`" for t in mutation.tests)
    print(f"| {mutation.name} | `{mutation.path}` | {guards} | {result} |")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
