"""Pinned SGLang releases: download, verify the sha256, unpack into a cache.

Downloads go through ``pip download`` where pip is importable (so a pip configuration,
mirror or proxy applies); without pip (e.g. a ``uv tool`` environment) the wheel is fetched
straight from PyPI's JSON API (``$DYNSPEC_PYPI_URL``, default https://pypi.org/pypi).

The cache lives outside any checkout: ``$DYNSPEC_CACHE``, else
``$XDG_CACHE_HOME/dynspec-patch``, else ``~/.cache/dynspec-patch``. Wheels sit in
``wheels/``, their ``.py`` files unpacked under ``releases/<version>/sglang``.
With ``DYNSPEC_OFFLINE=1`` nothing is downloaded: a release missing from the cache is an
error (the tests run that way; CI fetches the pins first).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dynspec_patch.patcher.errors import ReleaseFetchError, UsageError

# The newest wheels are cp311 platform wheels; ask pip for exactly those whatever runs us.
_PIP_PLATFORM_ARGS = (
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_34_x86_64",
)


Progress = Callable[[str], None] | None
DEFAULT_PYPI_URL = "https://pypi.org/pypi"


@dataclass(frozen=True)
class Pin:
    version: str
    wheel: str
    sha256: str
    route: str
    workers: tuple[str, ...] = ()
    refused: tuple[str, ...] = field(default=())


def default_pins_path() -> Path:
    return Path(str(resources.files("dynspec_patch.fixtures") / "pins.toml"))


def load_pins(path: Path | None = None) -> list[Pin]:
    path = path or default_pins_path()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read pins file {path}: {exc}") from exc
    try:
        return [
            Pin(
                version=entry["version"],
                wheel=entry["wheel"],
                sha256=entry["sha256"],
                route=entry["route"],
                workers=tuple(entry.get("workers", ())),
                refused=tuple(entry.get("refused", ())),
            )
            for entry in data["release"]
        ]
    except (KeyError, TypeError) as exc:
        raise UsageError(f"pins file {path} is malformed: missing {exc}") from exc


def find_pin(version: str, pins: list[Pin] | None = None) -> Pin:
    for pin in pins if pins is not None else load_pins():
        if pin.version == version:
            return pin
    raise UsageError(f"sglang {version} is not pinned (see fixtures/pins.toml)")


def cache_dir() -> Path:
    if env := os.environ.get("DYNSPEC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dynspec-patch"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_available() -> bool:
    return importlib.util.find_spec("pip") is not None


def _pip_download(pin: Pin, scratch: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        *_PIP_PLATFORM_ARGS,
        "--dest",
        scratch,
        f"sglang=={pin.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (Path(scratch) / pin.wheel).exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ReleaseFetchError(f"pip could not download {pin.wheel}: {tail}")


def _pypi_download(pin: Pin, scratch: str) -> None:
    """Without pip: the wheel's URL from PyPI's JSON API, then the wheel itself."""
    base = os.environ.get("DYNSPEC_PYPI_URL", DEFAULT_PYPI_URL).rstrip("/")
    index = f"{base}/sglang/{pin.version}/json"
    try:
        with urllib.request.urlopen(index, timeout=60) as response:
            files = json.load(response)["urls"]
        url = next(f["url"] for f in files if f["filename"] == pin.wheel)
        with urllib.request.urlopen(url, timeout=600) as response, open(
            Path(scratch) / pin.wheel, "wb"
        ) as fh:
            shutil.copyfileobj(response, fh)
    except StopIteration:
        raise ReleaseFetchError(f"{index} does not list {pin.wheel}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise ReleaseFetchError(
            f"pip is not installed in this environment ({sys.executable}), and downloading "
            f"{pin.wheel} from {base} failed: {exc}; install pip there, or put the wheel in "
            f"{cache_dir() / 'wheels'}"
        ) from exc


def fetch_wheel(pin: Pin, on_progress: Progress = None) -> Path:
    """Return the cached wheel of ``pin``, downloading it first if needed; sha256-checked."""
    wheels = cache_dir() / "wheels"
    target = wheels / pin.wheel
    if target.exists():
        if _sha256(target) == pin.sha256:
            return target
        target.unlink()  # a corrupt or substituted cache entry is never trusted
    if os.environ.get("DYNSPEC_OFFLINE") == "1":
        raise ReleaseFetchError(
            f"{pin.wheel} is not in the cache {wheels} and DYNSPEC_OFFLINE=1 forbids downloading"
        )
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels) as scratch:
        how = "pip" if _pip_available() else "PyPI (no pip here)"
        if on_progress:
            on_progress(f"downloading {pin.wheel} with {how}")
        (_pip_download if _pip_available() else _pypi_download)(pin, scratch)
        downloaded = Path(scratch) / pin.wheel
        actual = _sha256(downloaded)
        if actual != pin.sha256:
            raise ReleaseFetchError(
                f"{pin.wheel}: sha256 {actual} does not match the pinned {pin.sha256}"
            )
        os.replace(downloaded, target)
    return target


def release_dir(pin: Pin, on_progress: Progress = None) -> Path:
    """Return ``<cache>/releases/<version>/sglang``: the wheel's ``sglang`` package, unpacked."""
    root = cache_dir() / "releases" / pin.version
    package = root / "sglang"
    complete = root / ".complete"
    if complete.exists() and complete.read_text().strip() == pin.sha256:
        return package
    wheel = fetch_wheel(pin, on_progress)
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{pin.version}-"))
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith("sglang/") and n.endswith(".py")]
        archive.extractall(staging, members=members)
    (staging / ".complete").write_text(pin.sha256 + "\n")
    os.replace(staging, root)
    return package


def copy_release(pin: Pin, dest: Path, on_progress: Progress = None) -> Path:
    """Copy a pinned release into ``dest/sglang-<version>/sglang`` (a scratch tree to patch)."""
    source = release_dir(pin, on_progress)
    target = dest / f"sglang-{pin.version}" / "sglang"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    return target
