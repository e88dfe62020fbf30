"""``replaymoe.hf.recompute.find_in_checkpoint``: the wrapper of a decoder layer's checkpoint function
that makes every run of the checkpointed forward (the forward and each recompute) report the layer's
input, as transformers >= 5.23 needs (it checkpoints ``forward``, so a recompute runs no module hook).
A toy layer stands in for transformers' ``GradientCheckpointingLayer``, whose ``forward`` calls
``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``; the end-to-end check
is the hf suite on transformers 5.23 (README, "Install")."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from replaymoe.hf.recompute import find_in_checkpoint, unwrap_checkpoint


class ToyLayer(nn.Module):
    def __init__(self, reentrant: bool, by_keyword: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = partial(checkpoint, use_reentrant=reentrant)
        self.by_keyword = by_keyword

    def body(self, hidden_states):
        return torch.tanh(self.lin(hidden_states))

    def forward(self, hidden_states):
        if self.by_keyword:  # hidden_states bound into the checkpointed callable, no positional input
            return self._gradient_checkpointing_func(
                partial(type(self).body, self, hidden_states=hidden_states)
            )
        return self._gradient_checkpointing_func(partial(type(self).body, self), hidden_states)


@pytest.mark.parametrize(
    "reentrant,by_keyword",
    [
        (False, False),  # transformers' default: the saved input object itself comes back
        (True, False),  # reentrant: a detached copy sharing the input's storage
        (False, True),  # the input bound into the checkpointed callable by keyword
    ],
    ids=["nonreentrant", "reentrant", "keyword"],
)
def test_every_run_of_the_checkpointed_forward_reports_the_input(reentrant, by_keyword):
    layer = ToyLayer(reentrant, by_keyword)
    seen = []
    find_in_checkpoint(layer, lambda h: seen.append(h.untyped_storage().data_ptr()))
    find_in_checkpoint(layer, lambda h: seen.append(-1))  # idempotent: still the first wrapper
    x = torch.randn(3, 4, requires_grad=True)
    y = layer(x)
    assert seen == [x.untyped_storage().data_ptr()]  # the forward's run
    y.sum().backward()
    # the recompute's run: the same storage (non-reentrant: the saved tensor; reentrant: a detached copy)
    assert seen == [x.untyped_storage().data_ptr()] * 2
    assert x.grad is not None and layer.lin.weight.grad is not None
    unwrap_checkpoint(layer)
    assert isinstance(layer._gradient_checkpointing_func, partial)  # transformers' function again


def test_layers_without_checkpointing_are_left_alone():
    layer = ToyLayer(False, False)
    layer.gradient_checkpointing = False
    func = layer._gradient_checkpointing_func
    find_in_checkpoint(layer, lambda h: None)
    assert layer._gradient_checkpointing_func is func
    unwrap_checkpoint(nn.Linear(2, 2))  # nothing to undo: no error
