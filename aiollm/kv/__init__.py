"""The KV cache: paged block pool and allocation (`blocks`), storage of all layers (`pool`) and the native
attention/kv_write entry points over it (`attention`)."""

from aiollm.kv.blocks import BlockAllocator, BlockTable
from aiollm.kv.pool import KVBlocks, KVConfig, KVPool
from aiollm.native.attention import decode_attention, force_isa, get_num_threads, isa, kv_write, set_num_threads

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "KVBlocks",
    "KVConfig",
    "KVPool",
    "decode_attention",
    "force_isa",
    "get_num_threads",
    "isa",
    "kv_write",
    "set_num_threads",
]
