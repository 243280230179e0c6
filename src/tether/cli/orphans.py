"""``tether orphans``: list (and with ``--reap`` stop) runners that outlived their worker, with their memory."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

from tether.cli.common import table
from tether.node import orphans
from tether.node.memory import ProcessMemory
from tether.node.registry import Registry
from tether.units import format_bytes

_json = msgspec.json.Encoder()


def _memory_json(m: ProcessMemory | None) -> dict[str, int | None] | None:
    if m is None:
        return None
    return {
        "rss": m.rss,
        "uss": m.uss,
        "pss": m.pss,
        "anon": m.anon,
        "file": m.file,
        "swap": m.swap,
        "gpu": m.gpu,
        "footprint": m.footprint,
    }


def _group_json(group: orphans.RunnerGroup, now: float) -> dict[str, object]:
    return {
        "pid": group.pid,
        "ppid": group.ppid,
        "runner_alive": group.runner is not None,
        "age_s": round(group.age(now), 3),
        "runner_id": group.runner_id,
        "worker_pid": group.worker_pid,
        "engine": group.engine,
        "model": group.model,
        "orphan": group.orphan,
        "reason": group.reason,
        "watchdog": group.watchdog,
        "cgroup": str(group.cgroup.path) if group.cgroup is not None else None,
        "memory": _memory_json(group.memory),
        "members": [
            {
                "pid": p.pid,
                "ppid": p.ppid,
                "role": group.role(p),
                "command": p.command,
                "memory": _memory_json(p.memory),
            }
            for p in group.members
        ],
    }


def _age(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _print_groups(groups: list[orphans.RunnerGroup], now: float) -> None:
    header = ["PID", "PPID", "AGE", "RUNNER", "MODEL", "RSS", "USS", "PSS", "ANON", "FILE", "SWAP", "GPU", "PROCS"]
    rows = [header]
    for g in groups:
        m = g.memory
        model = Path(g.model).name if g.model else (f"{g.engine}: default model" if g.engine else "?")
        sizes = (m.rss, m.uss, m.pss, m.anon, m.file, m.swap, m.gpu)
        rows.append(
            [str(g.pid or "-"), str(g.ppid or "-"), _age(g.age(now)), g.runner_id, model[:32]]
            + [format_bytes(x) for x in sizes]
            + [str(len(g.members))]
        )
    for i, line in enumerate(table(rows)):
        print(line)
        if i:
            g = groups[i - 1]
            print(f"    {g.reason}")
            print("    processes: " + ", ".join(f"{p.pid} {g.role(p)}" for p in g.members))


def command(args: argparse.Namespace) -> int:
    now = time.time()
    registry = Registry()
    found = orphans.scan(registry)
    results = orphans.reap_all(found, registry, grace=args.grace) if args.reap else []
    failed = [r for r in results if not r.ok]
    if args.json:
        report: dict[str, object] = {
            "orphans": [_group_json(g, now) for g in found.orphans],
            "stale_records": [{"path": str(s.path), "pid": s.pid, "why": s.why} for s in found.stale],
            "gpu": {"available": found.gpu.available, "reason": found.gpu.reason},
        }
        if args.all:
            report["healthy"] = [_group_json(g, now) for g in found.healthy]
        if args.reap:
            report["reaped"] = [
                {
                    "pid": r.group.pid,
                    "ok": r.ok,
                    "killed_with": r.killed_with,
                    "gone": r.gone,
                    "survivors": r.survivors,
                    "refused": [{"pid": pid, "why": why} for pid, why in r.refused],
                    "freed": _memory_json(r.freed),
                    "seconds": round(r.seconds, 3),
                }
                for r in results
            ]
        print(_json.encode(report).decode())
    else:
        shown = found.orphans + (found.healthy if args.all else [])
        if shown:
            _print_groups(shown, now)
        if shown and not found.gpu.available:
            print(f"(GPU memory: n/a, {found.gpu.reason})", file=sys.stderr)
        total = ProcessMemory.total(g.memory for g in found.orphans)
        if not found.orphans:
            print("no orphaned tether runners")
        elif not args.reap:
            print(
                f"{len(found.orphans)} orphaned runner(s) holding {format_bytes(total.footprint)} "
                f"(anonymous + swap + GPU; RSS {format_bytes(total.rss)}). Stop them: tether orphans --reap"
            )
        for r in results:
            for pid, why in r.refused:
                print(f"left pid {pid} alone: {why}")
            if r.ok:
                print(
                    f"reaped {r.group.label} ({len(r.gone)} processes) with {r.killed_with} in {r.seconds:.2f} s: "
                    f"freed {format_bytes(r.freed.footprint)} (RSS {format_bytes(r.freed.rss)})"
                )
            else:
                print(f"could not reap {r.group.label}: {r.survivors} survived SIGKILL (stuck in the kernel?)")
        if args.reap and found.stale:
            print(f"removed {len(found.stale)} stale runner record(s) from {registry.path}")
    if args.reap:
        return 1 if failed else 0
    return 1 if found.orphans else 0
