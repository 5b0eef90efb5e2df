"""Errors a user can act on.

Every error Sluice raises on bad input is a ``SluiceError`` subclass whose message
says what is wrong, where (file, tensor, layer, expert) and what to do about it.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base class of all errors Sluice raises on purpose."""


class CheckpointError(SluiceError, ValueError):
    """A model directory or container is missing, malformed or inconsistent."""


class UnsupportedModelError(SluiceError, ValueError):
    """The model family or one of its config options is not supported."""


class ConfigError(CheckpointError, UnsupportedModelError):
    """A config.json value is of the wrong type or out of range (the message names the key and value)."""


class ChatTemplateError(CheckpointError):
    """The model's chat template does not parse or fails to render."""


class InvalidArgumentError(SluiceError, ValueError):
    """An argument of the API or a command-line flag is invalid (the message names it and its value)."""


class UnknownOptionError(InvalidArgumentError, TypeError):
    """``load()`` was given an option it does not know."""


class BudgetError(SluiceError, ValueError):
    """The memory budget is below the floor the model needs."""


class ExpertReadError(SluiceError, OSError):
    """Reading an expert's bytes from storage failed (I/O error, short read, bad CRC)."""


class ConvertError(SluiceError, OSError):
    """``sluice convert`` refused its output path or could not write it (nothing was deleted)."""


class GenerationCancelled(SluiceError):
    """A generation was cancelled by its caller."""


def shown(value) -> str:
    """``repr(value)`` cut to 80 characters, for error messages that quote a bad value."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe_panic(exc: BaseException) -> str:
    """One line for a ``BaseException`` that is not an ``Exception`` and not an interrupt or exit:
    in practice a native library's panic (pyo3's ``PanicException``, raised by Rust extensions such
    as ``tokenizers`` or ``safetensors`` when they hit a bug or a hostile input)."""
    kind = type(exc)
    name = kind.__name__ if kind.__module__ in ("builtins", None) else f"{kind.__module__}.{kind.__name__}"
    text = " ".join(str(exc).split())  # a panic message can span lines
    if len(text) > 300:
        text = text[:297] + "..."
    return (f"a native library failed ({name}: {text or 'no message'}); the input may be malformed, or the "
            "library has a bug: rerun with --debug for the traceback")
