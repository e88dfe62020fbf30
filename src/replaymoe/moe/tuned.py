"""Tuned kernel tables of the fused MoE: one per card, chosen by the device at run time.

A :class:`TunedTable` maps a problem ``(H, I, E_local, K, fp8, token bucket)`` to the
:class:`~replaymoe.moe.configs.MoEConfig` measured fastest for it on one card; :func:`moe_config
<replaymoe.moe.configs.moe_config>` takes an entry where the table has one and its heuristics
elsewhere. Its ``backward`` section does the same for the training backward's kernel tiles
(:class:`~replaymoe.moe.configs.MoEBwdConfig` less its data-movement switches, which stay the device's),
read by :func:`moe_bwd_config <replaymoe.moe.configs.moe_bwd_config>`. The tables ship as JSON beside
this module (``tables/<name>.json``, written by ``replaymoe bench tune``, ``--backward`` for the
backward entries; what each run found: bench/README.md, "bench tune"):

* ``h200``: tuned on the H200;
* ``h100``: tuned on the H100; the problems it was not re-tuned for keep the H200's entries (its
  ``base``); backward entries for Mixtral (the dX GEMM in 3 stages);
* ``generic``: no entries, the heuristics alone: what a GPU other than Hopper, and the CPU
  (Triton's interpreter), get.

:func:`table_for` picks a device's table once per device: the set override (:func:`set_tuned_table`)
if any; else on Hopper (compute capability 9.x) the table whose card name the device's name contains,
else the Hopper table of the nearest memory size; else ``generic``. Every entry keeps the fp8
batch-invariance guarantee (:func:`~replaymoe.moe.configs.fp8_invariant`) except those of
``fp8_fast``, which serve ``batch_invariant=False`` only. A table changes time, never which results
a caller may rely on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._validation import fail
from .configs import BWD_TILE_FIELDS, FP8_BLOCK_M, MoEConfig, fp8_invariant, table_key

__all__ = ["TunedTable", "builtin_table", "set_tuned_table", "table_for", "table_key"]

TABLES_DIR = Path(__file__).resolve().parent / "tables"
FORMAT = "replaymoe.moe.tuned_table"
FORMAT_VERSION = 1
# Hopper cards with a shipped table: name -> (the string their device names contain, memory in GiB)
HOPPER_CARDS: dict[str, tuple[str, float]] = {"h100": ("H100", 80.0), "h200": ("H200", 141.0)}
_FIELDS = [
    f.name
    for f in dataclasses.fields(MoEConfig)
    if f.name not in ("half_tiles", "pdl", "swap_ab", "fused_reduce", "merge_slots")
]
# written only where set: fp8 tile-mode entries on the swapped kernels (16- / 32-row tiles, fp8_invariant);
# a direct-mode entry whose top-k sum runs in the reduce kernel instead of GEMM2 (fused_reduce False)
_OPTIONAL = ("swap_ab", "fused_reduce")
_REQUIRED = [f.name for f in dataclasses.fields(MoEConfig) if f.default is dataclasses.MISSING]
_FLAGS = ("direct", "tma", "swap_ab", "fused_reduce")
_POW2 = ("block_m", "block_n1", "block_k1", "warps1", "block_n2", "block_k2", "warps2")
# backward entries: tiles and warps powers of two, the rest positive except these (their ranges)
_BWD_POW2 = ("block_m", "bn_a", "bk_a", "warps_a", "bn_x", "bk_x", "warps_x", "bm_w", "bn_w", "bk_w",
             "warps_w")  # fmt: skip
_BWD_RANGES = {"dw_mode": (0, 2), "dw_progs": (-1, None), "maxnreg_w": (0, None)}


def _key_text(key: tuple) -> str:
    H, I, E, K, fp8, bucket = key  # noqa: E741
    return f"H={H},I={I},E={E},K={K},fp8={int(fp8)},T<={bucket}"


def _key_from_text(text: str) -> tuple:
    try:
        parts = dict(p.split("=") for p in text.replace("T<=", "T=").split(","))
        return (int(parts["H"]), int(parts["I"]), int(parts["E"]), int(parts["K"]), bool(int(parts["fp8"])),
                int(parts["T"]))  # fmt: skip
    except (KeyError, ValueError):
        fail("table entry key", "'H=..,I=..,E=..,K=..,fp8=0|1,T<=bucket'", repr(text))


@dataclass(frozen=True)
class TunedTable:
    """Tuned configurations of one card.

    Attributes
    ----------
    name : str
        ``"h200"``, ``"h100"``, ``"generic"`` or a user's name.
    tuned_on : str
        The device name the entries were measured on (``torch.cuda.get_device_name``), "" if none.
    entries : Mapping[tuple, MoEConfig]
        :func:`table_key` -> configuration (fp8 entries batch-invariant:
        :func:`~replaymoe.moe.configs.fp8_invariant`).
    fp8_fast : Mapping[tuple, MoEConfig]
        fp8 entries for ``batch_invariant=False`` (any tile height).
    backward : Mapping[tuple, Mapping[str, int]]
        :func:`table_key` (``fp8`` False) -> the backward's kernel tiles
        (:data:`~replaymoe.moe.configs.BWD_TILE_FIELDS`: tiles, warps, stages, ``group_m``, ``dw_mode``,
        ``dw_progs``, ``maxnreg_w``); :func:`~replaymoe.moe.configs.moe_bwd_config` keeps the device's
        switches (TMA, half tiles) around them.
    base : str
        The table whose entries this one started from ("" if none); informative.
    notes : str
        Where the entries come from (the tuning runs), free text.
    """

    name: str
    tuned_on: str = ""
    entries: Mapping[tuple, MoEConfig] = field(default_factory=dict)
    fp8_fast: Mapping[tuple, MoEConfig] = field(default_factory=dict)
    base: str = ""
    notes: str = ""
    backward: Mapping[tuple, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, c in self.entries.items():
            if key[4] and not fp8_invariant(c):
                fail(f"entries[{_key_text(key)}].block_m",
                     f"{FP8_BLOCK_M}, or 16 / 32 with swap_ab (fp8 batch invariance: one MMA kind)",
                     f"{c.block_m} (swap_ab={c.swap_ab})")  # fmt: skip
        for key, fields in self.backward.items():
            _check_backward_entry(f"backward[{_key_text(key)}]", key, fields)

    def lookup(self, key: tuple, *, fp8_fast: bool = False) -> MoEConfig | None:
        """The entry of ``key`` (from ``fp8_fast`` for fp8 with ``batch_invariant=False``), or None."""
        return (self.fp8_fast if fp8_fast else self.entries).get(key)

    def lookup_backward(self, key: tuple) -> Mapping[str, int] | None:
        """The backward's kernel tiles for ``key`` (a :func:`table_key` with ``fp8`` False), or None."""
        return self.backward.get(key)

    def with_entries(
        self, entries: Mapping[tuple, MoEConfig], *, fp8_fast: bool = False, backward: bool = False, **changes
    ) -> TunedTable:
        """A copy with ``entries`` added (they win over this table's; ``backward``: backward entries, kernel
        tiles per key), and other fields changed."""
        which = "backward" if backward else "fp8_fast" if fp8_fast else "entries"
        merged: dict[str, Any] = {which: {**getattr(self, which), **entries}}
        return dataclasses.replace(self, **merged, **changes)

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        def rows(table):
            return {_key_text(k): {**{f: getattr(c, f) for f in _FIELDS},
                                   **{f: getattr(c, f) for f in _OPTIONAL if getattr(c, f) is not None}}
                    for k, c in sorted(table.items())}  # fmt: skip

        backward = {_key_text(k): {f: int(fields[f]) for f in BWD_TILE_FIELDS}
                    for k, fields in sorted(self.backward.items())}  # fmt: skip
        return {"format": FORMAT, "version": FORMAT_VERSION, "name": self.name, "tuned_on": self.tuned_on,
                "base": self.base, "notes": self.notes, "entries": rows(self.entries),
                "fp8_fast": rows(self.fp8_fast), "backward": backward}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Mapping) -> TunedTable:
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            got = repr(obj.get("format")) if isinstance(obj, Mapping) else type(obj).__name__
            fail("table", f"a JSON object with format {FORMAT!r}", got)
        if obj.get("version") != FORMAT_VERSION:
            fail("table version", FORMAT_VERSION, obj.get("version"))

        def configs(rows, what):
            out = {}
            for text, fields in (rows or {}).items():
                key = _key_from_text(text)
                unknown, missing = set(fields) - set(_FIELDS) - set(_OPTIONAL), set(_REQUIRED) - set(fields)
                if unknown or missing:
                    names = ", ".join(_FIELDS + list(_OPTIONAL))
                    fail(f"{what}[{text}]", f"the fields of MoEConfig ({names})",
                         f"unknown {sorted(unknown)}, missing {sorted(missing)}")  # fmt: skip
                bad = [f for f, v in fields.items() if not isinstance(v, int) or (v < 1 and f not in _FLAGS)]
                bad += [f for f in _OPTIONAL if f in fields and not isinstance(fields[f], bool)]
                bad += [f for f in _POW2 if f not in bad and fields[f] & (fields[f] - 1)]
                if bad:
                    fail(
                        f"{what}[{text}]",
                        "positive ints, tiles and warps powers of two (direct, tma, swap_ab: true/false)",
                        {f: fields[f] for f in bad},
                    )
                out[key] = MoEConfig(**fields)
            return out

        text = {k: str(obj.get(k, "")) for k in ("name", "tuned_on", "base", "notes")}
        entries, fast = configs(obj.get("entries"), "entries"), configs(obj.get("fp8_fast"), "fp8_fast")
        backward = {_key_from_text(t): dict(fields) for t, fields in (obj.get("backward") or {}).items()}
        return cls(text["name"], text["tuned_on"], entries, fast, text["base"], text["notes"], backward)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> TunedTable:
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            fail("path", "a readable tuned-table JSON file", f"{str(path)!r} ({exc})")
        return cls.from_json(obj)


def _check_backward_entry(what: str, key: tuple, fields: Mapping) -> None:
    """A backward entry: fp8 False in its key, exactly :data:`BWD_TILE_FIELDS`, ints in range."""
    if key[4]:
        fail(what, "a key with fp8=0 (the training backward is bf16 / fp16 / fp32)", _key_text(key))
    if not isinstance(fields, Mapping) or set(fields) != set(BWD_TILE_FIELDS):
        got = sorted(fields) if isinstance(fields, Mapping) else type(fields).__name__
        fail(what, f"the fields {', '.join(BWD_TILE_FIELDS)}", got)
    bad = {}
    for f, v in fields.items():
        low, high = _BWD_RANGES.get(f, (1, None))
        out_of_range = v < low or (high is not None and v > high) if type(v) is int else True
        if out_of_range or (f in _BWD_POW2 and v & (v - 1)):
            bad[f] = v
    if bad:
        fail(what, "ints: tiles and warps powers of two, dw_mode 0-2, dw_progs >= -1, the rest >= 1", bad)


_BUILTIN: dict[str, TunedTable] = {}


def builtin_table(name: str) -> TunedTable:
    """The shipped table ``name`` (``"h200"``, ``"h100"`` or ``"generic"``), loaded once."""
    table = _BUILTIN.get(name)
    if table is None:
        if name == "generic":
            table = TunedTable("generic")
        elif name in HOPPER_CARDS:
            table = TunedTable.load(TABLES_DIR / f"{name}.json")
        else:
            fail("name", f"one of {sorted([*HOPPER_CARDS, 'generic'])}", repr(name))
        _BUILTIN[name] = table
    return table


def choose_table_name(device_name: str, capability: tuple[int, int], memory_gib: float) -> str:
    """Which shipped table a device gets (module docstring): by name on Hopper, else the Hopper table
    of the nearest memory size; ``generic`` off Hopper."""
    if capability[0] != 9:
        return "generic"
    words = re.findall(r"[A-Z0-9]+", device_name.upper())  # "GH200" is not an "H200"
    for name, (marker, _) in HOPPER_CARDS.items():
        if marker in words:
            return name
    return min(HOPPER_CARDS, key=lambda n: abs(HOPPER_CARDS[n][1] - memory_gib))


_OVERRIDE: list[TunedTable | None] = [None]
_BY_DEVICE: dict = {}


def set_tuned_table(table: TunedTable | str | os.PathLike | None) -> None:
    """Use ``table`` (a :class:`TunedTable`, the path of its JSON, or a shipped name) on every device
    from now on; None goes back to choosing by device. For a card without a shipped table: tune it
    (``replaymoe bench tune``) and set the result here."""
    if table is not None and not isinstance(table, TunedTable):
        text = str(table)
        table = builtin_table(text) if text in (*HOPPER_CARDS, "generic") else TunedTable.load(text)
    _OVERRIDE[0] = table
    _BY_DEVICE.clear()


def table_for(device: torch.device) -> TunedTable:
    """The table of ``device`` (module docstring; chosen once per device)."""
    table = _BY_DEVICE.get(device)
    if table is None:
        from .._backend import INTERPRET

        if _OVERRIDE[0] is not None:
            table = _OVERRIDE[0]
        elif device.type != "cuda" or INTERPRET:
            table = builtin_table("generic")
        else:
            props = torch.cuda.get_device_properties(device)
            name = choose_table_name(props.name, (props.major, props.minor), props.total_memory / 2**30)
            table = builtin_table(name)
        _BY_DEVICE[device] = table
    return table
