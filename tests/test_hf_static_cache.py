"""The static KV cache kept across ``generate(cache_implementation="static")`` calls (CPU, tiny model).

A reused cache must generate exactly what a new one does (it is reset), the same cache object and
tensors must come back while the call shape stays, and a cache handed to the caller is never reset
under them. The GPU reason for all this (cudagraph trees re-recording the decode step when the cache
moves) is measured by ``replaymoe bench hf``, not here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import replaymoe.hf as rhf  # noqa: E402
from replaymoe.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(model, ids, new=4, **kw):
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation="static",
            **kw,
        )


class _CacheSpy:
    """Records the cache object and its first layer's key tensor address at every forward."""

    def __init__(self, model):
        self.seen = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        cache = kwargs.get("cache") if cache is None else cache  # transformers >= 5.24's name
        layer = cache.layers[0]
        self.seen.append((cache, layer.keys.data_ptr() if layer.is_initialized else None))


def test_kept_cache_generates_what_a_new_cache_does(generator):
    stock = build_model("qwen3_moe", "tiny", seed=0)
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, backend="torch", experts=False)  # the same routing math as stock
    spy = _CacheSpy(model)
    vocab = model.config.vocab_size
    first = torch.randint(3, vocab, (2, 7), generator=generator)
    second = torch.randint(3, vocab, (2, 7), generator=generator)  # same shape: the cache is reused
    try:
        got = [_generate(model, first), _generate(model, second), _generate(model, first)]
        want = [_generate(stock, first), _generate(stock, second), _generate(stock, first)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        caches = {id(c) for c, _ in spy.seen}
        ptrs = {p for _, p in spy.seen if p is not None}
        assert len(caches) == 1 and len(ptrs) == 1  # one cache object, its tensors never moved
        assert moe._engine.patch.static_cache.reuses == 2
    finally:
        spy.handle.remove()
        moe.disable()


@pytest.mark.parametrize(
    "change",
    [
        "batch",  # another batch size: a new cache
        "length",  # a longer generate: a new, longer cache (transformers then keeps that length)
    ],
)
def test_other_call_shape_gets_a_new_cache(change, generator):
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, backend="torch", experts=False)
    spy = _CacheSpy(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=generator)
    try:
        _generate(model, ids)
        if change == "batch":
            _generate(model, ids[:1])
        else:
            _generate(model, ids, new=9)
        first, last = spy.seen[0][0], spy.seen[-1][0]
        assert first is not last and moe._engine.patch.static_cache.cache is last
        assert moe._engine.patch.static_cache.reuses == 0
    finally:
        spy.handle.remove()
        moe.disable()


def test_returned_cache_is_not_reset_by_a_later_call(generator):
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, backend="torch", experts=False)
    ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=generator)
    try:
        out = _generate(model, ids, return_dict_in_generate=True)
        held = out.past_key_values
        length = int(held.get_seq_length())
        keys = held.layers[0].keys.clone()
        assert moe._engine.patch.static_cache.cache is None  # given away with the output
        _generate(model, ids)
        assert int(held.get_seq_length()) == length  # the caller's cache is untouched
        torch.testing.assert_close(held.layers[0].keys, keys, rtol=0, atol=0)
    finally:
        moe.disable()


def test_disable_restores_transformers_method():
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, backend="torch", experts=False)
    assert "_prepare_static_cache" in model.__dict__
    moe.disable()
    assert "_prepare_static_cache" not in model.__dict__
    assert model._prepare_static_cache.__func__ is type(model)._prepare_static_cache


def test_capture_through_kept_cache_equals_fresh_caches(generator):
    # capture's batch start reads the cache's (device) length: a reset cache must read as empty
    kept = build_model("qwen3_moe", "tiny", seed=0)
    fresh = build_model("qwen3_moe", "tiny", seed=0)
    vocab = kept.config.vocab_size
    prompts = [torch.randint(3, vocab, (2, 6), generator=generator) for _ in range(3)]
    runs = []
    for model, keep in ((kept, True), (fresh, False)):
        moe = rhf.enable(model, backend="torch", capture=True, max_batch_size=2, max_positions=16)
        if not keep:
            moe._engine.patch.static_cache.uninstall()
        try:
            traces = []
            for ids in prompts:
                _generate(model, ids)
                traces += moe.traces()
            runs.append(traces)
            assert moe._engine.patch.static_cache.reuses == (2 if keep else 0)
        finally:
            moe.disable()
    assert len(runs[0]) == len(runs[1]) == 6
    for a, b in zip(*runs):
        assert a.num_tokens == b.num_tokens == 6 + 4 - 1
        np.testing.assert_array_equal(a.ids, b.ids)


@pytest.mark.parametrize(
    "backend",
    [
        "torch",  # the torch routers and step path
        pytest.param("triton", marks=pytest.mark.interpret),  # the Triton routers (interpreter)
    ],
)
def test_kept_cache_length_is_counted_on_the_host(backend, generator, monkeypatch):
    # transformers counts a StaticCache's length on the device: the keeper counts it on the host, so
    # a capturing decode step does not restart the capture batch on the device (a pass over the
    # whole buffer per step), and its traces are a dynamic cache's
    from replaymoe.hf.state import CaptureBuffer

    model = build_model("qwen3_moe", "tiny", seed=0)
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=generator)
    restarts = []
    monkeypatch.setattr(CaptureBuffer, "restart_if", lambda self, is_new: restarts.append(is_new))
    moe = rhf.enable(model, backend=backend, capture=True, max_batch_size=2, max_positions=16)
    try:
        keeper = moe._engine.patch.static_cache
        traces = []
        for _ in range(2):  # a new cache, then the kept one reset (a device length of 0)
            _generate(model, ids)
            assert keeper.length == 6 + 4 - 1  # the prompt and every fed-back token
            traces += moe.traces()
        assert keeper.reuses == 1 and restarts == []
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                           min_new_tokens=4, do_sample=False)  # fmt: skip
        dynamic = moe.traces()
    finally:
        moe.disable()
    assert len(traces) == 4
    for t, d in zip(traces, dynamic + dynamic):
        np.testing.assert_array_equal(t.ids, d.ids)


def test_kept_cache_length_is_forgotten_where_the_host_cannot_count():
    # a compiled forward (or one without a token tensor) cannot be counted: the length is forgotten
    # and the device counter is used; another cache than the kept one is never counted
    from replaymoe.hf.static_cache import StaticCacheKeeper

    model = build_model("qwen3_moe", "tiny", seed=0)
    keeper = StaticCacheKeeper(model, install=False)
    keeper.cache, keeper.length = object(), 0
    other = object()
    keeper.advance(keeper.cache, 5)
    keeper.advance(other, 3)
    assert keeper.host_length(keeper.cache) == 5 and keeper.host_length(other) is None
    keeper.advance(keeper.cache, None)
    assert keeper.host_length(keeper.cache) is None
    keeper.advance(keeper.cache, 1)  # stays unknown until the next generate hands the cache out
    assert keeper.length is None


def test_model_without_generate_is_left_alone():
    base = build_model("qwen3_moe", "tiny", seed=0).model  # the decoder stack: no generate, no caches made
    moe = rhf.enable(base, backend="torch")
    assert not moe._engine.patch.static_cache.installed and "_prepare_static_cache" not in base.__dict__
    moe.disable()  # nothing to restore, no error


# release: release_static_cache() after a call; off: enable(..., keep_static_cache=False)
@pytest.mark.parametrize("how", ["release", "off"])
def test_release_and_opt_out_make_new_caches(how, generator):
    model = build_model("qwen3_moe", "tiny", seed=0)
    moe = rhf.enable(model, backend="torch", experts=False, keep_static_cache=how != "off")
    spy = _CacheSpy(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=generator)
    try:
        _generate(model, ids)
        if how == "release":
            assert moe._engine.patch.static_cache.cache is spy.seen[0][0]
            moe.release_static_cache()
            assert moe._engine.patch.static_cache.cache is None
        else:
            assert (
                not moe._engine.patch.static_cache.installed and "_prepare_static_cache" not in model.__dict__
            )
        _generate(model, ids)
        assert spy.seen[0][0] is not spy.seen[-1][0]  # the second call made its own cache
        assert moe._engine.patch.static_cache.reuses == 0
    finally:
        spy.handle.remove()
        moe.disable()


def test_keep_static_cache_must_be_bool():
    model = build_model("qwen3_moe", "tiny", seed=0)
    with pytest.raises(ValueError, match="keep_static_cache"):
        rhf.enable(model, keep_static_cache="yes")
    assert getattr(model, "_replaymoe", None) is None and "_prepare_static_cache" not in model.__dict__
