"""An in-process stand-in for ``vllm.LLM`` as TRL's colocate mode drives it (no vLLM here or on the GPU
machines): enough of the engine's surface for ``trl.generation.vllm_generation.VLLMGeneration`` to
build it, push weights into it and generate with it, returning ``RequestOutput``-shaped objects whose
``routed_experts`` come from the engine's own native routing.

The engine is a separate copy of the policy, loaded from disk and never touched by replaymoe: it
samples with transformers' ``generate``, then runs one plain forward over the fed positions with
forward hooks on the routers (transformers' ``*TopKRouter`` modules return ``(logits, weights,
indices)``) and keeps each MoE layer's selected experts, which is what vLLM's capturer records.
``form`` picks the payload layout:

* ``"vllm_0_33"`` (default), vLLM 0.33's as its source defines it: ``CompletionOutput.routed_experts``
  ``[P + C - 1 - s, num_hidden_layers, top_k]``, one column per decoder layer with dense layers all
  zero, uint8 when E <= 256 else uint16, rows from ``s = sampling_params.routed_experts_prompt_start``
  (default 0); ``RequestOutput`` carries no routing field;
* ``"legacy_moe_columns_int32"``: the first engines' layout, one column per MoE layer, int32, from
  position 0 (no prompt start).
"""

from __future__ import annotations

import functools
import math
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


class SamplingParams(SimpleNamespace):
    """``vllm.SamplingParams``: the keywords TRL passes, as attributes."""


class StandInLLM:
    """``vllm.LLM(model=path, ..., enable_return_routed_experts=...)`` over a transformers model."""

    instances: list[StandInLLM] = []
    form = "vllm_0_33"  # or "legacy_moe_columns_int32" (module docstring)

    def __init__(
        self, model: str, *, enable_return_routed_experts: bool = False, seed: int = 0, **kwargs: Any
    ):
        from transformers import AutoModelForCausalLM

        self.kwargs = kwargs
        self.returns_routing = enable_return_routed_experts
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.generator = torch.Generator().manual_seed(1000 + seed)
        runner = SimpleNamespace(
            model=self
        )  # TRL reaches llm_engine.model_executor.driver_worker.model_runner.model
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )
        self.generate_calls = 0
        # fed tokens -> the experts its MoE layers routed them to [N, L, K]
        self.routes: dict[tuple, Any] = {}
        self.starts: list[int] = []  # the prompt start of every request, in order
        self._selected: dict[int, torch.Tensor] | None = None  # layer number -> [N, K], while recording
        self.moe_layers: list[int] = []  # the model layer numbers of the MoE layers
        for name, module in self.model.named_modules():
            if type(module).__name__.lower().endswith("topkrouter"):
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
                self.moe_layers.append(layer)
                self.num_experts = module.weight.shape[0]
                module.register_forward_hook(functools.partial(self._record, layer))
        assert self.moe_layers, "no transformers TopKRouter in the model"
        StandInLLM.instances.append(self)

    def _record(self, layer: int, module, args, output) -> None:
        if self._selected is not None:
            self._selected[layer] = output[2].reshape(-1, output[2].shape[-1])  # (logits, weights, indices)

    # ------------------------------------------------------------ what TRL calls
    def load_weights(self, weights) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in weights:
                params[name].copy_(value)

    def reset_prefix_cache(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[dict], sampling_params=None, use_tqdm: bool = False) -> list:
        """vLLM's ``generate``: ``sampling_params`` is one ``SamplingParams`` or a list, one per prompt."""
        self.generate_calls += 1
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(params) == len(prompts)
        return [self._one(list(p["prompt_token_ids"]), sp) for p, sp in zip(prompts, params)]

    # ------------------------------------------------------------ one request
    def _one(self, prompt: list[int], sp: SamplingParams) -> SimpleNamespace:
        temperature = getattr(sp, "temperature", 1.0) or 1.0
        ids = torch.tensor([prompt])
        completion: list[int] = []
        eos = self.model.config.eos_token_id
        for _ in range(getattr(sp, "max_tokens", 16)):  # plain sampling, seeded (enough for a stand-in)
            logits = self.model(
                input_ids=torch.cat([ids, torch.tensor([completion], dtype=ids.dtype)], 1)
            ).logits
            probs = torch.softmax(logits[0, -1].float() / temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
            completion.append(token)
            if token == eos:
                break
        tokens = torch.tensor([prompt + completion])
        self._selected = {}
        try:
            out = self.model(input_ids=tokens[:, :-1])  # the fed positions: P + C - 1
        finally:
            selected, self._selected = self._selected, None
        routes = torch.stack([selected[n] for n in self.moe_layers], 1).numpy()  # [N, L_moe, K]
        self.routes[tuple(prompt + completion[:-1])] = routes
        logp = torch.log_softmax(out.logits[0].float() / temperature, -1)
        logprobs = [
            {t: SimpleNamespace(logprob=float(logp[len(prompt) - 1 + i, t]), rank=1)}
            for i, t in enumerate(completion)
        ]
        assert not any(math.isnan(d[t].logprob) for d, t in zip(logprobs, completion))
        choice = SimpleNamespace(token_ids=completion, logprobs=logprobs, routed_experts=None)
        request = SimpleNamespace(prompt_token_ids=prompt, outputs=[choice])
        start = getattr(sp, "routed_experts_prompt_start", None) or 0
        assert 0 <= start <= len(prompt), start
        self.starts.append(start)
        if self.returns_routing:
            if self.form == "legacy_moe_columns_int32":
                choice.routed_experts = routes.astype(np.int32)
            else:
                assert self.form == "vllm_0_33", self.form
                dtype = np.uint8 if self.num_experts <= 256 else np.uint16
                rows = np.zeros((len(routes), self.model.config.num_hidden_layers, routes.shape[2]), dtype)
                rows[:, self.moe_layers] = routes
                choice.routed_experts = rows[start:]
        return request
