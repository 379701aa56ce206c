"""Arithmetic accuracy of a served model (or an in-process Engine), SGLang-style: few-shot and
zero-shot ``37+45=`` completions on /generate and ``What is 37+45?`` on
/v1/chat/completions, greedy, over the problems the bundled trained models never saw
(``launch/arith_data.py``).

    python benchmark/offline/eval_accuracy.py --base-url http://127.0.0.1:30000 --parallel 64
    python benchmark/offline/eval_accuracy.py --model-path launch/models/arith-deepseek-v3 \
        --engine-args '{"tp_size": 2, "enable_dp_attention": true, "dp_size": 2}'
    python benchmark/offline/eval_accuracy.py --model-path launch/models/arith-qwen3-moe \
        --engine-args '{"dtype": "bfloat16"}'
    python benchmark/offline/eval_accuracy.py --model-path launch/models/arith-qwen3-moe \
        --engine-args '{"quantization": "fp8"}'

``--engine-args`` takes any ``ServerArgs`` field: ``dtype`` (``bfloat16``) runs the bundled
float32 checkpoints in bf16, ``quantization`` (``fp8``) quantizes them at load to block-FP8
(``docs/quantization.md``); ``docs/accuracy.md`` has the accuracies measured each way.

Prints, per mode, ``Accuracy``, ``Invalid`` (no number in the answer), ``Latency`` and
``Output throughput`` (as SGLang's GSM8K and few-shot benchmarks do), and appends one JSON
line per mode to ``--result-file``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

from arith_data import Problem, chat_answer, few_shot_prompt, parse_answer, split_problems

MODES = ("few-shot", "zero-shot", "chat")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="a running server")
    p.add_argument("--model-path", default=None, help="else: an in-process srt.Engine")
    p.add_argument("--engine-args", default="{}", help="JSON of srt.Engine keyword arguments")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--num-shots", type=int, default=3)
    p.add_argument("--num-questions", type=int, default=None, help="default: all held out")
    p.add_argument("--parallel", type=int, default=32, help="requests in flight (server)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    args = p.parse_args(argv)
    if (args.base_url is None) == (args.model_path is None):
        p.error("give --base-url (a server) or --model-path (an Engine)")
    return args


def questions(args) -> list[Problem]:
    _, held = split_problems()
    if args.num_questions is not None:
        held = random.Random(args.seed).sample(held, min(args.num_questions, len(held)))
    return held


def shots_for(train: list[Problem], k: int, index: int, seed: int) -> list[Problem]:
    return random.Random(seed * 1_000_003 + index).sample(train, k)


class ServerClient:
    def __init__(self, base_url: str, parallel: int):
        import httpx

        self.http = httpx.Client(base_url=base_url, timeout=300.0)
        self.parallel = parallel

    def complete(self, prompts: list[str], max_new_tokens: int) -> list[tuple[str, int]]:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, "stop": ["\n"]}

        def one(prompt: str) -> tuple[str, int]:
            out = self.http.post("/generate", json={"text": prompt, "sampling_params": params})
            out.raise_for_status()
            body = out.json()
            return body["text"], body["meta_info"]["completion_tokens"]

        with ThreadPoolExecutor(self.parallel) as pool:
            return list(pool.map(one, prompts))

    def chat(self, questions: list[str], max_tokens: int) -> list[tuple[str, int]]:
        def one(question: str) -> tuple[str, int]:
            body = {"messages": [{"role": "user", "content": question}], "temperature": 0}
            out = self.http.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens})
            out.raise_for_status()
            data = out.json()
            return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]

        with ThreadPoolExecutor(self.parallel) as pool:
            return list(pool.map(one, questions))


class EngineClient:
    def __init__(self, model_path: str, engine_args: dict):
        import srt

        self.engine = srt.Engine(model_path=model_path, **engine_args)

    def complete(self, prompts: list[str], max_new_tokens: int) -> list[tuple[str, int]]:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, "stop": ["\n"]}
        outs = self.engine.generate(prompts, params)
        return [(o["text"], o["meta_info"]["completion_tokens"]) for o in outs]

    def chat(self, questions: list[str], max_tokens: int) -> list[tuple[str, int]]:
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in questions
        ]
        outs = self.engine.generate(prompts, {"temperature": 0, "max_new_tokens": max_tokens})
        return [(o["text"], o["meta_info"]["completion_tokens"]) for o in outs]


def evaluate(client, mode: str, problems: list[Problem], args) -> dict:
    train, _ = split_problems()
    start = time.perf_counter()
    if mode == "chat":
        outs = client.chat([p.chat_question for p in problems], 16)
        answers = [chat_answer(text) for text, _ in outs]
    else:
        k = args.num_shots if mode == "few-shot" else 0
        prompts = [
            few_shot_prompt(p, shots_for(train, k, i, args.seed)) for i, p in enumerate(problems)
        ]
        outs = client.complete(prompts, 8)
        answers = [parse_answer(text) for text, _ in outs]
    latency = time.perf_counter() - start
    correct = sum(a == p.answer for a, p in zip(answers, problems))
    return {
        "mode": mode,
        "num_questions": len(problems),
        "accuracy": correct / len(problems),
        "invalid": sum(a is None for a in answers) / len(problems),
        "latency": latency,
        "output_throughput": sum(n for _, n in outs) / latency,
    }


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    problems = questions(args)
    if args.base_url:
        client = ServerClient(args.base_url, args.parallel)
    else:
        client = EngineClient(args.model_path, json.loads(args.engine_args))
    results = []
    try:
        for mode in args.modes:
            r = evaluate(client, mode, problems, args)
            results.append(r)
            print(f"== {mode} ({r['num_questions']} questions)")
            print(f"Accuracy: {r['accuracy']:.3f}")
            print(f"Invalid: {r['invalid']:.3f}")
            print(f"Latency: {r['latency']:.3f} s")
            print(f"Output throughput: {r['output_throughput']:.3f} token/s")
    finally:
        if isinstance(client, EngineClient):
            client.engine.shutdown()
    if args.result_file:
        with open(args.result_file, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return results


if __name__ == "__main__":
    main()
