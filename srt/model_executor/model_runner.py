"""ModelRunner: loads the model, sizes and owns the KV pools and the attention backend, runs
the forward pass and sampling.

Under tensor parallelism each rank has its own ModelRunner with its shard of the model (heads,
vocabulary, expert slices) and a KV pool of its local heads (MLA: the full latent). All ranks
agree on the pool size (the minimum over ranks), so their schedulers stay in lock-step.

``forward_step`` is the one entry for a step, used by the scheduler, bench_one_batch and the
tests: it plans this rank's split (``plan_split``: where its batch would split into two
micro-batches under TBO or DBO); under DP attention it runs the MLP sync
(``srt.model_executor.dp_sync``; every rank, every step, with or without a batch), which makes
the split decision unanimous, or runs an IDLE forward when only other groups have work so that
the MoE and LM-head collectives line up. Without DP attention every rank runs the same batch
and its own plan decides. ``StepOverlap`` then chooses the step's mode and the batch gets its
``StepSplit`` (``settle_split``), which everything after reads. ``forward`` runs one prepared
batch: it builds the two micro-batches of a split step, and the model runs them through the
executors given to it here (``srt.batch_overlap``: TBO's interleaved operations, DBO's
threads)."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter

import torch

from srt.batch_overlap.calibration import calibrate
from srt.batch_overlap.step_overlap import StepOverlap
from srt.batch_overlap.step_split import SplitConfig, plan_split, settle_split
from srt.batch_overlap.two_batch_overlap import run_layers_overlapped, with_children
from srt.batch_overlap.ubatching import UBatchWrapper
from srt.distributed.communication_op import all_gather_object
from srt.distributed.parallel_state import ParallelState
from srt.eplb.expert_distribution import ExpertDistributionRecorder
from srt.eplb.expert_location import expert_location_from_args, model_experts
from srt.layers import cpu_kernels
from srt.layers.attention.cpu_backend import CpuAttnBackend
from srt.layers.attention.registry import attention_backend_class
from srt.layers.attention.tbo_backend import TboAttnBackend
from srt.layers.cpu_preparation import prepare_for_cpu
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.moe.moe_block import SparseMoeBlock
from srt.layers.overlap.operations import OperationObserver
from srt.layers.sampler import Sampler
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from srt.model_executor.cpu_graph import CpuGraphError
from srt.model_executor.cpu_threads import CpuThreads
from srt.model_executor.cuda_graph_runner import CudaGraphRunner
from srt.model_executor.dp_sync import DpSyncInfo, apply_dp_sync, sync_dp_batch
from srt.model_executor.eplb_manager import EplbManager
from srt.model_executor.forward_batch_info import (
    AttnPart,
    ForwardBatch,
    mla_attention_parts,
)
from srt.model_executor.weight_bytes import WeightBytes
from srt.model_loader.config import ModelConfig
from srt.model_loader.loader import load_model
from srt.models.model_context import ModelOptions
from srt.server_args import ServerArgs
from srt.utils import stream_trace
from srt.utils.process import keep_heap_pages
from srt.utils.sync_guard import forbid_host_sync

logger = logging.getLogger(__name__)


def available_memory_bytes(device: str) -> int:
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_cache_budget_bytes(device: str, mem_fraction_static: float) -> float:
    """CUDA: weights and KV cache together take ``mem_fraction_static`` of the device's total
    memory (SGLang's rule), so the KV cache gets what is free now (weights loaded) minus the
    ``1 - fraction`` of the total kept for activations and the allocator. CPU: that fraction of
    the memory available now."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return free - total * (1 - mem_fraction_static)
    return available_memory_bytes(device) * mem_fraction_static


class ModelRunner:
    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig | None = None,
        parallel: ParallelState | None = None,
    ):
        self.server_args = server_args
        self.device = torch.device(server_args.device)
        self.parallel = parallel or ParallelState.single_rank(self.device)
        if self.parallel.tp_size != server_args.tp_size:
            raise ValueError(
                f"--tp-size {server_args.tp_size} needs a parallel state of that many ranks "
                f"(got {self.parallel.tp_size})"
            )
        self.model_config = model_config or ModelConfig.from_server_args(server_args)
        if self.device.type == "cuda":
            # cuDNN's SDPA builds an execution plan for every new shape (about 60 ms each on an
            # H100, torch 2.11, bf16/fp16): decode changes the KV length every step and extend
            # runs one call per prompt length, so it would build a plan on nearly every call.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._init_model()
        self._init_memory_pools()
        if self.device.type == "cpu":
            keep_heap_pages()  # activations reuse pages instead of faulting in fresh ones
        self.split_config = SplitConfig.from_server_args(server_args)
        self._init_split_executors()
        self._init_attention_backend()
        self.sampler = Sampler(server_args.random_seed)
        self.weight_bytes = WeightBytes.of(self.model).total
        self.cpu_threads = CpuThreads.from_server_args(server_args, WeightBytes.of(self.model, 4))
        # forwards run, by (overlap mode: off / tbo / sbo / dbo, local forward mode)
        self.step_counts: Counter[tuple[str, str]] = Counter()
        self.step_overlap = StepOverlap(
            server_args.overlap_mode, server_args.overlap_modes, self.model.comm_meter, self.device
        )
        self.dp_attention = server_args.enable_dp_attention
        self.last_dp_sync: DpSyncInfo | None = None  # DP attention: the last step's agreement
        self.num_idle_forward_steps = 0
        # MLA: attend a MIXED batch's decoding rows on the latent (``mla_attention_parts``);
        # the mixed-step benchmark turns it off to measure the expanded form.
        self.split_mla_decode_tail = True
        # Fail any host synchronisation inside ``forward`` (``srt.utils.sync_guard``): the tests
        # set it, on CPU too, to keep the step device-resident and capturable.
        self.forbid_host_sync = server_args.forbid_host_sync
        if server_args.enable_operation_profile:
            self.set_operation_observer(OperationObserver())
        self.graph_runner: CudaGraphRunner | None = None
        self.last_step_replayed_graph = False  # the last forward_step replayed a CUDA graph
        if self.step_overlap.policy is not None:
            calibrate(self)  # --overlap-mode auto: measure every mode before serving
        if self._can_capture_graphs():
            if self.expert_recorder is not None:  # a replay counts only what was captured
                self.expert_recorder.always = True
            self.graph_runner = CudaGraphRunner(self, server_args.cuda_graph_bs)

    def _init_split_executors(self) -> None:
        """Hand the model the executors of a step split in two micro-batches (models import
        none): TBO's interleaved operations for its overlapped layers, DBO's threads."""
        self.model.model.run_layers_overlapped = run_layers_overlapped
        self.model.run_body = UBatchWrapper(self.model.model)

    def _init_attention_backend(self) -> None:
        """``--attention-backend`` (resolved by ServerArgs), wrapped for two-batch overlap."""
        create = attention_backend_class(self.server_args.attention_backend)
        if self.split_config.rule == "dbo":  # the children attend, never the whole batch
            self.attn_backend = TboAttnBackend.init_new(create, parent_attends_when_split=False)
        elif self.split_config.rule == "tbo":
            self.attn_backend = TboAttnBackend.init_new(
                create, parent_attends_when_split=self.model.model.tbo_start_layer > 0
            )
        else:
            self.attn_backend = create()

    def _can_capture_graphs(self) -> bool:
        """Graphs for decode, unless disabled, where a decode step's inputs can all live in
        static buffers (see ``cuda_graph_runner``): CUDA graphs on CUDA, recorded ones on a
        CPU that runs alone (``cpu_graph``)."""
        sa = self.server_args
        if sa.disable_cuda_graph:
            return False
        if self.device.type == "cpu":
            return self._can_record_cpu_graphs()
        why_not = [
            (not self.attn_backend.static_decode_metadata, "--attention-backend torch_native"),
            (self.step_overlap.policy is not None, "--overlap-mode auto"),
            (self.split_config.rule == "dbo", "--enable-dbo (its steps run eagerly)"),
            (
                sa.moe_a2a_backend == "torch" and sa.deepep_mode == "normal",
                "--deepep-mode normal (its all-to-all sizes are host values: low_latency or "
                "auto decode from graphs)",
            ),
        ]
        reasons = [reason for off, reason in why_not if off]
        if reasons:
            logger.info("CUDA graphs off (decode runs eagerly): %s", ", ".join(reasons))
        return not reasons

    def _can_record_cpu_graphs(self) -> bool:
        """CPU decode graphs: one rank (a replay holds no collectives) whose decode attention
        reads the batch's own tensors: the CPU kernels over a float32 or bfloat16 cache."""
        kernels = isinstance(self.attn_backend, CpuAttnBackend)
        why_not = [
            (self.parallel.tp_size > 1, "more than one rank"),
            (not kernels, f"--attention-backend {self.server_args.attention_backend}"),
            (self.server_args.enable_operation_profile, "--enable-operation-profile"),
            (
                kernels and self.token_to_kv_pool.dtype not in cpu_kernels.ACT_TYPES,
                f"a {self.token_to_kv_pool.dtype} KV cache (decoded on SDPA)",
            ),
        ]
        reasons = [reason for off, reason in why_not if off]
        if reasons:
            logger.info("CPU decode graphs off (decode runs eagerly): %s", ", ".join(reasons))
        return not reasons

    def set_operation_observer(self, observer: OperationObserver | None) -> None:
        """Wrap every layer operation in a profiler marker (and, with ``observer.record``,
        time it); None turns it off."""
        self.model.model.operation_observer = observer

    def _init_model(self) -> None:
        torch.manual_seed(self.server_args.random_seed)
        location = expert_location_from_args(self.server_args, self.model_config.hf_config)
        options = ModelOptions.from_server_args(self.server_args, location)
        self.model = load_model(self.model_config, self.device, self.parallel, options)
        self.expert_recorder = self._attach_recorder()
        self.eplb = None  # --enable-eplb: rebalances the placement every N forward steps
        if self.server_args.enable_eplb:
            _, _, groups = model_experts(self.model_config.hf_config)
            sa = self.server_args
            self.eplb = EplbManager(
                self.model, location, self.expert_recorder, self.parallel,
                sa.eplb_rebalance_num_iterations, groups, sa.nnodes,
            )  # fmt: skip
        if self.device.type == "cpu":
            prepare_for_cpu(self.model)  # weight layouts and C kernels (``cpu_preparation``)

    def _attach_recorder(self) -> ExpertDistributionRecorder | None:
        """The expert-distribution recorder of the model's MoE blocks, set on each of them
        (None for a model without one)."""
        layers, experts, _ = model_experts(self.model_config.hf_config)
        blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        if not experts or not blocks:
            return None
        recorder = ExpertDistributionRecorder(layers, experts, self.parallel)
        for block in blocks:
            block.recorder = recorder
        return recorder

    def _make_kv_pool(self, size: int) -> KVCache:
        cfg, dtype = self.model_config.hf_config, self.model_config.kv_cache_dtype
        layers = cfg.num_hidden_layers
        if self.model_config.is_mla:
            return MLATokenToKVPool(
                size, dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim, layers, self.device
            )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # This rank's KV heads (replicated when fewer than ranks, as QKVParallelLinear).
        num_kv_heads = max(1, cfg.num_key_value_heads // self.parallel.attn_tp_size)
        return MHATokenToKVPool(size, dtype, num_kv_heads, head_dim, layers, self.device)

    def _profile_max_num_tokens(self) -> int:
        sa = self.server_args
        per_token = self._make_kv_pool(0).bytes_per_token()
        budget = kv_cache_budget_bytes(sa.device, sa.mem_fraction_static)
        tokens = int(budget // per_token)
        if sa.max_total_tokens is not None:
            tokens = (
                min(tokens, sa.max_total_tokens) if sa.device == "cuda" else sa.max_total_tokens
            )
        tokens = min(all_gather_object(self.parallel.world, tokens))
        if tokens < 16:
            raise RuntimeError(
                f"not enough memory for the KV cache ({tokens} tokens); raise "
                "--mem-fraction-static or --max-total-tokens"
            )
        return tokens

    def _init_memory_pools(self) -> None:
        sa = self.server_args
        self.max_total_num_tokens = self._profile_max_num_tokens()
        self.max_running_requests = sa.max_running_requests
        context_len = self.model_config.context_len
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + 1, context_len + 4, self.device
        )
        self.token_to_kv_pool = self._make_kv_pool(self.max_total_num_tokens)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            self.max_total_num_tokens, self.device
        )
        logger.info(
            "KV cache: %d tokens, %.1f MB; max running requests %d",
            self.max_total_num_tokens,
            self.max_total_num_tokens * self.token_to_kv_pool.bytes_per_token() / 2**20,
            self.max_running_requests,
        )

    @torch.inference_mode()
    def forward_step(self, forward_batch: ForwardBatch | None) -> LogitsProcessorOutput | None:
        """One step of this rank (see the module docstring). Returns the batch's logits, the
        0-row output of an IDLE forward, or None when nothing ran (no batch here, and under DP
        attention none anywhere). With ``--enable-eplb``, a rebalance may follow the step."""
        out = self._forward_step(forward_batch)
        if out is not None and self.eplb is not None:
            self.eplb.after_step()
        return out

    def _forward_step(self, forward_batch: ForwardBatch | None) -> LogitsProcessorOutput | None:
        proposal = None if forward_batch is None else plan_split(forward_batch, self.split_config)
        overlap = self.step_overlap
        self.last_step_replayed_graph = False
        if not self.dp_attention:
            if forward_batch is None:
                return None
            shared = overlap.share(self.parallel)
            mode, tokens = forward_batch.forward_mode, forward_batch.num_tokens
            chosen = overlap.choose(mode, tokens, proposal is not None, shared)
            forward_batch.split = settle_split(chosen, forward_batch, proposal)
            return self.forward(forward_batch)
        info = self.last_dp_sync = sync_dp_batch(
            self.parallel, forward_batch, proposal, overlap.measurement, self.split_config.rule
        )
        mode, tokens = info.global_forward_mode, max(info.global_num_tokens)
        chosen = overlap.choose(mode, tokens, info.can_split, info.max_extra)
        if forward_batch is not None:
            split = settle_split(chosen, forward_batch, proposal, info.split_tokens)
            apply_dp_sync(forward_batch, info, split)
        elif info.all_idle:
            return None
        else:
            self.num_idle_forward_steps += 1
        graphs = self.graph_runner
        bucket = None if graphs is None else graphs.dp_bucket(info)
        if bucket is not None:  # every rank replays the same bucket
            return self._replay(forward_batch, bucket)
        if forward_batch is not None:
            return self.forward(forward_batch)
        return self._forward_idle(info, chosen)

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """One prepared batch (planned, and synced under DP attention): ``forward_step``."""
        mode = forward_batch.forward_mode.name
        with (
            self._sync_guard(),
            stream_trace.forward_step(mode, forward_batch.batch_size, forward_batch.num_tokens),
        ):
            return self._forward(forward_batch)

    def _sync_guard(self) -> contextlib.AbstractContextManager:
        return forbid_host_sync(self.device) if self.forbid_host_sync else contextlib.nullcontext()

    def _replay(self, forward_batch: ForwardBatch | None, bucket: int) -> LogitsProcessorOutput:
        """DP attention: this rank's batch (None: its group is idle) from bucket's graph."""
        with self._sync_guard():
            out = self.graph_runner.replay(forward_batch, bucket)
        self.last_step_replayed_graph = True
        graph = self.graph_runner.graphs[bucket].batch
        self.step_counts[(graph.split.mode, "decode" if forward_batch else "idle")] += 1
        return out

    def _forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        graphs = self.graph_runner
        # on CPU an observed step runs eagerly: a replay runs no operation to watch
        watched = self.model.model.operation_observer is not None and self.device.type == "cpu"
        eager = self.dp_attention or watched
        out = None
        if graphs is not None and not eager and graphs.can_run(forward_batch):
            out = self._replay_or_none(forward_batch)
        if out is None:
            self.prepare_forward(forward_batch)
            self.step_overlap.start()
            out = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
            self.step_overlap.finish()
        self.step_counts[(forward_batch.split.mode, forward_batch.forward_mode.name.lower())] += 1
        return out

    def _replay_or_none(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput | None:
        """The batch's bucket replayed (``last_step_replayed_graph``), or None where the
        bucket's first decode finds a CPU forward it cannot record: graphs off from then on
        (the step runs eagerly; what the attempt wrote, it writes again)."""
        self.apply_cpu_threads(forward_batch)
        try:
            out = self.graph_runner.replay(forward_batch)
        except CpuGraphError as e:
            logger.info("CPU decode graphs off (decode runs eagerly): %s", e)
            self.graph_runner = None
            return None
        self.last_step_replayed_graph = True
        return out

    def prepare_forward(self, forward_batch: ForwardBatch) -> None:
        """Everything a planned batch needs before the model runs on it: its micro-batches,
        the attention backend and its metadata (and the CPU threads for its kind of step)."""
        with_children(forward_batch, self.parallel.attn_tp_size)
        forward_batch.attn_backend = self.attn_backend
        self.apply_cpu_threads(forward_batch)
        parts = self._attention_parts(forward_batch)
        forward_batch.attn_parts = None if parts[0].batch is forward_batch else parts
        for part in parts:
            self.attn_backend.init_forward_metadata(part.batch)

    def apply_cpu_threads(self, forward_batch: ForwardBatch) -> None:
        """The CPU threads for this kind of step (``cpu_threads``); a graph's replay too."""
        if self.cpu_threads is not None:
            self.cpu_threads.apply(
                forward_batch.global_forward_mode or forward_batch.forward_mode,
                forward_batch.batch_size,
                forward_batch.num_tokens,
            )

    def _attention_parts(self, forward_batch: ForwardBatch) -> tuple[AttnPart, ...]:
        """How the batch attends: in parts for MLA (``mla_attention_parts``; not in a step split
        into micro-batches, whose metadata comes from the whole batch's backend call), else
        whole."""
        whole = (AttnPart(forward_batch, 0, forward_batch.num_tokens, False),)
        if not self.model_config.is_mla or forward_batch.tbo_children:
            return whole
        absorbed = self.attn_backend.absorbed_mla_extend
        return mla_attention_parts(forward_batch, absorbed, self.split_mla_decode_tail)

    def _forward_idle(self, info: DpSyncInfo, mode: str) -> LogitsProcessorOutput:
        """DP attention, this group without a batch: run the model on 0 tokens so that every
        collective of the step has this rank in it, in the step's overlap ``mode``. The output
        has 0 rows."""
        batch = ForwardBatch.idle(self.req_to_token_pool, self.token_to_kv_pool, self.device)
        apply_dp_sync(batch, info, settle_split(mode, batch, None, info.split_tokens))
        return self.forward(batch)

    @torch.inference_mode()
    def sample(
        self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_idle():
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self.sampler(logits_output.next_token_logits, forward_batch.sampling_info)
