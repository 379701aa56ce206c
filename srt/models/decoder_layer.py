"""The decoder layer shared by srt's MoE models: attention, then a sparse MoE block or a dense
MLP, exposed as a list of operations."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from srt.distributed.communication_op import all_reduce
from srt.distributed.parallel_state import ParallelState
from srt.layers.layernorm import RMSNorm
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.moe.moe_block import SparseMoeBlock
from srt.layers.overlap.operations import (
    LayerState,
    OperationItem,
    OperationObserver,
    execute_operations,
)
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.models.model_context import ModelContext, ModelOptions
from srt.models.operations_strategy import (
    OperationsFamily,
    OperationsStrategy,
    layer_operations,
)
from srt.models.weight_mapping import WeightMapping, load_weights_by_mapping


class MoEDecoderLayer(nn.Module):
    """Subclasses build ``self_attn`` (with ``op_prepare_attn`` / ``op_core_attn``) and ``mlp``
    (a SparseMoeBlock or a dense module) from the ModelContext, then call ``_init_norms``. The
    communicator moves tokens and reduces partial sums around them (see LayerCommunicator).

    Routed experts follow the ParallelState's MoE layout: with ``--moe-a2a-backend none`` that
    is expert TP (``moe_ep_size`` 1, every rank holds a 1/T slice of every expert's
    intermediate dimension), as SGLang. Chosen over EP-style sharding for plain TP because each
    rank's work is then a T-th of the MoE whatever the routing (EP-style leaves ranks idle when
    routing is skewed); the same reduction completes either layout, so an explicit ``ep_size``
    needs no other change."""

    self_attn: nn.Module
    mlp: nn.Module
    operations_family: OperationsFamily  # set by each model's layer class
    layer_id: int

    def _init_norms(self, hidden_size: int, eps: float, ctx: ModelContext) -> None:
        self.input_layernorm = RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps)
        self.comm = ctx.communicator(
            self.input_layernorm, self.post_attention_layernorm, is_moe=self.is_moe
        )
        # built once per (forward mode, overlap mode)
        self._operations: dict[tuple[ForwardMode, str], list[OperationItem]] = {}

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, SparseMoeBlock)

    @property
    def has_shared_experts(self) -> bool:
        return self.is_moe and self.mlp.shared_experts is not None

    def op_mlp(self, state: LayerState) -> None:
        state.put(mlp_output=self.mlp(state.pop("mlp_input")))

    def operation(self, name: str):
        """The bound operation an OperationsStrategy names."""
        comm, attn = self.comm, self.self_attn
        table = {
            "comm_prepare_attn": comm.prepare_attn,
            "prepare_attn": attn.op_prepare_attn,
            "core_attn": attn.op_core_attn,
            "comm_prepare_mlp": comm.prepare_mlp,
            "comm_postprocess": comm.postprocess,
            "mlp": self.op_mlp,
        }
        if name in table:
            return table[name]
        op = getattr(self.mlp, f"op_{name}", None) if self.is_moe else None
        if op is None:
            raise KeyError(f"layer {type(self).__name__} has no operation {name!r}")
        return op

    def get_operations(
        self, forward_mode: ForwardMode, overlap: str = "off"
    ) -> list[OperationItem]:
        key = (forward_mode, overlap)
        if key not in self._operations:
            self._operations[key] = layer_operations(self, forward_mode, overlap).operations
        return self._operations[key]

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        observer: OperationObserver | None = None,
    ):
        state = LayerState(batch, positions)
        state.put(hidden_states=hidden_states, residual=residual)
        ops = self.get_operations(strategy_mode(batch), batch.split.mode)
        execute_operations(state, ops, observer)
        return state.take_outputs("hidden_states", "residual")


def strategy_mode(batch: ForwardBatch) -> ForwardMode:
    """The mode whose operations list a batch runs: the global one (an idle rank follows the
    others; with nothing global, an idle batch takes the decode list)."""
    mode = batch.global_forward_mode or batch.forward_mode
    return ForwardMode.DECODE if mode.is_idle() else mode


class MoEModel(nn.Module):
    """Embedding → decoder layers → final norm."""

    def __init__(self, config, layer_cls: type[MoEDecoderLayer], ctx: ModelContext):
        super().__init__()
        self.attn_tp_group = ctx.parallel.attn_tp
        self.embed_tokens = ctx.embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_cls(config, i, ctx) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Two-batch overlap starts at the first MoE layer; dense layers before it (DeepSeek's
        # first_k_dense_replace) run on the whole batch.
        self.tbo_start_layer = next(
            (i for i, layer in enumerate(self.layers) if layer.is_moe), len(self.layers)
        )
        self.operation_observer: OperationObserver | None = None  # set by the ModelRunner
        # Two-batch overlap's executor for the layers from tbo_start_layer, given by the
        # ModelRunner (``srt.batch_overlap.two_batch_overlap``): models import no executor.
        self.run_layers_overlapped: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._tbo_strategies: dict[ForwardMode, OperationsStrategy] = {}  # built once per mode

    def tbo_strategy(self, mode: ForwardMode) -> OperationsStrategy:
        """The overlapped layers' operations, concatenated, for the step's global mode."""
        if mode not in self._tbo_strategies:
            layers = self.layers[self.tbo_start_layer :]
            self._tbo_strategies[mode] = OperationsStrategy.init_new_tbo(layers, mode)
        return self._tbo_strategies[mode]

    def forward(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        # Each rank embeds the ids of its vocabulary shard (zeros elsewhere): sum them.
        hidden = all_reduce(self.attn_tp_group, self.embed_tokens(input_ids))
        residual, observer = None, self.operation_observer
        interleaved = batch.split.mode == "tbo" and batch.tbo_children is not None
        end = self.tbo_start_layer if interleaved else len(self.layers)
        for layer in self.layers[:end]:
            hidden, residual = layer(positions, hidden, residual, batch, observer)
        if end < len(self.layers):
            if self.run_layers_overlapped is None:
                raise RuntimeError("a two-batch-overlap step needs the ModelRunner's executor")
            strategy = self.tbo_strategy(strategy_mode(batch))
            run = self.run_layers_overlapped
            hidden, residual = run(strategy, hidden, residual, batch, observer)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class MoECausalLM(nn.Module):
    """``model`` (MoEModel of ``layer_cls``) + LM head. Subclasses set ``layer_cls`` and
    ``weight_mapping``; parameter names follow the HF checkpoints. ``parallel``: this rank's
    groups (default: one rank, no torch.distributed); ``options``: the server flags that shape
    the model (default: ModelOptions()). ``run_body``, given by the ModelRunner, runs ``model``
    (``srt.batch_overlap.ubatching.UBatchWrapper``: once per micro-batch, in threads, on a
    dual-batch-overlap step); the LM head runs on the whole batch."""

    layer_cls: type[MoEDecoderLayer]

    def __init__(
        self, config, parallel: ParallelState | None = None, options: ModelOptions | None = None
    ):
        super().__init__()
        self.config = config
        ctx = ModelContext(parallel, options)
        self.model = MoEModel(config, self.layer_cls, ctx)
        self.run_body: Callable[..., torch.Tensor] | None = None  # None: ``model`` itself
        self.lm_head, self.logits_processor = ctx.lm_head(config.vocab_size, config.hidden_size)
        self.comm_meter = ctx.comm_meter
        # A tied LM head shares the embedding's parameter when both have the same shard.
        self.shares_embedding = getattr(config, "tie_word_embeddings", False) and (
            not ctx.cross_dp_lm_head
        )
        if self.shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden = (self.run_body or self.model)(input_ids, positions, batch)
        return self.logits_processor(hidden, self.lm_head, batch)

    def weight_mapping(self) -> WeightMapping:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        mapping = self.weight_mapping()
        if self.shares_embedding:
            mapping.skip_prefixes = (*mapping.skip_prefixes, "lm_head.")
        elif getattr(self.config, "tie_word_embeddings", False):
            weights = _with_tied_lm_head(weights)
        load_weights_by_mapping(self, weights, mapping)


def _with_tied_lm_head(weights: Iterable[tuple[str, torch.Tensor]]):
    """A tied LM head sharded differently from the embedding loads its own shard of the
    embedding tensor (a tied checkpoint may omit ``lm_head.weight``)."""
    for name, tensor in weights:
        if name == "lm_head.weight":
            continue
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor
