"""Evaluations of samplers: the generative quality of samples (`evaluation.generative`) and
lm-evaluation-harness requests (`evaluation.harness`, with the exact and bounded likelihoods of
`evaluation.likelihood`; the harness's registered model class is `build/harness.py`). Each is imported on
its own, since they load data and samplers. Training's own validation pass is `training.validation`."""
