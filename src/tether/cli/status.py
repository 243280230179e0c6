"""``tether status``: ask a running server for its instances and print them as a table (or its JSON)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tether import env
from tether.cli.common import table
from tether.units import format_bytes


def command(args: argparse.Namespace) -> int:
    """Ask a running server for its instances and print them as a table (or its JSON)."""
    import httpx  # only this command talks HTTP as a client

    url = (args.url or f"http://127.0.0.1:{args.port}").rstrip("/")
    key = args.api_key or os.environ.get(env.API_KEY)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(f"{url}/v1/instances", headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(
            f"tether: cannot reach a tether server at {url}: {exc}; is `tether serve` running there?", file=sys.stderr
        )
        return 1
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        print(f"tether: {url} answered {response.status_code}: {message}", file=sys.stderr)
        return 1
    instances = response.json()["data"]
    if args.json:
        print(json.dumps(instances, indent=2))
        return 0
    if not instances:
        print(f"no instances at {url}")
        return 0
    rows = [
        [
            "INSTANCE",
            "STATE",
            "PID",
            "ENGINE",
            "MODEL",
            "FOOTPRINT",
            "RSS",
            "RESTARTS",
            "RUNNING",
            "WAITING",
            "FAILURES",
        ]
    ]
    for inst in instances:
        runner = inst.get("runner") or {}
        memory = runner.get("memory") or {}
        model = Path(inst["model"]).name if inst.get("model") else "default model"
        rows.append(
            [
                inst["id"],
                inst["state"],
                str(runner.get("pid", "-")),
                inst["engine"],
                model[:40],
                format_bytes(memory.get("footprint")) if memory else "-",
                format_bytes(memory.get("rss")) if memory else "-",
                str(inst["restarts"]),
                f"{inst['queue']['running']}/{inst['queue']['parallel']}",
                f"{inst['queue']['waiting']}/{inst['queue']['max_queue']}",
                str(len(inst["history"])),
            ]
        )
    lines = table(rows)
    print(lines[0])
    for line, inst in zip(lines[1:], instances, strict=True):
        print(line)
        if not inst["ready"]:
            print(f"    {inst['reason']}")
        for failure in inst["history"][-3:]:
            when = time.strftime("%H:%M:%S", time.localtime(failure["at"]))
            print(f"    {when} life {failure['life']} (pid {failure['pid']}): {failure['cause']['summary']}")
    return 0
