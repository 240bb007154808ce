"""Build the Lambda packages infra/lambda.tf deploys, as deterministic zips (fixed timestamps and modes, sorted):

- rewards.zip: jetroll.functions.lambda_handler and the reward modules it imports (no shared/, no torch), plus the
  third-party packages the rewards import (msgspec; math-verify and its sympy stack for the math reward);
- job_trigger.zip: jetroll.functions.job_trigger (boto3 comes with the Lambda Python runtime).

functions/<module>.py lands at jetroll/functions/<module>.py, its installed name (`jetroll` is a namespace package).

Third-party code comes from this interpreter's installed distributions (--deps venv, offline: run it with the
Python of the Lambda runtime, CPython 3.11 on Linux x86_64), or from PyPI wheels for that platform (--deps pip).

    .venv/bin/python scripts/build_lambda_zips.py [--out build/lambda] [--deps venv|pip|none]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# lambda_handler's import closure; celery_app (celery, redis) stays out.
REWARD_MODULES = ("__init__", "lambda_handler", "runner", "registry", "builtin", "sandbox")
REWARD_REQUIREMENTS = ("msgspec", "math-verify")  # builtin.py imports msgspec, and math_verify inside math_reward
JOB_TRIGGER_MODULES = ("__init__", "job_trigger")
LAMBDA_PYTHON = (3, 11)  # infra/variables.tf lambda_runtime
LAMBDA_PLATFORM = "manylinux2014_x86_64"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
SKIPPED_DIST_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def first_party(modules: tuple[str, ...]) -> dict[str, Path]:
    """Archive name -> source file for functions/<module>.py."""
    return {f"jetroll/functions/{m}.py": ROOT / "functions" / f"{m}.py" for m in modules}


def distribution_closure(requirements: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions that `requirements` need (markers evaluated here, no extras), sorted by name."""
    found: dict[str, metadata.Distribution] = {}
    pending = [Requirement(r) for r in requirements]
    while pending:
        req = pending.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        dist = metadata.distribution(req.name)
        found[name] = dist
        pending.extend(Requirement(r) for r in dist.requires or [])
    return [found[n] for n in sorted(found)]


def installed_files(dists: list[metadata.Distribution]) -> dict[str, Path]:
    """Archive name -> file for every importable file of `dists` (no bytecode, no scripts outside site-packages)."""
    files: dict[str, Path] = {}
    for dist in dists:
        for entry in dist.files or []:
            name = entry.as_posix()
            if name.startswith("..") or "__pycache__" in entry.parts or name.endswith(".pyc"):
                continue
            if entry.parts[0].endswith(".dist-info") and entry.name in SKIPPED_DIST_FILES:
                continue
            path = Path(dist.locate_file(entry))
            if path.is_file():
                files[name] = path
    return files


def pip_files(requirements: tuple[str, ...], scratch: Path) -> dict[str, Path]:
    """Archive name -> file for wheels of `requirements` (pinned to the versions installed here) for Lambda."""
    pins = [f"{d.metadata['Name']}=={d.version}" for d in distribution_closure(requirements)]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--no-deps", "--target", str(scratch),
         "--platform", LAMBDA_PLATFORM, "--implementation", "cp", "--only-binary=:all:",
         "--python-version", ".".join(map(str, LAMBDA_PYTHON)), *pins],
        check=True,
    )
    return {
        p.relative_to(scratch).as_posix(): p
        for p in scratch.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name not in SKIPPED_DIST_FILES and p.suffix != ".pyc"
        and p.relative_to(scratch).parts[0] not in ("bin", "share")  # console scripts, man pages
    }


def write_zip(path: Path, files: dict[str, Path]) -> Path:
    """A zip of `files` that depends only on their names and bytes: sorted, fixed timestamp, 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, so external_attr carries the mode
            info.external_attr = 0o100644 << 16
            zf.writestr(info, files[name].read_bytes(), compresslevel=9)
    return path


def check_venv_matches_lambda() -> None:
    here = (sys.implementation.name, sys.version_info[:2], sys.platform, platform.machine())
    want = ("cpython", LAMBDA_PYTHON, "linux", "x86_64")
    if here != want:
        raise SystemExit(f"--deps venv copies compiled packages (msgspec) from this interpreter {here}, but Lambda "
                         f"runs {want}; rerun with --deps pip or with a matching Python")


def build(out_dir: Path, deps: str = "venv") -> dict[str, Path]:
    """Build rewards.zip and job_trigger.zip under `out_dir`; returns name -> path."""
    reward_files = first_party(REWARD_MODULES)
    with tempfile.TemporaryDirectory() as scratch:
        if deps == "venv":
            check_venv_matches_lambda()
            third_party = installed_files(distribution_closure(REWARD_REQUIREMENTS))
        elif deps == "pip":
            third_party = pip_files(REWARD_REQUIREMENTS, Path(scratch))
        elif deps == "none":
            third_party = {}
        else:
            raise ValueError(f"unknown deps mode {deps!r}; valid: venv, pip, none")
        clash = sorted(set(third_party) & set(reward_files))
        assert not clash, f"third-party files shadow jetroll's: {clash}"
        rewards = write_zip(out_dir / "rewards.zip", {**third_party, **reward_files})
    job_trigger = write_zip(out_dir / "job_trigger.zip", first_party(JOB_TRIGGER_MODULES))
    return {"rewards": rewards, "job_trigger": job_trigger}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "lambda", help="output directory")
    parser.add_argument("--deps", choices=("venv", "pip", "none"), default="venv",
                        help="third-party packages of rewards.zip: this interpreter's (offline), PyPI wheels for "
                        "Lambda, or none (supply them as a layer)")
    args = parser.parse_args()
    for name, path in build(args.out, args.deps).items():
        with zipfile.ZipFile(path) as zf:
            print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB, {len(zf.namelist())} files)")


if __name__ == "__main__":
    main()
