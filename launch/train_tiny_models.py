"""Train the bundled tiny MoE checkpoints on arithmetic (``launch/arith_data.py``), on the CPU.

    python launch/train_tiny_models.py --out-dir launch/models      # both, as committed
    python launch/train_tiny_models.py --out-dir /tmp/m --only arith-deepseek-v3 --steps 300

Two models share one byte-level BPE tokenizer (make_tiny_models' corpus plus arithmetic text,
with every digit its own token, so that numbers are spelled digit by digit):
  arith-qwen3-moe    Qwen3MoeForCausalLM: GQA with q/k norms, 8 experts top-2 in every layer,
                     the Switch load-balancing loss of each layer (coefficient 0.1) in training
  arith-deepseek-v3  DeepseekV3ForCausalLM: MLA (queries uncompressed), a dense first layer,
                     then 8 routed experts in 4 groups (sigmoid scores, top-2 of the best 2
                     groups, correction bias) and a shared expert; the bias follows DeepSeek-V3's
                     auxiliary-loss-free balancing (raised for underloaded experts, lowered for
                     overloaded ones, by ``BIAS_RATE`` per step)
Each batch mixes plain lines (1 to 4 solved problems, one per line, ending with the EOS token)
and ChatML turns (``What is 37+45?`` → ``82``); the loss counts only the answers and what
ends them. The held-out tenth of the problems never appears. AdamW, warm-up then cosine decay.
Fixed seeds and batch order, one torch thread per model (``--threads``): a rerun with the same
torch version should give the same weights.
Writes HF checkpoints (config, generation config, tokenizer, per-expert safetensors) and
``training_log.json`` (loss per step; at the end the held-out accuracy and each MoE layer's
share of the expert picks on that text); ``--plot PNG`` draws the loss curves (needs
matplotlib).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import shutil
import time
from pathlib import Path

import torch
from arith_data import Problem, split_problems
from make_tiny_models import (
    BUNDLED_MODELS,
    EOS_TOKEN,
    _write_json,
    deepseek_config,
    qwen3_moe_config,
    save_tokenizer,
    save_weights,
)
from make_tiny_models import build_tokenizer as build_tiny_tokenizer
from tokenizers import Tokenizer

IM_END = "<|im_end|>"
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma)
MAX_LINES = 4  # solved problems in one plain example (a 3-shot prompt and its question)
MODEL_NAMES = list(BUNDLED_MODELS)
STEPS = 4000  # per model (side by side, both finish in about 12 minutes on 2 cores)
SIZES = {"hidden_size": 128, "num_hidden_layers": 3, "moe_intermediate_size": 64}


def build_tokenizer(train: list[Problem]) -> Tokenizer:
    """make_tiny_models' byte-level BPE, also trained on some problems, digits split."""
    lines = [f"{p.chat_question}\n{p.equation}\n" for p in train[:200]]
    return build_tiny_tokenizer(lines, split_digits=True)


def chat_text(problem: Problem) -> tuple[str, int]:
    """One user turn and its answer in the bundled template; where the answer starts."""
    prompt = f"<|im_start|>user\n{problem.chat_question}{IM_END}\n<|im_start|>assistant\n"
    return f"{prompt}{problem.answer}{IM_END}\n", len(prompt)


def example(tok: Tokenizer, problems: list[Problem], chat: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside the answers and their terminators)."""
    if chat:
        text, start = chat_text(problems[0])
        spans = [(start, len(text) - 1)]  # the reply and its <|im_end|>
    else:
        text, spans = "", []
        for i, p in enumerate(problems):
            end = EOS_TOKEN if i == len(problems) - 1 else "\n"
            spans.append((len(text) + len(p.question), len(text) + len(p.equation) + len(end)))
            text += p.equation + end
    enc = tok.encode(text)
    labels = [
        t if any(s <= lo and hi <= e for s, e in spans) else -100
        for t, (lo, hi) in zip(enc.ids, enc.offsets)
    ]
    return enc.ids, labels


def make_batch(tok, train, rng: random.Random, size: int, pad: int) -> dict[str, torch.Tensor]:
    """Half plain lines (1 to 4 problems), half chat turns."""
    rows = []
    for i in range(size):
        chat = i % 2 == 1
        rows.append(example(tok, rng.sample(train, 1 if chat else rng.randint(1, MAX_LINES)), chat))
    return pad_rows(rows, pad)


def pad_rows(rows: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    out = {k: torch.full((len(rows), width), v) for k, v in (("input_ids", pad), ("labels", -100))}
    out["attention_mask"] = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, labels) in enumerate(rows):
        out["input_ids"][r, : len(ids)] = torch.tensor(ids)
        out["labels"][r, : len(labels)] = torch.tensor(labels)
        out["attention_mask"][r, : len(ids)] = 1
    return out


def build_model(name: str, vocab_size: int, eos_id: int, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model_config(name, vocab_size, eos_id)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**cfg)
    return AutoModelForCausalLM.from_config(config), cfg


def model_config(name: str, vocab_size: int, eos_id: int) -> dict:
    if name == "arith-qwen3-moe":
        cfg = qwen3_moe_config(vocab_size, eos_id) | SIZES
        return cfg | {"intermediate_size": 256, "router_aux_loss_coef": 0.1}
    cfg = deepseek_config(3, vocab_size, eos_id) | SIZES
    # Queries uncompressed (q_lora_rank None, as in DeepSeek-V2-Lite) and half of each query /
    # key head rotary: with q_lora 64 and 16 rotary dims it learned the digits' alignment slowly.
    mla = {"q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32}
    cfg = cfg | mla | {"v_head_dim": 32, "intermediate_size": 256, "n_group": 4, "topk_group": 2}
    # Weights drawn with std 0.05, not 0.02 (a width-7168 model's value): without Qwen3's q/k
    # norms the attention logits of a width-128 model start near zero and the digits'
    # alignment was learned late or not at all within the steps.
    cfg["initializer_range"] = 0.05
    del cfg["rope_scaling"]  # plain RoPE: the problems are short
    return cfg


class Routing:
    """Forward hooks on every MoE layer's router (``mlp.gate``; both architectures' routers
    return ``(logits, weights, expert indices)``): the router logits and picks of the last
    forward."""

    def __init__(self, model):
        self.gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
        self.logits: list[torch.Tensor | None] = [None] * len(self.gates)
        self.picks: list[torch.Tensor | None] = [None] * len(self.gates)
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(self._recorder(i))

    def _recorder(self, i: int):
        def hook(module, inputs, outputs):
            self.logits[i], self.picks[i] = outputs[0], outputs[-1]

        return hook

    def loads(self, mask: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, how many of the last forward's real (unpadded) tokens picked each expert."""
        return [expert_load(p, mask, lg.shape[-1]) for lg, p in zip(self.logits, self.picks)]

    def balancing_loss(self, mask: torch.Tensor) -> torch.Tensor:
        return balancing_loss(self.logits, self.picks, mask)


def expert_load(picks: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    keep = mask.reshape(-1).bool()
    return torch.bincount(picks[keep].flatten(), minlength=num_experts).float()


def balancing_loss(logits: list, picks: list, mask: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss of each MoE layer (number of experts times
    the sum over experts of the share of picks and the mean router probability; 1.0 when
    balanced), averaged over the layers. ``logits[i]`` [tokens, experts] and ``picks[i]``
    [tokens, top_k] are layer i's; ``mask`` marks the real tokens. transformers' own loss pools
    the picks of all layers before balancing, which leaves each layer free to use only two
    or three of its experts."""
    keep = mask.reshape(-1, 1).float()
    losses = []
    for layer_logits, layer_picks in zip(logits, picks):
        probs = layer_logits.softmax(-1)
        load = expert_load(layer_picks, mask, probs.shape[-1])
        mean_prob = (probs * keep).sum(0) / keep.sum()
        losses.append(probs.shape[-1] * (load / load.sum() * mean_prob).sum())
    return torch.stack(losses).mean()


class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: counts each MoE layer's expert choices in
    a step, then moves its correction bias toward equal load."""

    def __init__(self, routing: Routing):
        self.routing = routing

    def step(self, mask: torch.Tensor) -> None:
        with torch.no_grad():
            for gate, load in zip(self.routing.gates, self.routing.loads(mask)):
                gate.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)


def held_out_accuracy(model, routing: Routing, tok, held: list[Problem], pad: int) -> dict:
    """Exact match of every answer token and its terminator under teacher forcing (the same
    as greedy decoding getting the answer), plain and chat; and each MoE layer's share of the
    expert picks over that text (one list per layer, expert 0 first)."""
    model.eval()
    scores: dict = {}
    picks = [torch.zeros(g.weight.shape[0]) for g in routing.gates]
    terminators = [tok.token_to_id(EOS_TOKEN), tok.encode("\n").ids[0]]
    with torch.no_grad():
        for chat in (False, True):
            correct = 0
            for start in range(0, len(held), 256):
                chunk = held[start : start + 256]
                batch = pad_rows([example(tok, [p], chat) for p in chunk], pad)
                logits = model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits
                for total, load in zip(picks, routing.loads(batch["attention_mask"])):
                    total += load
                pred = logits[:, :-1].argmax(-1)
                target = batch["labels"][:, 1:]
                ok = (pred == target) | (target == -100)
                if not chat:  # after a lone problem, a new line or the end are both right
                    last = (target != -100).cumsum(1).argmax(1)
                    rows = torch.arange(len(chunk))
                    ok[rows, last] = torch.isin(pred[rows, last], torch.tensor(terminators))
                correct += int(ok.all(dim=1).sum())
            scores["chat" if chat else "plain"] = correct / len(held)
    scores["expert_share"] = [[round(float(x), 4) for x in p / p.sum()] for p in picks]
    model.train()
    return scores


def train(name: str, tok: Tokenizer, args) -> tuple[object, dict, dict]:
    """Train one model; returns it, its config and its log."""
    steps = args.steps
    train_set, held = split_problems()
    eos_id = tok.token_to_id(EOS_TOKEN)
    vocab_size = -(-tok.get_vocab_size() // 8) * 8
    model, cfg = build_model(name, vocab_size, eos_id, args.seed)
    routing = Routing(model)
    balancer = BiasBalancer(routing) if cfg["model_type"] == "deepseek_v3" else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(args.seed)
    log: dict = {"steps": [], "loss": []}
    start = time.monotonic()
    model.train()
    for step in range(steps):
        batch = make_batch(tok, train_set, rng, args.batch_size, eos_id)
        mask = batch["attention_mask"]
        loss = model(**batch).loss
        if balancer is None:  # Qwen3-MoE: per-layer balancing instead of transformers' pooled loss
            loss = loss + cfg["router_aux_loss_coef"] * routing.balancing_loss(mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if balancer is not None:
            balancer.step(mask)
        log["steps"].append(step)
        log["loss"].append(round(loss.item(), 5))
        if step % 100 == 0 or step == steps - 1:
            print(
                f"{name} step {step}: loss {loss.item():.4f} ({time.monotonic() - start:.0f} s)",
                flush=True,
            )
    log["train_seconds"] = round(time.monotonic() - start, 1)
    result = held_out_accuracy(model, routing, tok, held, eos_id)
    log["expert_share"] = result.pop("expert_share")
    log["held_out_accuracy"] = result
    print(f"{name}: held-out accuracy {result}; expert shares {log['expert_share']}", flush=True)
    return model, cfg, log


def per_expert_tensors(model) -> dict[str, torch.Tensor]:
    """The state dict under the released checkpoints' names: transformers keeps each MoE
    layer's experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]); checkpoints name every expert's projections."""
    out = {}
    for key, value in model.state_dict().items():
        value = value.detach().to(torch.float32).contiguous()
        if key.endswith("experts.gate_up_proj"):
            prefix, inter = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = value[e, inter:].clone()
        elif key.endswith("experts.down_proj"):
            prefix = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e].clone()
        else:
            out[key] = value
    return dict(sorted(out.items()))


def save(name: str, model, cfg: dict, tok: Tokenizer, log: dict, out_dir: Path) -> Path:
    out = out_dir / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _write_json(out / "config.json", cfg)
    eos_ids = [tok.token_to_id(EOS_TOKEN), tok.token_to_id(IM_END)]
    gen_cfg = {"bos_token_id": eos_ids[0], "eos_token_id": eos_ids, "pad_token_id": eos_ids[0]}
    _write_json(out / "generation_config.json", gen_cfg)
    save_tokenizer(tok, out)
    save_weights(per_expert_tensors(model), out, 1)
    _write_json(out / "training_log.json", log)
    return out


def plot(logs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, log in logs.items():
        window = 20
        loss = log["loss"]
        smooth = [
            sum(loss[max(0, i - window + 1) : i + 1]) / len(loss[max(0, i - window + 1) : i + 1])
            for i in range(len(loss))
        ]
        acc = log["held_out_accuracy"]
        ax.plot(
            log["steps"],
            smooth,
            label=f"{name} (held out: plain {acc['plain']:.3f}, chat {acc['chat']:.3f})",
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (20-step mean)")
    ax.set_title(
        "answer tokens; Qwen3-MoE's adds 0.1 x balancing loss (1.0 when balanced)", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def train_and_save(name: str, args) -> tuple[str, dict]:
    torch.set_num_threads(args.threads)
    tok = build_tokenizer(split_problems()[0])
    model, cfg, log = train(name, tok, args)
    print(f"{name}: {save(name, model, cfg, tok, log, Path(args.out_dir))}", flush=True)
    return name, log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--only", nargs="+", choices=MODEL_NAMES, default=MODEL_NAMES)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per model (results depend on it)"
    )
    p.add_argument("--plot", default=None, metavar="PNG")
    args = p.parse_args()
    # One process per model, side by side (one core each on a 2-core machine).
    with multiprocessing.get_context("spawn").Pool(len(args.only)) as pool:
        logs = dict(pool.starmap(train_and_save, [(name, args) for name in args.only]))
    if args.plot:
        plot(logs, args.plot)


if __name__ == "__main__":
    main()
