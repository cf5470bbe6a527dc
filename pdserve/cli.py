"""`pdserve` command line: model management, the engine alone, workers, router and a cluster.

Environment variables and flags are read here only; components get frozen configs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from pathlib import Path


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("PDSERVE_MODEL"),
                   help="model directory, .gguf file, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool size in MiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: the CPUs this process may run on)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16",
                                                          "int8"),
                   help="weights: float32 (exact, default); bfloat16/float16 (needs native bf16 "
                   "on CPU); int8 (per-channel int8 weights, per-token int8 activations)")


def engine_config_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine.config import EngineConfig

    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                               else None)
    return EngineConfig(
        block_size=args.block_size, kv_cache_bytes=args.kv_cache_mb << 20,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk, num_threads=threads, device=args.device,
        dtype=args.dtype)


def _cmd_model_pull(args: argparse.Namespace) -> int:
    from engine.model_store import convert_gguf, pull_default_model

    if args.gguf:
        out = convert_gguf(Path(args.gguf), Path(args.out), progress=True)
    else:
        out = pull_default_model(progress=True)
    print(out)
    # Build the fused CPU kernels now (once per machine) rather than in the first worker.
    import torch

    from engine.kernels import kernels_for

    print(f"CPU kernels: {kernels_for(torch.device('cpu'), torch.float32).name}",
          file=sys.stderr)
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from engine.model_store import resolve_model
    from engine.types import GenerateRequest, SamplingParams

    model_dir = resolve_model(args.model)
    engine = LLMEngine.from_dir(model_dir, engine_config_from_args(args))
    tok = engine.tokenizer
    assert tok is not None
    ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}])
           if args.chat else tok.encode(args.prompt))
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=args.seed)
    async with AsyncEngine(engine) as aeng:
        async for ev in aeng.generate(GenerateRequest(uuid.uuid4().hex, tuple(ids), sampling)):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finished:
                sys.stdout.write("\n")
                print(f"[{ev.finish_reason}: {ev.num_prompt_tokens} prompt tokens, "
                      f"{ev.num_output_tokens} generated]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    # UCX warns about variables other libraries set for it; those warnings are noise here.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # ucxx's default progress mode awaits every UCX request in a yield loop on the event loop,
    # so a KV receiver with a receive always posted spins a core while idle; with Python
    # futures a notifier thread completes them instead. Must be set before ucxx is imported.
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    pull = model_sub.add_parser("pull", help="fetch and convert the default model (cached)")
    pull.add_argument("--gguf", help="convert this local .gguf file instead")
    pull.add_argument("--out", help="output directory for --gguf")
    pull.set_defaults(func=_cmd_model_pull)

    gen = sub.add_parser("generate", help="run the engine alone and stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_args(gen)
    gen.set_defaults(func=lambda a: asyncio.run(_generate(a)))

    try:
        from pdserve import services_cli
    except ImportError:  # services not installed in this build
        services_cli = None  # type: ignore[assignment]
    if services_cli is not None:
        services_cli.register(sub, _add_engine_args)

    args = parser.parse_args(argv)
    if args.command == "model" and args.gguf and not args.out:
        parser.error("--gguf needs --out")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
