"""Benchmarks for pdserve. `bench.loadgen` drives any OpenAI-compatible endpoint."""


def commit_id() -> str:
    """The checkout's commit for a record, with `-dirty` when the tree has changes
    ("unknown" outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
