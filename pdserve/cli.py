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

from pdserve import cluster_cli, services_cli
from pdserve.cli_args import (
    HelpFormatter,
    add_engine_args,
    engine_config_from_args,
    version,
)
from pdserve.rpc import core_env


def _cmd_model_pull(args: argparse.Namespace) -> int:
    from pdserve.engine.model_store import convert_gguf, pull_default_model

    if args.gguf:
        out = convert_gguf(Path(args.gguf), Path(args.out), progress=True)
    else:
        out = pull_default_model(progress=True)
    print(out)
    # Build the fused CPU kernels now (once per machine) rather than in the first worker.
    import torch

    from pdserve.engine.kernels import kernels_for

    print(f"CPU kernels: {kernels_for(torch.device('cpu'), torch.float32).name}",
          file=sys.stderr)
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine.async_engine import AsyncEngine, load_engine
    from pdserve.engine.model_store import resolve_model
    from pdserve.types import GenerateRequest, SamplingParams

    model_dir = resolve_model(args.model)
    engine = await load_engine(model_dir, engine_config_from_args(args))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pdserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(parent: argparse._SubParsersAction, name: str,
            help: str) -> argparse.ArgumentParser:
        return parent.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)

    model = add(sub, "model", "manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    pull = add(model_sub, "pull", "fetch and convert the default model (cached)")
    pull.add_argument("--gguf", help="convert this local .gguf file instead")
    pull.add_argument("--out", help="output directory for --gguf")
    pull.set_defaults(func=_cmd_model_pull)

    gen = add(sub, "generate", "run the engine alone and stream a completion")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature (0: greedy)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=lambda a: asyncio.run(_generate(a)))

    services_cli.register(sub, add)
    cluster_cli.register(sub, add)
    return parser


def main(argv: list[str] | None = None) -> int:
    # UCX warns about variables other libraries set for it; those warnings are noise here.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # ucxx's default progress mode awaits every UCX request in a yield loop on the event loop,
    # so a KV receiver with a receive always posted spins a core while idle; with Python
    # futures a notifier thread completes them instead. Must be set before ucxx is imported.
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    core_env.apply()  # grpc's C core reads its variables when grpc is first imported
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "model" and args.gguf and not args.out:
        parser.error("--gguf needs --out")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
