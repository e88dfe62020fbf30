"""CUDA graphs of MoE blocks for eager forwards of decode size.

An eager ``generate`` at small batch is bound by the CPU: a MoE block (router linear, routing,
the experts' kernels, shared experts) costs a few hundred microseconds of Python and kernel
launches per call while its kernels run for tens. :class:`BlockGraphs` runs such a block as one
CUDA graph instead: the block's own forward (with the patched router and experts inside) is
captured the second time an eligible input shape is seen, and later calls copy the input into the
graph's static input, replay it and return a copy of its output (about three launches).

Eligible calls (:func:`graphable`): eager (not traced by ``torch.compile``, not inside someone
else's CUDA-graph capture), no gradient, no autocast, at most :data:`GRAPH_MAX_TOKENS` tokens, on
CUDA, bf16/fp16 activations (the fused kernels'), no hooks on the block's submodules (they would
fire at capture only). Training mode too (an RL trainer's rollout: TRL generates with the policy in
training mode, under ``no_grad``), unless the block is random in training mode: a dropout module
with ``p > 0`` or a router jitter (:data:`TRAINING_NOISE`) set; the mode is part of the graph's key.
Everything a replayed graph reads or writes has a fixed address: the block's parameters and
buffers (checked on every call: a parameter replaced or moved drops the graph), and the session's
per-shape replay-ids and capture-slab buffers (part of the graph's key). A block whose capture fails
runs eagerly from then on, with one warning.
"""

from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules import module as _module

__all__ = ["GRAPH_MAX_TOKENS", "TRAINING_NOISE", "BlockGraphs", "graphable", "random_in_training"]

GRAPH_MAX_TOKENS = 64  # decode sizes: beyond this, the kernels outrun the host anyway
# transformers' MoE attributes that add noise in training mode (Mixtral, MiniMax, Switch, PhiMoE, DBRX)
TRAINING_NOISE = ("jitter_noise", "router_jitter_noise", "input_jitter_noise", "moe_jitter_eps")
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_MAX_SHAPES = 8  # graphs kept per block (least recently used dropped first)
_SEEN = object()  # a key seen once: the next call captures


def graphable(num_tokens: int, device: torch.device) -> bool:
    """Whether a forward of ``num_tokens`` tokens on ``device`` may replay block graphs (module
    docstring); the per-block conditions are checked by :meth:`BlockGraphs.usable`."""
    return (
        not torch.compiler.is_compiling()  # first: nothing below is traced by dynamo
        and num_tokens <= GRAPH_MAX_TOKENS
        and device.type == "cuda"
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cuda")
        and not torch.cuda.is_current_stream_capturing()
        and not (_module._global_forward_hooks or _module._global_forward_pre_hooks)
    )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: Any  # a tensor or a tuple of tensors (gpt-oss returns the router scores too)
    weights: tuple[int, ...]  # addresses of the block's parameters and buffers at capture


def random_in_training(block: nn.Module) -> bool:
    """Whether ``block`` draws random numbers in training mode: a dropout module with ``p > 0``, or a
    non-zero :data:`TRAINING_NOISE` attribute on one of its modules."""
    for m in block.modules():
        if isinstance(m, _DROPOUTS) and m.p > 0:
            return True
        if any(getattr(m, name, None) for name in TRAINING_NOISE):
            return True
    return False


def _copy_out(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(o.clone() if isinstance(o, torch.Tensor) else o for o in out)


def _shape_of(module: nn.Module, block: bool) -> tuple:
    """(children, forward override or None, parameter and buffer names) of one module (the block's
    own forward is the graphs wrapper itself: not part of it)."""
    forward = None if block else module.__dict__.get("forward")
    return tuple(module._modules.values()), forward, (*module._parameters, *module._buffers)


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


class BlockGraphs:
    """The CUDA graphs of one MoE block, keyed by input shape and the session buffers it uses.

    Parameters
    ----------
    block : nn.Module
        The transformers MoE block (its forward is ``forward``; its router and experts are patched).
    forward : callable
        The block's own forward, bound (``type(block).forward.__get__(block)``).
    pool : list
        Holder of the memory pool shared by the session's graphs (empty until the first capture
        puts ``torch.cuda.graph_pool_handle()`` in it): graphs replay one at a time on one stream
        and their outputs are copied out, so their intermediates may share memory.
    """

    def __init__(self, block: nn.Module, forward: Callable, pool: list) -> None:
        self.block = block
        self.forward = forward
        self.pool = pool
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()
        self.failed = False
        self.captures = 0  # graphs captured so far (a steady state captures none)
        self._survey()

    def _survey(self) -> None:
        """Record the block's structure: every module with its children, forward override and
        parameter / buffer names (a change drops the graphs: see :meth:`usable`), and the (module,
        name) of every parameter and buffer, whose addresses are read again at each call so that a
        parameter replaced (not just updated in place) or moved is noticed."""
        self.tree = [(m, _shape_of(m, m is self.block)) for m in self.block.modules()]
        self.random_in_training = random_in_training(self.block)
        self.tensor_slots = [
            (m, n)
            for m in self.block.modules()
            for n, t in (*m._parameters.items(), *m._buffers.items())
            if t is not None
        ]

    def _weights(self) -> tuple[int, ...]:
        return tuple(getattr(getattr(m, n), "data_ptr", int)() for m, n in self.tensor_slots)  # None: 0

    def usable(self) -> bool:
        """The per-block conditions: not failed, eval mode or a block without randomness in
        training mode, no hooks inside the block, and the structure seen at capture (a module added,
        removed or replaced, a forward overridden or a parameter added: the graphs are dropped, this
        call runs eagerly, later ones re-capture)."""
        if self.failed or (self.block.training and self.random_in_training):
            return False
        for m, shape in self.tree:
            if m is not self.block and _hooked(m):
                return False
            if _shape_of(m, m is self.block) != shape:
                self.graphs.clear()
                self._survey()
                return False
        return True

    def __call__(
        self, hidden_states: torch.Tensor, buffers: tuple[Optional[torch.Tensor], ...], head: Any = None
    ) -> Any:
        """The block's output for ``hidden_states``, through a graph when one is (or can be) made.

        ``buffers``: the session tensors this forward's routers read or write (replay ids, capture
        slab; None where unused); their addresses are part of the key. ``head``: a
        :class:`~replaymoe.hf.step.DecodeHead` that runs first (in the graph, or eagerly before the
        block); its ``key`` is part of the graph's.
        """
        key = (
            tuple(hidden_states.shape),
            hidden_states.dtype,
            hidden_states.device,
            torch.is_inference_mode_enabled(),
            self.block.training,
            *(None if b is None else b.data_ptr() for b in buffers),
            None if head is None else head.key,
        )
        entry = self.graphs.get(key)
        if entry is None:  # first sighting: eager (it also compiles and autotunes what it needs)
            self.graphs[key] = _SEEN
            if len(self.graphs) > _MAX_SHAPES:
                self.graphs.popitem(last=False)
            return self._eager(hidden_states, head)
        self.graphs.move_to_end(key)
        if entry is _SEEN or entry.weights != self._weights():
            entry = self._capture(key, hidden_states, head)
            if entry is None:
                return self._eager(hidden_states, head)
        entry.static_in.copy_(hidden_states)
        entry.graph.replay()
        return _copy_out(entry.static_out)

    def _eager(self, hidden_states: torch.Tensor, head: Any) -> Any:
        if head is not None:
            head.launch()
        return self.forward(hidden_states)

    def _capture(self, key: tuple, hidden_states: torch.Tensor, head: Any = None) -> Optional[_Graph]:
        static_in = hidden_states.clone()
        if not self.pool:
            self.pool.append(torch.cuda.graph_pool_handle())
        error = None
        for _ in range(2):  # a first capture may load kernels it has not run yet: try once more
            graph = torch.cuda.CUDAGraph()
            # no garbage collection inside the capture: a collection there can destroy an unreachable
            # CUDA graph (an earlier session's, a user's), which is not permitted while a stream
            # captures and invalidates this capture (torch.cuda.graph no longer collects first)
            gc_on = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self.pool[0]):
                    if head is not None:
                        head.launch()
                    static_out = self.forward(static_in)
            except Exception as exc:  # noqa: BLE001 - any capture failure means: stay eager
                error = exc
                continue
            finally:
                if gc_on:
                    gc.enable()
            entry = _Graph(graph, static_in, static_out, self._weights())
            self.graphs[key] = entry
            self.captures += 1
            return entry
        self.failed = True
        self.graphs.clear()
        warnings.warn(
            f"replaymoe: the MoE block {type(self.block).__name__} could not be captured in a CUDA "
            f"graph ({type(error).__name__}: {error}); it runs eagerly from now on",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    def captured(self) -> int:
        """How many graphs (input shapes) this block holds."""
        return sum(isinstance(e, _Graph) for e in self.graphs.values())

    def clear(self) -> None:
        self.graphs.clear()
