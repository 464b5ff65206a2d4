"""A key/value cache for incremental decoding.

Self-attention: each step appends the new tokens' keys and values, and the new queries
attend to everything cached (``causal=True`` aligns bottom-right, so query ``i`` of the step
sits at position ``len(cache) - Tq + i``). Cross-attention: the encoder's keys and values are
computed once, on the first step, and reused.

Layout: one preallocated buffer per role, ``(B, h_kv, capacity, d)``. A step writes its
positions in place and attention reads the views ``buffer[:, :, :len]`` (batch and head strides
of the full buffer, contiguous rows): nothing is copied per step. When the buffer is full it
grows geometrically (×2), so appending ``T`` positions costs ``O(T)`` copies in all;
``capacity=`` (or :meth:`reserve`) sizes it once when the length is known (generation).

Storage dtype: ``dtype=torch.bfloat16`` keeps a bf16 cache for an fp32 model (half the memory
and half the bytes read per step); :meth:`update` then returns the bf16 views, and
:class:`~qkv.MultiHeadAttention` widens them to the queries' dtype before attention.
``dtype=torch.int8`` stores each key and value row (one token, one head) as ``d`` int8
values and one fp32 scale (:func:`quantize_rows`: ``row ≈ scale · values``, ``scale =
max|row| / 127``): about a quarter of the fp32 bytes. Its buffers and views are those packed
rows, ``(B, h_kv, T, d + 4)`` int8, which the decode kernel reads as they are;
:func:`dequantize_rows` widens them for any other use. Each element is off by at most half
a step, ``max|row| / 254``.

Beams: :meth:`reorder` gathers only the filled positions, into a second buffer that is
allocated once and swapped with the first (``index_select(..., out=)``), so a beam step costs
``B·h_kv·len·d`` copies, never the whole capacity, and no allocation; a smaller batch
(sentences that finished) lives in the first rows of the same buffers.

Pages: buffers of 16 MiB and more are asked for on 2 MiB pages where Linux offers them
(``qkv._pages``): a decode step streams the whole cache, and reads it faster without a TLB
walk every 4 KiB.

Reused memory: with ``pool=`` (a :class:`BufferPool`) the buffers come from the pool and go
back to it on :meth:`reset`, so that a generation loop run again and again (a translator
serving sentences) does not hand its memory back to the OS and fault it in again, zeroed,
4 KiB at a time.

One layer per cache: the first :class:`~qkv.MultiHeadAttention` that uses a cache owns it
(a weak reference), and another layer using it is a ``ValueError`` — sharing one cache
between layers would interleave their keys and values. :meth:`reset` releases it.

Shapes: keys and values are ``(B, h_kv, T, d_k)``.
"""

from __future__ import annotations

import math
import numbers
import threading
import weakref

import torch
from torch import Tensor

from qkv import _pages
from qkv.kernels.decode import SCALE_BYTES, dequantize_rows  # the rows the decode kernel reads

__all__ = ["SCALE_BYTES", "BufferPool", "KVCache", "dequantize_rows", "quantize_rows"]

_MIN_CAPACITY = 16


def quantize_rows(x: Tensor) -> Tensor:
    """``x (..., d)`` floating → packed int8 rows ``(..., d + 4)``: ``d`` values
    ``round(x / scale)`` in [-127, 127], then ``scale = max|x| / 127`` (fp32, its 4 bytes).

    A row of zeros gets scale 0 and values 0. A row holding a NaN or an inf gets scale NaN
    and values 0: it reads back as a row of NaN, so attention treats it as it treats a NaN
    value or key (docs/errors.md). Rounding is to nearest, ties to even (the compiled
    decoder step quantizes the same way, bit for bit)."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    if x.numel() == 0:
        return torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8,
                           device=x.device)  # fmt: skip
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127  # (..., 1)
    scale = scale.masked_fill(~torch.isfinite(scale), float("nan"))  # an inf row too: NaN
    values = torch.where(scale > 0, x / scale, 0.0).round_().to(torch.int8)  # (..., d)
    return torch.cat([values, scale.contiguous().view(torch.int8)], dim=-1)  # (..., d + 4)


class BufferPool:
    """Flat buffers kept between uses, handed out as tensors of any shape that fits.

    A large tensor freed goes back to the OS (glibc gives back the top of its heap beyond a
    threshold of tens of MB), and the next one of the same size is faulted in again page by
    page, each page zeroed by the kernel: for a 32-sentence beam search with the shipped
    translator, ~10,700 page faults (42 MiB) per call, 3-6 % of its time. Buffers given back
    here are kept (up to ``max_bytes`` in all) and reused by the next :meth:`take` that
    fits; thread-safe. Contents of a reused buffer are whatever was left in it.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: list[Tensor] = []  # flat, contiguous
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held (not in use)."""
        return sum(b.numel() * b.element_size() for b in self._free)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        """A flat, uninitialised buffer of at least ``numel`` elements: the smallest kept one
        that fits, else a new one of exactly ``numel``.

        Only buffers of the same dtype, device and inference-mode-ness are reused (an
        inference tensor cannot be written outside ``torch.inference_mode``)."""
        device = torch.device(device)
        inference = torch.is_inference_mode_enabled()
        with self._lock:
            fits = [
                i for i, b in enumerate(self._free)
                if b.numel() >= numel and b.dtype == dtype and b.device == device
                and b.is_inference() == inference
            ]  # fmt: skip
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return _pages.empty((numel,), dtype, device)

    def give_back(self, flat: Tensor) -> None:
        """Keep ``flat`` (from :meth:`take`) for later; the caller must not use it, or any
        view of it, any more. Beyond ``max_bytes`` in all it is simply dropped."""
        with self._lock:
            if self.nbytes + flat.numel() * flat.element_size() <= self.max_bytes:
                self._free.append(flat)


class KVCache:
    """Grows along time with amortised doubling; ``update`` returns views of what is filled.

    Args:
        max_len: most positions it may hold (``None`` = unbounded); more is a ``ValueError``.
        capacity: positions to allocate on the first ``update`` (default: what that update
            needs, at least 16); grows by doubling beyond it.
        dtype: storage dtype of keys and values (default: that of the first ``update``);
            ``torch.int8`` stores packed int8 rows (see the module's docstring).
        pool: a :class:`BufferPool` to take the buffers from; :meth:`reset` gives them
            back (generation loops that run again and again).

    Ownership: a cache holds one layer's keys and values. The first
    :class:`~qkv.MultiHeadAttention` that uses it claims it (:meth:`claim`); another layer
    passing the same cache is refused with a ``ValueError``, since both would append to
    one sequence (two layers, 5 steps: a length of 10, each attending to the other's keys).
    Give each layer its own cache (``[KVCache() for _ in layers]``, ``model.new_cache()``);
    :meth:`reset` releases the cache for another layer. Sharing is deliberately not
    supported.

    >>> cache = KVCache()
    >>> k, v = cache.update(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8))
    >>> k.shape, len(cache)
    (torch.Size([2, 4, 3, 8]), 3)
    """

    def __init__(
        self,
        max_len: int | None = None,
        *,
        capacity: int | None = None,
        dtype: torch.dtype | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and (
                dtype.is_floating_point or dtype == torch.int8)):  # fmt: skip
            raise TypeError(f"dtype must be a floating torch.dtype, torch.int8 or None, "
                            f"got {dtype!r}")  # fmt: skip
        self.max_len = max_len
        self.capacity_hint = capacity
        self.dtype = dtype
        self.pool = pool
        self._taken: list[Tensor] = []  # the pool's flat buffers behind _full and _spare
        self._k: Tensor | None = None  # (B, h_kv, capacity, d_k)
        self._v: Tensor | None = None  # (B, h_kv, capacity, d_v)
        self._spare: tuple[Tensor, Tensor] | None = None  # reorder's second buffers
        # the buffers _k/_v are views of (their first rows, after a batch shrank)
        self._full: tuple[Tensor, Tensor] | None = None
        self._len = 0
        # the layer that writes into it (weak: a cache must not keep a model alive)
        self._owner: weakref.ref | None = None

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) is another sequence: no owner (and a weakref would not
        # pickle); the layer that uses it claims it
        return {**self.__dict__, "_owner": None}

    @property
    def is_empty(self) -> bool:
        return self._len == 0

    @property
    def batch_size(self) -> int | None:
        return None if self._k is None else self._k.shape[0]

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before they grow (0 before the first update)."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def quantized(self) -> bool:
        """Whether keys and values are stored as packed int8 rows."""
        return self.dtype == torch.int8

    @property
    def keys(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, : self._len]

    @property
    def values(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, : self._len]

    @property
    def owner(self) -> object | None:
        """The layer that claimed this cache (:meth:`claim`), or ``None``."""
        return None if self._owner is None else self._owner()

    def claim(self, layer: object) -> None:
        """Record ``layer`` as the one writing into this cache, or raise ``ValueError`` if
        another live layer already did (see the class docstring). Called by
        :class:`~qkv.MultiHeadAttention` before it reads or writes the cache."""
        owner = self.owner
        if owner is layer:
            return
        if owner is not None:
            raise ValueError(
                f"this KVCache already belongs to layer {_describe(owner)}, got it from "
                f"layer {_describe(layer)}: give each layer its own cache, e.g. "
                "caches = [KVCache() for _ in layers] (or model.new_cache()), or reset() "
                "it before handing it to another layer"
            )
        self._owner = weakref.ref(layer)

    def reset(self) -> None:
        """Forget everything, buffers included (a new batch may have another size); with a
        pool, the buffers go back to it for another cache. The owning layer is released
        too: a reset cache may serve another layer."""
        self._clear()
        self._owner = None

    def _clear(self) -> None:
        """Forget the contents and buffers, keeping the owner (``set`` by that layer)."""
        while self._taken:
            self.pool.give_back(self._taken.pop())
        self._k = self._v = None
        self._spare = self._full = None
        self._len = 0

    def _empty(self, like: Tensor, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        dtype = dtype or like.dtype
        if self.pool is None:
            return _pages.empty(shape, dtype, like.device)
        n = math.prod(shape)
        flat = self.pool.take(n, dtype, like.device)
        self._taken.append(flat)
        return flat[:n].view(shape)

    def _give_back(self, *tensors: Tensor) -> None:
        """Return the pool's buffers behind ``tensors`` (no longer used by this cache)."""
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            for i, flat in enumerate(self._taken):
                if flat.untyped_storage().data_ptr() == ptr:
                    self.pool.give_back(self._taken.pop(i))
                    break

    @staticmethod
    def _check_kv(k: Tensor, v: Tensor) -> None:
        """What any ``k``, ``v`` must be, whatever the cache holds."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                "k and v must be (B, h_kv, T, d) with equal B, h_kv, T, got "
                f"k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        if not k.dtype.is_floating_point or v.dtype != k.dtype:
            raise TypeError(f"k and v must share a floating dtype, got {k.dtype}, {v.dtype}")

    def _check(self, k: Tensor, v: Tensor, rows: Tensor | None = None) -> None:
        self._check_kv(k, v)
        if self._k is None:
            return
        want_k, want_v = self._k.shape, self._v.shape
        if self.quantized:  # stored rows carry their scale
            want_k = (*want_k[:3], want_k[3] - SCALE_BYTES)
            want_v = (*want_v[:3], want_v[3] - SCALE_BYTES)
        if rows is not None:  # an integer tensor of batch rows, as reorder()'s index
            self._check_index(rows, "rows")
            if rows.shape[0] != k.shape[0]:
                raise ValueError(f"rows must be 1-D with one batch row per row of k "
                                 f"({k.shape[0]}), got shape {tuple(rows.shape)}")  # fmt: skip
        if rows is None and k.shape[0] != want_k[0]:
            raise ValueError(
                f"cache holds batch size {want_k[0]}, got k with batch size {k.shape[0]} "
                "(call reset() for a new batch, or reorder() to select beams)"
            )
        if k.shape[1] != want_k[1] or k.shape[3] != want_k[3] or v.shape[3] != want_v[3]:
            raise ValueError(
                f"cache holds k (B, {want_k[1]}, T, {want_k[3]}) and v (B, {want_v[1]}, T, "
                f"{want_v[3]}), got k={tuple(k.shape)}, v={tuple(v.shape)}"
            )
        if k.device != self._k.device:
            raise TypeError(f"cache lives on {self._k.device}, got k on {k.device}")
        if self.dtype is None and k.dtype != self._k.dtype:
            raise TypeError(f"cache holds {self._k.dtype}, got {k.dtype}")

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` positions now (no effect if there already is)."""
        capacity = _check_count("capacity", capacity)
        if self._k is not None and capacity > self._k.shape[2]:
            self._resize(capacity)
        elif self._k is None:
            self.capacity_hint = max(capacity, self.capacity_hint or 0)

    def update(self, k: Tensor, v: Tensor, *, check: bool = True,
               rows: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Append ``k (B, h_kv, T_new, d_k)``, ``v (B, h_kv, T_new, d_v)``; return all cached.

        The new positions are written in place; the returned views share the buffers (they
        stay valid until the next ``update``, ``reorder`` or ``reset``). ``check=False``
        skips validating shapes and dtypes: for a decode loop that validated its first step.
        ``rows (B',)``: write row ``i`` of ``k``/``v`` into batch row ``rows[i]`` of the
        cache (a batch some of whose rows stopped: nothing is moved, the rest stay stale).
        """
        if check or self._k is None:
            self._check(k, v, rows)
        if rows is not None and self._k is None:
            raise ValueError("rows= writes into an existing batch: the first update has none")
        new_len = self._len + k.shape[2]
        if self.max_len is not None and new_len > self.max_len:
            raise ValueError(f"cache overflow: {new_len} positions > max_len={self.max_len}")
        if self._k is None:
            self._allocate(k, v, max(new_len, self.capacity_hint or _MIN_CAPACITY))
        elif new_len > self._k.shape[2]:
            self._resize(max(new_len, 2 * self._k.shape[2]))
        if self.quantized:
            k, v = quantize_rows(k), quantize_rows(v)  # (B, h_kv, T_new, d + 4)
        if rows is None:
            self._k[:, :, self._len : new_len] = k  # cast to the storage dtype, in place
            self._v[:, :, self._len : new_len] = v
        else:
            dt = self._k.dtype
            rows = rows.to(device=self._k.device, dtype=torch.long)  # int32 rows too
            self._k[:, :, self._len : new_len].index_copy_(0, rows, k.to(dt))
            self._v[:, :, self._len : new_len].index_copy_(0, rows, v.to(dt))
        self._len = new_len
        return self._k[:, :, :new_len], self._v[:, :, :new_len]

    def extend(self, n: int = 1) -> tuple[Tensor, Tensor]:
        """Count ``n`` more positions as filled and return the whole buffers ``(B, h_kv,
        capacity, d)`` (int8: the packed rows, ``d + 4``): the caller writes positions
        ``[len - n, len)`` itself (a fused decode step writes them in place). The buffers
        grow first if needed; the cache must hold a batch already (a first :meth:`update`
        sets its shape and dtype)."""
        n = _check_count("n", n)  # before anything changes: a bad n must not corrupt the length
        if self._k is None:
            raise ValueError("extend() needs a cache that holds a batch: update() it first")
        new_len = self._len + n
        if self.max_len is not None and new_len > self.max_len:
            raise ValueError(f"cache overflow: {new_len} positions > max_len={self.max_len}")
        if new_len > self._k.shape[2]:
            self._resize(max(new_len, 2 * self._k.shape[2]))
        self._len = new_len
        return self._k, self._v

    def _allocate(self, k: Tensor, v: Tensor, capacity: int) -> None:
        if self.max_len is not None:
            capacity = min(capacity, self.max_len)
        dtype = self.dtype or k.dtype
        B, h, _, d_k = k.shape
        extra = SCALE_BYTES if self.quantized else 0
        self._k = self._empty(k, B, h, capacity, d_k + extra, dtype=dtype)
        self._v = self._empty(k, B, h, capacity, v.shape[3] + extra, dtype=dtype)
        self._full = (self._k, self._v)

    def _resize(self, capacity: int) -> None:
        if self.max_len is not None:
            capacity = min(capacity, self.max_len)
        old_k, old_v = self._k, self._v
        B, h, _, d_k = old_k.shape
        self._k = self._empty(old_k, B, h, capacity, d_k)
        self._v = self._empty(old_v, B, h, capacity, old_v.shape[3])
        self._k[:, :, : self._len] = old_k[:, :, : self._len]
        self._v[:, :, : self._len] = old_v[:, :, : self._len]
        self._give_back(*(self._full or ()), *(self._spare or ()))
        self._full, self._spare = (self._k, self._v), None

    def set(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Replace the contents (cross-attention: the encoder's keys and values, once); the
        owner stays."""
        self._check_kv(k, v)  # before the old contents go
        if self.max_len is not None and k.shape[2] > self.max_len:
            raise ValueError(f"cache overflow: {k.shape[2]} positions > max_len={self.max_len}")
        self._clear()
        return self.update(k, v)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` ``(B',)`` (beam search: follow the surviving beams;
        finished sentences leave the batch).

        Only the filled positions are gathered, into a second buffer kept for the purpose
        (swapped with the first); a smaller batch uses the first ``B'`` rows of it, so
        following beams and dropping sentences allocate nothing once it exists.
        """
        self._check_index(index)
        if self._k is None:
            return
        index = index.to(device=self._k.device, dtype=torch.long)
        n, B = self._len, index.shape[0]
        if torch.is_grad_enabled() and (self._k.requires_grad or self._v.requires_grad):
            self._k = self._k.index_select(0, index)  # new buffers: out= has no autograd
            self._v = self._v.index_select(0, index)
            self._full, self._spare = (self._k, self._v), None
            return
        spare = self._spare
        if spare is None or spare[0].shape[0] < B:
            _, h, cap, d_k = self._k.shape
            self._give_back(*(spare or ()))
            spare = (self._empty(self._k, B, h, cap, d_k),
                     self._empty(self._v, B, h, cap, self._v.shape[3]))  # fmt: skip
        k2, v2 = spare[0][:B], spare[1][:B]  # (B', h_kv, capacity, d)
        if n:
            torch.index_select(self._k[:, :, :n], 0, index, out=k2[:, :, :n])
            torch.index_select(self._v[:, :, :n], 0, index, out=v2[:, :, :n])
        self._spare, self._full = self._full, spare  # swapped: the old buffers are the spare
        self._k, self._v = k2, v2

    def _check_index(self, index: Tensor, name: str = "index") -> None:
        """``reorder``'s ``index`` (and ``update``'s ``rows``): a 1-D integer tensor within
        the batch. A bool mask or float would be cast to long and silently read as other
        rows; an index out of range is refused here, before any buffer changes
        (``index_select`` would not check an empty cache, and fails on a device only
        asynchronously)."""
        if not isinstance(index, Tensor):
            raise TypeError(f"{name} must be an integer tensor (B',), got {type(index).__name__}")
        if index.dtype == torch.bool or index.dtype.is_floating_point or index.dtype.is_complex:
            raise TypeError(f"{name} must be an integer tensor (B',) of batch rows, got dtype "
                            f"{index.dtype}")  # fmt: skip
        if index.dim() != 1:
            raise ValueError(f"{name} must be 1-D (B',), got shape {tuple(index.shape)}")
        B = self.batch_size
        if B is not None and index.numel():
            lo, hi = (int(t) for t in torch.aminmax(index))
            if lo < 0 or hi >= B:
                raise IndexError(f"{name} must hold batch rows in [0, {B - 1}] (the cache "
                                 f"holds batch size {B}), got {lo if lo < 0 else hi}")  # fmt: skip

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding, retries)."""
        if isinstance(length, bool) or not isinstance(length, numbers.Integral):
            raise TypeError(f"length must be an int, got {type(length).__name__}")
        length = int(length)
        if not 0 <= length <= self._len:
            raise ValueError(f"length must be in [0, {self._len}], got {length}")
        self._len = length


def _check_count(name: str, n: object) -> int:
    """A count of positions as an ``int`` >= 0 (numpy ints too): a float or a negative count
    would leave the cache's length unusable."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n}")
    return int(n)


def _describe(layer: object) -> str:
    """A layer as an error names it: its class, its ``extra_repr`` if any, and its id (the
    layers of one model often look alike)."""
    extra = layer.extra_repr() if hasattr(layer, "extra_repr") else ""
    return f"{type(layer).__name__}({extra}) at {id(layer):#x}"
