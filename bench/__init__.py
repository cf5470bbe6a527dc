"""Benchmarks for pdserve. `bench.loadgen` drives any OpenAI-compatible endpoint."""


def commit_id() -> str:
    """The checkout's commit for a record, with `-dirty` when the tree has changes."""
    import subprocess

    return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False).stdout.strip()
