"""``tether status``: ask a running server for its instances, models and scheduler decisions and print them as tables
(or its JSON)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

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
    body = response.json()
    instances = body["data"]
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    node = body.get("node")
    if node:
        print_node(node, url)
    if instances:
        print_instances(instances)
    else:
        print(f"no instances at {url}")
    scheduler = body.get("scheduler")
    if scheduler:
        print_scheduler(scheduler)
    cluster = body.get("cluster")
    if cluster:
        print_cluster(cluster)
    return 0


def print_node(node: dict[str, Any], url: str) -> None:
    """The worker and this machine's memory as tether measures it (and where the number comes from)."""
    memory = node["memory"]
    gpus = ", ".join(
        f"GPU {g['index']} {format_bytes(g['used'])} of {format_bytes(g['total'])}" for g in node["gpus"] or ()
    )
    print(
        f"tether {node['version']} at {url} (pid {node['pid']}, up {node['uptime']:.0f} s): "
        f"{format_bytes(memory['available'])} available ({memory['source']}){'; ' + gpus if gpus else ''}\n"
    )


def print_instances(instances: list[dict[str, Any]]) -> None:
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
        for rank in inst.get("ranks") or ():
            where = f" on node {rank['node'][:8]}" if rank.get("node") else ""
            state = rank["status"] if rank["alive"] else "gone"
            print(f"    rank {rank['rank']} at {rank['address']}{where}: pid {rank['pid'] or '-'}, {state}")
        for failure in inst["history"][-3:]:
            when = time.strftime("%H:%M:%S", time.localtime(failure["at"]))
            print(f"    {when} life {failure['life']} (pid {failure['pid']}): {failure['cause']['summary']}")


def print_cluster(cluster: dict[str, Any], last: int = 10) -> None:
    """The Ray cluster's nodes (agent, state, memory as tether measures it, runners) and the last node events."""
    print(f"\nnodes (lost after {cluster['lost_after']:g} s of silence, agents fence after {cluster['lease']:g} s):")
    rows = [["NODE", "HOST", "AGENT", "STATE", "AVAILABLE", "RUNNERS"]]
    for node in cluster["nodes"]:
        memory = node.get("memory") or {}
        rows.append(
            [
                node["node"][:8],
                str(node.get("host") or "-"),
                str(node.get("agent_pid") or "-"),
                node["state"],
                format_bytes(memory.get("available")) if memory else "-",
                ", ".join(node["runners"]) or "-",
            ]
        )
    for line in table(rows):
        print(f"  {line}")
    events = cluster["events"][-last:]
    if events:
        print(f"last {len(events)} node events:")
    for e in events:
        when = time.strftime("%H:%M:%S", time.localtime(e["at"]))
        print(f"  {when} {e['node'][:8]} {e['kind']}: {e['why']}")


def print_scheduler(scheduler: dict[str, Any], last: int = 10) -> None:
    """The catalog's models (state, busy, when keep-alive unloads them) and the scheduler's last decisions."""
    limit = scheduler.get("max_loaded")
    print(f"\nmodels (max loaded: {limit if limit is not None else 'by memory'}):")
    rows = [["MODEL", "STATE", "BUSY", "UNLOADS IN", "LOADS"]]
    for model, state in scheduler["models"].items():
        expires = state["expires_in"]
        rows.append(
            [
                model,
                state["state"],
                "yes" if state["busy"] else "no",
                f"{expires:.0f} s" if expires is not None else "-",
                str(state["loads"]),
            ]
        )
    for line in table(rows):
        print(f"  {line}")
    decisions = scheduler["decisions"][-last:]
    if decisions:
        print(f"last {len(decisions)} scheduler decisions:")
    for d in decisions:
        when = time.strftime("%H:%M:%S", time.localtime(d["at"]))
        print(f"  {when} {d['kind']} {d['model']}: {d['reason']}")
