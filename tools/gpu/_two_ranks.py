"""Two ranks started as ``torchrun`` would, for the GPU checks that compare them with one process.

A check script (``ddp_check.py``, ``fsdp_sharded_check.py``) hands its ``main`` to
:func:`run_check`: with ``--rank-worker DIR`` the script is a rank and saves ``DIR/rank{r}.pt``;
otherwise its check starts it twice with :func:`run_ranks` (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set, as ``torchrun`` would) and compares what the ranks saved with one
process; the JSON report is printed, and written to ``--out``. The scripts import this module
as a sibling: run as ``python tools/gpu/X.py``, their folder is first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RANKS = 2


def run_check(
    doc: str | None,
    argv: list[str] | None,
    *,
    rank_main: Callable[[Path, str], None],
    check: Callable[[argparse.Namespace, dict[str, Any]], bool],
) -> int:
    """A check script's ``main``: ``--device cuda|cpu``, ``--out FILE`` and the hidden
    ``--rank-worker DIR`` (then ``rank_main(DIR, device)``, one rank); else ``check(args,
    report)`` fills the report and says whether it passed. Returns the exit status."""
    import torch

    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--rank-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker is not None:
        rank_main(args.rank_worker, args.device)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 1
    report: dict[str, Any] = {"torch": torch.__version__}
    ok = check(args, report)
    report["ok"] = ok
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


def rank_device(kind: str) -> tuple[Any, str]:
    """This rank's device and backend: on CUDA with two GPUs or more one each and nccl, with
    one GPU both ranks on it and gloo (nccl refuses two ranks on one device); on CPU gloo."""
    import torch

    if kind == "cuda":
        count = torch.cuda.device_count()
        rank = int(os.environ["RANK"])
        return torch.device("cuda", rank % count), "nccl" if count >= 2 else "gloo"
    return torch.device("cpu"), "gloo"


def versus_single(ranks: list[dict[str, Any]], single: dict[str, Any]) -> tuple[bool, float]:
    """Whether both ranks hold the same ``params``, and rank 0's largest absolute difference
    from the one process's *single*."""
    import torch

    same = all(torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]) for n in single)
    diff = max(float((ranks[0]["params"][n] - single[n]).abs().max()) for n in single)
    return same, diff


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(script: str, device: str, report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Run *script* as ranks 0 and 1 (``--rank-worker`` into a temporary folder) and return
    what each saved; *report* gets ``ranks_sec``, and ``error`` (each failed rank's last
    stderr) when a rank fails, and then ``None`` is returned."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        start = time.perf_counter()
        procs = []
        for rank in range(RANKS):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(RANKS),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            cmd = [sys.executable, script, "--device", device, "--rank-worker", tmp]
            procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
        errors = [p.communicate(timeout=300)[1] for p in procs]
        report["ranks_sec"] = round(time.perf_counter() - start, 1)
        failed = {r: errors[r][-2000:] for r, p in enumerate(procs) if p.returncode != 0}
        if failed:
            report["error"] = failed
            return None
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]
