"""The native CPU backend: decode attention in C++ straight from the paged pool.

Decode reads each request's keys and values through the request-to-token table with no
padded gather. Requests that share a long cached prefix (the same leading KV slots:
branches of a fork, prompts with one system prompt; see `CASCADE_MIN_SPARED_KEYS` for how
long) get cascade attention: the shared prefix is
attended to once per group by torch's fused CPU attention kernel, each request's own suffix
in C++, and the two partial results are merged by their log-sum-exp. Extend (prefill) in
bfloat16 runs in C++ (`csrc/extend_attention.cpp`: products on AMX tiles where the CPU has
them, else by AVX512-BF16 dot products, with float32 sums; the softmax in float32; head
sizes 64 and 128), reading every key, cached prefix and new, from the pool, when the batch's
new tokens are at least 5% of its keys; otherwise, on CPUs with neither and in float32, it
uses the reference path. In a mixed extend the running requests' decode tokens still take the C++ decode path.
float32 or bfloat16 on CPU: the kernels read the pool in its dtype and compute scores,
softmax and sums in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lmprog_runtime.attention.base import AttentionLayout
from lmprog_runtime.attention.torch_backend import TorchAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool
from lmprog_runtime.native import load_native

# A shared prefix shorter than this is not worth a separate pass.
MIN_CASCADE_PREFIX = 64
# Nor is a cascade that spares fewer key reads than this per layer (over its groups: each
# group's prefix length times its members after the first). Plain decode attention reads a
# group's prefix once per member, but from cache, and a plain step runs in one native call
# (the decode stack), where a cascade's prefix passes and merges are Python calls per
# layer. Measured on SmolLM2-135M (bfloat16, 2 cores, decode steps at batch 32): 4 groups
# x 8 members x 512 prefix tokens (14k keys spared) were faster plain (104-112 ms against
# 119-144 ms a step); 2 x 16 x 2048 (61k) and 1 x 32 x 4096 (127k) faster as a cascade
# (130-148 against 176-214 ms; 121-130 against 376-419 ms). Since plain steps of up to 32
# requests run as one parallel region, on a 2-core Zen 5 (median step, best of 3): 4 x 8 x
# 512 plain 32 / cascade 63 ms, 2 x 16 x 2048 62 / 64, 1 x 32 x 4096 105 / 130, 1 x 64 x
# 2048 119 / 142, 1 x 64 x 4096 198 / 213, but 2 x 32 x 4096 345 / 237: spared keys alone
# do not predict the crossover there (the groups' prefixes against the caches do).
CASCADE_MIN_SPARED_KEYS = 32768
# The native extend kernel rearranges every key it reads (cached prefix included) into
# tiles, so it runs a batch only when new tokens are at least this share of the keys. With
# the rearranging vectorized, 32 prompts x 32 new tokens after a 512-token prefix (6% new)
# measured 1.22x faster than torch's kernel at one layer on AMX; a few new tokens after long
# cached prefixes (less) go to torch's kernel.
NATIVE_EXTEND_MIN_NEW_SHARE = 0.05


def _preferred_extend_kernel(ops) -> str | None:
    """'amx' on a CPU with AMX (and an OS that grants it), else 'avx512_bf16' where the
    build has it, else None (torch's kernel)."""
    for kernel, amx in (("amx", True), ("avx512_bf16", False)):
        if ops.extend_attention_available(amx):
            return kernel
    return None


class _PrefixGroup(NamedTuple):
    members: torch.Tensor  # [m] batch indices
    slots: torch.Tensor  # [prefix_len] KV slots every member starts with
    span: slice | None  # the same slots as a slice when they are consecutive (no copy)


class NativeAttentionBackend(TorchAttentionBackend):
    def __init__(
        self, layout: AttentionLayout, kv_pool: KVPool, req_to_token: ReqToTokenPool
    ) -> None:
        super().__init__(layout, kv_pool, req_to_token)
        buf = kv_pool.k_buffers[0]
        if buf.device.type != "cpu" or buf.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("attention_backend='native' runs float32 or bfloat16 on CPU only")
        self._ops = load_native()
        # Native extend attention: bfloat16 and head sizes it has tiles for.
        self._extend_kernel = None
        if buf.dtype == torch.bfloat16 and layout.head_dim in (64, 128):
            self._extend_kernel = _preferred_extend_kernel(self._ops)

    @property
    def native_ops(self):
        """The compiled extension (the model's native decode stack is built from it)."""
        return self._ops

    def plain_decode_inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...] | None:
        """The decode attention inputs after `init_forward_metadata(batch)`, when the step
        is plain decode (no prefill tokens, no shared-prefix cascade): req_to_token,
        req_rows, seq_lens, key_starts, order. None otherwise."""
        if batch.mode is not ForwardMode.DECODE or self._parts is not None or self._groups:
            return None
        table = self.req_to_token.table
        return table, batch.req_pool_indices, self._seq_lens, self._key_starts, self._order

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._parts = None
        if batch.mode is ForwardMode.EXTEND and batch.num_decodes:
            self._parts = batch.split_decodes()
            self._init_extend_any(self._parts[0])
            self._init_native_decode(self._parts[1])
        elif batch.mode is not ForwardMode.DECODE:
            self._init_extend_any(batch)
        else:
            self._init_native_decode(batch)

    def _init_extend_any(self, batch: ForwardBatch) -> None:
        extend_lens = batch.extend_lens
        self._native_extend_now = self._extend_kernel is not None and sum(
            extend_lens
        ) >= NATIVE_EXTEND_MIN_NEW_SHARE * sum(batch.seq_lens)
        if not self._native_extend_now:
            super().init_forward_metadata(batch)
            return
        starts = [0]
        for n in extend_lens[:-1]:
            starts.append(starts[-1] + n)
        # Host tensors, one each per forward (every layer reuses them).
        self._extend_meta = (
            batch.req_pool_indices,
            torch.tensor(batch.prefix_lens, dtype=torch.int64, device="cpu"),
            torch.tensor(extend_lens, dtype=torch.int64, device="cpu"),
            torch.tensor(starts, dtype=torch.int64, device="cpu"),
        )

    def _forward_extend_any(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        if not self._native_extend_now:
            return super().forward(q, k, v, layer_id, batch)
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        heads, dim = self.layout.num_heads, self.layout.head_dim
        return self._ops.extend_attention(
            q.reshape(q.shape[0], heads, dim),
            self.kv_pool.k_buffers[layer_id],
            self.kv_pool.v_buffers[layer_id],
            self.req_to_token.table,
            *self._extend_meta,
            self.layout.scaling,
            self.layout.sliding_window or 0,
            self._extend_kernel == "amx",
        )

    def _init_native_decode(self, batch: ForwardBatch) -> None:
        seq_lens = batch.seq_lens
        self._seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device="cpu")
        table_rows = batch.req_pool_indices
        first = self.req_to_token.table[table_rows, 0]  # [batch] each request's first slot
        # Requests that share a cached prefix share its first slot: process them together
        # so the prefix is read from memory once per step, not once each.
        self._order = torch.argsort(first, stable=True)
        self._groups: list[_PrefixGroup] = []
        self._key_starts = torch.zeros(batch.batch_size, dtype=torch.int64, device="cpu")
        # A cascade spares at most every request but one its longest possible prefix: where
        # even that is below the threshold (a single stream, short contexts), skip the search.
        can_spare = (len(seq_lens) - 1) * (max(seq_lens) - 1)
        if self.layout.sliding_window is None and can_spare >= CASCADE_MIN_SPARED_KEYS:
            self._find_prefix_groups(table_rows, first, seq_lens)

    def _find_prefix_groups(
        self, table_rows: torch.Tensor, first: torch.Tensor, seq_lens: list[int]
    ) -> None:
        values, counts = torch.unique(first, return_counts=True)
        for value in values[counts > 1].tolist():
            members = torch.nonzero(first == value).flatten()
            # Each member keeps at least its newest key for its own pass.
            limit = min(seq_lens[i] for i in members.tolist()) - 1
            if limit < MIN_CASCADE_PREFIX:
                continue
            block = self.req_to_token.table[table_rows[members], :limit]
            same = (block == block[0]).all(dim=0)
            shared = int(same.to(torch.int64).cumprod(0).sum())
            if shared >= MIN_CASCADE_PREFIX:
                slots = block[0, :shared].clone()
                first_slot = int(slots[0])
                run = torch.arange(first_slot, first_slot + shared, device="cpu")
                consecutive = bool((slots == run).all())
                span = slice(first_slot, first_slot + shared) if consecutive else None
                self._groups.append(_PrefixGroup(members, slots, span))
                self._key_starts[members] = shared
        spared = sum((len(g.members) - 1) * len(g.slots) for g in self._groups)
        if spared < CASCADE_MIN_SPARED_KEYS:
            self._groups = []
            self._key_starts.zero_()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        if self._parts is not None:  # a mixed extend: [extend tokens ; decode tokens]
            extend, decode = self._parts
            n = extend.num_tokens
            return torch.cat(
                [
                    self._forward_extend_any(q[:n], k[:n], v[:n], layer_id, extend),
                    self._forward_native_decode(q[n:], k[n:], v[n:], layer_id, decode),
                ]
            )
        if batch.mode is not ForwardMode.DECODE:
            return self._forward_extend_any(q, k, v, layer_id, batch)
        return self._forward_native_decode(q, k, v, layer_id, batch)

    def _forward_native_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id]
        q = q.contiguous()
        out, lse = self._ops.decode_attention(
            q,
            k_buf,
            v_buf,
            self.req_to_token.table,
            batch.req_pool_indices,
            self._seq_lens,
            self._key_starts,
            self._order,
            self.layout.scaling,
            self.layout.sliding_window or 0,
        )
        for group in self._groups:
            self._merge_prefix(group, q, k_buf, v_buf, out, lse)
        return out.view(q.shape[0], -1)

    def _merge_prefix(
        self,
        group: _PrefixGroup,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Attend the group's queries to its shared prefix; merge into `out` in place.

        The prefix pass is torch's fused CPU attention kernel (the one SDPA runs): inputs in
        the pool's dtype, scores and softmax in float32, and it returns the log-sum-exp the
        merge needs. bfloat16 matmuls instead would round every score to bfloat16 (measured:
        3x the output error of this kernel, and slower at these shapes)."""
        kv_heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        heads = self.layout.num_heads
        members = group.members
        m = members.numel()
        # [kv_heads, members * group, dim]: a kv head's query heads, for every member.
        qg = q[members].view(m, kv_heads, heads // kv_heads, dim).permute(1, 0, 2, 3)
        qg = qg.reshape(kv_heads, -1, dim)
        index = group.span if group.span is not None else group.slots
        keys = k_buf[index].transpose(0, 1)  # [kv_heads, prefix, dim]
        values = v_buf[index].transpose(0, 1)  # [kv_heads, prefix, dim]
        part, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg[None], keys[None], values[None], scale=self.layout.scaling
        )  # [1, kv_heads, members * group, dim], [1, kv_heads, members * group] (float32)
        part = part.float()
        # Back to [members, heads, dim] / [members, heads].
        part = part.view(kv_heads, m, -1, dim).permute(1, 0, 2, 3).reshape(m, heads, dim)
        part_lse = part_lse.view(kv_heads, m, -1).permute(1, 0, 2).reshape(m, heads)
        own, own_lse = out[members].float(), lse[members]
        peak = torch.maximum(part_lse, own_lse)
        w_prefix, w_own = torch.exp(part_lse - peak), torch.exp(own_lse - peak)
        merged = (part * w_prefix[..., None] + own * w_own[..., None]) / (w_prefix + w_own)[
            ..., None
        ]
        out[members] = merged.to(out.dtype)
