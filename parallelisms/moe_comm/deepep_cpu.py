"""A CPU stand-in for DeepEP's V1 `deep_ep.Buffer` (normal, intranode mode), built on gloo collectives.

It lets the DeepEP backend (`parallelisms/moe_comm/deepep.py`) run, and its handle lifecycle be tested, on a
machine without GPUs. It keeps DeepEP's interface as the backend sees it:

* the same methods, argument names and defaults, and return tuples: `get_dispatch_layout` ->
  (num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event); `dispatch` -> (recv_x,
  recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event), and in cached mode
  (`handle=`) -> (recv_x, None, None, None, None, event); `combine` -> (combined_x, combined_topk_weights or None,
  event); static `get_dispatch_config`/`get_combine_config` returning a `Config` with the two size hints;
* DeepEP's dtype and shape rules: int64 `topk_idx` [T, K] with -1 for "no expert", fp32 `topk_weights`,
  `hidden * element size` a multiple of 16 bytes, received top-k ids local to the receiving rank (-1 for slots
  owned by another rank, with weight 0), the per-expert counts as a Python list, combine summing *without*
  weights and optionally reducing top-k weights the same way;
* the intranode handle: a 6-tuple (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
  recv_src_idx, is_token_in_rank, send_head) of tensors with DeepEP's roles and shapes. It really holds what a
  combine and a cached dispatch need, so a handle that is never released is a memory leak here too.

Documented relaxations and omissions:
* dispatch takes x as bf16 or, as DeepEP does, as an FP8 tuple (e4m3 rows [T, hidden], fp32 scales
  [T, hidden / 128], one per 1 x 128 tile) and then returns recv_x as such a tuple. x may also be fp32 (a
  relaxation), so an fp32 model reproduces the all-to-all backend's numbers exactly; combine accumulates in fp32
  and returns x's dtype, as DeepEP does for bf16.
* `num_worst_tokens`, internode (RDMA) ranks, low-latency kernels: not emulated (NotImplementedError).
* Work is synchronous: `async_finish`/`allocate_on_comm_stream` are accepted and the returned events are already
  complete (`EventOverlap.current_stream_wait()` returns at once).
* Rank counts: 2, 4 or 8 (DeepEP's intranode sizes); the config tables hold DeepEP V1's values for them.
* The channel prefix matrices are computed (C = num_sms / 2 channels over contiguous token ranges, as DeepEP
  splits work) so that a handle has DeepEP's content and footprint; the all-to-all transport does not read them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.quantization import FP8_TILE

__all__ = ["FP8_BLOCK", "Buffer", "Config", "EventOverlap"]

#: FP8 dispatch: one fp32 scale per this many values of a row (DeepEP's kernels fix it at DeepSeek-V3's tile)
FP8_BLOCK = FP8_TILE

#: tokens a Config's buffers hold per channel and peer carry this much beyond the hidden bytes: top-k ids (int64)
#: and weights (fp32) for up to 128 experts, 128 fp32 FP8 scales, and an 8-byte source record
_MAX_TOPK = 128
_MAX_SCALES = 128
_SOURCE_META_BYTES = 8
_MAX_NVL_PEERS = 8


class Config:
    """Kernel tuning knobs of one collective, and the buffer sizes they imply (DeepEP's `deep_ep_cpp.Config`)."""

    def __init__(self, num_sms: int, num_max_nvl_chunked_send_tokens: int, num_max_nvl_chunked_recv_tokens: int,
                 num_max_rdma_chunked_send_tokens: int, num_max_rdma_chunked_recv_tokens: int):
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError("need 0 < nvl chunked send tokens < nvl chunked recv tokens")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink buffer: per channel (2 SMs) and peer, a ring of `recv` tokens with their metadata."""
        _check_intranode(num_ranks)
        channels, recv = self.num_sms // 2, self.num_max_nvl_chunked_recv_tokens
        per_token = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (8 + 4) + _MAX_SCALES * 4
        head_tail_ints = channels * num_ranks * 5 * 4
        return _align(head_tail_ints + channels * num_ranks * recv * per_token, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the RDMA buffer: none for intranode groups, the only ones the stand-in emulates."""
        _check_intranode(num_ranks)
        return 0


class EventOverlap:
    """DeepEP's handle on a communication event. CPU work is synchronous, so every event is already complete."""

    def __init__(self, event=None, extra_tensors: tuple | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event: nothing to wait for on CPU."""

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()


class Buffer:
    """The communication buffer of one EP group: layout, dispatch and combine over `group` (gloo, CPU tensors).

    Construction, as in DeepEP, is collective over the group: every rank must create its buffer at the same time
    with the same sizes (checked). The buffer memory itself is allocated (`num_nvl_bytes`) so that its size is
    real, although the gloo transport does not stage data through it.
    """

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False):
        if low_latency_mode or enable_shrink:
            raise NotImplementedError("the CPU stand-in emulates DeepEP's normal (high-throughput) kernels only")
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        _check_intranode(self.group_size)
        if num_rdma_bytes:
            raise NotImplementedError("the CPU stand-in emulates intranode groups only (num_rdma_bytes must be 0)")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.explicitly_destroy = explicitly_destroy
        sizes = [None] * self.group_size
        dist.all_gather_object(sizes, (num_nvl_bytes, num_rdma_bytes), group=group)
        if len(set(sizes)) != 1:
            raise RuntimeError(f"DeepEP buffer sizes differ between the ranks of the group: {sizes}")
        self._nvl_buffer: torch.Tensor | None = torch.empty(num_nvl_bytes, dtype=torch.uint8)

    # ------------------------------------------------------------------------------------------ static helpers

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count of the normal kernels for every buffer (even, as in DeepEP)."""
        if new_num_sms % 2:
            raise ValueError("the SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (already complete on CPU)."""
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP V1's recommended dispatch config for an intranode group of `num_ranks`."""
        chunks = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
        return Config(Buffer.num_sms, *_lookup(chunks, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP V1's recommended combine config for an intranode group of `num_ranks`."""
        chunks = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)}
        return Config(Buffer.num_sms, *_lookup(chunks, num_ranks))

    def destroy(self) -> None:
        """Free the buffer (required before dropping it when built with `explicitly_destroy=True`)."""
        self._nvl_buffer = None

    # ------------------------------------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Where each token goes: (num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event). A token is counted once per rank however many of its experts
        live there; slots with -1 go nowhere."""
        self._check_live()
        _check_topk_idx(topk_idx)
        R = self.group_size
        if num_experts % R:
            raise ValueError(f"num_experts {num_experts} is not divisible by the group size {R}")
        valid = topk_idx >= 0
        dest_rank = torch.where(valid, topk_idx // (num_experts // R), R)  # R: a column dropped below
        in_rank = torch.zeros(topk_idx.shape[0], R + 1, dtype=torch.bool)
        is_token_in_rank = in_rank.scatter_(1, dest_rank, True)[:, :R].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, EventOverlap()

    # ------------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: torch.Tensor, handle: tuple | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token once to every rank that owns one of its experts.

        Received tokens come grouped by source rank, each group in the source's token order. With `handle` (cached
        mode) the layout of an earlier dispatch is reused and only x travels: (recv_x, None, None, None, None,
        event); this is the backward of combine. x is a tensor, or an FP8 tuple (rows, scales); recv_x is then a
        tuple too.
        """
        self._check_live()
        if num_worst_tokens:
            raise NotImplementedError("num_worst_tokens is not emulated by the CPU stand-in")
        config = config if config is not None else self.get_dispatch_config(self.group_size)
        if isinstance(x, tuple):
            _check_fp8_x(*x)
        else:
            _check_x(x)
        rows = x[0] if isinstance(x, tuple) else x
        self._check_size(config, rows)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle=...) takes no topk_idx/topk_weights")
            rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, _ = handle
            recv_x = self._send_x(x, _send_order(is_token_in_rank)[1], is_token_in_rank, rank_prefix_matrix)
            if (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0] != recv_src_idx.shape[0]:
                raise RuntimeError("cached dispatch received a different token count than the handle's dispatch")
            return recv_x, None, None, None, None, EventOverlap()

        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch without a handle needs the layout (see get_dispatch_layout)")
        R, me, T = self.group_size, self.rank, rows.shape[0]
        if is_token_in_rank.shape != (T, R):
            raise ValueError(f"is_token_in_rank must be [{T}, {R}], got {list(is_token_in_rank.shape)}")
        E = num_tokens_per_expert.numel()
        E_local = E // R
        channel_prefix_matrix = _channel_prefix(is_token_in_rank, config.num_sms // 2)

        # notify: every rank learns what every rank sends where (DeepEP's notify kernel does the same)
        notify = torch.cat([num_tokens_per_rank.to(torch.int32), num_tokens_per_expert.to(torch.int32),
                            channel_prefix_matrix.reshape(-1)])
        gathered = [torch.empty_like(notify) for _ in range(R)]
        dist.all_gather(gathered, notify, group=self.group)
        counts_SD = torch.stack([g[:R] for g in gathered])  # tokens rank s sends to rank d
        rank_prefix_matrix = counts_SD.cumsum(0, dtype=torch.int32)
        recv_per_expert = torch.stack([g[R + me * E_local:R + (me + 1) * E_local] for g in gathered]).sum(0)
        num_recv_tokens_per_expert_list = [-(-n // expert_alignment) * expert_alignment
                                           for n in recv_per_expert.tolist()]
        recv_channel_prefix_matrix = torch.stack([g[R + E:].view(R, -1)[me] for g in gathered])

        send_rank, send_token = _send_order(is_token_in_rank)
        recv_x = self._send_x(x, send_token, is_token_in_rank, rank_prefix_matrix)
        # which source token each received row is: the index travels with the row
        recv_src_idx = self._send_rows(send_token.to(torch.int32), is_token_in_rank, rank_prefix_matrix)
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            _check_topk_idx(topk_idx)
            if topk_weights is None or topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
                raise ValueError("topk_weights must be fp32 and shaped like topk_idx")
            # top-k ids become local to the receiving rank; slots owned elsewhere (or -1) become -1 with weight 0
            local_idx = topk_idx[send_token] - send_rank.unsqueeze(1) * E_local
            mine = (local_idx >= 0) & (local_idx < E_local)
            local_idx = torch.where(mine, local_idx, -1)
            local_w = torch.where(mine, topk_weights[send_token], 0.0)
            recv_topk_idx = self._send_rows(local_idx, is_token_in_rank, rank_prefix_matrix)
            recv_topk_weights = self._send_rows(local_w, is_token_in_rank, rank_prefix_matrix)
        send_head = torch.where(is_token_in_rank, is_token_in_rank.cumsum(0, dtype=torch.int32) - 1, -1)
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, send_head.to(torch.int32))
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, EventOverlap()

    # ------------------------------------------------------------------------------------------ combine

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send every received row back to its source token and sum the rows of each token, without weights.

        x: [num received tokens, hidden], in the order `dispatch` delivered them. `topk_weights` ([received, K],
        fp32) are reduced the same way (the backward of dispatch uses this for the routing-weight gradient);
        `bias` (one or two [T, hidden] tensors) is added to the result.
        Returns (combined_x [T, hidden] in x's dtype, combined_topk_weights [T, K] or None, event).
        """
        self._check_live()
        config = config if config is not None else self.get_combine_config(self.group_size)
        _check_x(x)
        self._check_size(config, x)
        rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, send_head = handle
        if x.shape[0] != recv_src_idx.shape[0]:
            raise ValueError(f"combine got {x.shape[0]} rows, the handle's dispatch delivered {recv_src_idx.shape[0]}")
        combined = self._reduce(x.float(), rank_prefix_matrix, is_token_in_rank, send_head)
        for b in (bias if isinstance(bias, tuple) else (bias,)):
            if b is not None:
                combined += b.float()
        combined_w = None
        if topk_weights is not None:
            if topk_weights.dtype != torch.float32:
                raise TypeError("topk_weights must be fp32")
            combined_w = self._reduce(topk_weights, rank_prefix_matrix, is_token_in_rank, send_head)
        return combined.to(x.dtype), combined_w, EventOverlap()

    # ------------------------------------------------------------------------------------------ internals

    def _check_live(self) -> None:
        if self._nvl_buffer is None:
            raise RuntimeError("this DeepEP buffer was destroyed")

    def _check_size(self, config: Config, x: torch.Tensor) -> None:
        # DeepEP asserts the same: the config's ring buffers must fit into the buffer it was built with
        needed = config.get_nvl_buffer_size_hint(x.shape[1] * max(x.element_size(), 2), self.group_size)
        if needed > self.num_nvl_bytes:
            raise RuntimeError(f"DeepEP buffer too small: {self.num_nvl_bytes} NVL bytes, this call needs {needed}")

    def _recv_splits(self, rank_prefix_matrix: torch.Tensor) -> list[int]:
        column = rank_prefix_matrix[:, self.rank]
        return torch.diff(column, prepend=column.new_zeros(1)).tolist()

    def _send_x(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], send_token: torch.Tensor,
                is_token_in_rank: torch.Tensor, rank_prefix_matrix: torch.Tensor):
        """x's rows `send_token` (in send order) to their ranks; an FP8 tuple travels as its bytes and its scales."""
        if not isinstance(x, tuple):
            return self._send_rows(x[send_token], is_token_in_rank, rank_prefix_matrix)
        rows, scales = x
        # gloo has no float8 type: the e4m3 bytes travel as uint8, one byte per value as on DeepEP's wire
        recv_rows = self._send_rows(rows.view(torch.uint8)[send_token], is_token_in_rank, rank_prefix_matrix)
        recv_scales = self._send_rows(scales[send_token], is_token_in_rank, rank_prefix_matrix)
        return recv_rows.view(rows.dtype), recv_scales

    def _send_rows(self, rows: torch.Tensor, is_token_in_rank: torch.Tensor,
                   rank_prefix_matrix: torch.Tensor) -> torch.Tensor:
        """All-to-all rows already laid out in send order (destination rank, then token)."""
        recv_splits = self._recv_splits(rank_prefix_matrix)
        out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, is_token_in_rank.sum(0).tolist(),
                               group=self.group)
        return out

    def _reduce(self, rows: torch.Tensor, rank_prefix_matrix: torch.Tensor, is_token_in_rank: torch.Tensor,
                send_head: torch.Tensor) -> torch.Tensor:
        """Rows back to their sources (the reverse all-to-all), summed per token in rank order."""
        back_splits = is_token_in_rank.sum(0).tolist()
        back = rows.new_empty(sum(back_splits), *rows.shape[1:])
        dist.all_to_all_single(back, rows.contiguous(), back_splits, self._recv_splits(rank_prefix_matrix),
                               group=self.group)
        out = rows.new_zeros(send_head.shape[0], *rows.shape[1:])
        start = 0
        for d, n in enumerate(back_splits):
            tokens = is_token_in_rank[:, d].nonzero().squeeze(1)
            # send_head[t, d]: where token t sits in the block that rank d returns
            out.index_add_(0, tokens, back[start:start + n][send_head[tokens, d].long()])
            start += n
        return out


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _check_intranode(num_ranks: int) -> None:
    if num_ranks not in (2, 4, 8):
        raise NotImplementedError(f"the CPU stand-in emulates intranode groups of 2, 4 or 8 ranks, not {num_ranks}")


def _lookup(table: dict[int, tuple[int, int, int, int]], num_ranks: int) -> tuple[int, int, int, int]:
    _check_intranode(num_ranks)
    return table[num_ranks]


def _send_order(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination rank, token) of every sent row: each token once per rank that wants it, by rank then token."""
    rank_token = is_token_in_rank.t().nonzero()
    return rank_token[:, 0], rank_token[:, 1]


def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("x must be a contiguous [tokens, hidden] tensor")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bf16 (DeepEP) or fp32 (stand-in relaxation), got {x.dtype}")
    if (x.shape[1] * x.element_size()) % 16:
        raise ValueError(f"hidden * element size must be a multiple of 16 bytes, got {x.shape[1] * x.element_size()}")


def _check_fp8_x(rows: torch.Tensor, scales: torch.Tensor) -> None:
    if rows.dim() != 2 or not rows.is_contiguous() or rows.dtype != torch.float8_e4m3fn:
        raise TypeError("FP8 dispatch: the rows must be a contiguous [tokens, hidden] float8_e4m3fn tensor")
    T, H = rows.shape
    if H % FP8_BLOCK:
        raise ValueError(f"FP8 dispatch: hidden must be a multiple of {FP8_BLOCK}, got {H}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (T, H // FP8_BLOCK):
        raise ValueError(f"FP8 dispatch: scales must be fp32 [{T}, {H // FP8_BLOCK}] (one per 1 x {FP8_BLOCK} tile), "
                         f"got {scales.dtype} {list(scales.shape)}")


def _check_topk_idx(topk_idx: torch.Tensor) -> None:
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or not topk_idx.is_contiguous():
        raise TypeError("topk_idx must be a contiguous 2-D int64 tensor (-1 = no expert)")


def _channel_prefix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[R, C] int32: tokens of channels 0..c sent to each rank; channel c covers a contiguous token range."""
    T = is_token_in_rank.shape[0]
    channel_of_token = torch.arange(T) * num_channels // max(T, 1)
    per_channel = torch.zeros(num_channels, is_token_in_rank.shape[1], dtype=torch.int32)
    per_channel.index_add_(0, channel_of_token, is_token_in_rank.to(torch.int32))
    return per_channel.cumsum(0, dtype=torch.int32).t().contiguous()
