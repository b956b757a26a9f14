"""KV memory: the paged K/V pool, the slot allocator and the request-to-token table."""

from lmprog_runtime.kvcache.allocator import TokenSlotAllocator
from lmprog_runtime.kvcache.kv_pool import KVPool
from lmprog_runtime.kvcache.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "TokenSlotAllocator"]
