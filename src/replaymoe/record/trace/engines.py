"""The engine wire-format methods of :class:`~replaymoe.record.trace.RoutingTrace`: vLLM's and SGLang's.

This module's one job is the trace's face towards inference engines: ``to_vllm``, ``from_vllm``,
``to_sglang`` and ``from_sglang``, as :class:`EngineFormats`, which ``RoutingTrace`` inherits. The
bytes themselves are :mod:`replaymoe.record.trace.wire`'s; this module documents the methods and
delegates, and imports neither ``RoutingTrace`` nor its module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from . import wire as _wire

__all__ = ["EngineFormats"]

_T = TypeVar("_T", bound="EngineFormats")


class EngineFormats:
    """vLLM's and SGLang's routed-experts payloads, read into and written from a trace (a mixin of
    :class:`~replaymoe.record.trace.RoutingTrace`, whose constructor the ``from_*`` methods call)."""

    ids: np.ndarray  # int16 [N, L, K]
    layer_ids: tuple[int, ...] | None

    # ---------------------------------------------------------------- vLLM
    def to_vllm(self, dtype: str = "int32", *, num_hidden_layers: int | None = None) -> str:
        """Encode as a vLLM server's ``routed_experts``: base64 of an ``.npy`` file [rows, columns, top_k].

        ``numpy.load(io.BytesIO(base64.b64decode(s)))`` reads it back; :meth:`from_vllm` too.

        Parameters
        ----------
        dtype : {"int32", "int16", "int64", "uint8", "uint16"}
            Element type. vLLM 0.33 sends ``uint8`` for up to 256 experts, else ``uint16``; unsigned
            types cannot hold -1, so a trace with missing rows (or ids too large for the type) raises
            ``ValueError``. The default int32 keeps missing rows (the earliest engines' type).
            The payload holds ids only: a trace's ``weights`` are not written (vLLM's format has no
            place for them).
        num_hidden_layers : int, optional
            The model's decoder layers: write vLLM 0.33's layout, one column per decoder layer, the MoE
            layers' columns at their layer numbers (``layer_ids``, the identity when None) and every
            other (dense) column zero. None writes one column per MoE layer (the earliest layout).
        """
        return _wire.encode_vllm(
            self.ids, dtype, num_hidden_layers=num_hidden_layers, layer_ids=self.layer_ids
        )

    @classmethod
    def from_vllm(
        cls: type[_T],
        obj: Any,
        *,
        num_experts: int | None = None,
        choice: int = 0,
        prompt_start: int | None = None,
        layer_ids: Sequence[int] | None = None,
        model_id: str | None = None,
    ) -> _T:
        """Decode vLLM's ``routed_experts`` (vLLM 0.33's format: :mod:`replaymoe.record.trace.wire`).

        Parameters
        ----------
        obj : str, bytes, dict, np.ndarray or nested list
            * the base64 string of an ``.npy`` (what the server puts in ``choices[i].routed_experts``),
              or the raw ``.npy`` bytes, or an already-decoded array [rows, layers, top_k] (the
              offline ``CompletionOutput.routed_experts``);
            * a choice dict holding ``routed_experts``;
            * a whole chat or ``/v1/completions`` response (dict, or its JSON text):
              ``choices[choice]`` is used. Legacy: a response carrying ``prompt_routed_experts``
              (the split form of vLLM's v0.21 design; vLLM 0.33 never sends it) gives the prompt
              rows followed by the choice's rows.
        num_experts : int, optional
            The model's E (vLLM does not send it). ``None`` leaves it unknown.
        choice : int
            Which choice of a whole response.
        prompt_start : int, optional
            The request's ``routed_experts_prompt_start`` (``s``, default 0): row ``i`` is position
            ``s + i`` (becomes ``token_offset``). vLLM does not echo it, so it is never read from
            the response: pass the value the request used.
        layer_ids : sequence of int, optional
            The model layer numbers of the MoE layers (e.g.
            :func:`replaymoe.integrations.vllm_outputs.moe_layer_ids`). vLLM 0.33 sends one column
            per decoder layer, dense layers all zero: the MoE columns are kept, and every other
            column must be all zero. A payload with exactly ``len(layer_ids)`` columns is the
            legacy MoE-only layout, taken as is. Without ``layer_ids`` every column is a MoE layer,
            and a column that is entirely zero (a dense layer) raises instead of being guessed.
        model_id : str, optional
            Stored on the trace (defaults to the response's ``model`` field).

        Returns
        -------
        RoutingTrace
            ids int16 [rows, len(layer_ids) or columns, top_k] from position ``prompt_start``;
            ``token_ids`` int64 [rows] when the response carries its token ids
            (``return_token_ids: true``).

        Raises
        ------
        TraceFormatError
            A malformed payload; a response with no choices; rows that do not fit the response's
            token counts (``P + C - 1 - prompt_start`` rows for ``P`` prompt and ``C`` completion
            tokens, checked whenever both are present: chat's top-level or ``/v1/completions``'
            per-choice ``prompt_token_ids``, and the choice's ``token_ids``); an all-zero column
            without ``layer_ids``; a non-zero column outside ``layer_ids``.
        ValueError
            ``choice`` past the response's choices, ``prompt_start`` past the prompt, ids outside
            [0, num_experts).

        Notes
        -----
        vLLM 0.33 sends uint8 ids when E <= 256, else uint16; never -1. Rows of -1 (the prefix-cache
        sentinel of older int16/int32 payloads) are kept as missing.
        """
        return _wire.decode_vllm(
            cls,
            obj,
            num_experts=num_experts,
            choice=choice,
            prompt_start=prompt_start,
            layer_ids=layer_ids,
            model_id=model_id,
        )

    # ---------------------------------------------------------------- SGLang
    @classmethod
    def from_sglang(
        cls: type[_T],
        b64: str | bytes | Mapping[str, Any],
        num_layers: int,
        top_k: int,
        *,
        dtype: str = "int32",
        num_experts: int | None = None,
        start: int = 0,
        layer_ids: Sequence[int] | None = None,
        model_id: str | None = None,
    ) -> _T:
        """Decode SGLang's flat ``meta_info.routed_experts``.

        Parameters
        ----------
        b64 : str, bytes or dict
            Base64 of the flat little-endian array, or the ``meta_info`` dict (then
            ``routed_experts`` is read from it, and its ``routed_experts_dtype`` -- ``"uint8"`` or
            ``"torch.uint8"`` alike -- overrides ``dtype`` when present). With a dict holding
            ``prompt_tokens`` and ``completion_tokens``, the rows must number
            ``prompt_tokens + completion_tokens - 1 - start`` (TraceFormatError otherwise).
        num_layers, top_k : int
            The logical shape [rows, num_layers, top_k] (SGLang does not send it). When SGLang fuses
            shared experts into the capture, top_k counts them too.
        dtype : {"int32", "uint8", "uint16", "int16"}
            Element type: SGLang's default int32; uint8/uint16 with
            ``SGLANG_ROUTED_EXPERTS_DTYPE``.
        num_experts : int, optional
            The model's E. ``None`` leaves it unknown.
        start : int
            ``routed_experts_start_len``: the first position covered (becomes ``token_offset``).
        layer_ids : sequence of int, optional
            The model layer numbers of the MoE layers. When ``num_layers`` is larger (a column per
            decoder layer), the MoE columns are kept and every other column must be all zero, as
            for :meth:`from_vllm`; without ``layer_ids`` an all-zero column raises.
        model_id : str, optional
            Stored on the trace.

        Returns
        -------
        RoutingTrace
            ids int16 [rows, len(layer_ids) or num_layers, top_k] from position ``start``.

        Notes
        -----
        Checked against payloads built here (``to_sglang`` and numpy), not against a running
        SGLang server: the layer axis (every decoder layer or the MoE layers only), whether a
        request's rows are ``seqlen - 1`` with ``routed_experts_start_len``, and the exact
        spelling of ``routed_experts_dtype`` in ``meta_info`` (both ``"uint8"`` and
        ``"torch.uint8"`` are read) have not been seen on a real server.
        """
        return _wire.decode_sglang(
            cls,
            b64,
            num_layers,
            top_k,
            dtype=dtype,
            num_experts=num_experts,
            start=start,
            layer_ids=layer_ids,
            model_id=model_id,
        )

    def to_sglang(self, dtype: str = "int32") -> str:
        """Encode as SGLang does: base64 of the flat little-endian array (inverse of :meth:`from_sglang`);
        ids only (a trace's ``weights`` are not written)."""
        return _wire.encode_sglang(self.ids, dtype)
