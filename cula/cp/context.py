"""Context-parallel partition of a packed token stream across the ranks of a process group.

The global input is one packed stream of ``T`` tokens with ``cu_seqlens`` ``[N+1]`` (FLA's varlen layout,
``B == 1``). Rank ``r`` of ``W`` holds the contiguous token range ``[offsets[r], offsets[r+1])``; by default
``offsets[r] = r * T // W`` (equal to FLA 0.6.0's contiguous layout, which requires ``T % W == 0``; we also
allow remainders and explicit offsets). On each rank the sequences are clipped to the local range, which
gives local ``cu_seqlens`` for the local op. Only the first local segment can continue a sequence from an
earlier rank and only the last can continue onto a later one; the flags below say which.

Field names follow ``fla.ops.cp.FLACPContext`` where it has one (``group``, ``cu_seqlens``,
``cu_seqlens_cpu``, ``is_first_rank``, ``is_last_rank``, ``pre_num_ranks``, ``post_num_ranks``):

- ``is_first_rank``: the first local segment starts on this rank (no state is carried in);
- ``pre_num_ranks``: how many earlier ranks hold tokens of the first local sequence;
- ``is_last_rank``: the last local segment ends on this rank (nothing is carried out);
- ``post_num_ranks``: how many later ranks hold tokens of the last local sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SCAN_MODES = ("allgather", "ring")


@dataclass(frozen=True, eq=False)
class CPContext:
    """What one rank knows about the context-parallel split (build it with :func:`build_cp_context`).

    Attributes:
        group: the process group (``None`` for a single-process emulated rank).
        rank, world_size: this rank's index in ``group`` and the group size.
        cu_seqlens: local ``[N_local+1]`` int32 boundaries on the device of the global ``cu_seqlens``.
        cu_seqlens_cpu: the same, int64 on the CPU (no device sync needed to read it).
        is_first_rank, pre_num_ranks, is_last_rank, post_num_ranks: see the module docstring.
        scan: how the initial states travel: ``"allgather"`` (one all-gather of every rank's affine summary,
            then each rank composes its predecessors) or ``"ring"`` (point-to-point: each rank receives its
            initial state from ``rank - 1`` and sends its end state to ``rank + 1``, W-1 hops in sequence).
        offsets: ``[W+1]`` global token offsets of the ranks (``None`` when built from an FLA context).
        seq_ids: global sequence index of each local segment (``None`` when built from an FLA context).
        cu_seqlens_global_cpu: the global ``[N+1]`` boundaries, int64 on the CPU (``None`` from FLA).
    """

    group: ProcessGroup | None
    rank: int
    world_size: int
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    is_first_rank: bool
    pre_num_ranks: int
    is_last_rank: bool
    post_num_ranks: int
    scan: str = "allgather"
    offsets: tuple[int, ...] | None = None
    seq_ids: tuple[int, ...] | None = None
    cu_seqlens_global_cpu: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        """Number of local segments on this rank (FLA's ``num_seqs``)."""
        return len(self.cu_seqlens_cpu) - 1

    @property
    def num_tokens(self) -> int:
        """Number of tokens this rank holds."""
        return int(self.cu_seqlens_cpu[-1])

    @property
    def carries_in(self) -> bool:
        """The first local segment needs a state from earlier ranks."""
        return not self.is_first_rank

    @property
    def carries_out(self) -> bool:
        """The last local segment's end state is needed by later ranks."""
        return not self.is_last_rank

    @property
    def is_cp_enabled(self) -> bool:
        """Whether the split spans more than one rank (FLA's property of the same name)."""
        return self.world_size > 1

    @property
    def token_range(self) -> tuple[int, int]:
        """This rank's ``[start, end)`` in the global token stream."""
        offsets = self._need_global("token_range")
        return offsets[self.rank], offsets[self.rank + 1]

    def _need_global(self, what: str) -> tuple[int, ...]:
        if self.offsets is None:
            raise ValueError(
                f"cp_context: {what} needs the global partition (build the context with "
                "cula.cp.build_cp_context); this one was converted from an FLA context, which lacks it"
            )
        return self.offsets

    @classmethod
    def from_fla(cls, fla_context: Any, scan: str = "allgather") -> CPContext:
        """Wrap an ``fla.ops.cp.FLACPContext`` (contiguous layout) so that cula's CP ops accept it.

        The local op needs only the local boundaries and the chain flags, which FLA's context has; the
        helpers that need the global partition (:func:`cula.cp.gather_tokens`, ``gather_final_state``)
        do not work on the result.
        """
        import torch.distributed as dist

        layout = getattr(fla_context, "layout", "contiguous")
        if layout != "contiguous":
            raise NotImplementedError(f"cp_context: only the 'contiguous' layout is supported, got {layout!r}")
        group = fla_context.group
        if group is None:
            raise ValueError("cp_context: the FLA context has no process group (group=None)")
        cu_cpu = fla_context.cu_seqlens_cpu
        if cu_cpu is None:
            cu_cpu = fla_context.cu_seqlens.cpu()
        return cls(
            group=group,
            rank=dist.get_rank(group=group),
            world_size=dist.get_world_size(group=group),
            cu_seqlens=fla_context.cu_seqlens,
            cu_seqlens_cpu=cu_cpu.to(torch.int64),
            is_first_rank=bool(fla_context.is_first_rank),
            pre_num_ranks=int(fla_context.pre_num_ranks),
            is_last_rank=bool(fla_context.is_last_rank),
            post_num_ranks=int(fla_context.post_num_ranks),
            scan=_check_scan(scan),
        )


def _check_scan(scan: str) -> str:
    if scan not in SCAN_MODES:
        raise ValueError(f"scan: expected one of {SCAN_MODES}, got {scan!r}")
    return scan


def check_global_cu_seqlens(cu_seqlens: Any) -> torch.Tensor:
    """Validate global ``cu_seqlens`` and return it as int64 on the CPU."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N+1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    cpu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cpu[0]) != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(cpu[0])}")
    if bool((cpu[1:] < cpu[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing values, got {cpu.tolist()}")
    return cpu


def default_offsets(total_tokens: int, world_size: int) -> tuple[int, ...]:
    """Equal contiguous split ``offsets[r] = r * T // W`` (FLA's split when ``T % W == 0``)."""
    return tuple(r * total_tokens // world_size for r in range(world_size + 1))


def _check_offsets(offsets: Sequence[int], total_tokens: int, world_size: int) -> tuple[int, ...]:
    offsets = tuple(int(o) for o in offsets)
    if len(offsets) != world_size + 1 or offsets[0] != 0 or offsets[-1] != total_tokens:
        raise ValueError(
            f"offsets: expected {world_size + 1} token offsets from 0 to {total_tokens}, got {list(offsets)}"
        )
    if any(b <= a for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(
            f"offsets: expected strictly increasing offsets (every rank holds >= 1 token), got {list(offsets)}"
        )
    return offsets


def _rank_of_token(offsets: tuple[int, ...], position: int) -> int:
    """Index of the rank whose range holds global token ``position``."""
    return int(torch.searchsorted(torch.tensor(offsets[1:]), position, right=True))


def partition(
    cu_seqlens_cpu: torch.Tensor, offsets: tuple[int, ...], rank: int
) -> tuple[torch.Tensor, tuple[int, ...], bool, int, bool, int]:
    """Local boundaries and chain metadata of ``rank`` (pure; no communication).

    Returns ``(cu_local, seq_ids, is_first_rank, pre_num_ranks, is_last_rank, post_num_ranks)``; zero-length
    sequences and sequences outside the rank's range have no local segment.
    """
    start, end = offsets[rank], offsets[rank + 1]
    seq_start, seq_end = cu_seqlens_cpu[:-1], cu_seqlens_cpu[1:]
    overlaps = (seq_start < end) & (seq_end > start) & (seq_end > seq_start)
    ids = torch.nonzero(overlaps).flatten()
    # At least one sequence overlaps: every rank holds >= 1 token and tokens all belong to sequences.
    lo = seq_start[ids].clamp(min=start) - start
    hi = seq_end[ids].clamp(max=end) - start
    cu_local = torch.cat([lo[:1], hi]).to(torch.int64)
    first, last = int(ids[0]), int(ids[-1])
    first_rank_of_first = _rank_of_token(offsets, int(cu_seqlens_cpu[first]))
    last_rank_of_last = _rank_of_token(offsets, int(cu_seqlens_cpu[last + 1]) - 1)
    return (
        cu_local,
        tuple(int(i) for i in ids),
        first_rank_of_first == rank,
        rank - first_rank_of_first,
        last_rank_of_last == rank,
        last_rank_of_last - rank,
    )


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: ProcessGroup | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    layout: str = "contiguous",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    offsets: Sequence[int] | None = None,
    scan: str = "allgather",
) -> CPContext:
    """Build this rank's :class:`CPContext` from the global ``cu_seqlens`` (mirrors FLA's ``build_cp_context``).

    Args:
        cu_seqlens: global ``[N+1]`` int32/int64 boundaries of the packed stream (same on every rank).
        group: the CP process group; ``rank`` and ``world_size`` are read from it. ``None`` builds an
            emulated rank for single-process use (then ``rank`` and ``world_size`` are required).
        cu_seqlens_cpu: the same boundaries on the CPU, to skip a device-to-host copy.
        layout: ``"contiguous"`` (the only layout supported; FLA's ``"zigzag"`` is not).
        rank, world_size: override / supply the position in the group.
        offsets: ``[W+1]`` global token offsets of the ranks; default ``r * T // W``.
        scan: ``"allgather"`` (default) or ``"ring"``; see :class:`CPContext`.
    Returns:
        The context to pass as ``cp_context`` to :func:`cula.cp.lightning_attn_fwd` / :func:`cula.cp.chunk_kda`
        (and, once wired, to the public ops).
    """
    if layout != "contiguous":
        raise NotImplementedError(f"layout: only 'contiguous' is supported, got {layout!r}")
    scan = _check_scan(scan)
    if group is not None:
        import torch.distributed as dist

        group_rank, group_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        if rank is not None and rank != group_rank:
            raise ValueError(f"rank: expected this process's rank in group ({group_rank}), got {rank}")
        if world_size is not None and world_size != group_size:
            raise ValueError(f"world_size: expected the group size ({group_size}), got {world_size}")
        rank, world_size = group_rank, group_size
    if world_size is None or rank is None:
        raise ValueError("rank, world_size: required when group is None (single-process emulation)")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")

    cpu = check_global_cu_seqlens(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu)
    if cu_seqlens_cpu is not None and cpu.numel() != cu_seqlens.numel():
        raise ValueError(
            f"cu_seqlens_cpu: expected the same {cu_seqlens.numel()} entries as cu_seqlens, got {cpu.numel()}"
        )
    total = int(cpu[-1])
    if total < world_size:
        raise ValueError(f"cu_seqlens: expected at least world_size={world_size} tokens in total, got {total}")
    offsets = default_offsets(total, world_size) if offsets is None else _check_offsets(offsets, total, world_size)
    cu_local, seq_ids, is_first, pre, is_last, post = partition(cpu, offsets, rank)
    return CPContext(
        group=group,
        rank=rank,
        world_size=world_size,
        cu_seqlens=cu_local.to(device=cu_seqlens.device, dtype=torch.int32),
        cu_seqlens_cpu=cu_local,
        is_first_rank=is_first,
        pre_num_ranks=pre,
        is_last_rank=is_last,
        post_num_ranks=post,
        scan=scan,
        offsets=offsets,
        seq_ids=seq_ids,
        cu_seqlens_global_cpu=cpu,
    )


def emulated_contexts(
    cu_seqlens: torch.Tensor, world_size: int, offsets: Sequence[int] | None = None
) -> list[CPContext]:
    """The contexts of all ``world_size`` ranks, for single-process emulation of the split."""
    cpu = check_global_cu_seqlens(cu_seqlens)
    return [
        build_cp_context(cu_seqlens, None, cpu, rank=r, world_size=world_size, offsets=offsets)
        for r in range(world_size)
    ]
