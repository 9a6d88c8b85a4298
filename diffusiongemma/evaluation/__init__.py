"""Evaluations of samplers: the generative quality of samples (`evaluation.generative`), imported on its
own since it loads data and samplers. Training's own validation pass is `training.validation`."""
