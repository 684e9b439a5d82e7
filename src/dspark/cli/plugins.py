"""``dspark plugins``: every registered implementation per extension point, with the plugin and the
distribution that installed it."""

from __future__ import annotations

import argparse

from dspark.cli.core import command, emit


def _plugins_args(p: argparse.ArgumentParser) -> None:
    p.description = ("List every registered implementation per extension point, with the plugin that "
                     "registered it and the installed distribution (and version) it comes from.")


def _listing(rows: list[dict]) -> str:
    from dspark.plugins import EXTENSION_POINTS

    lines = []
    for kind in EXTENSION_POINTS:
        lines.append(f"{kind}:")
        entries = [r for r in rows if r["kind"] == kind]
        if not entries:
            lines.append("  (none)")
        for r in entries:
            dist, version = r["distribution"], f" {r['version']}" if r["version"] else ""
            if dist is None:
                origin = f"{r['plugin']}{version}, registered at run time"
            elif dist == r["plugin"]:
                origin = f"{dist}{version}"
            else:
                origin = f"{r['plugin']} from {dist}{version}"
            lines.append(f"  {r['name']:<14} [{origin}]  {r['description']}")
    return "\n".join(lines)


@command("plugins", _plugins_args, summary="list every registered implementation per extension point")
def _plugins(args: argparse.Namespace) -> int:
    from dspark.plugins import list_plugins

    rows = list_plugins()
    emit(args, {"plugins": rows}, lambda: _listing(rows))
    return 0
