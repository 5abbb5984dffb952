"""`ragblend ingest PATH...` against the real retriever: folders are walked recursively,
unsupported files skipped, bad files reported, and the exit code says whether any failed."""

from __future__ import annotations

import uuid


def test_ingest_walks_folders_summarises_and_fails_on_bad_files(
    shared_retriever, run_ragblend, tmp_path
):
    def _ingest(url: str, *paths: str):
        return run_ragblend("ingest", *paths, "--url", url)

    tag = uuid.uuid4().hex[:8]
    (tmp_path / "docs" / "nested").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text(f"Alpha {tag}: the mill grinds oats.")
    (tmp_path / "docs" / "nested" / "b.md").write_text(f"# Beta {tag}\n\nThe mill grinds rye.")
    (tmp_path / "docs" / "nested" / "c.html").write_text(f"<p>Gamma {tag}: wheat.</p>")
    (tmp_path / "docs" / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "docs" / "bad.txt").write_bytes(f"caf\xe9 {tag}".encode("latin-1"))
    (tmp_path / "named.docx").write_bytes(b"PK")

    run = _ingest(shared_retriever.url, str(tmp_path / "docs"), str(tmp_path / "named.docx"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "documents: 3" in run.stdout
    assert "skipped: 1" in run.stdout
    assert "failed: 2" in run.stdout
    assert "bad.txt is not valid UTF-8" in run.stdout
    assert "unsupported file type '.docx'" in run.stdout

    again = _ingest(shared_retriever.url, str(tmp_path / "docs" / "nested"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "documents: 0" in again.stdout
    assert "2 already ingested (unchanged)" in again.stdout

    with shared_retriever.client() as http:
        listing = http.get("/v1/documents", params={"limit": 100000}).json()["documents"]
    sources = {d["metadata"].get("source") for d in listing}
    assert str(tmp_path / "docs" / "nested" / "b.md") in sources


def test_ingest_reports_a_file_above_max_document_chars(shared_retriever, run_ragblend, tmp_path):
    huge = tmp_path / "huge.txt"
    huge.write_text("a" * 2_000_001)  # the default max_document_chars, plus one
    run = run_ragblend("ingest", str(huge), "--url", shared_retriever.url)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "huge.txt holds more than max_document_chars (2000000)" in run.stdout
