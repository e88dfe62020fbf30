"""Launch Triton kernels with less host work per call than ``kernel[grid](...)``: the one fast launcher.

At decode sizes a forward is bound by the CPU: Triton's per-call dispatch (current device and
stream lookups, pre-run hooks, a string-built cache key, launch metadata) costs tens of
microseconds per launch, more than the kernel runs. Two mechanisms, for two kinds of caller:

:class:`FastLaunch` (``fast(kernel)[grid](*args, **kwargs)``): any kernel, any arguments (routing, moe,
the hf step bookkeeping). It launches exactly the kernel Triton would pick:

* the specialization comes from Triton's own per-kernel binder (the same values-to-signature
  mapping: dtypes, 16-byte alignment of pointers, integers equal to 1 or divisible by 16,
  constexprs), so a call whose arguments specialize differently gets its own compiled kernel;
* the first call of every specialization goes through Triton (compiling it if needed) and its
  compiled kernel is kept; later calls launch it directly on the current stream, with tensors passed
  as their addresses (Triton's launcher would otherwise query the driver about every pointer), through
  the launcher's native entry point when the kernel needs no scratch memory;
* a call whose arguments repeat an earlier call's in everything Triton specializes on skips the binder
  too: the call is keyed by its arguments' types, its scalars' exact values (bools, ints, floats,
  strings, None), its
  tensors' dtypes and 16-byte alignment and its tensor descriptors' dtypes, blocks, padding and
  alignment, a superset of what the binder reads, so two calls with one key bind alike. The key costs
  a fraction of the binder's per-argument specialization (tens of microseconds per launch of a
  50-argument GEMM on a slow host). A new key (a new T, say) binds once through Triton.

:meth:`FastLaunch.launch_fixed` skips the binder as well, for a kernel whose caller's key fixes the
compiled variant (it does not specialize on integer values or pointer alignment).

:class:`Launcher` (``Launcher(kernel, num_warps)(grid, args)``): one kernel with one specialization
fixed for the launcher's life, its caller holding the arguments (addresses included) ready-made. The
expert-parallel all-to-all uses it: the plan cached by a call's signature fixes every integer,
constexpr and pointer alignment, so a launcher made for that plan compiles once and then launches
through the compiled kernel's launcher with no binding, no key and no conversion per call. Use it only
where the caller can promise that; else :class:`FastLaunch`.

The plain Triton path is used when the process runs Triton's interpreter, when CUDA is
unavailable, when a launch hook (a profiler) is installed, and when ``REPLAYMOE_FAST_LAUNCH=0``
(both mechanisms; :data:`ENABLED` holds it: :attr:`replaymoe._switches.Switches.fast_launch`, read once
when this module is imported).
"""

from __future__ import annotations

from typing import Any, Final

import torch

from ._switches import DEFAULTS, INTERPRET

__all__ = ["FastLaunch", "Launcher", "addresses", "cdiv", "fast", "hooks_off", "next_power_of_2"]

# the direct launch paths are on: the process default (REPLAYMOE_FAST_LAUNCH; no per-call form) outside
# Triton's interpreter, fixed at import (a constant of the launch path, never reassigned; a benchmark
# that wants Triton's own path installs a launch hook, see hooks_off)
ENABLED: Final = DEFAULTS.fast_launch and not INTERPRET


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers: ``triton.cdiv`` on the host, without its cost (Triton's is a
    ``constexpr_function``, about 1.5 µs a call, and a training step sizes hundreds of grids)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for ``n <= 0``): ``triton.next_power_of_2`` on the
    host, without its cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class FastLaunch:
    """A ``@triton.jit`` function with a cache of compiled kernels keyed by specialization.

    ``FastLaunch(kernel)[grid](*args, **kwargs)`` takes the same arguments as
    ``kernel[grid](*args, **kwargs)`` (launch options such as ``num_warps`` included).
    """

    __slots__ = ("fn", "_compiled", "_fixed", "_memo")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: dict[tuple, Any] = {}
        self._fixed: dict[Any, tuple] = {}  # launch_fixed: caller's key -> compiled entry, parameter order
        self._memo: dict[tuple, tuple] = {}  # launch: arguments' key -> compiled entry, parameter order

    def __getitem__(self, grid: tuple[int, ...]):
        return _Bound(self, grid)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if not ENABLED or not hooks_off():
            self.fn[grid](*args, **kwargs)
            return
        device = torch._C._cuda_getDevice()
        memo_key = _call_key(device, args, kwargs)
        entry = self._memo.get(memo_key) if memo_key is not None else None
        if entry is not None:
            entry.run(grid, args, kwargs, device)
            return
        self._bind_and_launch(grid, args, kwargs, device)
        if memo_key is None:  # an argument it cannot key: always through the binder
            return
        entry = self._fixed_entry(args, kwargs, typed=True)
        if entry is not None:
            if len(self._memo) >= _MEMO_LIMIT:  # shapes that never repeat: start over, stay bounded
                self._memo.clear()
            self._memo[memo_key] = entry

    def _bind_and_launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict, device: int) -> None:
        """Launch through Triton's binder (and compile the specialization on its first call)."""
        caches = self.fn.device_caches.get(device)
        if caches is None:  # first launch on this device: Triton builds its binder
            self._compile(grid, args, kwargs, None)
            return
        bound, specialization, options = caches[4](*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        entry = self._compiled.get(key)
        if entry is None:
            self._compile(grid, args, kwargs, key)
            return
        kernel, launch, flags, tensors = entry
        values = list(bound.values())
        if tensors is None:  # which parameters are tensors: the specialization (the key) fixes it
            tensors = tuple(i for i, v in enumerate(values) if isinstance(v, torch.Tensor))
            self._compiled[key] = (kernel, launch, flags, tensors)
        for i in tensors:  # tensors as their addresses: Triton's launcher then skips a driver query each
            values[i] = values[i].data_ptr()
        _launch_native(launch, grid, device, kernel.function, flags, kernel.packed_metadata, values)

    def launch_fixed(self, key: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        """:meth:`launch` without Triton's binder, for a kernel whose compiled variant ``key`` fixes.

        The caller vouches that every call with the same ``key`` (hashable) specializes alike: the
        kernel marks its non-constexpr parameters ``do_not_specialize`` and
        ``do_not_specialize_on_alignment`` (so that only their types count), ``key`` covers the
        tensors' dtypes, the constexprs and launch options, and the integers stay in int32. The
        first call of a key goes through :meth:`launch` and records the compiled kernel and the
        parameter order; later calls only build the argument list (saving the binder's few
        microseconds of host time per launch). ``kwargs`` must name the same parameters on every call
        of a key; parameters left out take the value they had on its first call (their defaults;
        scalars only: no entry keeps a call's tensors).
        """
        entry = self._fixed.get(key) if ENABLED else None
        if entry is None or not hooks_off():
            self.launch(grid, args, kwargs)
            if ENABLED and hooks_off():
                self._fixed[key] = self._fixed_entry(args, kwargs)
            return
        entry.run(grid, args, kwargs, torch._C._cuda_getDevice())

    def _fixed_entry(self, args: tuple, kwargs: dict, typed: bool = False) -> _Entry | None:
        """What :meth:`launch_fixed` / the memo replays for calls like this one (which has just been
        launched). ``typed``: the caller's key fixes every argument's type (the memo's does), so the
        entry converts the tensors and descriptors of this call's positions only."""
        device = torch._C._cuda_getDevice()
        bound, specialization, options = self.fn.device_caches[device][4](*args, **kwargs)
        compiled = self._compiled.get((device, tuple(specialization), tuple(options.items())))
        if compiled is None:
            return None
        kernel, launch, flags, _ = compiled
        names = list(bound)
        # keyword parameters and defaults; a call's own tensors and descriptors are not kept (the
        # entry outlives the call: it would hold their memory, and a CUDA graph's pool, alive)
        rest = [(n, bound[n] if type(bound[n]) in _SCALARS else _GIVEN) for n in names[len(args) :]]
        if not typed:
            return _Entry(kernel, launch, flags, rest, None, ())
        values = list(bound.values())
        tensors = tuple(i for i, v in enumerate(values) if isinstance(v, torch.Tensor))
        descs = tuple(i for i, v in enumerate(values) if _descriptor_base(v) is not None)
        return _Entry(kernel, launch, flags, rest, tensors, descs)

    def _compile(self, grid: tuple[int, ...], args: tuple, kwargs: dict, key: tuple | None) -> None:
        kernel = self.fn[grid](*args, **kwargs)
        if key is None or kernel is None:
            return
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        if getattr(kernel, "function", None) is not None and hasattr(kernel, "packed_metadata"):
            self._compiled[key] = (kernel, *_native_launch(kernel), None)


def _native_launch(kernel: Any) -> tuple[Any, tuple]:
    """``(launch, flags)``: what a launch calls with ``(gx, gy, gz, stream, function, *flags,
    packed_metadata, None, None, None, *args)``. The entry point under Triton's launcher object
    (``kernel.run``, Triton 3.6's ``CudaLauncher``) with the arguments the object would pass ahead of
    the packed metadata, when the kernel needs no global or profiler scratch memory (the object then
    only forwards); else, or for a launcher of another shape, ``(kernel.run, ())``."""
    run = kernel.run
    native = getattr(run, "launch", None)
    try:
        if native is None or run.global_scratch_size > 0 or run.profile_scratch_size > 0:
            return run, ()
        return native, (run.launch_cooperative_grid, run.launch_pdl, None, None)
    except AttributeError:
        return run, ()


_MEMO_LIMIT = 4096  # keys kept per kernel before the memo starts over
_UNKEYED = object()  # _arg_key of an argument it cannot key: such a call is not memoized
_GIVEN = object()  # in an entry: a parameter every call of the key passes itself (by keyword)
_SCALARS = (bool, int, float, str, type(None))


def _call_key(device: int, args: tuple, kwargs: dict) -> tuple | None:
    """The memo key of one call: ``(device, keyword names, the arguments' types, their keys)``, where a
    tensor's key is its dtype and 16-byte alignment, a scalar's its value (its type is in the types),
    anything else's its ``_arg_key``; None when an argument cannot be keyed. This runs on every
    launch: the keys are read by a function made once per tuple of argument types
    (:func:`_keyer`), one tuple expression with no branch per argument."""
    values = (*args, *kwargs.values()) if kwargs else args
    types = tuple(map(type, values))
    keyer = _KEYERS.get(types)
    if keyer is None:
        if len(_KEYERS) >= _MEMO_LIMIT:  # type tuples that never repeat: start over, stay bounded
            _KEYERS.clear()
        keyer = _KEYERS[types] = _keyer(types)
    read, others = keyer
    keys = read(values)
    if others and any(k is _UNKEYED for k in keys):
        return None
    return (device, tuple(kwargs), types, keys)


def _keyer(types: tuple) -> tuple[Any, bool]:
    """``(read, others)`` for calls whose arguments have ``types``: ``read(values)`` is the tuple of
    the arguments' keys (see :func:`_call_key`), ``others`` whether an argument is neither a tensor nor
    a scalar (its ``_arg_key`` may be ``_UNKEYED``)."""
    parts, others = [], False
    for i, t in enumerate(types):
        if t is torch.Tensor or t is _PARAMETER:
            parts.append(f"v[{i}].dtype, v[{i}].data_ptr() & 15 == 0, ")
        elif t in _SCALARS:
            parts.append(f"v[{i}], ")
        else:
            parts.append(f"_arg_key(v[{i}]), ")
            others = True
    return eval(f"lambda v: ({''.join(parts)})", {"_arg_key": _arg_key}), others


_KEYERS: dict[tuple, tuple[Any, bool]] = {}  # argument types -> _keyer's (read, others)


_PARAMETER = torch.nn.Parameter


def _descriptor_base(a: Any) -> torch.Tensor | None:
    """The tensor of a host-side TensorDescriptor (None for anything else)."""
    base = getattr(a, "base", None) if hasattr(a, "block_shape") else None
    return base if isinstance(base, torch.Tensor) else None


class _Entry:
    """One compiled specialization, ready to launch with a call's arguments (no binder).

    ``rest``: the parameters after the positional ones, with their scalar defaults (``_GIVEN``: the
    call passes it); ``tensors``: the parameter positions holding tensors when the key fixes them
    (None: look at each value); ``descs``: the positions of host-side tensor descriptors, encoded here
    through a cache (:func:`_encode_descriptor`) when the kernel's launcher is Triton's descriptor
    wrapper around its native entry point, which is then called directly."""

    __slots__ = ("function", "packed", "launch", "flags", "rest", "tensors", "descs", "metas")

    def __init__(self, kernel: Any, launch: Any, flags: tuple, rest: list, tensors: tuple | None,
                 descs: tuple) -> None:  # fmt: skip
        self.function, self.packed = kernel.function, kernel.packed_metadata
        self.launch, self.flags, self.rest, self.tensors = launch, flags, rest, tensors
        self.descs, self.metas = (), ()
        if descs:
            unwrapped = _unwrap_descriptor_launch(launch, len(descs))
            if unwrapped is not None:
                self.launch, self.metas = unwrapped
                self.descs = descs

    def run(self, grid: tuple[int, ...], args: tuple, kwargs: dict, device: int) -> None:
        rest = self.rest
        values = [*args, *[kwargs[n] if n in kwargs else v for n, v in rest]] if rest else list(args)
        if self.tensors is None:
            values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
        else:
            for i in self.tensors:
                values[i] = values[i].data_ptr()
        if self.descs:
            values = _expand_descriptors(values, self.descs, self.metas)
        _launch_native(self.launch, grid, device, self.function, self.flags, self.packed, values)


def _launch_native(launch: Any, grid: tuple[int, ...], device: int, function: Any, flags: tuple, packed: Any,
                   values: list) -> None:  # fmt: skip
    """One launch on the current stream through ``launch`` (see :func:`_native_launch`)."""
    launch(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        torch._C._cuda_getCurrentRawStream(device),
        function,
        *flags,
        packed,
        None,
        None,
        None,
        *values,
    )


def _unwrap_descriptor_launch(launch: Any, n: int) -> tuple[Any, tuple] | None:
    """``(native launch, metadata per descriptor)`` under Triton 3.6's ``wrap_handle_tensordesc``
    wrapper (which encodes every descriptor again on every launch), or None where ``launch`` is not
    that wrapper or a descriptor has no TMA metadata (then the wrapper runs as it is)."""
    code = getattr(launch, "__code__", None)
    if code is None or launch.__name__ != "inner" or launch.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
    native, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    if native is None or not metas or len(metas) != n or any(m is None for m in metas):
        return None
    return native, tuple(metas)


_ENCODED: dict[tuple, list] = {}  # descriptor key -> [CUtensorMap, *shape, *strides]
_ENCODED_LIMIT = 4096


def _expand_descriptors(values: list, descs: tuple, metas: tuple) -> list:
    """``values`` with each descriptor replaced by what Triton's wrapper would pass in its place."""
    out: list = []
    prev = 0
    for pos, meta in zip(descs, metas):
        out.extend(values[prev:pos])
        out.extend(_encode_descriptor(values[pos], meta))
        prev = pos + 1
    out.extend(values[prev:])
    return out


def _encode_descriptor(d: Any, meta: dict) -> list:
    """Triton's ``make_tensordesc_arg(d, meta)``, cached by everything the encoding reads (the base
    address, shape, strides, padding and the kernel's TMA metadata): the encoding is a pure function
    of those values, so a hit is the same bits (no tensor is kept: only its address is)."""
    key = (d.base.data_ptr(), *d.shape, None, *d.strides, d.padding, meta["swizzle"], meta["elem_size"],
           meta["elem_type"], *meta["block_size"], meta["fp4_padded"])  # fmt: skip
    enc = _ENCODED.get(key)
    if enc is None:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        enc = make_tensordesc_arg(d, meta)
        if len(_ENCODED) >= _ENCODED_LIMIT:
            _ENCODED.clear()
        _ENCODED[key] = enc
    return enc


def _arg_key(a: Any) -> Any:
    """What of one argument can change Triton's specialization (a superset; see the module docstring)."""
    t = type(a)
    if t in _SCALARS:
        return (t, a)  # the type too: True == 1 and 1 == 1.0 specialize differently
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    base = getattr(a, "base", None)  # a host-side TensorDescriptor
    if isinstance(base, torch.Tensor):
        return (t, base.dtype, base.data_ptr() & 15 == 0, tuple(a.block_shape), a.padding)
    # anything else (a tuple, a constexpr object): no key; a call holding one always binds through
    # Triton and is never memoized (see FastLaunch.launch)
    return _UNKEYED


class _Bound:
    __slots__ = ("owner", "grid")

    def __init__(self, owner: FastLaunch, grid: tuple[int, ...]) -> None:
        self.owner, self.grid = owner, grid

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.owner.launch(self.grid, args, kwargs)


_WRAPPED: dict[int, FastLaunch] = {}


def fast(fn: Any) -> FastLaunch:
    """The :class:`FastLaunch` of ``fn`` (one per kernel, kept for the process)."""
    wrapped = _WRAPPED.get(id(fn))
    if wrapped is None or wrapped.fn is not fn:
        wrapped = _WRAPPED[id(fn)] = FastLaunch(fn)
    return wrapped


_RUNTIME_KNOBS = None


def hooks_off() -> bool:
    """No Triton launch hook is installed (profilers install one; they need the plain path)."""
    global _RUNTIME_KNOBS
    if _RUNTIME_KNOBS is None:
        from triton import knobs

        _RUNTIME_KNOBS = knobs.runtime
    rt = _RUNTIME_KNOBS
    return _empty(rt.launch_enter_hook) and _empty(rt.launch_exit_hook)


def _empty(hook: Any) -> bool:
    """``None`` (older Triton) or a hook chain without calls (Triton 3.6)."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


class Launcher:
    """One kernel with one fixed specialization; ``launcher(grid, args)`` (see the module docstring).

    ``kernel[grid](*args)`` spends several microseconds of host time per launch binding arguments,
    computing the specialization key and looking the compiled kernel up. A :class:`Launcher` launches
    through Triton once, keeps the compiled kernel, and afterwards calls its launcher directly.

    The caller must pass every parameter of the kernel positionally, constexprs included, in the
    kernel's order, and must make a new :class:`Launcher` whenever anything but a tensor's address
    may change (a tensor's alignment modulo 16 included: Triton specializes on it). The direct path is
    used only on CUDA, on the device the kernel was compiled for, when no Triton launch hook
    (profiler) is installed, and while :data:`ENABLED` holds when the kernel is first launched.
    """

    __slots__ = ("fn", "num_warps", "compiled", "device", "_native", "_flags")

    def __init__(self, fn, num_warps: int = 4) -> None:
        self.fn = fn
        self.num_warps = num_warps
        self.compiled = None
        self.device = -1
        self._native, self._flags = None, ()  # the compiled kernel's launch entry (see _native_launch)

    def ready(self) -> bool:
        """Whether :meth:`fast` may be used now (compiled here, on the current device, no hooks)."""
        return self.compiled is not None and hooks_off() and torch._C._cuda_getDevice() == self.device

    def fast(self, grid: tuple[int, ...], args: tuple) -> None:
        """Launch the compiled kernel directly (only after :meth:`ready`). Pointer arguments may be
        given as integer addresses: Triton's launcher then skips its per-pointer driver query. The
        launch goes through the launcher's native entry point where the kernel needs no scratch memory
        (as :class:`FastLaunch` does), else through Triton's launcher object."""
        ck = self.compiled
        g1 = grid[1] if len(grid) > 1 else 1
        self._native(grid[0], g1, 1, torch._C._cuda_getCurrentRawStream(self.device), ck.function,
                     *self._flags, ck.packed_metadata, None, None, None, *args)  # fmt: skip

    def __call__(self, grid: tuple[int, ...], args: tuple) -> None:
        if self.compiled is not None and self.ready():
            self.fast(grid, args)
            return
        ck = self.fn[grid](*args, num_warps=self.num_warps)
        if ENABLED and ck is not None and self.compiled is None and torch.cuda.is_available():
            if hasattr(ck, "result"):  # an asynchronous compile's future
                ck = ck.result()
            if getattr(ck, "function", None) is not None and hasattr(ck, "packed_metadata"):
                self._native, self._flags = _native_launch(ck)
                self.compiled = ck
                self.device = torch.cuda.current_device()

    def registers(self) -> tuple[int, int] | None:
        """(registers per thread, spills) of the compiled kernel, once launched on a GPU."""
        ck = self.compiled
        if ck is None:
            return None
        return getattr(ck, "n_regs", -1), getattr(ck, "n_spills", -1)


def addresses(args: tuple) -> tuple:
    """``args`` with every tensor replaced by its address (for :meth:`Launcher.fast`)."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
