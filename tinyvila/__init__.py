"""tinyvila: a standalone inference runtime for quantized VILA vision-language models.

    import tinyvila
    vlm = tinyvila.load("vila-8b-awq", device="cuda")
    chat = vlm.chat()
    chat.add_image("x.jpg")
    for piece in chat.ask("What is in the image?"):
        print(piece, end="")

See README.md and docs/ for the design and the measured results.
"""

from .api import Answer, Chat, Model, Stats, load
from .config import PRESETS, SparsityConfig, VLMConfig
from .errors import (AnswerClosedError, ArgumentError, ChatBusyError, CheckpointError, ConfigError, ContextLimitError,
                     DeviceError, EvalModeError, ImageError, ModelNotFoundError, TinyVilaError, TokenizerError, VideoError)
from .generate import SamplingParams
from .live import LiveSession
from .options import Options
from .video import Video, read_video

Sparsity = SparsityConfig

__all__ = [
    "load", "Model", "Chat", "Answer", "Stats", "LiveSession", "read_video", "Video", "SamplingParams", "Options",
    "Sparsity", "SparsityConfig", "VLMConfig", "PRESETS",
    "TinyVilaError", "CheckpointError", "ModelNotFoundError", "ImageError", "ContextLimitError",
    "ArgumentError", "ChatBusyError", "AnswerClosedError", "EvalModeError", "ConfigError", "TokenizerError", "DeviceError",
    "VideoError",
]
