#!/usr/bin/env python3
"""Build the offline parts for one SGLang release from the package index (build_parts.sh).

  kitparts.py build RELEASE OUTDIR [--cache DIR] [--pins FILE|latest] [--limit-mib M]
                                   [--glibc 2.34]
  kitparts.py dists DIR            names and versions of the distributions in DIR/part*
  kitparts.py compare OLD NEW      same distributions (names + versions) in both? exit 1 if not

Only `pip download --no-deps --only-binary=:all:` touches the index; the rest reads wheel files.
"""

from __future__ import annotations

import argparse
import calendar
import email
import gzip
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import InvalidVersion, Version

KIT = Path(__file__).resolve().parent
MIB = 1024 * 1024
# The GPU host: CPython 3.12 on x86_64 Linux (glibc >= 2.34).
TARGET_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
    "extra": "",
}
CRITICAL_HOST = {
    "torch",
    "triton",
    "numpy",
}  # a carried package that wants another version of these: fail


def log(*a):
    print(*a, flush=True)


def die(msg):
    print(f"ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


# ---------------------------------------------------------------- metadata
def wheel_name_version(path: Path) -> tuple[str, str]:
    parts = path.name[: -len(".whl")].split("-")
    return canonicalize_name(parts[0]), parts[1]


def wheel_metadata(path: Path) -> email.message.Message:
    with zipfile.ZipFile(path) as z:
        name = next(
            n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
        )
        return email.message_from_bytes(z.read(name))


def requirements(meta) -> list[Requirement]:
    """Requires-Dist entries that apply on the GPU host without extras."""
    out = []
    for line in meta.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except Exception:
            continue
        if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
            continue
        out.append(req)
    return out


def contains(spec: SpecifierSet, version: str) -> bool:
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def read_list(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def read_pins(path: Path | None) -> dict[str, str]:
    pins = {}
    if path is None:
        return pins
    for line in read_list(path):
        name, _, ver = line.partition("==")
        pins[canonicalize_name(name)] = ver.strip()
    return pins


def read_host(path: Path) -> dict[str, str | None]:
    host = {}
    for line in read_list(path):
        name, _, ver = line.partition("==")
        host[canonicalize_name(name)] = ver.strip() or None
    return host


def read_carry(path: Path) -> list[dict]:
    rows = []
    for line in read_list(path):
        names, part, mode = line.split()[:3]
        rows.append(
            {"names": [canonicalize_name(n) for n in names.split("|")], "part": part, "mode": mode}
        )
    return rows


# ---------------------------------------------------------------- pip
def platforms(glibc_max: str) -> list[str]:
    major, minor = (int(x) for x in glibc_max.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    return [*tags, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


class Downloader:
    def __init__(self, dest: Path, index: str, glibc_max: str):
        self.dest = dest
        dest.mkdir(parents=True, exist_ok=True)
        self.base = [
            *os.environ.get("KIT_PIP", f"{sys.executable} -m pip").split(),
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "--dest",
            str(dest),
        ]
        if index:  # else pip's own default index
            self.base += ["--index-url", index]
        for tag in platforms(glibc_max):
            self.base += ["--platform", tag]

    def get(self, reqs: list[str]) -> dict[str, Path]:
        """Download REQS (one pip call); name -> wheel path."""
        if not reqs:
            return {}
        log(f"  pip download --no-deps {' '.join(reqs)}")
        p = subprocess.run(self.base + reqs, capture_output=True, text=True)
        text = p.stdout + p.stderr
        if p.returncode != 0:
            die("pip download failed:\n" + "\n".join(text.splitlines()[-15:]))
        found = {}
        for m in re.finditer(r"(?:Saved|File was already downloaded)\s+(\S+\.whl)", text):
            path = Path(m.group(1))
            path = path if path.is_absolute() else (Path.cwd() / path)
            path = self.dest / path.name
            name, _ = wheel_name_version(path)
            found[name] = path
        for (
            req
        ) in reqs:  # fall back to the best file in the cache for anything not named in the output
            r = Requirement(req)
            name = canonicalize_name(r.name)
            if name in found:
                continue
            cands = [
                w
                for w in self.dest.glob("*.whl")
                if wheel_name_version(w)[0] == name
                and contains(r.specifier, wheel_name_version(w)[1])
            ]
            if not cands:
                die(f"pip download gave no wheel for {req}")
            found[name] = max(cands, key=lambda w: Version(wheel_name_version(w)[1]))
        return found


# ---------------------------------------------------------------- resolution
class Dist:
    def __init__(self, path: Path, source: str):
        self.path = path
        self.name, self.version = wheel_name_version(path)
        self.meta = wheel_metadata(path)
        self.reqs = requirements(self.meta)
        self.source = source


def resolve(release: str, dl: Downloader, carry: list[dict], pins: dict, host: dict):
    sg = Dist(dl.get([f"sglang=={release}"])["sglang"], "release")
    log(f"sglang {sg.version}: {len(sg.reqs)} requirements on the host platform")
    for r in (
        sg.reqs
    ):  # the host's torch/triton/numpy cannot travel: a release that wants others cannot run
        n, hv = canonicalize_name(r.name), host.get(canonicalize_name(r.name))
        if n in CRITICAL_HOST and hv and not contains(r.specifier, hv):
            die(
                f"sglang {sg.version} requires {r}, the GPU host has {n} {hv}: "
                "this release cannot run there"
            )
    declared = {canonicalize_name(r.name) for r in sg.reqs}
    rows = []
    for row in carry:
        if row["mode"] == "release":
            continue
        if row["mode"] == "declared" and not declared.intersection(row["names"]):
            continue  # carried only for the releases that require it
        name = next((n for n in row["names"] if n in declared), row["names"][0])
        rows.append(dict(row, name=name))
    chosen: dict[str, Dist] = {}
    skipped: dict[str, str] = {}
    # torchvision is built for exactly one torch: 0.(minor + 15).* goes with the host's torch
    # 2.minor
    extra: dict[str, list[tuple[str, SpecifierSet]]] = {}
    tv = re.match(r"2\.(\d+)\.", host.get("torch") or "")
    if tv:
        extra["torchvision"] = [("host torch", SpecifierSet(f"==0.{int(tv.group(1)) + 15}.*"))]
    for rnd in range(1, 6):
        cons: dict[str, list[tuple[str, SpecifierSet]]] = {k: list(v) for k, v in extra.items()}
        for d in [sg, *chosen.values()]:
            for r in d.reqs:
                cons.setdefault(canonicalize_name(r.name), []).append((d.name, r.specifier))
        wanted = {}
        for row in rows:
            name = row["name"]
            specs = [s for _, s in cons.get(name, [])]
            hv = host.get(name)
            if row["mode"] == "host" and hv and all(contains(s, hv) for s in specs):
                skipped[name] = f"host has {hv}"
                chosen.pop(name, None)
                continue
            skipped.pop(name, None)
            cur = chosen.get(name)
            pin = pins.get(name)
            pin_ok = pin is not None and all(contains(s, pin) for s in specs)
            if (
                cur
                and all(contains(s, cur.version) for s in specs)
                and (not pin_ok or cur.version == pin)
            ):
                continue
            if pin_ok:
                wanted[name] = (f"{name}=={pin}", "pins.txt")
            else:
                spec = ",".join(str(s) for s in specs if str(s))
                exact = [
                    p
                    for p, s in cons.get(name, [])
                    if any(x.operator in ("==", "===") and "*" not in x.version for x in s)
                ]
                why = (
                    f"pinned by {exact[0]}"
                    if exact
                    else (f"newest matching '{spec}'" if spec else "newest")
                )
                if pin is not None:
                    why += f" (pins.txt's {pin} does not fit)"
                wanted[name] = (f"{name}{spec}", why)
        if not wanted:
            break
        log(f"round {rnd}: {len(wanted)} to fetch")
        got = dl.get([req for req, _ in wanted.values()])
        for name, (_req, why) in wanted.items():
            chosen[name] = Dist(got[name], why)
    else:
        die("versions did not settle after 5 rounds")
    return sg, rows, chosen, skipped


def check(sg: Dist, chosen: dict, host: dict, carried_names: set) -> tuple[list, list, dict]:
    errors, warnings, absent = [], [], {}
    for d in [sg, *chosen.values()]:
        for r in d.reqs:
            n = canonicalize_name(r.name)
            if n in chosen:
                if not contains(r.specifier, chosen[n].version):
                    errors.append(
                        f"{d.name} {d.version} wants {r}, carried {n} {chosen[n].version}"
                    )
            elif n in host:
                hv = host[n]
                if hv and not contains(r.specifier, hv):
                    msg = f"{d.name} {d.version} wants {r}, host has {n} {hv}"
                    (errors if n in CRITICAL_HOST else warnings).append(msg)
            elif n not in carried_names:
                absent.setdefault(d.name, []).append(str(r))
    return errors, warnings, absent


# ---------------------------------------------------------------- trims
def _zip_mtime(info: zipfile.ZipInfo) -> int:
    try:
        return calendar.timegm((*info.date_time, 0, 0, 0))
    except Exception:
        return 0


def wheel_to_tar(whl: Path, out: Path, drop) -> tuple[int, int, list[str]]:
    """Repack WHL as a deterministic tar.gz without the members DROP(path) selects."""
    kept = dropped = 0
    dropped_names = []
    dirs = set()
    with (
        zipfile.ZipFile(whl) as z,
        open(out, "wb") as f,
        gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=6) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            if drop(info.filename):
                dropped += info.file_size
                dropped_names.append(info.filename)
                continue
            parts = info.filename.split("/")[:-1]
            for k in range(1, len(parts) + 1):
                d = "/".join(parts[:k])
                if d not in dirs:
                    dirs.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 0
                    ti.uname = ti.gname = "root"
                    tar.addfile(ti)
            ti = tarfile.TarInfo(info.filename)
            ti.size = info.file_size
            ti.mode = ((info.external_attr >> 16) & 0o777) or 0o644
            ti.mtime = _zip_mtime(info)
            ti.uname = ti.gname = "root"
            with z.open(info) as src:
                tar.addfile(ti, src)
            kept += info.file_size
    return kept, dropped, dropped_names


_KERNEL_DROP_TOP = re.compile(r"^(lib|lib64|include)/|^_mscclpp")
_KERNEL_DROP_SO = re.compile(r"(^|/)(flash_ops|flashmla|infllm)[^/]*\.so$")
_KERNEL_ARCH = re.compile(r"^sgl_kernel/sm(\d+)/")


def kernel_drop(path: str) -> bool:
    """sgl_kernel trimmed to what an sm90 (H100/H200) server loads."""
    if _KERNEL_DROP_TOP.search(path) or _KERNEL_DROP_SO.search(path):
        return True
    m = _KERNEL_ARCH.match(path)
    return bool(m and m.group(1) != "90")


def xgrammar_drop(path: str) -> bool:
    return path.startswith("xgrammar/") and path.endswith(".a")


def elf_needed(data: bytes) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sec in secs:
        if sec[1] != 6:  # SHT_DYNAMIC
            continue
        off, size, link = sec[4], sec[5], sec[6]
        stroff = secs[link][4]
        out = []
        for j in range(0, size, 16):
            tag, val = struct.unpack_from("<qQ", data, off + j)
            if tag == 0:
                break
            if tag == 1:
                end = data.index(b"\0", stroff + val)
                out.append(data[stroff + val : end].decode())
        return out
    return []


def kernel_needed(tar_path: Path) -> set[str]:
    needed = set()
    with tarfile.open(tar_path) as t:
        for m in t.getmembers():
            if m.isfile() and ".so" in m.name:
                needed.update(elf_needed(t.extractfile(m).read()))
    return needed


def find_system_lib(soname: str) -> Path | None:
    env = os.environ.get("LIBNUMA") if soname.startswith("libnuma") else None
    if env:
        return Path(env)
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.strip().startswith(soname + " ") and "x86-64" in line:
                return Path(line.rsplit("=>", 1)[1].strip())
    except OSError:
        pass
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64"):
        if (Path(d) / soname).exists():
            return Path(d) / soname
    return None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def du_b(path: Path) -> int:
    """Like `du -sb`: apparent sizes of files and directories."""
    total = path.stat().st_size
    for p in path.rglob("*"):
        total += p.lstat().st_size
    return total


# ---------------------------------------------------------------- build
def cmd_build(a):
    out = Path(a.outdir).resolve()
    cache = Path(a.cache).resolve()
    carry = read_carry(KIT / "carry.txt")
    pins = {} if a.pins == "latest" else read_pins(Path(a.pins))
    host = read_host(KIT / "host-packages.txt")
    dl = Downloader(cache / "wheels", a.index, a.glibc)
    sg, rows, chosen, skipped = resolve(a.release, dl, carry, pins, host)

    carried_names = {r["name"] for r in rows} | {"sglang"}
    errors, warnings, absent = check(sg, chosen, host, carried_names)
    # the host's torch must be the one the release pins
    torch_pin = [str(r.specifier) for r in sg.reqs if canonicalize_name(r.name) == "torch"]
    log(f"release pins torch{''.join(torch_pin)}; host has torch {host.get('torch')}")

    work = cache / f"trim-{a.release}"
    work.mkdir(parents=True, exist_ok=True)

    items = []  # (pref part, filename, path, dist, version, source)
    items.append(("A", sg.path.name, sg.path, "sglang", sg.version, "release"))
    libs = []  # the kernel's shared libraries the host lacks
    kernel = None  # the trimmed kernel's file
    for row in rows:
        name = row["name"]
        if name in skipped:
            continue
        d = chosen[name]
        if row["mode"] == "kernel":
            tgz = work / f"sgl_kernel-{d.version}-sm90-trim.tar.gz"
            kept, dropped, names = wheel_to_tar(d.path, tgz, kernel_drop)
            log(
                f"{d.name} {d.version}: kept {kept / MIB:.1f} MiB, dropped {dropped / MIB:.1f} MiB "
                f"({len(names)} files: flash_ops/flashmla/infllm .so, other archs, "
                "mscclpp, lib/include)"
            )
            needed = kernel_needed(tgz)
            for so in sorted(n for n in needed if n.startswith("libnuma")):
                src = find_system_lib(so)
                if src is None:
                    die(
                        f"{d.name} {d.version} links {so}; install it here "
                        "(Debian/Ubuntu: apt-get install "
                        f"libnuma1) or set LIBNUMA=/path/to/{so}"
                    )
                libs.append((so, src))
            items.append((row["part"], tgz.name, tgz, d.name, d.version, d.source))
            kernel = tgz.name
        elif row["mode"] == "xgrammar":
            tgz = work / f"xgrammar-{d.version}-nolib.tar.gz"
            kept, dropped, _ = wheel_to_tar(d.path, tgz, xgrammar_drop)
            log(f"xgrammar {d.version}: dropped {dropped / MIB:.1f} MiB of static libraries")
            items.append((row["part"], tgz.name, tgz, d.name, d.version, d.source))
        else:
            items.append((row["part"], d.path.name, d.path, d.name, d.version, d.source))

    limit = int(a.limit_mib * MIB) if a.limit_mib else carry_limit(checkout_bytes(KIT))
    size = {i[1]: i[2].stat().st_size for i in items}
    if libs:  # the kernel's libraries travel in its part's lib/
        size[kernel] += sum(src.stat().st_size for _, src in libs)
    try:
        part = pack_parts([(i[1], i[0], size[i[1]]) for i in items], limit - PART_SLACK_BYTES)
    except ValueError as exc:
        die(str(exc))
    for fname, letter in part.items():
        if letter != next(i[0] for i in items if i[1] == fname):
            log(f"{fname}: part {letter}")
    parts = sorted({f"part{letter}" for letter in part.values()})
    for stale in (p for p in out.glob("part*") if p.is_dir()):
        shutil.rmtree(stale)
    for name in parts:
        (out / name).mkdir(parents=True)

    manifest = []
    for _pref, fname, path, dist, ver, source in items:
        dest = out / f"part{part[fname]}" / fname
        shutil.copyfile(path, dest)
        manifest.append(
            (f"part{part[fname]}", fname, dest.stat().st_size, sha256(dest), dist, ver, source)
        )
    for so, src in libs:
        (out / f"part{part[kernel]}" / "lib").mkdir(exist_ok=True)
        dest = out / f"part{part[kernel]}" / "lib" / so
        shutil.copyfile(src, dest)
        manifest.append(
            (
                f"part{part[kernel]}",
                f"lib/{so}",
                dest.stat().st_size,
                sha256(dest),
                so,
                "-",
                f"build machine ({src})",
            )
        )

    with open(out / "MANIFEST.tsv", "w") as f:
        f.write("part\tfile\tbytes\tsha256\tdistribution\tversion\tversion chosen by\n")
        for row in sorted(manifest):
            f.write("\t".join(str(x) for x in row) + "\n")
    with open(out / "RESOLVE.txt", "w") as f:
        f.write(f"sglang {sg.version}\n")
        for n, why in sorted(skipped.items()):
            f.write(f"not carried: {n} ({why})\n")
        for e in errors:
            f.write(f"ERROR {e}\n")
        for w in warnings:
            f.write(f"warning {w}\n")
        for parent, reqs in sorted(absent.items()):
            f.write(
                f"not carried, not on the host (unused by this server): {parent}: "
                f"{', '.join(sorted(reqs))}\n"
            )

    log("")
    log(f"{'part':6} {'bytes':>10}  {'distribution':28} {'version':20} chosen by")
    for row in sorted(manifest):
        log(f"{row[0]:6} {row[2]:>10}  {row[4]:28} {row[5]:20} {row[6]}")
    for n, why in sorted(skipped.items()):
        log(f"{'-':6} {'':>10}  {n:28} {'':20} not carried: {why}")
    for w in warnings:
        log(f"warning: {w}")
    for parent, reqs in sorted(absent.items()):
        log(
            f"not carried and not on the host (not imported by this server; "
            f"see carry.txt): {parent}: "
            f"{len(reqs)} requirements"
        )
    for e in errors:
        log(f"ERROR: {e}")
    sizes = {p: du_b(out / p) for p in parts}
    log("sizes (du -b): " + ", ".join(f"{p} {n} B ({n / MIB:.1f} MiB)" for p, n in sizes.items())
        + f"; limit {limit} B a part")
    (out / "PARTS.txt").write_text("".join(f"{p}\n" for p in parts))  # install in this order
    for p in (p for p, n in sizes.items() if n > limit):
        die(f"{p} holds {sizes[p]} B, over the {limit} B one run carries beside the checkout")
    if errors:
        die(f"{len(errors)} constraint(s) broken; see above")


# ---------------------------------------------------------------- packing
RUN_CARRY_BYTES = 64 * MIB  # one device run carries the checkout and the named paths, this much
CARRY_MARGIN_BYTES = 2 * MIB  # the checkout grows between a build and the run
PART_SLACK_BYTES = 64 * 1024  # directory entries, lib/ (du -b counts them)


def checkout_bytes(inside: Path) -> int:
    """The bytes a device run lays down from the checkout holding ``inside``: its tracked files
    and the untracked ones git does not ignore."""
    root = subprocess.run(["git", "-C", str(inside), "rev-parse", "--show-toplevel"],
                          check=True, capture_output=True, text=True).stdout.strip()
    names = subprocess.run(
        ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True, text=True).stdout.split("\0")
    return sum((Path(root) / n).stat().st_size for n in names if n and (Path(root) / n).is_file())


def carry_limit(checkout: int) -> int:
    """The most one part may hold so that it and the checkout travel in one run."""
    return RUN_CARRY_BYTES - checkout - CARRY_MARGIN_BYTES


def pack_parts(items: list[tuple[str, str, int]], limit: int) -> dict[str, str]:
    """Each file's part letter, from (file, preferred letter, bytes) in listed order.

    The first file (the release's wheel) stays in part A, which install.sh takes first. A
    part over ``limit`` hands its last-listed files on to the next letter (B, C, ...); the
    files handed on then move back into the earliest part with room, largest first.
    """
    for name, _pref, size in items:
        if size > limit:
            raise ValueError(f"{name} alone ({size / MIB:.1f} MiB) exceeds a part's "
                             f"{limit / MIB:.1f} MiB")
    first = items[0][0]
    part = {name: pref for name, pref, _size in items} | {first: "A"}
    size = {name: n for name, _pref, n in items}

    def total(letter: str) -> int:
        return sum(size[f] for f in part if part[f] == letter)

    letter = "A"
    while letter <= max(part.values()):
        movable = [name for name, _p, _s in items if part[name] == letter and name != first]
        while total(letter) > limit:
            part[movable.pop()] = chr(ord(letter) + 1)
        letter = chr(ord(letter) + 1)
    handed_on = [name for name, pref, _s in items if part[name] != pref and name != first]
    for name in sorted(handed_on, key=lambda f: -size[f]):
        for earlier in sorted({p for p in part.values() if p < part[name]}):
            if total(earlier) + size[name] <= limit:
                part[name] = earlier
                break
    return part


# ---------------------------------------------------------------- listing / compare
def part_dists(d: Path) -> dict[str, tuple[str, str]]:
    """name -> (version, part) for the wheels, trimmed tars and libraries in D/part*."""
    out = {}
    for p in sorted(d.glob("part*")):
        part = p.name
        if not p.is_dir():
            continue
        for f in sorted(p.iterdir()):
            if f.suffix == ".whl":
                n, v = wheel_name_version(f)
                out[n] = (v, part)
            elif f.name.endswith(".tar.gz"):
                with tarfile.open(f) as t:
                    infos = {m.name.lstrip("./").split("/")[0] for m in t.getmembers()}
                for top in infos:
                    if top.endswith(".dist-info"):
                        n, v = top[: -len(".dist-info")].rsplit("-", 1)
                        out[canonicalize_name(n)] = (v, part)
            elif f.is_dir():
                for lib in sorted(f.iterdir()):
                    out[f"{f.name}/{lib.name}"] = ("file", part)
    return out


def cmd_dists(a):
    for n, (v, part) in sorted(part_dists(Path(a.dir)).items()):
        print(f"{part}  {n}  {v}")


def cmd_compare(a):
    old, new = part_dists(Path(a.old)), part_dists(Path(a.new))
    same = {n for n in old if n in new and old[n][0] == new[n][0]}
    print(f"old: {len(old)} entries, new: {len(new)} entries, same name+version: {len(same)}")
    rc = 0
    for n in sorted(set(old) | set(new)):
        o, w = old.get(n), new.get(n)
        if o is None or w is None or o[0] != w[0]:
            rc = 1
            print(
                f"  DIFF {n}: old {o[0] + ' (' + o[1] + ')' if o else '-'}  "
                f"new {w[0] + ' (' + w[1] + ')' if w else '-'}"
            )
        elif o[1] != w[1]:
            print(f"  moved {n} {o[0]}: {o[1]} -> {w[1]}")
    print("SAME SET OF DISTRIBUTIONS" if rc == 0 else "DISTRIBUTIONS DIFFER")
    sys.exit(rc)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = dict(
        cache=os.environ.get("KIT_CACHE", "/tmp/gpu-kit-cache"),
        index=os.environ.get("INDEX_URL", ""),
        glibc=os.environ.get("GLIBC_MAX", "2.34"),
    )
    b = sub.add_parser("build")
    b.add_argument("release")
    b.add_argument("outdir")
    b.add_argument("--pins", default=str(KIT / "pins.txt"))
    b.add_argument("--limit-mib", type=float, default=None,
                   help="the most one part may hold (default: what one run carries beside "
                   "this checkout)")
    b.add_argument("--cache", default=common["cache"])
    b.add_argument("--index", default=common["index"])
    b.add_argument("--glibc", default=common["glibc"])
    d = sub.add_parser("dists")
    d.add_argument("dir")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    a = ap.parse_args()
    {"build": cmd_build, "dists": cmd_dists, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    main()
