"""One forward of a patched model's decoder stack, planned at its start: the :class:`~replaymoe.hf.step.Step`
its routers read (replay ids, capture slab and rows, coverage bookkeeping), all on the device."""

from __future__ import annotations

from typing import Any, Optional

import torch

from replaymoe._validation import fail

from ._paged import is_paged_forward, plan_paged_step
from .graphs import graphable
from .positions import cache_length, forward_cache, token_positions
from .step import Step, fused_rows_ok, positions_bound, step_rows

__all__ = ["plan_step"]


def check_row_replay(replay: Any, B: int, input_ids: Optional[torch.Tensor]) -> None:
    """A forward of ``B`` rows that replays ``replay``'s traces by batch row (a KV cache, or traces
    that cannot be matched by content) has one trace per row and, when the traces carry their tokens,
    the tokens to check against them (``input_ids``: a forward of ``inputs_embeds`` alone has none)."""
    if replay.batch_size != B:
        fail(
            "replay",
            f"one trace per batch row ({B} rows in this forward), or traces that carry their "
            "tokens (captured by replaymoe) for forwards over whole sequences (no KV cache), "
            "which are matched to rows by content",
            f"{replay.batch_size} trace(s)",
        )
    if replay.checks_tokens and input_ids is None:
        fail(
            "replay",
            "input_ids in a forward that replays traces which carry their tokens (each row's tokens are "
            "checked against its trace's, so that no row replays another sequence's routes); for "
            "inputs_embeds alone, replay traces without tokens (trace.replace(token_ids=None)), "
            "matched by batch row and position only",
            "a forward without input_ids",
        )


def plan_step(engine: Any, input_ids: Optional[torch.Tensor], ref: torch.Tensor, kwargs: dict) -> Step:
    """The :class:`Step` of a forward of ``ref.shape[:2]`` tokens (``input_ids`` or ``inputs_embeds``,
    the forward's keyword arguments in ``kwargs``) for ``engine``
    (:class:`~replaymoe.hf._engine.Engine`: its capture and replay state, step buffers, decode chain).

    Positions come from :func:`~replaymoe.hf.positions.token_positions`, or, eagerly with a 2-D mask,
    with the capture rows and replay ids from one :func:`~replaymoe.hf.step.step_rows` launch, or from
    the decode chain's head (:class:`~replaymoe.hf.step.DecodeChain`) inside the first MoE block.
    """
    B, S = ref.shape[0], ref.shape[1]
    replay, capturing = engine.replay.table, engine.capture.on
    graphed = not torch.compiler.is_compiling() and engine.patch.graphs_on and graphable(B * S, ref.device)
    if is_paged_forward(kwargs):  # transformers' continuous batching: packed requests (hf._paged)
        engine.decode.reset()
        return plan_paged_step(engine, kwargs, B * S, graphed)
    if replay is None and not capturing:
        engine.decode.reset()
        return Step(B * S, None, None, None, graphed)
    # transformers >= 5.24 names the cache `cache` and, in generate, passes no attention mask: the
    # padding is in the position ids (a pad token starts a sequence of its own)
    cache, cache_kw = forward_cache(kwargs)
    mask, eager = kwargs.get("attention_mask"), not torch.compiler.is_compiling()
    past = cache_length(cache)
    if eager and not isinstance(past, int):  # a static cache: its length on the host, where known
        known = engine.patch.static_cache.host_length(cache)
        past = past if known is None else known
    # replay matched by content: whole sequences (no cache) of traces that carry their tokens
    content = (
        replay is not None
        and replay.by_content
        and input_ids is not None
        and isinstance(past, int)
        and past == 0
    )
    # eagerly, with a 2-D mask: positions, capture rows and replay ids in one kernel launch (which
    # writes ids only: a replay of weights, full recall, takes the torch gathers)
    replay_w = replay is not None and replay.with_weights
    fused = (
        eager and not content and not replay_w and fused_rows_ok(mask, S, past, ref.device, engine.backend)
    )
    if replay is not None and not content:  # matched by batch row
        check_row_replay(replay, B, input_ids)
    # replay by batch row of traces that carry their tokens: each token checked against its trace's
    check_tokens = replay is not None and not content and replay.checks_tokens
    positions = None
    if not fused or check_tokens:  # (the fused launch derives them on the device)
        positions = token_positions(
            B,
            S,
            attention_mask=mask,
            past_length=past,
            device=ref.device,
            position_ids=kwargs.get("position_ids"),
            padding_in_positions=cache_kw and mask is None,
        )
    if check_tokens:
        replay.count_token_diff(input_ids.to(device=ref.device, dtype=torch.int64), positions)
    forced = forced_out = staged = slot = forced_w = staged_w = None
    buffers = engine.step_buffers
    if replay is not None:
        forced_out = buffers.get("forced", B * S, torch.int32, ref.device) if graphed else None
        if replay_w:  # full recall: the rows' weights beside their ids
            shape = (len(engine.layers), B * S, engine.top_k)
            forced_w = (
                buffers.get("forced_w", B * S, torch.float32, ref.device)
                if graphed
                else torch.empty(shape, dtype=torch.float32, device=ref.device)
            )
        if not fused:  # the table's torch gathers (the fused launch asks the table below, in step_rows)
            matched = input_ids.to(device=ref.device, dtype=torch.int64) if content else None
            forced = replay.lookup(positions, tokens=matched, out=forced_out, weights_out=forced_w)
    if capturing:
        cap = engine.capture.buffer
        needed = positions_bound(cache, past, S) if eager else None
        cap.prepare(B, past, needed, new_batch=engine.capture.begin_pending, eager=eager)
        engine.capture.begin_pending = False
        if not fused:
            given = S > 1 and kwargs.get("position_ids") is not None  # (packed rows would restart them)
            slot = cap.slots(positions, check_overflow=not eager or needed is None, check_order=given)
        if graphed:
            staged = buffers.get("staged", B * S, torch.int16, ref.device)
        else:
            staged = torch.empty(
                (len(engine.layers), B * S, engine.top_k), dtype=torch.int16, device=ref.device
            )
        if cap.with_weights:  # full recall: the weights' slab, static like the ids' when graphed
            staged_w = (
                buffers.get("staged_w", B * S, torch.float32, ref.device)
                if graphed
                else torch.empty(staged.shape, dtype=torch.float32, device=ref.device)
            )
    head = None
    decode = engine.decode
    if fused:
        cap = engine.capture.buffer if capturing else None
        if graphed and engine.device_decode:  # a decode step continuing the chain: no launch here
            P = mask.shape[1]
            head = decode.head(engine.generation, B, S, P, past, cap, replay, staged, forced_out)
        if head is not None:
            if cap is not None:
                cap.take_pending()  # the head writes it, inside the first MoE block
            slot, forced = head.slot, forced_out
        elif graphed:
            slot_out, next_pos = decode.outputs(B * S, B, ref.device, cap)
            slot, forced = step_rows(mask, S, past, capture=cap, replay=replay, forced_out=forced_out,
                                     slot_out=slot_out, next_pos_out=next_pos)  # fmt: skip
            decode.served(engine.generation, B, mask.shape[1], past + S, slot)
        else:
            decode.reset()
            slot, forced = step_rows(mask, S, past, capture=cap, replay=replay, forced_out=forced_out)
    else:
        decode.reset()
    tokens = None
    if capturing and input_ids is not None:
        tokens = input_ids.reshape(-1).to(device=ref.device, dtype=torch.int64)
    coverage = None
    if replay is not None and (replay.missing == "error" or check_tokens):
        # the step bookkeeping kernel counts uncovered lookups itself (positions None)
        coverage = (replay, content, None if fused else positions)
    return Step(B * S, forced, staged, slot, graphed, fused, head, tokens, coverage, forced_w, staged_w)
