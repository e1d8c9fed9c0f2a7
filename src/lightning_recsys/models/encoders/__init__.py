"""Sequence encoders: each a plain ``nn.Module`` in its own file, implementing ``lightning_recsys.contracts.SequenceEncoder``.

A model takes one as a factory (``encoder=``), by ``class_path`` in a config::

    encoder:
      class_path: lightning_recsys.models.encoders.SASRecEncoder
      init_args: {num_layers: 2, num_heads: 1, dropout: 0.2}

A new encoder is one file here plus its line in ``ENCODERS`` and ``__all__``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_recsys.contracts.encoder import EncoderFactory
from lightning_recsys.models.encoders.hstu import HSTUEncoder
from lightning_recsys.models.encoders.sasrec import SASRecBlock, SASRecEncoder
from lightning_recsys.models.encoders.transact import TransActEncoder

__all__ = ["ENCODERS", "HSTUEncoder", "SASRecBlock", "SASRecEncoder", "TransActEncoder", "declared_causal", "default_encoder_options", "encoder_kind", "resolve_encoder"]

# The encoders this package ships, by the short name the docs use.
ENCODERS: dict[str, type[nn.Module]] = {"hstu": HSTUEncoder, "sasrec": SASRecEncoder, "transact": TransActEncoder}


def _class_path(cls: type) -> str:
    """The path a config names a class by: the package's public one for the shipped encoders."""
    if cls in ENCODERS.values():
        return f"{__name__}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def declared_causal(factory: Any) -> bool | None:
    """Whether the encoders ``factory`` builds are causal, read from their class; None where the factory names no class."""
    found = _class_and_options(factory)
    return None if found is None else bool(getattr(found[0], "causal", False))


def encoder_kind(encoder: nn.Module) -> str:
    """An encoder's kind for a warm start (``contracts.warm_start.WarmStartPart.kind``): its class path."""
    return _class_path(type(encoder))


def _import_class(path: str, owner: str) -> type:
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"{owner}(encoder={{'class_path': {path!r}}}): no class there ({err}); name an encoder class, e.g. "
            f"{_class_path(SASRecEncoder)!r}."
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{owner}(encoder={{'class_path': {path!r}}}) names {cls!r}, not an nn.Module class.")
    return cls


def _is_module_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


def _class_and_options(factory: Any) -> tuple[type, dict[str, Any]] | None:
    """The class and keyword options of a factory that is a class or a ``functools.partial`` of one (also jsonargparse's)."""
    if isinstance(factory, type):
        return factory, {}
    if isinstance(factory, functools.partial):
        if _is_module_class(factory.func) and not factory.args:
            return factory.func, dict(factory.keywords)
        # jsonargparse's callable injection: partial(call_without_instantiate_context, instantiator, cls, **init_args)
        if factory.args and _is_module_class(factory.args[-1]):
            return factory.args[-1], dict(factory.keywords)
    return None


def resolve_encoder(encoder: Any, default: EncoderFactory, owner: str) -> tuple[EncoderFactory, Any]:
    """``(factory, what the model's hyperparameters record)`` for a model's ``encoder`` argument.

    ``encoder``: None (``default``), a factory (a class, a ``functools.partial`` of one, any callable
    ``(embedding_dim, max_length) -> SequenceEncoder``), or a config mapping ``{"class_path": ..., "init_args": {...}}``
    (what a checkpoint's hyperparameters hold). The record is that mapping where the factory is a class or a
    partial of one, so a checkpoint reloads with ``torch.load(weights_only=True)``; any other callable is recorded as itself.
    """
    if encoder is None:
        encoder = default
    if isinstance(encoder, Mapping) or hasattr(encoder, "class_path"):
        get = encoder.get if isinstance(encoder, Mapping) else (lambda key, fallback=None: getattr(encoder, key, fallback))
        path = get("class_path")
        if not isinstance(path, str):
            raise ValueError(f"{owner}(encoder={encoder!r}) must name a class_path (e.g. {_class_path(SASRecEncoder)!r}).")
        options = get("init_args") or {}
        options = dict(vars(options)) if not isinstance(options, Mapping) else dict(options)
        cls = _import_class(path, owner)
        return functools.partial(cls, **options), {"class_path": path, "init_args": options}
    if not callable(encoder):
        raise ValueError(
            f"{owner}(encoder={encoder!r}) must be an encoder class, a factory (embedding_dim, max_length) -> module, or "
            f"{{'class_path': ..., 'init_args': ...}}; e.g. {_class_path(SASRecEncoder)!r}."
        )
    found = _class_and_options(encoder)
    record = encoder if found is None else {"class_path": _class_path(found[0]), "init_args": found[1]}
    return encoder, record


def default_encoder_options(owner: str, encoder: object, **shorthand: Any) -> dict[str, Any]:
    """The default encoder's options given as the model's own arguments (``num_layers=...``); refused beside ``encoder``."""
    given = {name: value for name, value in shorthand.items() if value is not None}
    if given and encoder is not None:
        raise ValueError(
            f"{owner}: {', '.join(f'{k}={v!r}' for k, v in given.items())} set the default encoder's options, but encoder= "
            f"names the encoder: give them as its own options instead (encoder: {{class_path: ..., init_args: {given}}})."
        )
    return given
