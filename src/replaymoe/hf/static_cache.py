"""One static KV cache kept across ``generate(cache_implementation="static")`` calls.

transformers (5.x) makes a new ``StaticCache`` in every such ``generate`` call, and its tensors are
allocated lazily during the prefill. The decode step it compiles runs as CUDA graphs (inductor's
cudagraph trees), which take the cache tensors as static inputs: when a call's cache lands at other
addresses than the recorded one's, the tree records the step again (tens of ms, and another graph's
memory). Where the cache lands depends on what else the prefill allocated before it, so with
replaymoe's kernels in the prefill it moved in about half of the calls (docs/TUNING.md,
"Transformers integration"), and stock transformers was spared only by its allocation pattern.

:class:`StaticCacheKeeper` replaces the model's ``_prepare_static_cache`` (an instance attribute,
removed by :meth:`StaticCacheKeeper.uninstall`) so that a call that would make the same cache as the
previous one (same implementation, batch size, length, dtype and device) gets that cache back, reset
(zeroed, length 0: what a new cache holds), as transformers 4.x did with ``model._cache``. Anything
else goes to transformers' own method. A ``generate`` that returns the cache to its caller
(``return_dict_in_generate=True``) gives it away: :meth:`StaticCacheKeeper.release_if_returned`
forgets it, so no later call resets a cache the caller holds.

The keeper also knows the kept cache's length on the host. transformers 5.x counts a ``StaticCache``'s
tokens on the device (``cumulative_length``), so ``get_seq_length()`` is a 0-dim CUDA tensor once the
cache is initialised, and a forward that captures or replays would have to find its positions with
torch ops (and restart the capture batch on the device) in every decode step. The cache the keeper
hands out starts empty, and every eager forward of the decoder stack appends its ``S`` tokens, so
:meth:`StaticCacheKeeper.advance` counts them and :meth:`StaticCacheKeeper.host_length` gives the length
as a Python int: a decode step then continues its capture batch on the host, as with a dynamic cache. A
compiled forward cannot count on the host: it forgets the length (the device counter is used from then
on).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["StaticCacheKeeper"]

_REUSED = ("static",)  # the cache implementations kept (offloaded caches keep transformers' own path)


class StaticCacheKeeper:
    """Hands the previous ``generate`` call's static cache, reset, to the next call that needs an
    identical one.

    Made on a model, it installs itself as the model's ``_prepare_static_cache`` (an instance
    attribute) unless ``install`` is False, the model has no such method (another transformers
    version) or is an encoder-decoder; :attr:`installed` says which. The kept cache's memory stays
    allocated between calls until :meth:`release` (or :meth:`uninstall`).

    Parameters
    ----------
    model : nn.Module
        A transformers generation model.
    install : bool
        Whether to install at all.
    """

    def __init__(self, model: nn.Module, *, install: bool = True) -> None:
        self.model = model
        self.cache: Any = None  # the kept cache (None: none kept)
        self.key: tuple | None = None  # what the kept cache was made for
        self.reuses = 0  # calls served with the kept cache (a diagnostic)
        self.length: int | None = None  # tokens in the kept cache, counted on the host (None: unknown)
        self._make = getattr(model, "_prepare_static_cache", None)
        config = getattr(model, "config", None)
        self.installed = (
            install and self._make is not None and not getattr(config, "is_encoder_decoder", False)
        )
        if self.installed:
            model._prepare_static_cache = self.prepare

    def uninstall(self) -> None:
        """Restore transformers' method and drop the kept cache (idempotent)."""
        if self.installed and self.model.__dict__.get("_prepare_static_cache") == self.prepare:
            del self.model.__dict__["_prepare_static_cache"]
        self.installed = False
        self.release()

    def prepare(self, **kwargs: Any) -> Any:
        """The cache for this ``generate`` call: the kept one reset, when it was made for the same
        ``(cache_implementation, batch_size, length, dtype, device)``, else a new one from
        transformers (kept for the next call where its implementation is plain ``"static"``)."""
        impl = kwargs.get("cache_implementation")
        batch = kwargs.get("batch_size")
        length = kwargs.get("max_cache_len")
        if impl not in _REUSED or not isinstance(batch, int) or not isinstance(length, int):
            return self._make(**kwargs)
        # transformers sizes a static cache to at least the longest one made before (no recompiles)
        length = max(length, getattr(self.model, "_previous_max_cache_length", -1))
        key = (impl, batch, length, kwargs.get("prefill_chunk_size"), self.model.dtype, self.model.device)
        if self.cache is not None and key == self.key:
            self.cache.reset()
            self.model._previous_max_cache_length = length
            self.reuses += 1
            self.length = 0
            return self.cache
        self.cache = self.length = None  # the old one goes before the new one is made (no two at once)
        self.cache, self.key = self._make(**kwargs), key
        self.length = 0
        return self.cache

    def release(self) -> None:
        """Forget the kept cache: its memory is freed (unless someone else holds it), and the next
        static ``generate`` makes a new one."""
        self.cache = self.key = self.length = None

    def host_length(self, cache: Any) -> int | None:
        """Tokens in ``cache`` as a Python int when it is the kept cache and its length is known on
        the host (handed out empty by :meth:`prepare`, every forward since counted by :meth:`advance`),
        else None."""
        return self.length if cache is not None and cache is self.cache else None

    def advance(self, cache: Any, tokens: int | None) -> None:
        """A forward of the decoder stack appended ``tokens`` tokens to ``cache``: counted when it is
        the kept cache. ``None``: a forward whose count the host cannot keep (under ``torch.compile``,
        where a host count would be traced as a constant, or without a token tensor to count); the
        length is forgotten, and the cache's own device counter is used from then on."""
        if cache is None or cache is not self.cache:
            return
        if tokens is None:
            self.length = None
        elif self.length is not None:
            self.length += tokens

    def release_if_returned(self, output: Any) -> None:
        """Forget the kept cache when ``generate`` handed it to its caller in ``output``."""
        if self.cache is None:
            return
        # `past_key_values` before transformers 5.24, `cache` from 5.24 on
        returned = (getattr(output, "past_key_values", None), getattr(output, "cache", None))
        if any(c is self.cache for c in returned):
            self.release()
