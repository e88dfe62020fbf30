"""Replay ids bound to the forward they served, so that activation-checkpoint recomputes route alike.

A gradient-checkpointed decoder layer runs twice: in the model's forward, then again during
``backward()`` to rebuild its activations. The second run happens outside the model's forward (the
session's per-forward state is gone, and the ``replaying`` block may have ended), possibly after
other forwards (micro-batches, gradient accumulation, a reference model). It must route exactly
as the first did, or the gradients belong to another routing.

Every checkpoint implementation recomputes a layer from the inputs it saved in the forward:
non-reentrant ``torch.utils.checkpoint`` (transformers' default, FSDP2's ``checkpoint_wrapper``)
passes the same tensor objects again, the reentrant one detached copies of them, which share their
storage. So the storage of the layer's input identifies the forward a recompute belongs to (also where another
hook, FSDP2's, hands the layer a fresh alias of that storage each time). While
the model's forward runs with gradients enabled, a pre-hook on every MoE decoder layer (and on the
MoE block itself, for checkpoints around the block alone) binds that layer's replay ids (or "routed
natively") to its input's storage; the binding lives as long as the input's storage, that is as long
as the autograd graph that may recompute it. A recompute looks its ids up by the same key. One
that finds nothing while any replayed forward's bindings are alive raises: it never routes natively
in silence.

Where the recompute runs the layer's hooks too (transformers before 5.23 checkpoints the layer's
``__call__``), the layer's pre-hook finds the ids. From 5.23 on, transformers checkpoints the layer's
``forward`` and keeps module hooks outside the checkpoint (so that FSDP2's do not run twice): the
recompute then calls the bare ``forward`` and only the MoE block's hook runs, on a recomputed input
that no forward bound. :func:`find_in_checkpoint` covers both: it wraps the layer's checkpoint
function (``_gradient_checkpointing_func``, which transformers sets per layer) so that the function
it checkpoints looks the ids up by the layer's input before it runs, in every recompute.

Only Python bookkeeping runs per layer call (no device work, no host sync); under
``torch.compile`` nothing is bound, since a compiled graph replays its recorded ops, forced ids
included.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from replaymoe._validation import fail

__all__ = [
    "MISSING",
    "RecomputeBindings",
    "drop_recompute_guard",
    "find_in_checkpoint",
    "guard_recomputes",
    "unwrap_checkpoint",
]

_GUARD = "_replaymoe_recompute_guard"  # a model's attribute: the hooks guard_recomputes left on it


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def _key(t: torch.Tensor) -> Optional[tuple]:
    """Identity of ``t``'s data (storage, offset, shape): shared by a tensor and its detached copies."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape), t.dtype)


class RecomputeBindings:
    """Per MoE layer: replay ids of live forwards, keyed by the layer's input (see module docstring).

    Attributes
    ----------
    replayed_alive : int
        Bindings alive that hold replay ids (not "routed natively"): while any is, a recompute that
        finds no binding raises.
    """

    def __init__(self) -> None:
        self._bound: dict[tuple, Optional[torch.Tensor]] = {}
        self._pending: dict[int, object] = {}  # MoE layer index -> ids for its next router call
        self.replayed_alive = 0

    def bind(self, layer: int, hidden_states: torch.Tensor, ids: Optional[torch.Tensor]) -> None:
        """In the model's forward: layer ``layer``'s input ``hidden_states`` routes with ``ids``
        (``int32 [T, K]``, -1 rows native) or natively (None)."""
        key = _key(hidden_states)
        if key is None:
            return
        key = (layer, *key)
        if key in self._bound:  # the same input bound again (the block hook after the layer's)
            return
        self._bound[key] = ids
        if ids is not None:
            self.replayed_alive += 1
        # tied to the storage, not to this tensor object: a hook before ours (FSDP2's) may pass an
        # alias that dies with the forward while the checkpoint keeps the storage for the recompute
        weakref.finalize(hidden_states.untyped_storage(), self._release, key)

    def _release(self, key: tuple) -> None:
        if key in self._bound and self._bound.pop(key) is not None:
            self.replayed_alive -= 1

    def lookup(self, layer: int, hidden_states: torch.Tensor, *, overwrite: bool) -> None:
        """Outside the model's forward (a recompute): find the ids layer ``layer``'s input was bound
        to and keep them for its router's next call. ``overwrite=False`` keeps an earlier find (the
        decoder layer's) when this one (the block's recomputed input) finds nothing."""
        key = _key(hidden_states)
        found = MISSING if key is None else self._bound.get((layer, *key), MISSING)
        if found is not MISSING or overwrite or layer not in self._pending:
            self._pending[layer] = found

    def take(self, layer: int) -> object:
        """The ids found for layer ``layer``'s recompute (a tensor or None), or :data:`MISSING`."""
        return self._pending.pop(layer, MISSING)

    def clear_pending(self) -> None:
        self._pending.clear()


_WRAPPED = "_replaymoe_finds_recompute"  # marks a checkpoint function wrapped by find_in_checkpoint


def find_in_checkpoint(layer: torch.nn.Module, find: Callable[[torch.Tensor], None]) -> None:
    """Wrap ``layer``'s checkpoint function so that every run of what it checkpoints first calls
    ``find(hidden_states)`` (the layer's input: the first positional argument, or the
    ``hidden_states`` keyword bound into the checkpointed callable). Idempotent; a layer without
    checkpointing on, or whose function transformers replaces later (``gradient_checkpointing_enable``
    again), is left as it is until the next call. ``find`` decides whether the run is a recompute."""
    func = layer.__dict__.get("_gradient_checkpointing_func")
    if func is None or getattr(func, _WRAPPED, False) or not getattr(layer, "gradient_checkpointing", False):
        return

    def checkpointed(fn, *args, **kwargs):
        def run(*a, **k):
            if not torch.compiler.is_compiling():
                hidden = a[0] if a else getattr(fn, "keywords", {}).get("hidden_states")
                if isinstance(hidden, torch.Tensor):
                    find(hidden)
            return fn(*a, **k)

        return func(run, *args, **kwargs)

    setattr(checkpointed, _WRAPPED, True)
    checkpointed.__wrapped__ = func
    layer._gradient_checkpointing_func = checkpointed


def unwrap_checkpoint(layer: torch.nn.Module) -> None:
    """Undo :func:`find_in_checkpoint` on ``layer`` (nothing if it is not wrapped)."""
    func = layer.__dict__.get("_gradient_checkpointing_func")
    if func is not None and getattr(func, _WRAPPED, False):
        layer._gradient_checkpointing_func = func.__wrapped__


def guard_recomputes(model: torch.nn.Module, blocks: list[tuple[str, torch.nn.Module]],
                     bindings: RecomputeBindings) -> None:  # fmt: skip
    """What ``disable()`` leaves on ``model`` while ``bindings`` hold replayed forwards
    (:attr:`RecomputeBindings.replayed_alive`): a pre-hook on each MoE block (``(name, block)``) that
    raises when the block runs inside a backward (an activation-checkpoint recompute) before those
    forwards' graphs are gone, since the restored model would route the recompute natively, and the
    gradients would belong to another routing. The hooks remove themselves once no replayed forward
    is alive, and :func:`drop_recompute_guard` (a new ``enable``) removes them at once."""
    handles: list = []

    def make(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if not bindings.replayed_alive:
                drop_recompute_guard(model)
            elif torch._C._current_graph_task_id() != -1:  # inside backward: a checkpoint recompute
                fail(
                    "disable",
                    "backward() of every checkpointed forward that replayed traces before disable() "
                    "(its recompute must route as that forward did)",
                    f"a recompute of {name} after disable(), which would route natively",
                    what="order",
                )

        return hook

    drop_recompute_guard(model)
    for name, block in blocks:
        handles.append(block.register_forward_pre_hook(make(name)))
    setattr(model, _GUARD, handles)


def drop_recompute_guard(model: torch.nn.Module) -> None:
    """Remove the hooks :func:`guard_recomputes` left on ``model`` (none: nothing)."""
    for handle in model.__dict__.pop(_GUARD, ()):
        handle.remove()
