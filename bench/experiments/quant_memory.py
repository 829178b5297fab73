"""Resident memory of the quantized models: synthetic real-size weights, or the servers.

Builds the Qwen2.5-Coder 1.5B target's or 0.5B draft's decoder (real config, random
GGML blocks of the types the shipped files use, float32 norms and biases; no model
file is read) as the loader does (``QuantizedEmbedding``, a tied head sharing the
embedding's blocks, ``prepare``: huge pages), then a KV pool of ``--kv-budget``, a
prefill of ``--prompt`` tokens (tiles past 32 rows) and ``--steps`` one-token steps.
Reported, from ``/proc/self/status``: the resident set after each stage (VmRSS) and
its peak (VmHWM), beside the bytes the model holds (``held_bytes``: blocks plus float
tensors), so what the process holds beyond its weights and KV pool shows.

One model per process (the peak is the process's): ``python -m bench.experiments.quant_memory
--model 1.5b`` and ``--model 0.5b`` write ``bench/results/quant_memory_<model>.{md,json}``.

``--servers`` measures the servers themselves instead: the target and draft servers of
``--target`` / ``--draft`` (the shipped pair by default, loaded as ``specserve up``
loads them: each server's own default weight form and KV budget) and one orchestrator,
each its own process on loopback (:func:`bench.serving_stack.serving_stack`); once both
serve, and again after one greedy request of ``--new-tokens`` through the orchestrator,
each server process's resident set (``VmRSS``, split into anonymous memory and mapped
files: ``RssAnon``, ``RssFile``) and peak (``VmHWM``) from ``/proc/<pid>/status``.
``--tiny`` serves the tiny random pair (the smoke test). Writes
``bench/results/server_memory.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import environment, environment_md, reproduce_command, write_results
from bench.concurrency import DRAFT, TARGET
from bench.experiments.policy_ablation import TINY_DRAFT, TINY_TARGET
from bench.serving_stack import OrchestratorSetting, serving_stack
from specserve.client import Client
from specserve.engine.config import ModelConfig
from specserve.engine.loader import prepare
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.quant import GGMLType
from specserve.engine.quant.synthetic import random_weight
from specserve.engine.quantized_layers import (
    QuantizedEmbedding,
    held_bytes,
    quantized_bytes,
    set_quantized_weight,
)
from specserve.engine.rope import RotaryEmbedding
from specserve.serving.cli_args import parse_bytes

_QWEN = {"model_type": "qwen2", "vocab_size": 151936, "attention_bias": True,
         "tie_word_embeddings": True, "rope_theta": 1000000.0}  # fmt: skip
CONFIGS = {
    "1.5b": ModelConfig(**_QWEN, hidden_size=1536, intermediate_size=8960, num_layers=28,
                        num_heads=12, num_kv_heads=2, head_dim=128),
    "0.5b": ModelConfig(**_QWEN, hidden_size=896, intermediate_size=4864, num_layers=24,
                        num_heads=14, num_kv_heads=2, head_dim=64),
    "tiny": ModelConfig(**{**_QWEN, "vocab_size": 512}, hidden_size=256,
                        intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=64),
}  # fmt: skip
# Block types per matrix, as Q4_K_M files use them (the 1.5B: Q4_K, with v, down and the
# embedding in Q6_K; the 0.5B, whose 896 columns are no multiple of 256: Q5_0, with the
# embedding in Q8_0).
TYPES = {
    "1.5b": {"embed": GGMLType.Q6_K, "v_proj": GGMLType.Q6_K, "down_proj": GGMLType.Q6_K,
             "other": GGMLType.Q4_K},
    "0.5b": {"embed": GGMLType.Q8_0, "other": GGMLType.Q5_0},
    "tiny": {"embed": GGMLType.Q8_0, "other": GGMLType.Q4_K},
}  # fmt: skip
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def synthetic_model(name: str) -> CausalLM:
    """``name``'s decoder with random blocks in every matrix, prepared to serve."""
    cfg, types = CONFIGS[name], TYPES[name]
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.rope = RotaryEmbedding(cfg)
    seed = 0
    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            for proj in _PROJECTIONS:
                linear = getattr(module, proj, None)
                if linear is None:
                    continue
                seed += 1
                ggml_type = types.get(proj, types["other"])
                out, k = linear.out_features, linear.in_features
                set_quantized_weight(linear, random_weight(ggml_type, out, k, seed=seed))
                if linear.bias is not None:
                    linear.bias = nn.Parameter(torch.zeros(out), requires_grad=False)
    for name_, param in list(model.named_parameters()):
        if param.is_meta:  # norms (embedding: replaced below)
            owner, _, attr = name_.rpartition(".")
            if "embed_tokens" not in owner:
                setattr(model.get_submodule(owner), attr, nn.Parameter(torch.ones(param.shape)))
    embed = random_weight(types["embed"], cfg.vocab_size, cfg.hidden_size, seed=0)
    model.model.embed_tokens = QuantizedEmbedding(embed, torch.float32)
    set_quantized_weight(model.lm_head, embed)  # tied
    return prepare(model)


def _status_kib(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _stage(stages: list[dict[str, Any]], name: str) -> None:
    stages.append(
        {"stage": name, "rss_gib": _status_kib("VmRSS") / 2**20,
         "peak_gib": _status_kib("VmHWM") / 2**20}
    )  # fmt: skip


def run(name: str, kv_budget: int, prompt: int, steps: int) -> dict[str, Any]:
    stages: list[dict[str, Any]] = []
    _stage(stages, "start")
    model = synthetic_model(name)
    _stage(stages, "weights loaded")
    kv = model.new_kv_pool(kv_budget)
    _stage(stages, "KV pool")
    kv.reserve({"s": prompt + steps})
    ids = [(7 * i) % model.config.vocab_size for i in range(prompt + steps)]
    with torch.no_grad():
        model([SeqInput("s", ids[:prompt])], kv)
        _stage(stages, f"prefill of {prompt} tokens")
        for i in range(steps):
            model([SeqInput("s", [ids[prompt + i]])], kv)
    _stage(stages, f"{steps} one-token steps")
    return {
        "model": name,
        "held_gib": held_bytes(model) / 2**30,
        "blocks_gib": quantized_bytes(model) / 2**30,
        "kv_budget_gib": kv_budget / 2**30,
        "stages": stages,
    }


_SERVER_FIELDS = {"rss_gib": "VmRSS", "anon_gib": "RssAnon", "file_gib": "RssFile",
                  "peak_gib": "VmHWM"}  # fmt: skip


def server_memory(pid: int) -> dict[str, float]:
    """A server process's resident set, its anonymous and file-backed parts and its
    peak, in GiB."""
    return {key: _status_kib(field, pid) / 2**20 for key, field in _SERVER_FIELDS.items()}


def run_servers(args: argparse.Namespace) -> dict[str, Any]:
    """The target and draft servers' memory once serving and after one request."""
    stack_args = argparse.Namespace(
        target=args.target, draft=args.draft, target_dtype=args.target_dtype,
        draft_dtype=args.draft_dtype, threads=args.threads, emulate_devices=None,
        target_timeout_s=600.0, logs=None,
    )  # fmt: skip
    stages: list[dict[str, Any]] = []
    with serving_stack(stack_args, {"default": OrchestratorSetting()}) as stack:
        pids = {role: s.proc.pid for role, s in stack.servers.items() if s.proc is not None}
        stages.append({"stage": "serving", **{r: server_memory(p) for r, p in pids.items()}})
        address = stack.orchestrators["default"].address
        with Client(address, timeout_s=3600) as client:
            done = client.generate(list(range(10, 40)), max_new_tokens=args.new_tokens)
        if not done.token_ids:
            raise RuntimeError("the request through the stack generated no tokens")
        name = f"after a request of {len(done.token_ids)} tokens"
        stages.append({"stage": name, **{r: server_memory(p) for r, p in pids.items()}})
    return {"target": args.target, "draft": args.draft, "stages": stages}


def servers_headline(served: dict[str, Any]) -> dict[str, float]:
    """Each server's resident and peak GiB after the request (the last stage)."""
    last = served["stages"][-1]
    return {
        f"{role}_{key}": last[role][key]
        for role in ("target", "draft")
        for key in ("rss_gib", "peak_gib")
    }


def markdown_servers(result: dict[str, Any], env: dict[str, Any], command: str) -> str:
    lines = [
        "# Resident memory of the servers (bench.experiments.quant_memory --servers)",
        "",
        environment_md(env),
        "",
        f"Reproduce: `{command}`",
        "",
        f"Target server `{result['target']}`, draft server `{result['draft']}`, each with "
        "its defaults (weight form, KV budget); GiB from /proc/<pid>/status.",
        "",
        "| stage | server | resident | anonymous | mapped files | peak |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for s in result["stages"]:
        for role in ("target", "draft"):
            m = s[role]
            lines.append(
                f"| {s['stage']} | {role} | {m['rss_gib']:.3f} | {m['anon_gib']:.3f} | "
                f"{m['file_gib']:.3f} | {m['peak_gib']:.3f} |"
            )
    return "\n".join(lines)


def markdown(result: dict[str, Any], env: dict[str, Any], command: str) -> str:
    lines = [
        f"# Resident memory, {result['model']} quantized (bench.experiments.quant_memory)",
        "",
        environment_md(env),
        "",
        f"Reproduce: `{command}`",
        "",
        f"Held by the model: {result['held_gib']:.3f} GiB ({result['blocks_gib']:.3f} GiB of "
        f"blocks); KV pool {result['kv_budget_gib']:.2f} GiB.",
        "",
        "| stage | resident GiB | peak GiB |",
        "| --- | ---: | ---: |",
    ]
    for s in result["stages"]:
        lines.append(f"| {s['stage']} | {s['rss_gib']:.3f} | {s['peak_gib']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(CONFIGS), default="1.5b")
    p.add_argument("--kv-budget", default="2GiB", help="the target server's default")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    p.add_argument("--servers", action="store_true", help="measure the server processes")
    p.add_argument("--target", default=TARGET, help="--servers: the target server's model")
    p.add_argument("--draft", default=DRAFT, help="--servers: the draft server's model")
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="bfloat16", help="as `specserve up` (default)")
    p.add_argument("--new-tokens", type=int, default=32, help="--servers: the request's")
    p.add_argument("--tiny", action="store_true", help="--servers: the tiny random pair")
    args = p.parse_args(argv)
    if args.servers:
        if args.tiny:
            args.target, args.draft = TINY_TARGET, TINY_DRAFT
            args.target_dtype = args.draft_dtype = "float32"
        served = run_servers(args)
        env = environment()
        command = reproduce_command("bench.experiments.quant_memory", argv)
        md = markdown_servers(served, env, command)
        print(md)
        if not args.no_write:
            data = {"headline": servers_headline(served), "environment": env, "command": command}
            write_results("server_memory", md, {**data, **served})
        return 0
    torch.set_num_threads(args.threads)
    result = run(args.model, parse_bytes(args.kv_budget), args.prompt, args.steps)
    env = environment()
    command = reproduce_command("bench.experiments.quant_memory", argv)
    md = markdown(result, env, command)
    print(md)
    if not args.no_write:
        name = f"quant_memory_{args.model}"
        write_results(name, md, {"environment": env, "command": command, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
