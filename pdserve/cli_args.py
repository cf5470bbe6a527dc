"""The flag vocabulary every pdserve command shares (`pdserve generate`, the workers, the
router, `pdserve cluster up` and `python -m pdserve.gateway`): one spelling, one help text,
one validation for each of model, engine, API-key and logging flags.

Flags that set a config field are generated from it (pdserve.settings): the engine's from
`ENGINE_SETTINGS` and EngineConfig's defaults, the router's and workers' from their config
dataclasses. Only argparse, the standard library and pdserve.settings at import time; the
config classes are imported when a parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import math
import os
from collections.abc import Collection, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from pdserve.cluster import api_keys_from_env, split_keys
from pdserve.settings import Flag, Setting, add_flags, table_flags, to_argv, values

DTYPES = ("float32", "bfloat16", "float16", "int8", "q4_0", "q4_1", "q8_0")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_MODEL_ALIASES = ("default", "SmolLM2-135M-Instruct")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, [], False) or action.help == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


# --------------------------------------------------------------------------- value types


def log_level(value: str) -> str:
    """argparse type: a logging level name in any case -> its upper-case name."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid log level {value!r} (choose from {', '.join(LOG_LEVELS)}, any case)")
    return level


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not 0 < x < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return x


def model_spec(value: str) -> str:
    """argparse type for --model: a model directory, a .gguf file, ``default``, or a Hugging
    Face id (``org/name``, optionally ``@revision``) already in the local Hugging Face cache
    (``HF_HUB_CACHE`` / ``HF_HOME``), resolved offline to its snapshot directory. Anything else
    is a usage error naming what was tried."""
    if value in DEFAULT_MODEL_ALIASES:
        return value
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"model directory {path} has no config.json")
        return str(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise argparse.ArgumentTypeError(
                f"{path} is a file but not a .gguf; pass a model directory or a .gguf file")
        return str(path)
    if path.suffix.lower() == ".gguf":
        raise argparse.ArgumentTypeError(f"GGUF file {path} does not exist")
    if _looks_like_hub_id(value):
        return str(resolve_hub_id(value))
    raise argparse.ArgumentTypeError(
        f"model {value!r} is not a directory, a .gguf file, 'default', or a Hugging Face id")


def _looks_like_hub_id(value: str) -> bool:
    repo = value.partition("@")[0]
    parts = repo.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "/", "~"))


def resolve_hub_id(value: str) -> Path:
    """``org/name[@revision]`` -> its snapshot directory in the local Hugging Face cache,
    without network access; ArgumentTypeError when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = value.partition("@")
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision or None,
                                          local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        from huggingface_hub.constants import HF_HUB_CACHE

        raise argparse.ArgumentTypeError(
            f"Hugging Face model {value!r} is not in the local cache ({HF_HUB_CACHE}); no hub "
            f"is contacted. Download it first (e.g. `hf download {repo_id}`), or pass a local "
            f"directory or .gguf file") from exc
    if not (snapshot / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"cached Hugging Face model {value!r} ({snapshot}) has no config.json")
    return snapshot


def served_name_default(model: str | None) -> str | None:
    """The model name to serve when --served-model-name is not given: a Hugging Face id's
    snapshot directory is named by its commit, so it is served as ``org/name``; otherwise
    None (the component uses the model directory's name)."""
    if model is None:
        return None
    parts = Path(model).parts
    if len(parts) >= 4 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


# --------------------------------------------------------------------------- flag groups


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_spec, default=os.environ.get("PDSERVE_MODEL"),
                   help="model directory, .gguf file, 'default' (SmolLM2-135M-Instruct), or "
                   "a Hugging Face id present in the local HF cache (env PDSERVE_MODEL; "
                   "none: 'default')")


# EngineConfig (pdserve.engine.config) fields that are flags; their defaults are its own.
ENGINE_SETTINGS = {
    "kv_cache_bytes": Setting("KV cache pool size in MiB", flag="--kv-cache-mb", scale=1 << 20,
                              metavar="MIB", ge=1, group="engine"),
    "block_size": Setting("tokens per KV cache block (a power of two)", ge=1, group="engine"),
    "max_num_seqs": Setting("most sequences scheduled in one engine step", ge=1,
                            group="engine"),
    "max_num_batched_tokens": Setting("most tokens (prefill + decode) in one engine step",
                                      ge=1, group="engine"),
    "max_prefill_chunk": Setting("most prompt tokens of one sequence prefilled per step "
                                 "(chunked prefill)", ge=1, group="engine"),
    "step_target_ms": Setting("a step's time the scheduler aims for: prompt tokens per step = "
                              "the measured prefill rate x this, within "
                              "--max-num-batched-tokens (0: the token budget alone)",
                              ge=0, metavar="MS", group="engine"),
    "interactive_step_target_ms": Setting(
        "the same for a step that computes an interactive prompt: worse classes' prompt "
        "tokens in it are cut to stay within the measured prefill rate x this (0: the "
        "--step-target-ms budget)", ge=0, metavar="MS", group="engine"),
    "num_threads": Setting("torch intra-op threads (default: the CPUs this process may run "
                           "on)", flag="--threads", kind=int, ge=1, group="engine"),
    "adapt_threads": Setting("run each step on as many of --threads as this process's CPUs "
                             "other processes leave free (a worker sharing its CPUs at a "
                             "lower priority: pdserve cluster up's prefill workers)",
                             group="engine"),
    "device": Setting("torch device of the engine", group="engine"),
    "dtype": Setting("weights: float32 (exact); bfloat16/float16 (needs native bf16 on CPU); "
                     "int8 (per-channel int8 weights, per-token int8 activations); "
                     "q4_1/q8_0/q4_0 (GGUF blocks, read from the model's own GGUF)",
                     choices=DTYPES, group="engine"),
}


def engine_flags() -> list[Flag]:
    """The engine's flags, with EngineConfig's defaults."""
    from pdserve.engine.config import EngineConfig

    return table_flags(EngineConfig, ENGINE_SETTINGS)


def add_engine_args(p: argparse.ArgumentParser, *, model: bool = True) -> None:
    """--model and the engine's flags (KV cache, batch limits, threads, device, dtype)."""
    if model:
        add_model_arg(p)
    add_flags(p, engine_flags())


ENGINE_FLAGS = tuple(s.flag.removeprefix("--").replace("-", "_") if s.flag else name
                     for name, s in ENGINE_SETTINGS.items())


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as a command line (for
    workers a cluster starts: unset ones keep the worker's own default, the same one)."""
    return to_argv(engine_flags(), args)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """The EngineConfig the engine flags in ``args`` describe."""
    from pdserve.engine.config import EngineConfig

    given = {path[-1]: value for path, value in values(engine_flags(), args).items()}
    if given.get("num_threads") is None:
        given["num_threads"] = (len(os.sched_getaffinity(0))
                                if hasattr(os, "sched_getaffinity") else None)
    return EngineConfig(**given)


class _DeprecatedKeyList(argparse.Action):
    """--api-keys K1,K2 (the router's old spelling): appends to --api-key's list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        keys = list(getattr(namespace, self.dest) or [])
        setattr(namespace, self.dest, keys + split_keys([str(values)]))


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", dest="api_key", action="append", default=[], metavar="KEY",
                   help="accepted bearer key, repeatable (default: the comma-separated "
                   "PDSERVE_API_KEY, else PDSERVE_API_KEYS; none: no authentication)")
    p.add_argument("--api-keys", dest="api_key", action=_DeprecatedKeyList,
                   help=argparse.SUPPRESS)
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="tenant keys, one per line with optional attributes "
                   "(`KEY max_concurrent=4 max_class=standard`, `KEY admin`; mode 600), "
                   "accepted beside --api-key's operator keys (default: env "
                   "PDSERVE_API_KEY_FILE)")


def api_keys(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[str]:
    """Keys from the flags, else from the environment; then the keys file's."""
    env = os.environ if env is None else env
    keys = split_keys(args.api_key) or api_keys_from_env(env)
    return keys + [k for k in api_key_policies(args, env) if k not in keys]


def api_key_policies(args: argparse.Namespace,
                     env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Key -> `pdserve.tenants.KeyPolicy` from --api-key-file, else PDSERVE_API_KEY_FILE,
    else {}; SystemExit naming the file and line (never a key) for a bad one."""
    from pdserve.tenants import KEYS_FILE_ENV, load_keys_file

    path = getattr(args, "api_key_file", None) or (
        os.environ if env is None else env).get(KEYS_FILE_ENV)
    if not path:
        return {}
    try:
        return load_keys_file(path)
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None


def add_cluster_secret_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="file (mode 600, yours) holding the secret shared by every process "
                   "of the cluster: authenticates router -> worker gRPC calls and KV writes "
                   "(default: env PDSERVE_CLUSTER_SECRET; none: not authenticated, with a "
                   "warning, and refused off loopback). At least 16 characters and 64 bits; "
                   "`openssl rand -hex 32` makes one, `cluster up` makes a random one")


def cluster_secret(args: argparse.Namespace) -> Any:
    """The `pdserve.rpc.auth.ClusterSecret` of --cluster-secret-file, else of the
    environment, else None; SystemExit naming the problem for a bad one."""
    from pdserve.rpc.auth import load_cluster_secret

    try:
        return load_cluster_secret(getattr(args, "cluster_secret_file", None))
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None


# --------------------------------------------------------------------------- TLS


def add_tls_args(p: argparse.ArgumentParser, *, client_auth: bool = False,
                 server_name: bool = False, client: bool = False) -> None:
    """--tls-cert, --tls-key, --tls-ca (all three, or none: plaintext); `client_auth`: the
    listener faces clients (--tls-client-auth); `server_name`: the process dials workers
    (--tls-server-name); `client`: only dials (then --tls-ca alone is enough)."""
    from pdserve.rpc.tls import CLIENT_AUTH_CHOICES, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV

    g = p.add_argument_group("TLS (pdserve.rpc.tls; `pdserve certs` makes the files)")
    g.add_argument("--tls-cert", default=None, metavar="PATH",
                   help="PEM certificate (chain) this process presents, as server and as "
                   f"client (default: env {TLS_CERT_ENV}; none: plaintext)")
    g.add_argument("--tls-key", default=None, metavar="PATH",
                   help=f"its private key, a mode-600 file (default: env {TLS_KEY_ENV})")
    g.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="CA certificate(s) that peers' certificates must chain to; workers "
                   f"take only clients it signed (default: env {TLS_CA_ENV})")
    if client_auth:
        g.add_argument("--tls-client-auth", choices=CLIENT_AUTH_CHOICES, default="none",
                       help="client certificates on the client-facing APIs (gRPC, HTTP): "
                       "not asked for (API keys only), or required and signed by --tls-ca")
    if server_name:
        g.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help="name the workers' certificates carry, checked instead of the "
                       "address dialled (default: the address)")


def _tls_paths(args: argparse.Namespace,
               env: Mapping[str, str] | None) -> tuple[str | None, str | None, str | None]:
    from pdserve.rpc.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV

    env = os.environ if env is None else env
    return (getattr(args, "tls_cert", None) or env.get(TLS_CERT_ENV) or None,
            getattr(args, "tls_key", None) or env.get(TLS_KEY_ENV) or None,
            getattr(args, "tls_ca", None) or env.get(TLS_CA_ENV) or None)


def tls_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Any:
    """The `pdserve.rpc.tls.TLSConfig` of the TLS flags (else the environment), or None when
    none is given; SystemExit naming the problem when only some are, or a file is bad."""
    from pdserve.rpc.tls import load_tls

    cert, key, ca = _tls_paths(args, env)
    if cert is None and key is None and ca is None:
        return None
    if cert is None or key is None or ca is None:
        raise SystemExit("pdserve: TLS needs --tls-cert, --tls-key and --tls-ca together")
    try:
        return load_tls(cert, key, ca, client_auth=getattr(args, "tls_client_auth", "none"),
                        server_name=getattr(args, "tls_server_name", None))
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None


def tls_client_files(args: argparse.Namespace, env: Mapping[str, str] | None = None
                     ) -> tuple[str, str | None, str | None] | None:
    """(ca, cert, key) for a command that only dials (`pdserve health`, `pdserve ask`):
    --tls-ca alone trusts a server, with --tls-cert and --tls-key it also presents a
    certificate; None without --tls-ca."""
    cert, key, ca = _tls_paths(args, env)
    if ca is None:
        if cert is not None or key is not None:
            raise SystemExit("pdserve: --tls-cert and --tls-key need --tls-ca")
        return None
    if (cert is None) != (key is None):
        raise SystemExit("pdserve: --tls-cert and --tls-key go together")
    return ca, cert, key


# --------------------------------------------------------------------------- fail closed

API_KEYS_NEEDED = "API keys (--api-key / PDSERVE_API_KEY)"
CLUSTER_SECRET_NEEDED = "a cluster secret (--cluster-secret-file / PDSERVE_CLUSTER_SECRET)"


def add_insecure_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true",
                   help="listen off loopback (--host) even without API keys or a cluster "
                   "secret, with a WARNING at start-up (default: refuse to start)")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; a wildcard (``0.0.0.0``, ``::``,
    ``""``), any other address and any other host name count as exposed."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def missing_credentials(*, api_keys: Collection[str] | None = None,
                        secret: Any = None, needs_secret: bool = True) -> list[str]:
    """What a process lacks to be exposed: API keys (when `api_keys` is not None: it serves
    the client API) and the cluster secret (when `needs_secret`)."""
    missing = []
    if api_keys is not None and not api_keys:
        missing.append(API_KEYS_NEEDED)
    if needs_secret and secret is None:
        missing.append(CLUSTER_SECRET_NEEDED)
    return missing


def exposure_problem(host: str, missing: Collection[str], insecure: bool) -> str | None:
    """Fail closed: why a process binding `host` without the `missing` credentials must not
    start, or None (on loopback, with every credential, or told --insecure)."""
    if is_loopback(host) or not missing or insecure:
        return None
    return (f"refusing to listen on {host} (not loopback) without {' and '.join(missing)}: "
            "anyone who can reach it could use it. Give them, bind --host 127.0.0.1, or pass "
            "--insecure to run open anyway (a WARNING is logged)")


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", type=log_level,
                   default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                   help=f"log threshold, one of {', '.join(LOG_LEVELS)} (env "
                   "PDSERVE_LOG_LEVEL)")


def check_log_level(level: str) -> int:
    """Level name -> logging level number; ValueError naming the valid ones."""
    try:
        return logging.getLevelNamesMapping()[log_level(level)]
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


def admission_flags() -> list[Any]:
    """The admission flags (`router.config.ADMISSION_SETTINGS`), as `pdserve.settings.Flag`s
    relative to `router.admission.AdmissionConfig`."""
    from pdserve.settings import flags
    from router.config import RouterConfig

    return [dataclasses.replace(f, path=f.path[1:]) for f in flags(RouterConfig)
            if f.path[0] == "admission"]


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """The router's admission flags alone (`pdserve router` has them among all its own)."""
    from pdserve.settings import add_flags

    add_flags(p, admission_flags())


def admission_argv(args: argparse.Namespace) -> list[str]:
    """The admission flags of `args` that differ from their defaults, as a command line."""
    from pdserve.settings import to_argv

    return to_argv(admission_flags(), args)


def admission_config_from_args(args: argparse.Namespace) -> Any:
    """An AdmissionConfig; argparse.ArgumentTypeError for a bad --ttft-deadline."""
    from pdserve.settings import values
    from router.admission import AdmissionConfig

    return AdmissionConfig(**{path[-1]: v for path, v in values(admission_flags(), args).items()})
