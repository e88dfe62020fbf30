"""Hugging Face ``transformers`` integration: fused experts, routing through replaymoe, capture and replay.

Two entry points:

``experts_implementation="replaymoe"``
    :func:`register` adds :func:`replaymoe_experts_forward` to transformers' experts registry
    (``transformers.integrations.moe.ExpertsInterface``; :func:`enable` does it too), so the usual
    switch works::

        replaymoe.hf.register()  # once per process; importing the module registers nothing
        model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="replaymoe")
        model.set_experts_implementation("replaymoe")          # or switch a loaded model

    This replaces the experts' compute only (routers stay the model's own).

:func:`enable`
    Patches a loaded model in place: experts as above, every router through
    :func:`replaymoe.routing.route` with the matching :class:`~replaymoe.routing.RoutingMethod`,
    and optional routing **capture** (one :class:`~replaymoe.record.trace.RoutingTrace` per sequence) and
    **replay** (forced expert ids per layer with weights recomputed from the model's own router
    logits, so gradients reach the router — the "rollout routing replay" (R3) recipe)::

        moe = replaymoe.hf.enable(model, capture=True)
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
        traces = moe.traces()                    # list[RoutingTrace], one per batch row
        moe.set_capture(False)
        with moe.replaying(traces):              # the trainer forward
            logits = model(full_ids, attention_mask=full_mask).logits
        moe.disable()                            # restores the model

Supported architectures (transformers 5.17) and how each router maps
-------------------------------------------------------------------------
=====================  ==========================  =================================================
router class           method                      notes
=====================  ==========================  =================================================
Qwen3MoeTopKRouter     RENORMALIZE if              softmax -> top-k (-> renormalise); weights cast
Qwen2MoeTopKRouter     ``norm_topk_prob`` else     to the logits' dtype as the model does. Qwen2-MoE's
OlmoeTopKRouter        DEFAULT                     shared expert is left to the model.
MixtralTopKRouter      RENORMALIZE                 softmax -> top-k -> renormalise; fp32 weights.
DeepseekV3TopkRouter   DEEPSEEK_V3                 fp32 logits; ``bias = e_score_correction_bias``,
Glm4MoeTopkRouter                                  ``n_group``, ``topk_group``,
                                                   ``routed_scaling_factor``. With
                                                   ``norm_topk_prob=False`` the ids come from
                                                   route() and the weights are
                                                   ``sigmoid(x)[ids] * scale`` (no renorm). Dense
                                                   first layers are not MoE layers (layer_ids).
GptOssTopKRouter       RENORMALIZE                 logits include the router bias; top-k on logits,
                                                   softmax over the k. Experts are interleaved,
                                                   transposed, biased and use a clamped SwiGLU, which
                                                   fused_moe does not implement: they stay on
                                                   transformers' ``grouped_mm``.
=====================  ==========================  =================================================

Column order: replaymoe returns ids in descending selection-score order (ties to the smaller
index), as ``torch.topk(sorted=True)``; DeepSeek-V3/GLM4's own router uses ``sorted=False``, so
its column order may differ while the sets and the sums are the same.

Experts compute (:func:`replaymoe_experts_forward`)
---------------------------------------------------
* :func:`replaymoe.moe.fused_moe`, inference and training alike: the Triton kernels on CUDA and
  the torch reference elsewhere (``backend="auto"``; override with ``enable(..., backend=...)``).
  fp32 weights on CUDA use the torch reference (the kernels take bf16/fp16). Gradients reach the
  activations, the expert weights and the routing weights (hence the router).
* gpt-oss's experts (transposed, gate/up interleaved, biased, clamped SwiGLU) run fused_moe too:
  transposed views of its weights (no copy), its biases, ``gate_up_layout="interleaved"`` and
  ``ClampedSwiGLU(alpha, limit)``. Experts of any other layout fused_moe does not take (other
  biased or transposed layouts, non-SiLU) run through transformers' ``grouped_mm``.
* Eager decode-size forwards on CUDA (no gradient, bf16/fp16, at most 64 tokens) replay each MoE
  block with fused experts as a CUDA graph, captured the second time an input shape is seen
  (:mod:`replaymoe.hf.graphs`; ``enable(..., graphs=False)`` keeps every block eager).

Positions, capture and replay
-----------------------------
A pre-forward hook on the decoder stack (``model.base_model``) derives each token's **position in
its sequence with padding excluded** from what the forward holds on the device
(:func:`token_positions`): a 2-D ``attention_mask`` (``cumsum - 1``, ``-1`` for padding, so left
padding in ``generate`` and right padding in a trainer batch both work), or, with the 4-D masks of
a static cache, ``position_ids`` with padding read off the mask. Batch row ``b`` is sequence ``b``.
All capture and replay state lives on the device and a forward only indexes into it, so the
patched model runs eagerly, under ``torch.compile(fullgraph=True)``, with
``generate(cache_implementation="static")`` and in CUDA graphs (``mode="reduce-overhead"``).

* Capture: every router writes its ids into a per-forward slab through
  ``route(..., routing_replay_out=...)`` and a forward hook copies the slab into a device buffer
  ``[L, B, S_max, K]`` at (row, position). A call of ``generate``, or a forward with an empty cache,
  starts a new batch. :meth:`ReplayMoE.traces` reads the buffer once (the one host sync) and
  returns one trace per sequence: ``ids int16 [N, L, K]`` with the model's real layer numbers in
  ``layer_ids``. As in vLLM, the last generated token has no routing (it was never fed back), so
  ``N`` is ``len(prompt) + len(completion) - 1``. The buffer grows at eager forwards (to a static
  cache's ``max_cache_len`` at its prefill); give compiled forwards their capacity with
  ``enable(..., max_batch_size=, max_positions=)`` (``traces()`` raises if a token did not fit).
* Replay: :meth:`ReplayMoE.set_replay` checks the traces once and copies them to a device table;
  each forward gathers the forced ids of all layers with one indexing op (``-1`` rows — positions
  past a trace's end, padding — are routed natively inside ``route``) and ``route(...,
  replay_ids=...)`` forces them, recomputing the weights from this model's logits,
  differentiably. A trace is matched to the model's MoE layers by ``layer_ids`` (in MoE-layer
  order without them). Replay needs one trace per batch row, in batch order; ``report()`` tells
  how many tokens fell back.
* Gradient checkpointing: a recomputed layer (called outside the model's forward) reuses the ids
  of the last forward when the token count matches, so recomputation sees the same routing.

Limits: capture assumes each batch row stays one sequence for the whole ``generate`` (greedy or
sampling, ``num_return_sequences`` included; beam search reorders rows and is not supported).
transformers' continuous batching (``generate_batch``, ``init_continuous_batching``) captures per
request instead, one trace each in the order the requests were added (``replaymoe.hf._paged``); replay
under it is refused.
Padded batches need their ``attention_mask``. Batches begun inside a compiled forward (a
``torch.compile``'d training forward with capture on) overwrite each other: call ``traces()`` after
each (it warns when a batch was lost). With a static cache driven outside ``generate``, a batch
restart is detected on the device and only its lengths restart.

:func:`check_routes` (:mod:`replaymoe.hf.conformance`, ``replaymoe check``) checks an engine's routes
against the model's own routing of the same tokens before they are replayed.
"""

from replaymoe.hf.conformance import check_routes
from replaymoe.hf.discovery import MoELayerInfo, find_moe_layers
from replaymoe.hf.experts import IMPLEMENTATION_NAME, register, replaymoe_experts_forward
from replaymoe.hf.positions import token_positions
from replaymoe.hf.routers import SUPPORTED_ROUTERS
from replaymoe.hf.session import ReplayMoE, enable

__all__ = [
    "IMPLEMENTATION_NAME",
    "SUPPORTED_ROUTERS",
    "MoELayerInfo",
    "ReplayMoE",
    "check_routes",
    "enable",
    "find_moe_layers",
    "register",
    "replaymoe_experts_forward",
    "token_positions",
]
