"""scripts/kv_offload_tree.py: the series applies to a pristine base, overlay rules, conflicts, refresh."""

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "scripts" / "kv_offload_tree.py"


@pytest.fixture()
def tool(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("kv_offload_tree_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", patches)
    monkeypatch.setattr(module, "PATCHES", patches)
    return module


def run_tool(*args):
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600
    )


def test_check_applies_series_to_pristine_base():
    res = run_tool("check")
    assert res.returncode == 0, res.stderr
    assert "apply cleanly to the pristine base" in res.stdout
    assert "none shadows upstream" in res.stdout
    assert "footprint:" in res.stdout and "upstream files touched" in res.stdout
    assert "python/sglang/srt/arg_groups/fields/memory.py" in res.stdout


def test_unknown_or_missing_command_is_an_error(tmp_path):
    build = tmp_path / "build"
    res = run_tool("--build-dir", str(build), "bogus")
    assert res.returncode == 2 and res.stdout == ""
    assert "invalid choice: 'bogus'" in res.stderr
    assert "'build', 'refresh', 'check'" in res.stderr  # the commands it does know
    # No command at all is refused the same way (not a traceback from a missing handler).
    res = run_tool("--build-dir", str(build))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "required: command" in res.stderr
    assert not build.exists()


def test_overlay_may_not_shadow_upstream(tool, tmp_path, monkeypatch):
    overlay = tmp_path / "python"
    (overlay / "sglang/srt/mem_cache/sparsity/kv_offload").mkdir(parents=True)
    (overlay / "sglang/srt/mem_cache/sparsity/kv_offload/x.py").write_text("")
    monkeypatch.setattr(tool, "OVERLAY", overlay)
    base = {
        "sglang",
        "sglang/srt",
        "sglang/srt/mem_cache",
        "sglang/srt/mem_cache/sparsity",
        "sglang/srt/mem_cache/sparsity/__init__.py",
    }
    assert tool.overlay_links(base) == [Path("sglang/srt/mem_cache/sparsity/kv_offload")]
    (overlay / "sglang/srt/mem_cache/sparsity/__init__.py").write_text("")
    with pytest.raises(
        tool.TreeError, match=r"python/sglang/srt/mem_cache/sparsity/__init__.py would shadow"
    ):
        tool.overlay_links(base)


def _git(repo, *args):
    subprocess.run(
        ["git", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        },
    )


def test_conflict_names_patch_file_and_hunk(tool, tmp_path):
    repo = tmp_path / "repo"
    (repo / "python").mkdir(parents=True)
    lines = [f"line {i}" for i in range(1, 41)]
    (repo / "python/a.py").write_text("\n".join(lines) + "\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    patch = textwrap.dedent("""\
        Subject: [PATCH] demo

        ---
        diff --git a/python/a.py b/python/a.py
        --- a/python/a.py
        +++ b/python/a.py
        @@ -2,3 +2,4 @@
         line 2
         line 3
        +new line
         line 4
        @@ -30,3 +31,4 @@
         line 30
         line DIFFERENT
        +another
         line 32
        """)
    (tool.PATCHES / "0099-demo.patch").write_text(patch)
    with pytest.raises(tool.TreeError) as info:
        tool.apply_series(repo, ["0099-demo.patch"], commit=False)
    message = str(info.value)
    assert "patch 0099-demo.patch does not apply" in message
    assert "file python/a.py" in message
    assert "hunk #2 (@@ -30,3 +31,4 @@)" in message


def test_build_refresh_round_trip(tool, tmp_path):
    build = tmp_path / "build"
    args = ["--build-dir", str(build)]
    assert tool.main([*args, "build", "--no-venv"]) == 0
    tree = build / "sglang"
    server_args = tree / "python/sglang/srt/arg_groups/fields/memory.py"
    text = server_args.read_text()
    assert "    enable_kv_offload: A[\n        bool," in text
    # The base is the pinned wheel's sources, its metadata included.
    assert (tree / "python/sglang-0.5.23.dist-info/METADATA").is_file()
    # Overlay directories are linked, not copied.
    link = tree / "python/sglang/srt/mem_cache/sparsity/kv_offload"
    assert link.is_symlink() and link.resolve() == (
        ROOT / "python/sglang/srt/mem_cache/sparsity/kv_offload"
    )

    # A second build with nothing changed does not touch the tree.
    marker = server_args
    mtime = marker.stat().st_mtime_ns
    assert tool.main([*args, "build", "--no-venv"]) == 0
    assert marker.stat().st_mtime_ns == mtime

    # Edits without a destination are refused; with --into they land in that patch.
    server_args.write_text(
        text.replace(
            "    # KV offload for DSA decode (mem_cache/sparsity/kv_offload)\n",
            "    # KV offload for DSA decode (mem_cache/sparsity/kv_offload)  # round-trip marker\n",
        )
    )
    assert tool.main([*args, "refresh"]) == 1
    patch_name = "0001-server-args-kv-offload-flag.patch"
    assert tool.main([*args, "refresh", "--into", patch_name]) == 0
    assert "# round-trip marker" in (tool.PATCHES / patch_name).read_text()
    assert (tool.PATCHES / patch_name).read_text().startswith("Subject: [PATCH] server_args:")
    # Every patch keeps its header paragraph (the "why") through build + refresh.
    for name in tool.read_series():
        assert (
            tool.patch_why((tool.PATCHES / name).read_text())
            == tool.patch_why((ROOT / "patches" / name).read_text())
            != ""
        ), name

    # A new topic becomes its own patch, listed in the series after the first.
    init = tree / "python/sglang/srt/mem_cache/sparsity/__init__.py"
    init.write_text(init.read_text() + "# new topic\n")
    assert (
        tool.main(
            [
                *args,
                "refresh",
                "--new",
                "0002-demo-topic.patch",
                "--subject",
                "sparsity: demo",
                "--why",
                "Because a test says so.",
            ]
        )
        == 0
    )
    assert tool.read_series()[-1] == "0002-demo-topic.patch"
    body = (tool.PATCHES / "0002-demo-topic.patch").read_text()
    assert "Because a test says so." in body and "+# new topic" in body

    # The regenerated series still applies to a pristine base.
    fresh = tmp_path / "fresh"
    assert tool.main(["--build-dir", str(fresh), "build", "--no-venv"]) == 0
    assert (
        "# new topic"
        in (fresh / "sglang/python/sglang/srt/mem_cache/sparsity/__init__.py").read_text()
    )


def test_system_pip_pins_come_from_the_constraints_file(tool, tmp_path):
    cons = tmp_path / "constraints.txt"
    cons.write_text("# comment\ntriton==9.9.9\ntorch==1.2.3  # why\ntorchvision==0.1.0\nfoo==1\n")
    assert tool.constraint_pins(cons, ("torch", "torchvision", "triton")) == [
        "torch==1.2.3",
        "torchvision==0.1.0",
        "triton==9.9.9",
    ]
    cons.write_text("torch==1.2.3\n")
    with pytest.raises(tool.TreeError, match="pins no version for torchvision, triton"):
        tool.constraint_pins(cons, ("torch", "torchvision", "triton"))


def test_a_new_venv_refuses_a_full_disk_before_installing(tool, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    tool.check_free_disk(tmp_path / "venv-parent", usage.free / 1e9 / 2)  # enough: no error
    full = usage._replace(free=int(2.5e9))
    monkeypatch.setattr(tool.shutil, "disk_usage", lambda path: full)
    with pytest.raises(tool.TreeError, match=r"has 2\.5 GB free; the venv needs about 9 GB"):
        tool.check_free_disk(tmp_path, tool.VENV_FREE_GB)
