"""``opake info``: a true report of what is installed and what the plugins provide."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata
from typing import Any

__all__ = ["collect_info", "format_info", "register"]

_THIRD_PARTY = ("torch", "triton", "transformers", "peft", "gguf", "pluggy")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _opake_distributions() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and (name == "opake" or name.startswith("opake-")):
            found[name] = dist.version
    return dict(sorted(found.items()))


def _devices() -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = [{"type": "cpu", "name": platform.processor() or "cpu"}]
    try:
        import torch
    except ImportError:
        return devices
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "type": "cuda",
                    "index": i,
                    "name": props.name,
                    "memory_gb": round(props.total_memory / 1024**3, 2),
                }
            )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append({"type": "mps", "name": "Apple Metal"})
    return devices


def collect_info() -> dict[str, Any]:
    """Gather the report as a JSON-serialisable dict."""
    import warnings

    from opake.core import errors, plugins

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "opake_distributions": _opake_distributions(),
        "libraries": {name: _version(name) for name in _THIRD_PARTY},
        "devices": _devices(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.OpakePluginWarning)
        info["plugin_autoload"] = not plugins._manager._autoload_disabled()
        info["plugins"] = [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "value": p.value}
            for p in plugins.plugins()
        ]
        info["broken_plugins"] = [
            {
                "name": b.name,
                "distribution": b.distribution,
                "version": b.version,
                "value": b.value,
                "error": b.error,
            }
            for b in plugins.broken_plugins()
        ]
    try:
        families = plugins.model_families()
        info["model_families"] = {}
        for mt, fam in sorted(families.items()):
            ok, why = fam.supported()
            info["model_families"][mt] = {"family": fam.name, "supported": ok, "reason": why}
    except errors.OpakeError as err:
        info["model_families_error"] = str(err)
        info["model_families"] = {}
    try:
        backends = plugins.kernel_backends()
        info["kernel_backends"] = {
            name: {
                "ops": sorted(be.ops),
                "devices": list(be.devices),
                "priority": be.priority,
                "available": be.is_available(),
            }
            for name, be in sorted(backends.items())
        }
    except errors.OpakeError as err:
        info["kernel_backends_error"] = str(err)
        info["kernel_backends"] = {}
    return info


def format_info(info: dict[str, Any]) -> str:
    """Render the report as aligned text."""
    lines = [f"Python {info['python']} on {info['platform']}", "", "Opake distributions:"]
    for name, ver in info["opake_distributions"].items():
        lines.append(f"  {name:<20} {ver}")
    lines += ["", "Libraries:"]
    for name, ver in info["libraries"].items():
        lines.append(f"  {name:<20} {ver or 'not installed'}")
    lines += ["", "Devices:"]
    for dev in info["devices"]:
        extra = f" ({dev['memory_gb']} GiB)" if "memory_gb" in dev else ""
        idx = f":{dev['index']}" if "index" in dev else ""
        lines.append(f"  {dev['type']}{idx:<6} {dev['name']}{extra}")
    auto = (
        "" if info["plugin_autoload"] else " (autoload disabled by OPAKE_DISABLE_PLUGIN_AUTOLOAD)"
    )
    lines += ["", f"Plugins{auto}:"]
    for p in info["plugins"] or [
        {"name": "(none)", "distribution": "", "version": "", "value": ""}
    ]:
        src = f"{p['distribution']} {p['version']}" if p["distribution"] else ""
        lines.append(f"  {p['name']:<20} {src:<26} {p['value']}")
    if info["broken_plugins"]:
        lines += ["", "Broken plugins (skipped):"]
        for b in info["broken_plugins"]:
            lines.append(f"  {b['name']:<20} {b['distribution']} {b['version']}: {b['error']}")
    lines += ["", "Model families (by model_type):"]
    if "model_families_error" in info:
        lines.append(f"  error: {info['model_families_error']}")
    for mt, fam in info["model_families"].items():
        state = "" if fam["supported"] else f"  [skipped: {fam['reason']}]"
        lines.append(f"  {mt:<20} family {fam['family']}{state}")
    if not info["model_families"]:
        lines.append("  (none)")
    lines += ["", "Kernel backends:"]
    if "kernel_backends_error" in info:
        lines.append(f"  error: {info['kernel_backends_error']}")
    for name, be in info["kernel_backends"].items():
        avail = "available" if be["available"] else "unavailable"
        lines.append(
            f"  {name:<10} priority {be['priority']:<3} {avail:<12} devices "
            f"{','.join(be['devices'])}  ops {', '.join(be['ops'])}"
        )
    if not info["kernel_backends"]:
        lines.append("  (none)")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def register(sub: Any) -> None:
    """Add the ``info`` subcommand to the ``opake`` parser."""
    p = sub.add_parser("info", help="versions, devices, plugins, model families, kernel backends")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_run)
