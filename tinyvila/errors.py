"""Errors tinyvila raises for bad input: each names the file or argument at fault and what to do.

All derive from `TinyVilaError` so the CLI can print them plainly and exit non-zero, and embedding
code can catch one class. They also derive from the matching builtin (ValueError, FileNotFoundError)
so generic handlers keep working.
"""


class TinyVilaError(Exception):
    """Base class of tinyvila's user-facing errors."""


class CheckpointError(TinyVilaError, ValueError):
    """A checkpoint folder is missing, incomplete, corrupt, or does not match its config."""


class ModelNotFoundError(TinyVilaError, FileNotFoundError):
    """`--model NAME` resolved to no folder; the message lists where we looked and how to build one."""


class ImageError(TinyVilaError, ValueError):
    """An image could not be read or has the wrong shape or dtype."""


class ContextLimitError(TinyVilaError, ValueError):
    """A prompt or conversation does not fit the model's declared context; nothing was changed."""


class ConfigError(TinyVilaError, ValueError):
    """A model config value is missing, of the wrong type or out of range; the message names the field."""


class TokenizerError(CheckpointError):
    """A tokenizer file is missing, unreadable, or holds ids the model's vocabulary does not have."""


class DeviceError(TinyVilaError, ValueError):
    """A device string (`--device`, `device=`) names no device this machine has."""


class ArgumentError(TinyVilaError, ValueError):
    """An argument out of range; `name` is the parameter or field at fault (the CLI maps it to its flag)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


class ChatBusyError(TinyVilaError, RuntimeError):
    """A Chat was called from one thread while it streams an answer for another: a Chat serves one
    thread at a time (give each thread its own Chat)."""


class AnswerClosedError(TinyVilaError, RuntimeError):
    """An answer's stream was read after a later `ask()` or `clear()` of its chat ended it."""


class EvalModeError(TinyVilaError, ValueError):
    """Something evaluation mode cannot do (e.g. add images after the first round); the message says
    what to do instead."""


class VideoError(TinyVilaError, ValueError):
    """A video file, frame folder or stream could not be read (missing, not a video, no frame decodes,
    unreachable), or OpenCV is not installed; the message names the source and what to do."""
