#!/usr/bin/env python3
"""Build, refresh and check the patched SGLang tree for kv_offload.

The project keeps three things: the pinned upstream base (``patches/base``), new code laid out like the
upstream repo (the overlay under ``python/``), and an ordered series of small diffs to existing upstream
files (``patches/series``). This tool turns them into a patched SGLang tree and back:

* ``build``   fetch the pinned wheel (sha256-checked), unpack its sources into ``build/sglang/python`` as
              a pristine git base, apply the series (one commit per patch), link the overlay in and put
              the tree on the project venv's path (``.venv``), creating the venv when needed. Idempotent.
* ``refresh`` regenerate ``patches/`` from the build tree: uncommitted edits go into the patch named by
              ``--into`` or into a new one (``--new``); every patch is rewritten from its commit.
* ``check``   prove that the series applies to a pristine base and that the overlay shadows no upstream
              file, and print the footprint.

Only the standard library is used, so the tool runs with any Python 3.9+ before the venv exists.
"""

from __future__ import annotations

import argparse
import base64
import csv
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
OVERLAY = ROOT / "python"
ENV_DIR = ROOT / "scripts" / "env"
DEFAULT_BUILD = ROOT / "build"
DEFAULT_VENV = ROOT / ".venv"
CACHE = Path(os.environ.get("KV_OFFLOAD_CACHE", Path.home() / ".cache" / "kv-offload"))

UV_VERSION = "0.13.9"
# Installed by the system pip, which finds them on this machine kind's disk (uv would download):
# torch and torchvision, the only pair there whose torchvision loads (upstream's sglang.srt.utils
# imports it; CUDA builds, which run on the CPU), and triton. Their versions are the pins of
# scripts/env/constraints-cpu.txt.
SYSTEM_PIP_PACKAGES = ("torch", "torchvision", "triton")
# Free disk a new venv needs: it takes 6.2 GB (torch's CUDA build), and pip unpacks beside it.
VENV_FREE_GB = 9
GIT_ID = ["-c", "user.name=kv_offload", "-c", "user.email=kv_offload@localhost"]
PATCH_TRAILER = "Patch-File:"


class TreeError(RuntimeError):
    """A failure the user can act on; printed without a traceback."""


def log(msg: str) -> None:
    print(f"[kv_offload_tree] {msg}", flush=True)


def run(cmd: Sequence[str], cwd: Optional[Path] = None, check: bool = True, env=None):
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, text=True, capture_output=True)
    if check and res.returncode != 0:
        raise TreeError(
            f"command failed ({res.returncode}): {' '.join(map(str, cmd))}\n{res.stdout}{res.stderr}"
        )
    return res


def git(repo: Path, *args: str, check: bool = True) -> str:
    return run(["git", *GIT_ID, *args], cwd=repo, check=check).stdout


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Base and series
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Base:
    """The pinned upstream release: its wheel (the release ships no sdist) and that file's sha256."""

    name: str
    version: str
    wheel: str
    sha256: str


def read_base() -> Base:
    fields = {}
    for line in (PATCHES / "base").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            fields[key.strip()] = value.strip()
    return Base(**fields)


def read_series() -> List[str]:
    series = PATCHES / "series"
    if not series.exists():
        return []
    names = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            if not (PATCHES / line).is_file():
                raise TreeError(f"patches/series names {line}, but patches/{line} does not exist")
            names.append(line)
    return names


@dataclasses.dataclass
class Hunk:
    file: str
    index: int  # 1-based within its file
    header: str


def parse_hunks(patch_text: str) -> List[Hunk]:
    hunks, current, count = [], None, 0
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            count = 0
        elif line.startswith("@@") and current is not None:
            count += 1
            hunks.append(Hunk(current, count, line.split("@@")[1].strip()))
    return hunks


def patch_stats(patch_text: str) -> Tuple[List[str], int, int]:
    files, added, removed, in_body = [], 0, 0, False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            files.append(line.split(" b/", 1)[1])
            in_body = False
        elif line.startswith("@@"):
            in_body = True
        elif in_body and line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif in_body and line.startswith("-") and not line.startswith("---"):
            removed += 1
    return files, added, removed


def patch_subject(patch_text: str, fallback: str) -> str:
    for line in patch_text.splitlines():
        if line.startswith("Subject:"):
            return re.sub(r"^Subject:\s*(\[[^\]]*\]\s*)?", "", line).strip()
    return fallback


def patch_why(patch_text: str) -> str:
    """The header paragraph between the Subject line and ``---`` (kept through build/refresh)."""
    head = patch_text.split("\n---\n", 1)[0]
    lines = head.splitlines()
    start = next((i + 1 for i, l in enumerate(lines) if l.startswith("Subject:")), 0)
    return "\n".join(lines[start:]).strip()


def explain_conflict(name: str, patch_text: str, tree: Path) -> str:
    """Name the patch, file and hunk that does not apply (git reports only a line number)."""
    proc = subprocess.run(
        ["git", "apply", "--check", "-v"],
        cwd=tree,
        input=patch_text,
        text=True,
        capture_output=True,
    )
    report = proc.stderr + proc.stdout
    m = re.search(r"error: patch failed: (\S+):(\d+)", report)
    if m:
        path, line = m.group(1), int(m.group(2))
        candidates = [h for h in parse_hunks(patch_text) if h.file == path]
        hunk = next(
            (h for h in candidates if int(re.match(r"-(\d+)", h.header).group(1)) == line),
            candidates[0] if candidates else None,
        )
        where = f"hunk #{hunk.index} (@@ {hunk.header} @@)" if hunk else f"line {line}"
        return f"patch {name} does not apply: file {path}, {where}.\n{report.strip()}"
    m = re.search(r"error: (\S+): (does not exist in index|No such file or directory)", report)
    if m:
        return f"patch {name} does not apply: file {m.group(1)} does not exist in the base.\n{report.strip()}"
    return f"patch {name} does not apply.\n{report.strip()}"


def apply_series(tree: Path, names: Sequence[str], commit: bool) -> None:
    for name in names:
        text = (PATCHES / name).read_text()
        if "diff --git" not in text:
            raise TreeError(f"patch {name} holds no diff")
        proc = subprocess.run(
            ["git", "apply", "--index", "--whitespace=nowarn"],
            cwd=tree,
            input=text,
            text=True,
            capture_output=True,
        )
        if proc.returncode != 0:
            raise TreeError(explain_conflict(name, text, tree))
        if commit:
            subject = patch_subject(text, name)
            why = patch_why(text)
            message = ["-m", subject] + (["-m", why] if why else [])
            git(tree, "commit", "-q", *message, "-m", f"{PATCH_TRAILER} {name}")


# --------------------------------------------------------------------------------------------------
# Overlay
# --------------------------------------------------------------------------------------------------


def overlay_files() -> List[Path]:
    """Files under python/ relative to python/ (caches excluded)."""
    out = []
    for path in sorted(OVERLAY.rglob("*")):
        rel = path.relative_to(OVERLAY)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
            out.append(rel)
    return out


def overlay_links(base_paths: set) -> List[Path]:
    """The overlay entries to link: the topmost path of each new file that is absent upstream.

    ``base_paths`` holds every file and directory of the pristine base, relative to ``python/``.
    Raises if an overlay file would shadow an upstream file.
    """
    links = set()
    for rel in overlay_files():
        if str(rel) in base_paths:
            raise TreeError(
                f"overlay file python/{rel} would shadow upstream file python/{rel}; change the upstream "
                "file through a patch (edit it in build/sglang and run `refresh`) instead"
            )
        parts = rel.parts
        for i in range(1, len(parts) + 1):
            prefix = Path(*parts[:i])
            if str(prefix) not in base_paths:
                links.add(prefix)
                break
    return sorted(links)


def base_paths_of(tree: Path) -> set:
    files = git(tree, "ls-tree", "-r", "--name-only", "base", "--", "python").splitlines()
    paths = set()
    for f in files:
        p = Path(f).relative_to("python")
        paths.add(str(p))
        paths.update(str(parent) for parent in p.parents if str(parent) != ".")
    return paths


def link_overlay(tree: Path) -> List[Path]:
    links = overlay_links(base_paths_of(tree))
    exclude = tree / ".git" / "info" / "exclude"
    lines = [f"/python/{rel}" for rel in links]
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("# kv_offload overlay links\n" + "\n".join(lines) + "\n")
    for rel in links:
        dst = tree / "python" / rel
        src = OVERLAY / rel
        if dst.is_symlink():
            if Path(os.readlink(dst)) == src:
                continue
            dst.unlink()
        elif dst.exists():
            raise TreeError(f"{dst} exists in the build tree and is not an overlay link; remove it")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src, target_is_directory=src.is_dir())
    # Links whose overlay source disappeared are stale.
    for path in (tree / "python").rglob("*"):
        if path.is_symlink() and not path.exists():
            path.unlink()
    return links


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------


def pip_download(dest, requirement: str, *extra: str) -> None:
    """``pip download`` one requirement (no dependencies) into ``dest`` with the system pip."""
    run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check"]
        + ["--no-deps", *extra, "-d", dest, requirement]
    )


def trimmed_base_path(base: Base) -> Path:
    """Where a trimmed copy of the pinned wheel lies in the cache (see :func:`write_trimmed_base`)."""
    return CACHE / f"{Path(base.wheel).stem}.trimmed.zip"


def _record_hashes(record: str) -> Dict[str, str]:
    """``path -> sha256`` (RECORD's urlsafe base64, no padding) of a wheel's RECORD text."""
    out = {}
    for row in csv.reader(record.splitlines()):
        if len(row) >= 2 and row[1].startswith("sha256="):
            out[row[0]] = row[1][len("sha256=") :]
    return out


def _member_digest(zf: zipfile.ZipFile, name: str) -> str:
    h = hashlib.sha256()
    with zf.open(name) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def _record_name(base: Base) -> str:
    return f"{base.name}-{base.version}.dist-info/RECORD"


def write_trimmed_base(whl: Path, base: Base, drop: Sequence[str], out: Path) -> List[str]:
    """Copy the pinned wheel ``whl`` (sha256-checked here) to ``out`` without the members whose
    path starts with one of ``drop``; a sidecar ``out.json`` names the wheel and the sha256 of its
    RECORD, against which :func:`verify_trimmed_base` checks every member that is left. Returns the
    dropped members."""
    if sha256_file(whl) != base.sha256:
        raise TreeError(f"{whl}: sha256 differs from patches/base's {base.sha256}")
    dropped = []
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = src.read(_record_name(base))
        for info in src.infolist():
            if info.filename.startswith(tuple(drop)):
                dropped.append(info.filename)
            else:
                dst.writestr(info, src.read(info))
    sidecar = {
        "wheel": base.wheel,
        "sha256": base.sha256,
        "record_sha256": hashlib.sha256(record).hexdigest(),
        "dropped": dropped,
    }
    Path(f"{out}.json").write_text(json.dumps(sidecar, indent=1) + "\n")
    tmp.replace(out)
    return dropped


def verify_trimmed_base(archive: Path, base: Base) -> None:
    """``archive`` holds members of the pinned wheel only, each byte for byte (RECORD's hashes),
    and its sidecar names the pinned wheel; raises :class:`TreeError` otherwise."""
    sidecar_path = Path(f"{archive}.json")
    if not sidecar_path.exists():
        raise TreeError(f"{archive} has no {sidecar_path.name}; rewrite it with write_trimmed_base")
    sidecar = json.loads(sidecar_path.read_text())
    if (sidecar.get("wheel"), sidecar.get("sha256")) != (base.wheel, base.sha256):
        raise TreeError(
            f"{archive} was trimmed from {sidecar.get('wheel')} (sha256 {sidecar.get('sha256')}), "
            f"not from patches/base's {base.wheel}; fetch it again (scripts/env/fetch_gpu_wheels.sh)"
        )
    with zipfile.ZipFile(archive) as zf:
        record = zf.read(_record_name(base))
        if hashlib.sha256(record).hexdigest() != sidecar["record_sha256"]:
            raise TreeError(f"{archive}: its RECORD is not the pinned wheel's")
        hashes = _record_hashes(record.decode())
        for name in zf.namelist():
            if name == _record_name(base) or name.endswith("/"):
                continue
            if hashes.get(name) != _member_digest(zf, name):
                raise TreeError(f"{archive}: {name} differs from the pinned wheel's RECORD")


def fetch_wheel(base: Base) -> Path:
    """The pinned wheel from the cache (fetched when missing), or, where only a trimmed copy was
    carried (the GPU machine, no network), that copy once verified."""
    CACHE.mkdir(parents=True, exist_ok=True)
    whl = CACHE / base.wheel
    if whl.exists() and sha256_file(whl) == base.sha256:
        return whl
    trimmed = trimmed_base_path(base)
    if not whl.exists() and trimmed.exists():
        verify_trimmed_base(trimmed, base)
        return trimmed
    log(f"fetching {base.name}=={base.version} wheel")
    # The wheel's tags, whatever Python runs this tool (the GPU image has 3.12; it reads the cache).
    _, _, python_tag, abi_tag, platform_tag = Path(base.wheel).stem.split("-")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        pip_download(
            tmp,
            f"{base.name}=={base.version}",
            "--only-binary=:all:",
            f"--python-version={python_tag[2:]}",
            f"--abi={abi_tag}",
            f"--platform={platform_tag}",
        )
        got = Path(tmp) / base.wheel
        if not got.exists():
            raise TreeError(f"pip did not produce {base.wheel} in {tmp}")
        digest = sha256_file(got)
        if digest != base.sha256:
            raise TreeError(
                f"sha256 mismatch for {base.wheel}: got {digest}, patches/base pins {base.sha256}"
            )
        shutil.move(str(got), whl)
    return whl


def uv_binary() -> Path:
    uv = CACHE / f"uv-{UV_VERSION}" / "bin" / "uv"
    if not uv.exists():
        log(f"installing uv {UV_VERSION}")
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--target",
                CACHE / f"uv-{UV_VERSION}",
                f"uv=={UV_VERSION}",
            ]
        )
    return uv


def uv_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.update(UV_CACHE_DIR=str(CACHE / "uv-cache"), UV_NO_PROGRESS="1")
    return env


def constraint_pins(constraints: Path, names: Sequence[str]) -> List[str]:
    """The ``name==version`` lines of ``constraints`` for ``names``, in that order."""
    pins = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            pins[line.split("==", 1)[0].strip().lower()] = line
    missing = [n for n in names if n not in pins]
    if missing:
        raise TreeError(
            f"{constraints} pins no version for {', '.join(missing)}; add name==version"
        )
    return [pins[n] for n in names]


def check_free_disk(path: Path, need_gb: float) -> None:
    """Fail before installing when the disk under ``path`` has less than ``need_gb`` GB free."""
    path.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(path).free / 1e9
    if free_gb < need_gb:
        raise TreeError(
            f"{path} has {free_gb:.1f} GB free; the venv needs about {need_gb} GB. "
            "Free disk space there (old venvs, worktrees) or pass --venv on another disk."
        )


def ensure_venv(venv: Path) -> None:
    reqs = ENV_DIR / "requirements-cpu.txt"
    cons = ENV_DIR / "constraints-cpu.txt"
    uv = uv_binary()
    pinned = constraint_pins(cons, SYSTEM_PIP_PACKAGES)
    stamp_value = hashlib.sha256(
        reqs.read_bytes() + cons.read_bytes() + " ".join(pinned).encode()
    ).hexdigest()[:16]
    stamp = venv / ".kv-offload-stamp"
    if stamp.exists() and stamp.read_text().strip() == stamp_value:
        fetch_debian_libs(venv)
        return
    log(f"creating venv {venv}")
    if venv.exists():
        shutil.rmtree(venv)
    check_free_disk(venv.parent, VENV_FREE_GB)
    env = uv_env()
    run([uv, "venv", "-q", "-p", "python3.11", venv], env=env)
    # The system pip installs torch from this machine's disk (its config points there); uv then
    # adds the rest and keeps that torch (the constraints pin the same versions).
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", *pinned])
    run([uv, "pip", "install", "-q", "-p", venv, "-r", reqs, "-c", cons], env=env)
    stamp.write_text(stamp_value + "\n")
    fetch_debian_libs(venv)


def fetch_debian_libs(venv: Path) -> None:
    """libibverbs + libnl for the Mooncake wheel (user space, in the cache); the venv records where.

    A failure is not fatal here: only the Mooncake test needs them, and it fails naming the script.
    """
    pointer = venv / "kv-offload-debian-libs"
    script = ENV_DIR / "fetch_debian_libs.sh"
    res = subprocess.run(
        ["bash", str(script), str(CACHE / "debroot")], capture_output=True, text=True
    )
    if res.returncode != 0:
        pointer.unlink(missing_ok=True)
        log(f"warning: {script.name} failed (the Mooncake test will fail): {res.stderr.strip()}")
        return
    pointer.write_text(res.stdout.strip().splitlines()[-1] + "\n")


def install_tree(venv: Path, tree: Path, base: Base) -> None:
    """Put the patched tree on the venv's path (a ``.pth`` file) with the wheel's metadata.

    A wheel cannot be installed editable; the ``.pth`` makes ``import sglang`` read the tree, and the
    dist-info (without RECORD, so no installer takes the tree's files for its own) answers
    ``importlib.metadata`` queries for sglang's version and entry points.
    """
    target = (tree / "python").resolve()
    site = Path(
        run(
            [
                venv / "bin" / "python",
                "-c",
                "import sysconfig; print(sysconfig.get_path('purelib'))",
            ]
        ).stdout.strip()
    )
    pth = site / "kv_offload_sglang_tree.pth"
    if pth.exists() and pth.read_text().strip() == str(target):
        return
    log("putting the patched tree on the venv's path")
    dist_info = f"{base.name}-{base.version}.dist-info"
    dst = site / dist_info
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(target / dist_info, dst, ignore=shutil.ignore_patterns("RECORD"))
    pth.write_text(f"{target}\n")


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------


def tree_path(build_dir: Path) -> Path:
    return build_dir / "sglang"


def series_digest(base: Base, names: Sequence[str]) -> str:
    h = hashlib.sha256(base.sha256.encode())
    for name in names:
        h.update(name.encode() + b"\0" + (PATCHES / name).read_bytes())
    return h.hexdigest()[:16]


def unpack_base(whl: Path, tree: Path, base: Base) -> None:
    """The wheel's files under ``tree/python`` (the package and its dist-info), committed as ``base``."""
    if tree.exists():
        shutil.rmtree(tree)
    (tree / "python").mkdir(parents=True)
    with zipfile.ZipFile(whl) as zf:
        zf.extractall(tree / "python")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(
        tree,
        "commit",
        "-q",
        "-m",
        f"pristine {base.name} {base.version} ({base.wheel}, sha256 {base.sha256})",
    )
    git(tree, "tag", "base")


def dirty_files(tree: Path) -> List[str]:
    out = git(tree, "status", "--porcelain", "--untracked-files=no")
    return [line[3:] for line in out.splitlines() if line.strip()]


def cmd_build(args) -> int:
    t0 = time.time()
    base, names = read_base(), read_series()
    tree = tree_path(args.build_dir)
    if not args.no_venv:
        ensure_venv(args.venv)
    want = series_digest(base, names)
    stamp = tree / ".git" / "kv-offload-series"
    current = stamp.read_text().strip() if stamp.exists() else None
    if current != want or args.force:
        if current is not None and dirty_files(tree) and not args.force:
            raise TreeError(
                "the build tree has edits that are not in patches/ ("
                + ", ".join(dirty_files(tree))
                + "); run `refresh --into NAME` (or `--new NAME`) to keep them, or `build --force` to drop them"
            )
        whl = fetch_wheel(base)
        log(f"unpacking pristine {base.name} {base.version} and applying {len(names)} patch(es)")
        unpack_base(whl, tree, base)
        apply_series(tree, names, commit=True)
        stamp.write_text(want + "\n")
    links = link_overlay(tree)
    if not args.no_venv:
        install_tree(args.venv, tree, base)
    log(
        f"patched tree ready at {tree / 'python'} ({len(names)} patches, {len(links)} overlay links) "
        f"in {time.time() - t0:.1f}s"
    )
    return 0


def patch_commits(tree: Path) -> List[Tuple[str, str, str]]:
    """(sha, patch file, full message) for every commit after the base, oldest first."""
    out = []
    for sha in git(tree, "rev-list", "--reverse", "base..HEAD").split():
        msg = git(tree, "log", "-1", "--format=%B", sha)
        m = re.search(rf"^{PATCH_TRAILER}\s*(\S+)", msg, re.M)
        if not m:
            raise TreeError(
                f"commit {sha[:10]} in the build tree has no '{PATCH_TRAILER}' trailer; commit with "
                "`refresh --new NAME` or amend it into a patch"
            )
        out.append((sha, m.group(1), msg))
    return out


def render_patch(tree: Path, sha: str, msg: str) -> str:
    body = re.sub(rf"^{PATCH_TRAILER}.*$", "", msg, flags=re.M).strip()
    subject, _, why = body.partition("\n")
    diff = git(tree, "diff", "--no-color", "--no-ext-diff", "-U3", f"{sha}^", sha)
    stat = git(tree, "diff", "--stat=100", f"{sha}^", sha)
    return f"Subject: [PATCH] {subject.strip()}\n\n{why.strip()}\n\n---\n{stat.rstrip()}\n\n{diff}"


def cmd_refresh(args) -> int:
    tree = tree_path(args.build_dir)
    if not (tree / ".git").exists():
        raise TreeError("no build tree; run `build` first")
    link_overlay(tree)
    dirty = dirty_files(tree)
    commits = patch_commits(tree)
    by_name = {name: sha for sha, name, _ in commits}
    if dirty:
        if args.into:
            if args.into not in by_name:
                raise TreeError(f"--into {args.into}: no such patch (series: {', '.join(by_name)})")
            git(tree, "add", "-u")
            git(tree, "commit", "-q", f"--fixup={by_name[args.into]}")
            env = dict(os.environ, GIT_SEQUENCE_EDITOR="true")
            res = run(
                ["git", *GIT_ID, "rebase", "-q", "-i", "--autosquash", "base"],
                cwd=tree,
                check=False,
                env=env,
            )
            if res.returncode != 0:
                run(["git", "rebase", "--abort"], cwd=tree, check=False)
                raise TreeError(
                    f"folding the edits into {args.into} conflicts with a later patch:\n{res.stderr}"
                )
        elif args.new:
            if not re.fullmatch(r"\d{4}-[a-z0-9][a-z0-9-]*\.patch", args.new):
                raise TreeError("--new NAME must look like 0003-topic-words.patch")
            if args.new in by_name:
                raise TreeError(f"--new {args.new}: a patch of that name exists; use --into")
            if not args.subject or not args.why:
                raise TreeError("--new needs --subject and --why (they become the patch header)")
            git(tree, "add", "-u")
            git(
                tree,
                "commit",
                "-q",
                "-m",
                args.subject,
                "-m",
                args.why,
                "-m",
                f"{PATCH_TRAILER} {args.new}",
            )
        else:
            raise TreeError(
                "the build tree has uncommitted edits to upstream files ("
                + ", ".join(dirty)
                + "); say which patch they belong to with --into NAME, or start one with --new NAME"
            )
    commits = patch_commits(tree)
    names = []
    for sha, name, msg in commits:
        (PATCHES / name).write_text(render_patch(tree, sha, msg))
        names.append(name)
    for stale in set(read_series_names_raw()) - set(names):
        (PATCHES / stale).unlink(missing_ok=True)
    (PATCHES / "series").write_text(
        "# Applied in order to the pristine base named in patches/base.\n" + "\n".join(names) + "\n"
    )
    stamp = tree / ".git" / "kv-offload-series"
    stamp.write_text(series_digest(read_base(), names) + "\n")
    log(f"wrote {len(names)} patch(es): {', '.join(names)}")
    return 0


def read_series_names_raw() -> List[str]:
    series = PATCHES / "series"
    if not series.exists():
        return []
    return [
        l.split("#", 1)[0].strip()
        for l in series.read_text().splitlines()
        if l.split("#", 1)[0].strip()
    ]


def cmd_check(args) -> int:
    base, names = read_base(), read_series()
    whl = fetch_wheel(base)
    with tempfile.TemporaryDirectory(prefix="kv-offload-check-") as tmp:
        tree = Path(tmp) / "sglang"
        unpack_base(whl, tree, base)
        apply_series(tree, names, commit=False)
        links = overlay_links(base_paths_of(tree))
    print(f"base: {base.name} {base.version} (sha256 {base.sha256[:12]}...)")
    print(
        f"overlay: {len(overlay_files())} files under {len(links)} new paths, none shadows upstream:"
    )
    for rel in links:
        print(f"  python/{rel}")
    total_files, total_add, total_del = set(), 0, 0
    print(f"series: {len(names)} patch(es) apply cleanly to the pristine base")
    for name in names:
        text = (PATCHES / name).read_text()
        files, add, rem = patch_stats(text)
        total_files.update(files)
        total_add += add
        total_del += rem
        print(f"  {name}: +{add} -{rem} in {', '.join(files)}")
    print(
        f"footprint: {len(names)} patches, {len(total_files)} upstream files touched, "
        f"{total_add} lines added, {total_del} removed"
    )
    tree = tree_path(args.build_dir)
    if (tree / ".git").exists() and dirty_files(tree):
        print(
            "warning: the build tree has edits not yet in patches/: "
            + ", ".join(dirty_files(tree))
            + " (run `refresh`)"
        )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv_offload_tree.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See docs/kv_offload.md, section 'Working on the patch series'.",
    )
    parser.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD, help="default: build/")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="default: .venv/")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="materialise the patched tree and put it on the venv's path")
    p.add_argument(
        "--force", action="store_true", help="rebuild from the base, dropping unrefreshed edits"
    )
    p.add_argument("--no-venv", action="store_true", help="do not create or install into the venv")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("refresh", help="regenerate patches/ from edits made in the build tree")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--into", metavar="NAME", help="fold uncommitted edits into this existing patch")
    g.add_argument(
        "--new", metavar="NAME", help="start a new patch NNNN-topic.patch from the edits"
    )
    p.add_argument("--subject", help="first line of a new patch (with --new)")
    p.add_argument("--why", help="why the hook exists (with --new)")
    p.set_defaults(func=cmd_refresh)
    p = sub.add_parser(
        "check", help="prove the series applies to a pristine base; print the footprint"
    )
    p.set_defaults(func=cmd_check)
    args = parser.parse_args(argv)
    args.build_dir = args.build_dir.resolve()
    args.venv = args.venv.resolve()
    try:
        return args.func(args)
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
