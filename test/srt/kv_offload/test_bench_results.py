"""benchmark/kv_offload/bench_common.results_json: the committed results' JSON layout."""

import gzip
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
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
