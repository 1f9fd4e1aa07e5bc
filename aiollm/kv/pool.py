"""The paged KV pool: K and V storage for every layer, written by `write`, read by `attend`.

Memory layout (numpy, C-contiguous, allocated lazily by the OS: untouched blocks cost no RAM):

    k        [n_layers, n_blocks, n_kv_heads, head_dim, block_size]   K transposed inside each block
    v        [n_layers, n_blocks, n_kv_heads, block_size, head_dim]
    k_scale  [n_layers, n_blocks, n_kv_heads, block_size] fp16        int8 and int4 only (None otherwise)
    v_scale  [n_layers, n_blocks, n_kv_heads, block_size] fp16

int8 tiles keep those shapes but interleave their bytes for the int8 dot products (VNNI / AMX B-tile order):
K as [head_dim / 4][block_size][4] (a 64-byte row = 4 dims of 16 tokens), V as [block_size / 4][head_dim][4]
(a 64-byte row = 4 tokens of 16 dims); a last group narrower than 4 is packed that wide. `int8_logical` undoes
it (tests, inspection); `read` / `write_blocks` ship the raw bytes unchanged.
int4 stores two codes a byte in uint8 arrays whose last dim is halved (k [..., head_dim, block_size / 2], v
[..., block_size, head_dim / 2]): pairs of the int8 layout's rows share bytes, one in each nibble
(native/attn_internal.h), so a tile is half an int8 one; `int4_logical` undoes it. It needs head_dim % 32 == 0
and block_size % 4 == 0.

One (block, kv head) tile of K or V is one contiguous run of head_dim * block_size elements, so the kernel
streams whole tiles and can prefetch the next block of a table. K is transposed inside a tile: 16 tokens of
one dimension are adjacent, so a SIMD load carries one dimension of 16 tokens and 16 scores come out of
plain FMAs, with no horizontal sums. Token t of a sequence lives in block `table[t // block_size]`, slot
`t % block_size`; slot numbers are `block_id * block_size + offset`.

Blocks can be exported and imported raw (`read`, `write_blocks`) to ship a sequence's KV between workers.
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from aiollm.native import attention
from aiollm.native.arrays import aligned_full

_STORAGE = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8, "int4": np.uint8}
_QUANTISED = ("int8", "int4")  # per-token-per-head fp16 scales beside the codes
KV_DTYPES = tuple(_STORAGE)  # the storage names every --kv-dtype option offers
# The one default of every role and config: exact against the fp32 reference; fp16/int8 are opt-in.
DEFAULT_KV_DTYPE = "fp32"
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, kw_only=True)
class KVConfig:
    """Shape and dtype of a KV pool (keyword-only: the fields are all ints and easy to swap)."""

    n_layers: int
    n_blocks: int
    n_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = DEFAULT_KV_DTYPE
    # sliding-window attention: decode attends to each sequence's last `window` tokens (0: all of them)
    window: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_blocks", "n_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVConfig.{name}: expected a positive int, got {value!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ValueError(f"KVConfig.window: expected an int >= 0 (0: no sliding window), got {self.window!r}")
        if self.head_dim > attention.MAX_HEAD_DIM:
            raise ValueError(f"KVConfig.head_dim: expected at most {attention.MAX_HEAD_DIM}, got {self.head_dim}")
        if self.dtype not in _STORAGE:
            raise ValueError(f"KVConfig.dtype: expected one of {sorted(_STORAGE)}, got {self.dtype!r}")
        if self.dtype == "int4" and (self.head_dim % 32 or self.block_size % 4):
            raise ValueError(
                f"KVConfig.dtype: int4 needs head_dim % 32 == 0 and block_size % 4 == 0, got "
                f"head_dim {self.head_dim}, block_size {self.block_size}"
            )

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers: K and V, plus the two scales per token per head for int8 / int4."""
        elems = self.n_kv_heads * self.block_size * self.head_dim
        per_layer = elems if self.dtype == "int4" else 2 * elems * np.dtype(_STORAGE[self.dtype]).itemsize
        if self.dtype in _QUANTISED:
            per_layer += 2 * self.n_kv_heads * self.block_size * 2  # fp16 scales
        return per_layer * self.n_layers

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.n_blocks

    @classmethod
    def for_model(
        cls, model_config, n_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = DEFAULT_KV_DTYPE
    ) -> "KVConfig":
        """The KV shape of a model (anything with `n_layers`, `n_kv_heads`, `head_dim` and optionally
        `sliding_window`: a ModelConfig)."""
        c = model_config
        return cls(
            n_layers=c.n_layers,
            n_blocks=n_blocks,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            block_size=block_size,
            dtype=dtype,
            window=getattr(c, "sliding_window", None) or 0,
        )

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: str = DEFAULT_KV_DTYPE,
        window: int = 0,
    ) -> "KVConfig":
        """As many blocks as fit in `budget_bytes`; ValueError if not even one does."""
        probe = cls(
            n_layers=n_layers, n_blocks=1, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype
        )
        n_blocks = int(budget_bytes) // probe.bytes_per_block
        if n_blocks < 1:
            raise ValueError(f"budget_bytes: {budget_bytes} is less than one block ({probe.bytes_per_block} bytes)")
        return cls(
            n_layers=n_layers,
            n_blocks=n_blocks,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            window=window,
        )


def _int8_order(rows: int, cols: int) -> np.ndarray:
    """Offsets inside a [rows][cols] int8 tile of element (r, c), grouped 4 rows per 4-byte lane (i8_k_at /
    i8_v_at in native/attn_internal.h): K is (head_dim, block_size), V is (block_size, head_dim)."""
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    g = r & ~3
    return g * cols + c * np.minimum(4, rows - g) + (r & 3)


def int8_logical(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Copies of int8 K [..., head_dim, block_size] and V [..., block_size, head_dim] tiles in plain order (K
    transposed, V row-major, as fp16/fp32 store them) from the interleaved int8 layout."""
    d, bs = k.shape[-2:]
    k_at, v_at = _int8_order(d, bs), _int8_order(bs, d)
    flat_k = np.ascontiguousarray(k).reshape(*k.shape[:-2], d * bs)
    flat_v = np.ascontiguousarray(v).reshape(*v.shape[:-2], d * bs)
    return flat_k[..., k_at], flat_v[..., v_at]


def int4_logical(k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 copies of int4 K [..., head_dim, block_size / 2] and V [..., block_size, head_dim / 2] tiles (uint8,
    two codes a byte) as codes in [-7, 7] in plain order: K [..., head_dim, block_size], V [..., block_size,
    head_dim] (i4_k_at / i4_v_at in native/attn_internal.h)."""
    d, half = k.shape[-2:]
    bs = 2 * half
    dk, tk = np.arange(d)[:, None], np.arange(bs)[None, :]
    k_at, k_hi = (dk >> 3) * 4 * bs + tk * 4 + (dk & 3), (dk >> 2) & 1
    tv, dv = np.arange(bs)[:, None], np.arange(d)[None, :]
    v_at, v_hi = (tv >> 2) * 2 * d + (dv >> 5) * 64 + (dv & 15) * 4 + (tv & 3), (dv >> 4) & 1
    flat_k = np.ascontiguousarray(k).reshape(*k.shape[:-2], d * half)
    flat_v = np.ascontiguousarray(v).reshape(*v.shape[:-2], d * half)
    codes = lambda b, hi: np.where(hi, b >> 4, b & 15).astype(np.int8) - 8
    return codes(flat_k[..., k_at], k_hi), codes(flat_v[..., v_at], v_hi)


class KVBlocks(NamedTuple):
    """Raw contents of some blocks (of one layer, or of all layers with a leading layer axis)."""

    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None


class KVPool:
    """K/V storage of all layers plus the calls that write and attend over one layer of it."""

    def __init__(self, config: KVConfig) -> None:
        c = config
        self.config = c
        dtype = _STORAGE[c.dtype]
        # on cache lines (aligned_full), and with it every K and V tile whose size is a multiple of 64 bytes (any
        # head_dim at block_size 16)
        pack = 2 if c.dtype == "int4" else 1  # int4: two codes a byte along the last dim
        self.k = aligned_full((c.n_layers, c.n_blocks, c.n_kv_heads, c.head_dim, c.block_size // pack), 0, dtype)
        self.v = aligned_full((c.n_layers, c.n_blocks, c.n_kv_heads, c.block_size, c.head_dim // pack), 0, dtype)
        scales = (c.n_layers, c.n_blocks, c.n_kv_heads, c.block_size)
        self.k_scale = aligned_full(scales, 0, np.float16) if c.dtype in _QUANTISED else None
        self.v_scale = aligned_full(scales, 0, np.float16) if c.dtype in _QUANTISED else None
        self._descs: list | None = None  # each layer's C descriptor, built at the first prepare_decode

    def _layer(self, layer: int) -> dict:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.config.n_layers:
            raise ValueError(f"layer: expected an int in [0, {self.config.n_layers}), got {layer!r}")
        scales = self.k_scale is not None
        return {
            "k_cache": self.k[layer],
            "v_cache": self.v[layer],
            "k_scale": self.k_scale[layer] if scales else None,
            "v_scale": self.v_scale[layer] if scales else None,
        }

    def write(self, layer: int, slot_mapping, k, v) -> None:
        """Store new tokens' k, v [n_tokens, n_kv_heads, head_dim] (fp32/fp16/bf16) at `slot_mapping`."""
        c = self._layer(layer)
        attention.kv_write(c["k_cache"], c["v_cache"], slot_mapping, k, v, k_scale=c["k_scale"], v_scale=c["v_scale"])

    def attend(
        self,
        layer: int,
        q,
        block_tables,
        seq_lens,
        *,
        scale: float | None = None,
        out=None,
        out_dtype: str | None = None,
        n_threads: int | None = None,
    ):
        """Decode attention of q [n_seqs, n_q_heads, head_dim] over this layer; see `attention.decode_attention`."""
        return attention.decode_attention(
            **self._layer(layer),
            q=q,
            block_tables=block_tables,
            seq_lens=seq_lens,
            scale=scale,
            out=out,
            out_dtype=out_dtype,
            n_threads=n_threads,
            window=self.config.window,
        )

    def prepare_decode(self, slot_mapping, block_tables, seq_lens) -> attention.DecodeStep:
        """Check one decode step's index arrays once; the returned step's `write`/`attend` serve every layer."""
        if self._descs is None:
            self._descs = [
                attention._layer(**self._layer(layer), window=self.config.window)
                for layer in range(self.config.n_layers)
            ]
        return attention.DecodeStep(self._descs, slot_mapping, block_tables, seq_lens, owner=self)

    def _block_index(self, block_ids) -> slice | np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.n_blocks):
            raise ValueError(f"block_ids: expected ids in [0, {self.config.n_blocks}), got {ids.tolist()}")
        if ids.size and np.array_equal(ids, np.arange(ids[0], ids[0] + ids.size)):
            return slice(int(ids[0]), int(ids[0]) + ids.size)  # a run of blocks: views, no copy
        return ids

    def read(self, layer: int | None, block_ids) -> KVBlocks:
        """The raw K/V (and int8 / int4 scales) of `block_ids` in one layer, or all layers (layer=None, leading axis).

        A run of consecutive ids returns views into the pool; any other list returns copies."""
        at = self._block_index(block_ids)
        idx = (slice(None), at) if layer is None else (self._check_layer(layer), at)
        pick = lambda a: None if a is None else a[idx]
        return KVBlocks(pick(self.k), pick(self.v), pick(self.k_scale), pick(self.v_scale))

    def read_tokens(self, layer: int, block_ids) -> tuple[np.ndarray, np.ndarray]:
        """The K and V of every token of `block_ids` in one layer as fp32 [n_blocks * block_size, n_kv_heads,
        head_dim], token order, dequantised (int8 / int4: code times scale): what attention over them reads."""
        kv = self.read(layer, block_ids)
        k, v = kv.k, kv.v
        if self.config.dtype in _QUANTISED:
            k, v = (int8_logical if self.config.dtype == "int8" else int4_logical)(k, v)
            k = k.astype(np.float32) * kv.k_scale.astype(np.float32)[:, :, None, :]
            v = v.astype(np.float32) * kv.v_scale.astype(np.float32)[..., None]
        n, h = k.shape[0] * self.config.block_size, self.config.n_kv_heads
        k = np.ascontiguousarray(k.transpose(0, 3, 1, 2), dtype=np.float32).reshape(n, h, self.config.head_dim)
        v = np.ascontiguousarray(v.transpose(0, 2, 1, 3), dtype=np.float32).reshape(n, h, self.config.head_dim)
        return k, v

    def write_blocks(self, layer: int | None, block_ids, k_blocks, v_blocks, *, k_scale=None, v_scale=None) -> None:
        """Import raw blocks as returned by `read` (same shapes and dtypes) into `block_ids`."""
        at = self._block_index(block_ids)
        idx = (slice(None), at) if layer is None else (self._check_layer(layer), at)
        targets = [("k_blocks", self.k, k_blocks), ("v_blocks", self.v, v_blocks)]
        if self.k_scale is not None:
            targets += [("k_scale", self.k_scale, k_scale), ("v_scale", self.v_scale, v_scale)]
        for name, dst, src in targets:
            view = dst[idx]
            src = np.asarray(src) if src is not None else None
            if src is None or src.shape != view.shape or src.dtype != view.dtype:
                got = None if src is None else (src.shape, str(src.dtype))
                raise ValueError(f"{name}: expected shape {view.shape} dtype {view.dtype}, got {got}")
        for _name, dst, src in targets:
            dst[idx] = np.asarray(src)

    def _check_layer(self, layer: int) -> int:
        self._layer(layer)
        return int(layer)

    @property
    def nbytes(self) -> int:
        return self.config.nbytes
