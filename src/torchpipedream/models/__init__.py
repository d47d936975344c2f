"""Example models and a name → builder registry.

``get_model("cnn")`` builds a registry model with its defaults; ``get_model("pkg.mod:fn")``
imports ``pkg.mod`` and calls ``fn()``, which must return an ``nn.Module``. Importing this
package needs no scikit-learn: the digits ship inside torchpipedream (``torchpipedream/data``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from torch import nn

from .data import cross_entropy, digits_data, loss_fn, sample_input, text_data
from .hf import gpt2
from .language import VOCAB_SIZE, transformer
from .vision import cnn, mlp, resnet

__all__ = [
    "MODELS",
    "DEFAULT_MODEL",
    "get_model",
    "ModelError",
    "mlp",
    "cnn",
    "resnet",
    "transformer",
    "gpt2",
    "digits_data",
    "text_data",
    "sample_input",
    "loss_fn",
    "cross_entropy",
    "VOCAB_SIZE",
]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "cnn": cnn,
    "resnet": resnet,
    "transformer": transformer,
    "gpt2": gpt2,
}

DEFAULT_MODEL = "cnn"


class ModelError(ValueError):
    """A model name or ``module:function`` spec cannot be turned into an nn.Module."""


def get_model(name_or_spec: str, **kwargs: Any) -> nn.Module:
    """Build a registry model by name, or call a user's ``module:function`` (with ``kwargs``).

    Raises:
        ModelError: unknown name, module not importable, no such function, the call failed,
            or it did not return an ``nn.Module``. The message says which and what to do.
    """
    spec = str(name_or_spec).strip()
    if spec in MODELS:
        return MODELS[spec](**kwargs)
    if ":" not in spec:
        raise ModelError(
            f"unknown model {spec!r}: use one of {', '.join(MODELS)} or 'module:function' "
            "for your own (e.g. mypkg.models:build)"
        )
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise ModelError(f"model spec {spec!r}: expected 'module:function', e.g. mypkg.models:build")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # ImportError, or what the user's code raised (sys.exit too)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(
            f"model spec {spec!r}: cannot import module {module_name!r} ({first}); "
            "check it is on PYTHONPATH"
        ) from None
    obj: Any = module
    for part in func_name.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model spec {spec!r}: module {module_name!r} has no attribute {func_name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"model spec {spec!r}: {func_name!r} is not callable")
    try:
        model = obj(**kwargs)
    except (Exception, SystemExit) as exc:  # a sys.exit() in the user's code must not end the run silently
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(f"model spec {spec!r}: calling {func_name}() failed: {type(exc).__name__}: {first}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model spec {spec!r}: {func_name}() returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model
