"""What :func:`replaymoe.hf.enable` installs on a model, and ``disable()`` removes: every router's
forward (:func:`~replaymoe.hf.patches.router_forward`), the experts implementation, the MoE blocks'
CUDA graphs, the activation-checkpoint binding pre-hooks (:mod:`replaymoe.hf.recompute`), the decoder
stack's forward hooks, the aux-loss provider, the static-cache keeper, ``generate``,
``init_continuous_batching`` and ``generate_batch``.

Every hook calls the session's engine (:class:`replaymoe.hf._engine.Engine`, through
:class:`~replaymoe.hf.patches.SessionHooks` and the attributes named below), never the public handle.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Optional

import torch
from torch import nn

from ._paged import paged_generate_batch, paged_init
from .aux_loss import install as install_aux_loss
from .aux_loss import target_modules
from .discovery import MoELayerInfo
from .experts import IMPLEMENTATION_NAME, fused_compatible, register, set_backend
from .graphs import BlockGraphs
from .patches import block_forward, mark_batch_start, router_forward
from .recompute import find_in_checkpoint, unwrap_checkpoint
from .static_cache import StaticCacheKeeper

__all__ = ["ModelPatch", "binding_hook"]


def binding_hook(engine: Any, info: MoELayerInfo, is_block: bool) -> Any:
    """Pre-hook of a MoE decoder layer (or block): in the model's forward with gradients on,
    bind this layer's replay ids to its input; outside it (an activation-checkpoint recompute),
    find them again (:mod:`replaymoe.hf.recompute`). ``engine``: its ``step`` and ``bindings``."""
    index = info.index

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            return
        step = engine.step
        if step is None:
            engine.bindings.lookup(index, hidden, overwrite=not is_block)
        elif torch.is_grad_enabled() or (module.training and not engine.outer_generation):
            # (reentrant checkpoints run under no_grad in training mode; generate, in whatever mode,
            # feeds no backward: nothing to bind)
            forced = None if step.forced is None else step.forced[index]
            if forced is not None and step.forced_w is not None:  # full recall: the weights too
                forced = (forced, step.forced_w[index])
            engine.bindings.bind(index, hidden, forced)
            if not is_block:  # transformers >= 5.23 recomputes the bare forward, without this hook
                find_in_checkpoint(module, find)

    def find(hidden: torch.Tensor) -> None:  # a run of the layer's checkpointed forward
        if engine.step is None:  # outside the model's forward: a recompute
            engine.bindings.lookup(index, hidden, overwrite=True)

    return hook


class ModelPatch:
    """Everything one session installed on its model, undone by :meth:`remove`.

    ``engine`` gives the model, its MoE ``layers``, the ``backend``, the hooks the patches call
    (:class:`~replaymoe.hf.patches.SessionHooks`), ``pre_forward`` / ``post_forward`` for the decoder
    stack, and ``replay.aux_ids`` (held weakly) for the aux loss. ``owner`` is the public handle: once
    it is collected without ``disable()``, the aux-loss providers are taken out (no module keeps the
    session alive).

    Attributes
    ----------
    block_graphs : list[BlockGraphs]
        The MoE blocks run as CUDA graphs (:mod:`replaymoe.hf.graphs`).
    graphs_on : bool
        Some block runs through :attr:`block_graphs`.
    static_cache : StaticCacheKeeper
        The static KV cache kept across ``generate`` calls.
    """

    def __init__(
        self, engine: Any, owner: object, *, experts: bool, graphs: bool, keep_static_cache: bool
    ) -> None:
        model = self.model = engine.model
        self.layers: list[MoELayerInfo] = engine.layers
        self.hooks: list[Any] = []
        self.prev_impl: Optional[str] = None
        self.block_graphs: list[BlockGraphs] = []
        self.aux_uninstall: list = []
        config = getattr(model, "config", None)
        switch = (
            experts
            and config is not None
            and hasattr(model, "set_experts_implementation")
            and any(fused_compatible(info.experts) for info in self.layers)
        )
        pool: list = []  # one CUDA-graph memory pool for all blocks, made at the first capture
        for info in self.layers:
            fused = switch and fused_compatible(info.experts)
            info.router.forward = types.MethodType(router_forward(engine, info, fused), info.router)
            set_backend(info.experts, engine.backend)
            for module, is_block in ((self.decoder_layer(info), False), (info.block, True)):
                if module is not None:
                    hook = module.register_forward_pre_hook(
                        binding_hook(engine, info, is_block), with_kwargs=True
                    )
                    self.hooks.append(hook)
            if graphs and fused and engine.backend != "torch" and info.block is not None:
                block_graphs = BlockGraphs(info.block, info.block.forward, pool)
                self.block_graphs.append(block_graphs)
                info.block.forward = block_forward(engine, block_graphs)
        self.graphs_on = bool(self.block_graphs)
        if switch:
            register()  # idempotent: "replaymoe" in transformers' experts registry
            self.prev_impl = config._experts_implementation
            model.set_experts_implementation(IMPLEMENTATION_NAME)
        # the aux loss of a replayed forward: the used ids. The provider holds the session weakly, and
        # a session collected without disable() takes its providers out (no module keeps it alive)
        ref = weakref.ref(engine.replay)

        def aux_ids(gate_logits: Any) -> Optional[list]:
            replay = ref()
            return None if replay is None else replay.aux_ids(gate_logits)

        for module in target_modules(model):
            uninstall = install_aux_loss(module, aux_ids)
            self.aux_uninstall.append(uninstall)
            weakref.finalize(owner, uninstall)
        stack = getattr(model, "base_model", model)
        self.hooks.append(stack.register_forward_pre_hook(engine.pre_forward, with_kwargs=True))
        self.hooks.append(
            stack.register_forward_hook(engine.post_forward, with_kwargs=True, always_call=True)
        )
        self.static_cache = StaticCacheKeeper(model, install=keep_static_cache)
        if hasattr(model, "generate"):
            model.generate = mark_batch_start(engine, model.generate)
        if hasattr(model, "init_continuous_batching"):  # continuous batching (hf._paged)
            model.init_continuous_batching = paged_init(engine, model.init_continuous_batching)
        if hasattr(model, "generate_batch"):
            model.generate_batch = paged_generate_batch(engine, model.generate_batch)

    def decoder_layer(self, info: MoELayerInfo) -> Optional[nn.Module]:
        """The decoder layer holding ``info``'s MoE block (None for a block at the model's root)."""
        if "." not in info.name:
            return None
        return self.model.get_submodule(info.name.rsplit(".", 1)[0])

    def remove(self) -> None:
        """The model as it was before: aux-loss providers, hooks and ``generate`` wrappers removed,
        original routers, block forwards and experts implementation, graphs freed."""
        for uninstall in self.aux_uninstall:
            uninstall()
        self.aux_uninstall.clear()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        for info in self.layers:
            layer = self.decoder_layer(info)
            if layer is not None:
                unwrap_checkpoint(layer)
        for info in self.layers:
            info.router.__dict__.pop("forward", None)
            set_backend(info.experts, None)
            if info.block is not None:
                info.block.__dict__.pop("forward", None)
        for block_graphs in self.block_graphs:
            block_graphs.clear()
        self.block_graphs.clear()
        self.graphs_on = False
        self.model.__dict__.pop("generate", None)
        self.model.__dict__.pop("init_continuous_batching", None)
        self.model.__dict__.pop("generate_batch", None)
        self.static_cache.uninstall()
        if self.prev_impl is not None:
            self.model.set_experts_implementation(self.prev_impl)
