"""DeepEP as the side-by-side peer of ``replaymoe bench ep`` (``--peer deepep``): DeepEP v1.2.1's
intranode dispatch / combine, loaded at run time from a git-ignored build (``--deepep-dir``;
never a dependency), its NVLink chunk sizes tuned once, then timed on the same tokens, routing and
weights as ours in eager, cached and CUDA-graph modes (:class:`DeepEPPeer`).
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from .ep_shape import Shape
from .ep_timing import err, graph, sync, time_phases, time_replays

# where .peers_ep/build_deepep.sh builds DeepEP (``replaymoe bench ep --deepep-dir``'s default)
DEEPEP_DIR = "/tmp/deepep/DeepEP-1.2.1"


def import_deepep(path: str = DEEPEP_DIR):
    """``deep_ep`` from the built DeepEP source tree ``path``."""
    if path not in sys.path:
        sys.path.insert(0, path)
    import deep_ep

    return deep_ep


class DeepEPPeer:
    """DeepEP v1.2.1 intranode ``Buffer.dispatch`` / ``Buffer.combine`` on the same tokens, routing
    and weights as ours (hidden bf16, top-k ids as int64, weights fp32), with ``num_sms`` SMs, for the
    layer ``shape``; ``align``: :func:`~replaymoe.bench.ep_timing.time_phases`.

    Modes:
    * ``eager``: ``get_dispatch_layout`` + ``dispatch`` (the host waits for the received counts: that
      is DeepEP's normal mode) and ``combine`` with the handle;
    * ``graph``: the same with ``num_worst_tokens = ep * T`` (no host sync; DeepEP's CUDA-graph
      mode), dispatch and combine each captured in a CUDA graph;
    * ``cached``: ``dispatch`` of the hidden states alone with a previous call's handle (the mode
      DeepEP's own tuning times), eager.
    The NVLink chunk sizes are tuned once at the largest token count, like DeepEP's test does
    (:meth:`tune`); the SM count stays fixed.
    """

    def __init__(
        self,
        ep: int,
        rank: int,
        num_sms: int,
        max_tokens: int,
        log,
        path: str = DEEPEP_DIR,
        *,
        shape: Shape,
        align: bool,
    ) -> None:
        deep_ep = import_deepep(path)
        self.deep_ep, self.ep, self.rank, self.num_sms, self.log = deep_ep, ep, rank, num_sms, log
        self.shape, self.align = shape, align
        deep_ep.Buffer.set_num_sms(num_sms)
        self.dcfg = deep_ep.Buffer.get_dispatch_config(ep)
        self.ccfg = deep_ep.Buffer.get_combine_config(ep)
        nvl = 0
        for chunk in (4, 8, 12, 16, 24, 32):
            cfg = deep_ep.Config(num_sms, chunk, 256, 6, 128)
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(shape.H * 2, ep))
        for cfg in (self.dcfg, self.ccfg):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(shape.H * 2, ep))
        self.buf = deep_ep.Buffer(dist.group.WORLD, nvl, 0)
        self.chunks = ("default", "default")

    def _dispatch(self, idx, x, w, cfg, worst=0):
        b = self.buf
        ntr, _, nte, in_rank, _ = b.get_dispatch_layout(idx, self.shape.E)
        out = b.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=in_rank, num_tokens_per_expert=nte,
                         topk_idx=idx, topk_weights=w, config=cfg, num_worst_tokens=worst)  # fmt: skip
        return out[0], out[4]  # recv_x, handle

    def tune(self, inputs, *, iters: int, warmup: int) -> list[dict]:
        """Best NVLink chunk sizes (cached mode at the largest T), as DeepEP's test tunes them."""
        ids, x, w = inputs[0], inputs[1], inputs[2]
        idx = ids.long()
        deep_ep = self.deep_ep
        recv_x, handle = self._dispatch(idx, x, w, self.dcfg)
        rows = []
        T = ids.shape[0]
        tuned = {  # op -> (NVLink chunk sizes tried, the cached-mode call with a config)
            "dispatch": ((8, 16, 24, 32), lambda cfg: self.buf.dispatch(x, handle=handle, config=cfg)),
            "combine": ((4, 8, 12, 16), lambda cfg: self.buf.combine(recv_x, handle, config=cfg)),
        }
        best = {}
        for op, (chunks, call) in tuned.items():
            best[op] = (None, float("inf"))
            for chunk in chunks:
                cfg = deep_ep.Config(self.num_sms, chunk, 256, 6, 128)

                def it(ev, cfg=cfg, call=call):
                    ev[0].record()
                    call(cfg)
                    ev[1].record()

                us = time_phases(it, 1, iters, warmup, align=self.align)[0][0]
                rows.append({"impl": "deepep-tune", "op": op, "mode": "cached", "nvl_chunk": chunk,
                             "num_sms": self.num_sms, "tokens": T, "us": round(us, 2)})  # fmt: skip
                if us < best[op][1]:
                    best[op] = (cfg, us, chunk)
        best_d, best_c = best["dispatch"], best["combine"]
        self.dcfg, self.ccfg = best_d[0], best_c[0]
        self.chunks = (best_d[2], best_c[2])
        self.log(f"[rank {self.rank}] DeepEP tuned: dispatch chunk {best_d[2]}, combine chunk {best_c[2]}")
        return rows

    def time(self, ids, x, w, T, iters, warmup, graphs):
        idx = ids.long()
        b = self.buf
        st = {}

        def it(ev):
            ev[0].record()
            t0 = time.perf_counter()
            st["rx"], st["h"] = self._dispatch(idx, x, w, self.dcfg)
            t1 = time.perf_counter()
            ev[1].record()
            t2 = time.perf_counter()
            b.combine(st["rx"], st["h"], config=self.ccfg)
            t3 = time.perf_counter()
            ev[2].record()
            return (t1 - t0, t3 - t2)

        dev, host = time_phases(it, 2, iters, warmup, align=self.align)
        res = {"eager": (tuple(dev), tuple(host))}
        rx, h = st["rx"], st["h"]

        def itc(ev):
            ev[0].record()
            t0 = time.perf_counter()
            b.dispatch(x, handle=h, config=self.dcfg)
            t1 = time.perf_counter()
            ev[1].record()
            t2 = time.perf_counter()
            b.combine(rx, h, config=self.ccfg)
            t3 = time.perf_counter()
            ev[2].record()
            return (t1 - t0, t3 - t2)

        dev, host = time_phases(itc, 2, iters, warmup, align=self.align)
        res["cached"] = (tuple(dev), tuple(host))
        if not graphs:
            return res
        worst = T * self.ep
        try:
            sync()
            rxw, hw = self._dispatch(idx, x, w, self.dcfg, worst)
            b.combine(rxw, hw, config=self.ccfg)
            sync()
            gd, outs = graph(lambda: self._dispatch(idx, x, w, self.dcfg, worst))
            gc, _ = graph(lambda: b.combine(outs[0], outs[1], config=self.ccfg), pool=gd.pool())
        except Exception as e:  # DeepEP may refuse capture: eager figures stand
            self.log(f"[rank {self.rank}] DeepEP graph capture failed: {err(e)}")
            return res

        res["graph"] = (time_replays([gd, gc], iters, warmup, align=self.align), None)
        return res
