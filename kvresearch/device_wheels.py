"""Wheels of what the GPU image lacks (requirements/device.txt), for a machine with no package registry.

``python -m kvresearch.device_wheels [--out .device-wheels] [--limit-mb 30]`` fetches each pinned package for the
image's Python (3.12, manylinux x86_64): a binary wheel where PyPI has one, else a wheel built here from the sdist
(pure Python). It writes ``manifest.json`` (name, version, file, bytes, sha256) and refuses a folder over the limit:
the working tree travels beside it and 64 MiB is the limit for everything carried. On the GPU machine:
``python3 -m pip install --no-index --no-deps --target /tmp/site .device-wheels/*.whl``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def requirements(path: Path) -> list[str]:
    """The pinned lines of a requirements file."""
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def fetch(requirement: str, out: Path, python: str = "3.12") -> None:
    """One wheel of ``requirement`` into ``out``: PyPI's for ``python`` on Linux x86_64, else built here."""
    pip = [sys.executable, "-m", "pip", "-q"]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    binary = [
        *pip,
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(out),
        requirement,
    ]
    if subprocess.run(binary, capture_output=True, text=True).returncode == 0:
        return
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(out), requirement], check=True)


def manifest(folder: Path) -> list[dict[str, object]]:
    """Name, version, file, bytes and sha256 of each wheel in ``folder``."""
    rows = []
    for wheel in sorted(folder.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        data = wheel.read_bytes()
        rows.append(
            {
                "name": name,
                "version": version,
                "file": wheel.name,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    return rows


def build(out: Path, spec: Path, limit_mb: float) -> list[dict[str, object]]:
    """Fetch every wheel of ``spec`` into a fresh folder, check the size, then replace ``out`` with it."""
    staging = Path(tempfile.mkdtemp(prefix=".device-wheels-", dir=out.parent))
    for requirement in requirements(spec):
        print(f"[device-wheels] {requirement}", flush=True)
        fetch(requirement, staging)
    rows = manifest(staging)
    total = sum(int(r["bytes"]) for r in rows)  # type: ignore[call-overload]
    if total > limit_mb * 2**20:
        raise SystemExit(f"{total / 2**20:.1f} MiB of wheels is over the {limit_mb} MiB limit: carry fewer packages.")
    (staging / "manifest.json").write_text(
        json.dumps({"spec": spec.name, "bytes": total, "wheels": rows}, indent=2) + "\n"
    )
    if out.exists():
        for old in out.iterdir():
            old.unlink()
        out.rmdir()
    staging.rename(out)
    print(f"[device-wheels] {len(rows)} wheels, {total / 2**20:.1f} MiB in {out}")
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".device-wheels")
    parser.add_argument("--spec", type=Path, default=ROOT / "requirements" / "device.txt")
    parser.add_argument("--limit-mb", type=float, default=30.0)
    args = parser.parse_args(argv)
    build(args.out.resolve(), args.spec, args.limit_mb)


if __name__ == "__main__":
    main()
