"""An in-process stand-in for ``vllm.LLM`` as TRL's colocate mode drives it (no vLLM here or on the GPU
machines): enough of the engine's surface for ``trl.generation.vllm_generation.VLLMGeneration`` to
build it, push weights into it and generate with it, returning ``RequestOutput``-shaped objects whose
``routed_experts`` come from the engine's own native routing.

The engine is a separate copy of the policy, loaded from disk and never touched by replaymoe: it
samples with transformers' ``generate``, then runs one plain forward over the whole sequence with
``output_router_logits=True`` and takes each layer's top-k, which is what vLLM's capturer records
(the experts the engine routed each fed position to). ``form`` picks vLLM's payload layout:
``"whole"`` (one array over prompt and completion per completion) or ``"split"``
(``prompt_routed_experts`` per request, the completion's rows per completion).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch


class SamplingParams(SimpleNamespace):
    """``vllm.SamplingParams``: the keywords TRL passes, as attributes."""


class StandInLLM:
    """``vllm.LLM(model=path, ..., enable_return_routed_experts=...)`` over a transformers model."""

    instances: list[StandInLLM] = []
    form = "split"

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
        self.routes: dict[tuple, Any] = {}  # fed tokens -> the experts this engine routed them to [N, L, K]
        StandInLLM.instances.append(self)

    # ------------------------------------------------------------ what TRL calls
    def load_weights(self, weights) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in weights:
                params[name].copy_(value)

    def reset_prefix_cache(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[dict], sampling_params: SamplingParams, use_tqdm: bool = False) -> list:
        self.generate_calls += 1
        return [self._one(list(p["prompt_token_ids"]), sampling_params) for p in prompts]

    # ------------------------------------------------------------ one request
    def _one(self, prompt: list[int], sp: SamplingParams) -> SimpleNamespace:
        temperature = getattr(sp, "temperature", 1.0) or 1.0
        ids = torch.tensor([prompt])
        completion: list[int] = []
        eos = self.model.config.eos_token_id
        for _ in range(sp.max_tokens):  # plain sampling, seeded (enough for a stand-in)
            logits = self.model(
                input_ids=torch.cat([ids, torch.tensor([completion], dtype=ids.dtype)], 1)
            ).logits
            probs = torch.softmax(logits[0, -1].float() / temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
            completion.append(token)
            if token == eos:
                break
        tokens = torch.tensor([prompt + completion])
        out = self.model(input_ids=tokens[:, :-1], output_router_logits=True)  # the fed positions
        k = self.model.config.num_experts_per_tok
        routes = torch.stack([lg.topk(k, dim=-1).indices for lg in out.router_logits], 1).to(
            torch.int32
        )  # [N, L, K]
        self.routes[tuple(prompt + completion[:-1])] = routes.numpy()
        logp = torch.log_softmax(out.logits[0].float() / temperature, -1)
        logprobs = [
            {t: SimpleNamespace(logprob=float(logp[len(prompt) - 1 + i, t]), rank=1)}
            for i, t in enumerate(completion)
        ]
        assert not any(math.isnan(d[t].logprob) for d, t in zip(logprobs, completion))
        choice = SimpleNamespace(token_ids=completion, logprobs=logprobs, routed_experts=None)
        request = SimpleNamespace(prompt_token_ids=prompt, outputs=[choice])
        if self.returns_routing:
            rows = routes.numpy()
            if self.form == "whole":
                choice.routed_experts = rows
            else:
                request.prompt_routed_experts = rows[: len(prompt)]
                choice.routed_experts = rows[len(prompt) :]
        return request
