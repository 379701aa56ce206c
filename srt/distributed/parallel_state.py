"""Process groups for tensor, attention-data and expert parallelism.

Design
------
- SGLang's convention: the TP group is the whole world (``tp_size`` = number of ranks). With DP
  attention, the world is cut into ``attn_dp_size = dp_size`` contiguous attention-TP groups of
  ``attn_tp_size = tp_size // dp_size`` ranks: ``attn_dp_rank = rank // attn_tp_size``,
  ``attn_tp_rank = rank % attn_tp_size``. Without it, attention TP is the whole world.
- MoE: ``moe_ep_size`` defaults to ``tp_size`` when tokens travel by all-to-all
  (``moe_a2a_backend != "none"``) and to 1 (experts TP-sharded on every rank) otherwise;
  ``moe_tp_size = tp_size // moe_ep_size``. EP groups hold the ranks with the same
  ``moe_tp_rank`` (strided), MoE-TP groups are contiguous (SGLang's layout).
- Every group is a :class:`GroupCoordinator`: its global ``ranks``, a device group (the world's
  backend: gloo on CPU, nccl on CUDA) for tensors and a separate gloo ``cpu_group`` for Python
  objects and metadata, so metadata never queues behind tensor traffic.
- ``torch.distributed.new_group`` must be called by every rank, for every group, in the same
  order; :func:`build_parallel_state` does so for all partitions, keeping the group it belongs to.
  A partition that is the whole world reuses the world's groups.
- ``world_duplex``: on gloo, with an all-to-all MoE backend or DP attention, a second device
  group over the world, so exchanges can go point to point split by link direction (one gloo
  group streams one way at a time; see ``srt.distributed.p2p``): the token dispatchers'
  (``moe_ep_duplex``: the EP group is the world with an all-to-all backend) and the LM head's
  over the world. nccl collectives are full duplex already, so it is not created there.
- ``moe_ep_combine``: with single-batch overlap on nccl, an EP device group of its own for the
  blocked combine, on a high-priority stream and limited to ``sbo_combine_ctas`` CTAs (one per
  SM): the communication side of SBO's SM split (``srt.layers.overlap.single_batch_overlap``).
- No module-level state: :func:`init_parallel_state` returns a :class:`ParallelState` that is
  passed to whoever needs it, and ``destroy()`` releases its groups. The pure layout lives in
  :class:`ParallelConfig`, testable without processes.
- Collectives on a group are in ``srt.distributed.communication_op``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from srt.distributed.group_coordinator import GroupCoordinator, new_group_coordinator
from srt.server_args_choices import MOE_A2A_BACKEND_CHOICES


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of ``tp_size`` ranks; pure arithmetic, no process groups."""

    tp_size: int
    dp_size: int = 1
    enable_dp_attention: bool = False
    moe_a2a_backend: str = "none"
    ep_size: int | None = None  # None: tp_size with an all-to-all backend, else 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size ({self.tp_size}) and dp_size ({self.dp_size}) must be ≥ 1")
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ValueError(
                f"DP attention needs tp_size ({self.tp_size}) divisible by dp_size ({self.dp_size})"
            )
        if self.moe_a2a_backend not in MOE_A2A_BACKEND_CHOICES:
            raise ValueError(
                f"moe_a2a_backend {self.moe_a2a_backend!r} is not one of {MOE_A2A_BACKEND_CHOICES}"
            )
        ep = self.moe_ep_size
        if ep < 1 or self.tp_size % ep:
            raise ValueError(f"ep_size ({ep}) must divide tp_size ({self.tp_size})")
        if self.moe_a2a_backend != "none" and ep != self.tp_size:
            raise ValueError(
                f"moe_a2a_backend {self.moe_a2a_backend!r} splits experts over all ranks: "
                f"ep_size must equal tp_size ({self.tp_size}), got {ep}"
            )

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def attn_dp_size(self) -> int:
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def moe_ep_size(self) -> int:
        if self.ep_size is not None:
            return self.ep_size
        return self.tp_size if self.moe_a2a_backend != "none" else 1

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.moe_ep_size

    def attn_tp_group_ranks(self) -> list[list[int]]:
        size = self.attn_tp_size
        return [list(range(d * size, (d + 1) * size)) for d in range(self.attn_dp_size)]

    def moe_ep_group_ranks(self) -> list[list[int]]:
        stride = self.moe_tp_size
        return [list(range(j, self.tp_size, stride)) for j in range(stride)]

    def moe_tp_group_ranks(self) -> list[list[int]]:
        size = self.moe_tp_size
        return [list(range(j * size, (j + 1) * size)) for j in range(self.moe_ep_size)]


@dataclass
class ParallelState:
    """This rank's groups. ``tp`` is ``world`` (SGLang: TP spans every rank)."""

    config: ParallelConfig
    world: GroupCoordinator
    attn_tp: GroupCoordinator
    moe_ep: GroupCoordinator
    moe_tp: GroupCoordinator
    world_duplex: dist.ProcessGroup | None = None  # second world device group (gloo only)
    moe_ep_combine: dist.ProcessGroup | None = None  # SBO's combine group (nccl only)
    owns_world: bool = False  # init_parallel_state created the default process group
    destroyed: bool = field(default=False, repr=False)

    @classmethod
    def single_rank(cls, device: torch.device | str = "cpu") -> ParallelState:
        """One rank without torch.distributed: every group has one member and every
        collective in communication_op is a no-op."""
        world = GroupCoordinator("world", (0,), 0, None, None, torch.device(device))
        groups = {n: dataclasses.replace(world, name=n) for n in ("attn_tp", "moe_ep", "moe_tp")}
        return cls(ParallelConfig(tp_size=1), world, **groups)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def tp(self) -> GroupCoordinator:
        return self.world

    @property
    def tp_rank(self) -> int:
        return self.world.rank_in_group

    @property
    def tp_size(self) -> int:
        return self.world.world_size

    @property
    def attn_tp_rank(self) -> int:
        return self.attn_tp.rank_in_group

    @property
    def attn_tp_size(self) -> int:
        return self.attn_tp.world_size

    @property
    def attn_dp_rank(self) -> int:
        return self.rank // self.attn_tp_size

    @property
    def attn_dp_size(self) -> int:
        return self.config.attn_dp_size

    @property
    def moe_ep_rank(self) -> int:
        return self.moe_ep.rank_in_group

    @property
    def moe_ep_size(self) -> int:
        return self.moe_ep.world_size

    @property
    def moe_ep_duplex(self) -> dist.ProcessGroup | None:
        """The second EP device group: the world's (an all-to-all backend's EP group is the
        world)."""
        return self.world_duplex if self.config.moe_a2a_backend != "none" else None

    @property
    def moe_ep_device_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The EP device group, then the duplex one when there is one (dispatcher ``groups``)."""
        groups = (self.moe_ep.device_group, self.moe_ep_duplex)
        return tuple(g for g in groups if g is not None)

    @property
    def world_device_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The world's device group and its duplex twin (gloo); empty without the twin."""
        if self.world_duplex is None:
            return ()
        return (self.world.device_group, self.world_duplex)

    @property
    def moe_tp_rank(self) -> int:
        return self.moe_tp.rank_in_group

    @property
    def moe_tp_size(self) -> int:
        return self.moe_tp.world_size

    def destroy(self) -> None:
        """Release the groups (and the default group when this object created it). Idempotent;
        every rank must call it."""
        if self.destroyed:
            return
        self.destroyed = True
        if self.world.device_group is None:  # single_rank: no process group
            return
        if self.owns_world:
            dist.destroy_process_group()
            return
        own = {
            id(g): g
            for c in (self.world, self.attn_tp, self.moe_ep, self.moe_tp)
            for g in (c.device_group, c.cpu_group)
        }
        for extra in (self.world_duplex, self.moe_ep_combine):
            if extra is not None:
                own[id(extra)] = extra
        for group in own.values():
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)


def _device_for(backend: str, rank: int, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if backend == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_parallel_state(
    config: ParallelConfig,
    device: torch.device | str | None = None,
    timeout: timedelta | None = None,
    sbo_combine_ctas: int | None = None,
) -> ParallelState:
    """Create every group of ``config`` on an initialised default process group. Collective:
    all ranks call it with the same config. ``sbo_combine_ctas``: see ``moe_ep_combine``."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; use init_parallel_state")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != config.tp_size:
        raise ValueError(f"tp_size {config.tp_size} != world size {world_size}")
    dev = _device_for(dist.get_backend(), rank, device)
    world_cpu = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    world_ranks = tuple(range(world_size))
    world = GroupCoordinator("world", world_ranks, rank, dist.GroupMember.WORLD, world_cpu, dev)

    def make(name: str, partition: list[list[int]]) -> GroupCoordinator:
        if partition == [list(world_ranks)]:
            return dataclasses.replace(world, name=name)
        return new_group_coordinator(name, partition, rank, dev, timeout)

    return ParallelState(
        config,
        world,
        attn_tp=make("attn_tp", config.attn_tp_group_ranks()),
        moe_ep=make("moe_ep", config.moe_ep_group_ranks()),
        moe_tp=make("moe_tp", config.moe_tp_group_ranks()),
        world_duplex=_duplex_group(config, timeout),
        moe_ep_combine=_combine_group(config, rank, timeout, sbo_combine_ctas),
    )


def _extra_ep_group(config: ParallelConfig, rank: int, **new_group_kwargs) -> dist.ProcessGroup:
    """One more device group per EP partition, keeping this rank's; collective like new_group."""
    mine = None
    for ranks in config.moe_ep_group_ranks():
        group = dist.new_group(ranks, **new_group_kwargs)
        if rank in ranks:
            mine = group
    return mine


def _duplex_group(config: ParallelConfig, timeout: timedelta | None) -> dist.ProcessGroup | None:
    """The second world device group (see the module docstring)."""
    if dist.get_backend() != "gloo":
        return None
    if config.moe_a2a_backend == "none" and config.attn_dp_size == 1:
        return None
    return dist.new_group(list(range(config.tp_size)), timeout=timeout, backend="gloo")


def _combine_group(
    config: ParallelConfig, rank: int, timeout: timedelta | None, ctas: int | None
) -> dist.ProcessGroup | None:
    """SBO's EP combine group on nccl (see the module docstring)."""
    if ctas is None or config.moe_a2a_backend == "none" or dist.get_backend() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    options.config.max_ctas = ctas
    return _extra_ep_group(config, rank, timeout=timeout, backend="nccl", pg_options=options)


def init_parallel_state(
    world_size: int,
    rank: int,
    dp_size: int = 1,
    enable_dp_attention: bool = False,
    moe_a2a_backend: str = "none",
    backend: str | None = None,
    init_method: str | None = None,
    *,
    ep_size: int | None = None,
    device: torch.device | str | None = None,
    timeout: timedelta | None = None,
    sbo_combine_ctas: int | None = None,
    rendezvous_timeout: timedelta | None = None,
) -> ParallelState:
    """Initialise torch.distributed (unless already done) and build this rank's groups.

    ``backend``: "gloo" or "nccl"; None picks nccl when CUDA is available. ``init_method``: e.g.
    ``tcp://127.0.0.1:PORT`` (None: torch's env:// default). ``timeout`` bounds every
    collective; ``rendezvous_timeout`` (default: ``timeout``) the wait for all ranks to join."""
    config = ParallelConfig(world_size, dp_size, enable_dp_attention, moe_a2a_backend, ep_size)
    owns_world = not dist.is_initialized()
    if owns_world:
        _init_default_group(
            world_size, rank, backend, init_method, device, rendezvous_timeout or timeout
        )
        if timeout is not None:
            dist.distributed_c10d._set_pg_timeout(timeout, None)  # the world's collectives
    elif dist.get_rank() != rank:
        raise ValueError(f"rank {rank} != the initialised rank {dist.get_rank()}")
    try:
        state = build_parallel_state(config, device, timeout, sbo_combine_ctas)
    except BaseException:
        if owns_world:
            dist.destroy_process_group()
        raise
    state.owns_world = owns_world
    return state


def _init_default_group(
    world_size: int,
    rank: int,
    backend: str | None,
    init_method: str | None,
    device: torch.device | str | None,
    timeout: timedelta | None,
) -> None:
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dev = _device_for(backend, rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(
        backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs
    )
