"""benchmark/kv_offload/bench_common: the committed results' JSON layout and the commit they
record."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
import bench_common  # noqa: E402
from bench_common import RESULTS_LINE, read_results, results_json  # noqa: E402


def test_results_json_round_trips_with_short_lists_on_one_line():
    kernel = ["_copy_rows_kernel", 7, 37.95, 1196.23, [16896, 1, 1], [128, 1, 1], 18, 0]
    tokens = list(range(300))  # longer than a line, but scalars: one line
    doc = {
        "rows": [{"bs": 32, "kernels": [kernel] * 3, "timeline": {}, "tokens": tokens}],
        "empty": [],
        "nested": [[{"a": 1}]],
        "wide": [[i] * 40 for i in range(3)],  # lists too long for one line together
        7: "keys become strings",
    }
    text = results_json(doc)
    assert json.loads(text) == json.loads(json.dumps(doc))
    lines = text.splitlines()
    assert lines[0] == "{" and lines[1] == ' "rows": ['
    assert (
        '    ["_copy_rows_kernel", 7, 37.95, 1196.23, [16896, 1, 1], [128, 1, 1], 18, 0],' in lines
    )
    assert f'   "tokens": {json.dumps(tokens)}' in lines
    assert ' "empty": [],' in lines and '  "timeline": {},' not in lines
    assert '   "timeline": {},' in lines
    wide = lines.index(' "wide": [')
    assert all(len(line) <= RESULTS_LINE + 2 for line in lines[wide + 1 : wide + 4])


def test_committed_results_are_in_that_layout():
    """Re-dumping a committed results file changes nothing (halves the bytes carried to the GPU);
    gzip'd ones (none committed now) hold the same layout, and read_results reads both."""
    files = sorted((BENCH_DIR / "results").glob("*.json"))
    zipped = sorted((BENCH_DIR / "results").glob("*.json.gz"))
    assert files
    for path in files + zipped:
        text = (
            gzip.decompress(path.read_bytes()).decode()
            if path.suffix == ".gz"
            else path.read_text()
        )
        assert results_json(json.loads(text)) == text, f"{path.name}: run results_json on it"
        assert read_results(str(path)) == json.loads(text)


def test_read_results_reads_a_gzipd_file_as_the_plain_one(tmp_path):
    """Files over 200 KB are committed gzip'd (``zcat`` reads them); read_results takes either."""
    doc = {"rows": [{"bs": 32, "tokens": list(range(10))}], "note": "x"}
    plain, zipped = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(results_json(doc))
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_results(str(plain)) == read_results(str(zipped)) == doc


def test_a_results_file_is_committed_once():
    """A results file is committed either plain or gzip'd, never both."""
    results = BENCH_DIR / "results"
    both = [p.name for p in results.glob("*.json.gz") if p.with_suffix("").exists()]
    assert not both, f"committed twice (plain and .gz): {both}"


def test_git_commit_names_the_commit_and_marks_a_tree_that_differs_from_it(tmp_path, monkeypatch):
    """A work tree copied over an older repository (the device machine's copy) must not pass for
    that older commit."""
    monkeypatch.setattr(bench_common, "ROOT", tmp_path)
    assert bench_common.git_commit() == ""  # not a repository

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, check=True)
        return run.stdout.decode().strip()

    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    git("tag", "v1")  # a tag does not replace the hash
    head = git("rev-parse", "--short=7", "HEAD")
    assert bench_common.git_commit() == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert bench_common.git_commit() == f"{head}-dirty"
    (tmp_path / "new.py").write_text("")  # untracked files do not count
    (tmp_path / "f.py").write_text("a = 1\n")
    assert bench_common.git_commit() == head
