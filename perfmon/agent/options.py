"""A ``generate()`` call's generation options, as transformers' ``generate()`` resolves them: the call's keyword first,
then its generation config's (``config_of``). ``decoding.GenerateCall`` reads those that decide its requests and its
tap; ``untimed_options`` those an untimed call (``LateCall``, quiet decoding) is decided by, on the request thread."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CALL_OPTIONS", "CUT_OPTIONS", "chunked_prefill", "config_of", "options", "untimed_options", "verifies"]


def config_of(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The generation config a ``generate()`` call runs with: its ``generation_config=``, a config passed second, or
    the model's own."""
    cfg = kwargs.get("generation_config")
    if cfg is None and len(args) > 1 and hasattr(args[1], "num_beams"):
        cfg = args[1]
    if cfg is None:  # the model's own: read in its __dict__ (where nn.Module keeps a plain attribute), no class walk
        own = getattr(model, "__dict__", None)
        cfg = own.get("generation_config") if type(own) is dict else None
    return cfg if cfg is not None else getattr(model, "generation_config", None)


#: The generation options every GenerateCall reads (``options``), in its order: what decides its requests and its tap.
CALL_OPTIONS = ("num_beams", "num_return_sequences", "prompt_lookup_num_tokens", "assistant_early_exit")
#: ... and those only a call whose rows are cut at their EOS reads (several rows, or beam search).
CUT_OPTIONS = ("eos_token_id", "pad_token_id", "stop_strings")


def options(kwargs: Mapping[str, Any], cfg: Any, keys: tuple[str, ...]) -> list[Any]:
    """The generation options ``keys`` as generate() resolves them: the call's keyword first, then the
    config's (None where neither sets one). A GenerationConfig keeps its options in its ``__dict__``: read there,
    each costs one dict lookup instead of an attribute lookup through the class."""
    own = getattr(cfg, "__dict__", None)
    if not isinstance(own, dict):
        own = {}
    out = []
    for key in keys:
        value = kwargs.get(key)
        if value is None:
            value = own.get(key)
            if value is None and cfg is not None and key not in own:
                value = getattr(cfg, key, None)
        out.append(value)
    return out


#: What a call that may time nothing reads before it runs (``untimed_options``): whether it is assisted, then what
#: quiet decoding keys it by (quiet.py).
_UNTIMED_OPTIONS = ("prompt_lookup_num_tokens", "assistant_early_exit", "num_beams", "num_return_sequences",
                    "cache_implementation", "use_cache")


def untimed_options(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any] | None:
    """None for an assisted call (an assistant model, prompt lookup, early exit: its main model's forwards after the
    first verify drafts); else its ``num_beams``, ``num_return_sequences``, ``cache_implementation`` and ``use_cache``
    as generate() resolves them (None where unset): one read of the call's config for both.

    The common call (its config its own ``generation_config=`` or the model's, every option an attribute of that
    config's own) is read in this one frame, each option a dict lookup, the ones the call sets first: on the request
    thread, between two model calls, each function entered costs ~1 µs in situ (stamped: 9.1 -> 5.8 µs against the
    loop of ``options``). Any other call takes that loop (``_untimed_slow``)."""
    get = kwargs.get
    cfg = get("generation_config")
    if cfg is None and len(args) < 2:  # a config passed second is the slow path's (config_of)
        own = getattr(model, "__dict__", None)
        cfg = own.get("generation_config") if type(own) is dict else None
    own = getattr(cfg, "__dict__", None)
    if type(own) is not dict:
        return _untimed_slow(model, args, kwargs)
    read = own.get
    # Unrolled: the same five reads in a loop over _UNTIMED_OPTIONS cost ~1.7 µs more in situ (stamped: 6.9 against
    # 5.1 µs), the loop's own objects being first touches too.
    lookup = get("prompt_lookup_num_tokens")
    if lookup is None:
        lookup = read("prompt_lookup_num_tokens", _UNSET)
    early_exit = get("assistant_early_exit")
    if early_exit is None:
        early_exit = read("assistant_early_exit", _UNSET)
    beams = get("num_beams")
    if beams is None:
        beams = read("num_beams", _UNSET)
    k = get("num_return_sequences")
    if k is None:
        k = read("num_return_sequences", _UNSET)
    implementation = get("cache_implementation")
    if implementation is None:
        implementation = read("cache_implementation", _UNSET)
    use_cache = get("use_cache")
    if use_cache is None:
        use_cache = read("use_cache", _UNSET)
    if (lookup is _UNSET or early_exit is _UNSET or beams is _UNSET or k is _UNSET or implementation is _UNSET
            or use_cache is _UNSET):  # one the config's class holds, not the config: the loop reads it there
        return _untimed_slow(model, args, kwargs)
    if lookup is not None or early_exit is not None or get("assistant_model") is not None:
        return None
    return [beams, k, implementation, use_cache]


#: An option the config's own ``__dict__`` does not hold (``untimed_options``).
_UNSET: Any = object()


def _untimed_slow(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any] | None:
    """``untimed_options`` for any call: ``options`` over the config ``config_of`` finds."""
    lookup, early_exit, *rest = options(kwargs, config_of(model, args, kwargs), _UNTIMED_OPTIONS)
    return None if verifies(kwargs, lookup, early_exit) else rest


def chunked_prefill(model: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a call's prefill may run in chunks (``prefill_chunk_size``, the call's or its config's): several
    forwards, each of a part of the prompt."""
    return options(kwargs, config_of(model, args, kwargs), ("prefill_chunk_size",))[0] is not None


def verifies(kwargs: Mapping[str, Any], lookup: Any, early_exit: Any) -> bool:
    """Whether a call is assisted (its main model's forwards after the first verify drafts): an assistant model, or
    prompt lookup (``lookup``) or early exit (``early_exit``) set."""
    return kwargs.get("assistant_model") is not None or lookup is not None or early_exit is not None
