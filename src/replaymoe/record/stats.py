"""Statistics over recorded routing: expert load, balance, agreement, heatmaps.

All functions take :class:`~replaymoe.record.trace.RoutingTrace` objects and ignore missing (-1) rows.

* :func:`expert_load` -- tokens per (layer, expert), int64 [L, E].
* :func:`balance` -- per layer: max/mean load, coefficient of variation (population std / mean)
  and entropy of the load distribution normalised by log E (1.0 = perfectly even).
* :func:`agreement` -- how often two traces of the same tokens (e.g. rollout vs trainer forward)
  chose the same expert *set*, per layer and in every layer at once.
* :func:`plot_heatmap` -- a layer x expert load picture, optionally beside per-layer agreement bars
  (needs matplotlib: the ``plot`` extra); the format follows the file suffix (:func:`heatmap_format`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .._validation import check_int, fail
from .trace import RoutingTrace

__all__ = ["expert_load", "balance", "agreement", "AgreementReport", "plot_heatmap", "heatmap_format"]


def _traces(trace: RoutingTrace | Sequence[RoutingTrace]) -> list[RoutingTrace]:
    tr = [trace] if isinstance(trace, RoutingTrace) else list(trace)
    if not tr:
        fail("trace", "a RoutingTrace or a non-empty sequence of them", "an empty sequence")
    for i, t in enumerate(tr):
        if not isinstance(t, RoutingTrace):
            fail(f"trace[{i}]" if len(tr) > 1 else "trace", "a RoutingTrace", type(t).__name__, what="type")
    first = tr[0]
    for i, t in enumerate(tr[1:], 1):
        if t.num_layers != first.num_layers:
            fail(f"trace[{i}]", f"{first.num_layers} layers like trace[0]", t.num_layers)
    return tr


def expert_load(
    trace: RoutingTrace | Sequence[RoutingTrace], *, num_experts: int | None = None
) -> np.ndarray:
    """Tokens routed to each expert, per MoE layer.

    Parameters
    ----------
    trace : RoutingTrace or sequence of RoutingTrace
        Several traces (same L) are summed.
    num_experts : int, optional
        E; default the traces' ``num_experts``, else ``max(id) + 1``.

    Returns
    -------
    np.ndarray int64 [L, E]
        ``load[l, e]`` = number of (token, k) slots of layer l that chose expert e; missing rows are
        ignored, so ``load[l].sum() == K * (tokens recorded in layer l)``.
    """
    tr = _traces(trace)
    known = {t.num_experts for t in tr if t.num_experts is not None}
    top = max((int(t.ids.max()) for t in tr if t.ids.size), default=-1)
    if num_experts is None:
        num_experts = max(known) if known else max(top + 1, 1)
    check_int("num_experts", num_experts, low=1)
    if top >= num_experts:
        fail("num_experts", f"more than the largest expert id {top}", num_experts)
    L = tr[0].num_layers
    load = np.zeros((L, num_experts), dtype=np.int64)
    for t in tr:
        if not t.ids.size:
            continue
        ids = t.ids.transpose(1, 0, 2).reshape(L, -1).astype(np.int64)  # [L, N*K]
        valid = ids >= 0
        flat = (np.arange(L)[:, None] * num_experts + ids)[valid]
        load += np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts)
    return load


def balance(load: np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer balance of an expert load.

    Parameters
    ----------
    load : array-like [L, E] (or [E] for one layer)
        Counts, e.g. from :func:`expert_load`.

    Returns
    -------
    dict of np.ndarray float64 [L]
        ``max_over_mean``: max load / mean load (1.0 = even, E = everything on one expert);
        ``cv``: population standard deviation / mean; ``entropy``: -sum p log p / log E with
        p = load / sum (1.0 = even, 0.0 = one expert; 1.0 when E == 1). Layers with no tokens
        give NaN.
    """
    a = np.asarray(load, dtype=np.float64)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2 or a.shape[1] < 1:
        fail("load", "an [L, E] array of counts", f"shape {a.shape}", what="shape")
    if (a < 0).any():
        fail("load", "non-negative counts", f"min {a.min()}")
    E = a.shape[1]
    total = a.sum(1)
    mean = total / E
    with np.errstate(invalid="ignore", divide="ignore"):
        mom = a.max(1) / mean
        cv = a.std(1) / mean
        p = a / total[:, None]
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        ent = -plogp.sum(1) / np.log(E) if E > 1 else np.ones(len(a))
    empty = total == 0
    for arr in (mom, cv, ent):
        arr[empty] = np.nan
    return {"max_over_mean": mom, "cv": cv, "entropy": np.asarray(ent, dtype=np.float64)}


@dataclass
class AgreementReport:
    """Agreement between two traces of the same tokens.

    Attributes
    ----------
    per_layer : np.ndarray float64 [L]
        Per layer, the fraction of tokens (recorded in both) whose expert *sets* are equal; NaN for
        a layer with no token recorded in both.
    all_layers : float
        Fraction of tokens recorded in every layer of both traces whose sets are equal in every
        layer; NaN when there is none.
    compared_per_layer : np.ndarray int64 [L]
        Tokens compared per layer.
    excluded_per_layer : np.ndarray int64 [L]
        Tokens (positions covered by either trace) missing in one or both, per layer.
    compared_tokens, excluded_tokens : int
        The same for the every-layer figure.
    """

    per_layer: np.ndarray
    all_layers: float
    compared_per_layer: np.ndarray
    excluded_per_layer: np.ndarray
    compared_tokens: int
    excluded_tokens: int

    @property
    def token_layer(self) -> float:
        """Fraction of the compared (token, layer) router decisions whose expert sets are equal (each
        layer weighted by its compared tokens); NaN when nothing was compared."""
        n = int(self.compared_per_layer.sum())
        if n == 0:
            return float("nan")
        same = np.where(self.compared_per_layer > 0, self.per_layer, 0.0) * self.compared_per_layer
        return float(same.sum() / n)

    def __str__(self) -> str:
        pl = self.per_layer
        lo = f"{np.nanmin(pl):.4f}" if np.isfinite(pl).any() else "n/a"
        mean = f"{np.nanmean(pl):.4f}" if np.isfinite(pl).any() else "n/a"
        return (
            f"agreement: {self.all_layers:.4f} of {self.compared_tokens} tokens identical in every layer "
            f"({self.excluded_tokens} excluded as missing); per layer mean {mean}, min {lo}"
        )


def agreement(a: RoutingTrace, b: RoutingTrace) -> AgreementReport:
    """Compare the routing of two traces position by position (token offsets honoured).

    Positions covered by only one trace, and rows missing (-1) in either, are excluded and counted.
    The traces must have the same number of layers and top_k.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, RoutingTrace):
            fail(name, "a RoutingTrace", type(t).__name__, what="type")
    if (a.num_layers, a.top_k) != (b.num_layers, b.top_k):
        fail("b", f"layers={a.num_layers}, top_k={a.top_k} like a", f"layers={b.num_layers}, top_k={b.top_k}")
    L = a.num_layers
    lo, hi = max(a.token_offset, b.token_offset), min(a.end, b.end)
    # positions covered by either trace (a gap between the two ranges is not a token of either)
    covered = a.num_tokens + b.num_tokens - max(0, hi - lo)
    if hi > lo:
        x = np.sort(a.ids[lo - a.token_offset : hi - a.token_offset], axis=-1)
        y = np.sort(b.ids[lo - b.token_offset : hi - b.token_offset], axis=-1)
        both = (x[..., 0] >= 0) & (y[..., 0] >= 0)  # [n, L]
        same = (x == y).all(-1) & both
    else:
        both = np.zeros((0, L), dtype=bool)
        same = both
    compared = both.sum(0).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = same.sum(0) / compared
    per_layer = np.where(compared > 0, per_layer, np.nan)
    every = both.all(1)
    n_every = int(every.sum())
    all_layers = float((same.all(1) & every).sum() / n_every) if n_every else float("nan")
    return AgreementReport(
        per_layer=per_layer.astype(np.float64),
        all_layers=all_layers,
        compared_per_layer=compared,
        excluded_per_layer=(covered - compared).astype(np.int64),
        compared_tokens=n_every,
        excluded_tokens=int(covered - n_every),
    )


# formats matplotlib writes (the jpeg/tiff/webp ones through pillow, which matplotlib needs anyway)
_FORMATS = ("png", "svg", "svgz", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def heatmap_format(path: str | os.PathLike) -> str:
    """The image format :func:`plot_heatmap` writes to ``path``: its suffix (``png`` when it has none).

    Raises
    ------
    ValueError
        Naming ``path``, for a suffix that is not an image format matplotlib writes.
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if not suffix:
        return "png"
    if suffix not in _FORMATS:
        fail("path", "a file name ending in ." + ", .".join(_FORMATS), repr(os.fspath(path)), what="suffix")
    return suffix


def plot_heatmap(
    trace: RoutingTrace | Sequence[RoutingTrace],
    path: str | os.PathLike,
    *,
    num_experts: int | None = None,
    title: str | None = None,
    dpi: int = 120,
    agreement: Mapping[str, Sequence[float]] | None = None,
    agreement_title: str | None = None,
) -> str:
    """Write a heatmap of the expert load, MoE layer (rows) x expert (columns).

    Each row is shown as the share of its layer's (token, k) slots, so layers compare on one
    colour scale (1/E = even). Needs matplotlib (``pip install 'replaymoe[plot]'``).

    Parameters
    ----------
    trace : RoutingTrace or sequence of RoutingTrace
        The load is summed over the traces (same L).
    path : str or PathLike
        Output file; the format follows its suffix (``.png``, ``.svg``, ``.pdf``, ...; PNG when it
        has none, ValueError for a suffix that is not an image format).
    num_experts : int, optional
        E; default as :func:`expert_load`.
    title : str, optional
        Title of the heatmap panel (default: model, tokens, top-k).
    dpi : int
        Resolution of raster formats.
    agreement : mapping of str to sequence of float [L], optional
        Per-layer agreement figures (e.g. ``{"native routing": a, "with replay": b}``, fractions in
        [0, 1], NaN allowed) drawn as grouped horizontal bars in a second panel whose rows are the
        heatmap's layers, so that a reader sees at a glance where routing agrees.
    agreement_title : str, optional
        Title of that panel.

    Returns
    -------
    str
        ``path``.
    """
    fmt = heatmap_format(path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError as e:
        raise ImportError(
            "plot_heatmap needs matplotlib, which is not installed: pip install 'replaymoe[plot]' "
            "(or pip install matplotlib)"
        ) from e
    tr = _traces(trace)
    load = expert_load(tr, num_experts=num_experts).astype(np.float64)
    L, E = load.shape
    bars: dict[str, np.ndarray] = {}
    for name, values in (agreement or {}).items():
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
        if arr.shape != (L,):
            fail(f"agreement[{name!r}]", f"{L} per-layer values", arr.shape[0], what="length")
        bars[str(name)] = arr
    with np.errstate(invalid="ignore", divide="ignore"):
        share = load / load.sum(1, keepdims=True)
    width = min(4 + E * 0.06, 20) + (3.2 if bars else 0.0)
    fig = Figure(figsize=(width, min((2.8 + L * 0.3) if bars else (2 + L * 0.18), 16)))
    FigureCanvasAgg(fig)
    if bars:
        grid = fig.add_gridspec(1, 2, width_ratios=[max(3.0, E * 0.06), 2.4])
        ax = fig.add_subplot(grid[0, 0])
        bx = fig.add_subplot(grid[0, 1])  # its own layer labels (a shared axis shares them: "0 (L0)")
    else:
        ax, bx = fig.add_subplot(1, 1, 1), None
    im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax, label="share of the layer's routed slots")
    ax.set_xlabel(f"expert (E = {E}; even share = {1 / E:.3g})")
    ax.set_ylabel("MoE layer")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=min(E, 16), integer=True))  # experts are integers
    ax.tick_params(axis="x", labelsize=7 if E > 10 else 9)
    layer_ids = tr[0].model_layer_ids()
    if L <= 64:
        ax.set_yticks(range(L))
        ax.set_yticklabels(
            [f"{i} (L{m})" if tr[0].layer_ids is not None else str(i) for i, m in enumerate(layer_ids)]
        )
        ax.tick_params(axis="y", labelsize=6 if L > 16 else 8)
    tokens = sum(t.num_tokens for t in tr)
    ax.set_title(
        title or f"{tr[0].model_id or 'routing'}: expert load, {tokens} tokens, top-{tr[0].top_k}",
        fontsize=9 if bars else None,
    )
    if bx is not None:
        n = len(bars)
        h = 0.8 / n
        colors = ("tab:orange", "tab:green", "tab:blue", "tab:red", "tab:purple")
        for j, (name, arr) in enumerate(bars.items()):
            y = np.arange(L) - 0.4 + h * (j + 0.5)
            bx.barh(y, np.nan_to_num(arr, nan=0.0), height=h * 0.9, color=colors[j % len(colors)], label=name)
            if L <= 32:
                for yi, v in zip(y, arr):
                    label = "n/a" if not np.isfinite(v) else f"{v:.2f}"
                    bx.text(1.02, yi, label, va="center", fontsize=6 if L > 8 else 7)
        bx.set_xlim(0, 1.22)
        bx.set_xticks([0, 0.5, 1.0])
        bx.axvline(1.0, color="0.5", lw=0.8, ls=":")
        bx.set_ylim(L - 0.5, -0.5)  # the heatmap's rows, top to bottom
        known = tr[0].layer_ids is not None  # else the MoE layer index is all there is
        names = [f"L{m}" if known else str(m) for m in layer_ids]
        if L <= 64:
            bx.set_yticks(range(L))
            bx.set_yticklabels(names)
            bx.tick_params(axis="y", labelsize=6 if L > 16 else 8)
        else:  # some rows, still named by their layer
            bx.yaxis.set_major_locator(MaxNLocator(integer=True))
            bx.yaxis.set_major_formatter(FuncFormatter(lambda v, _: names[int(v)] if 0 <= v < L else ""))
        bx.set_ylabel("model layer" if known else "MoE layer")
        bx.set_xlabel("tokens with the same expert set")
        bx.set_title(agreement_title or "agreement per layer", fontsize=9)
        bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(bars), fontsize=7, frameon=False)
    fig.tight_layout()
    path = os.fspath(path)
    try:
        fig.savefig(path, dpi=dpi, format=fmt)
    except OSError as e:
        if e.errno is not None and not e.filename:  # a failed write (a full disk) names no file: name it
            raise OSError(e.errno, e.strerror, path) from e
        raise
    return path
