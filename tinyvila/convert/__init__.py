"""Checkpoint conversion: everything that builds tinyvila checkpoints (docs/checkpoint_format.md).

    python scripts/quantize.py --help          # the command line over these functions

detect.py tells source layouts apart; build.py is `import` (any source, as stored) and `build` (the
full W4A16 + W8A8 checkpoint); hf.py maps HF / VILA configs and weights into the runtime layout; vila.py
imports fp16/bf16 VILA folders; awq.py runs the AWQ search (or RTN) on a dense LLM; smoothquant.py makes W8A8 vision
checkpoints; awq_formats.py repacks published llm-awq v2 / AutoAWQ checkpoints; gguf.py dequantizes
llama GGUF files; dinov2.py imports the ONNX DINOv2-small; vision_checkpoint.py saves and loads
vision-only checkpoints (the DINOv2 import and its W8A8 versions). Random-weight checkpoints stay in
tinyvila.loader (`build_synthetic`), because the runtime builds its demo model on first use.
The runtime imports only detect.py, lazily and only from the error paths of loading (loader._read_config,
api.resolve_model), to name the command that converts a raw source; otherwise convert -> tinyvila only.
"""

from tinyvila.convert.awq import quantize_checkpoint
from tinyvila.convert.build import build_checkpoint, import_source
from tinyvila.convert.awq_formats import import_autoawq, import_awq_v2
from tinyvila.convert.dinov2 import import_dinov2
from tinyvila.convert.gguf import import_gguf
from tinyvila.convert.smoothquant import smoothquant_vision
from tinyvila.convert.vila import import_vila

__all__ = ["build_checkpoint", "import_autoawq", "import_awq_v2", "import_dinov2", "import_gguf", "import_source",
           "import_vila", "quantize_checkpoint", "smoothquant_vision"]
