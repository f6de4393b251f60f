"""Fetching pinned releases: pip download, sha256, cache reuse, safe unpacking, local sources."""

from __future__ import annotations

import concurrent.futures as cf
import io
import multiprocessing as mp
import tarfile
import zipfile
from pathlib import Path

import pytest

from kb.errors import KBError
from ingest.archive import STAMP, unpack
from ingest.corpus import expand_braces, lift_source, select_files
from ingest.fetch import fetch, fetch_local, fetch_pypi, sha256_file
from ingest.manifest import find_manifest, list_manifests
from ingest.model import SourceKind
from tests.support.repo import TEST_CACHE



@pytest.fixture
def cache_env(monkeypatch):
    # Function-scoped: conftest's autouse fixture clears KB_* before every test.
    monkeypatch.setenv("KB_CACHE_DIR", str(TEST_CACHE))
    return TEST_CACHE


def test_manifests_pin_real_releases():
    names = {m.name: m for m in list_manifests()}
    assert {"flash-attn-2", "flash-attn-4", "nvidia-cutlass", "vllm", "sglang"} <= set(names)
    for m in names.values():
        assert len(m.sha256) == 64 and m.files
    assert names["flash-attn-2"].kind is SourceKind.SDIST
    assert ("FLASH_ATTENTION_SKIP_CUDA_BUILD", "TRUE") in names["flash-attn-2"].env
    lifters = {f.lifter for m in names.values() for f in m.files}
    assert lifters == {"cuda", "cute", "triton"}


def test_expand_braces():
    assert expand_braces("a/{x,y}.h") == ["a/x.h", "a/y.h"]
    assert expand_braces("{a,b}/{c,d}") == ["a/c", "a/d", "b/c", "b/d"]


@pytest.mark.network
@pytest.mark.parametrize("name", ["flash-attn-2", "flash-attn-4", "nvidia-cutlass", "vllm", "sglang"])
def test_fetch_verifies_and_every_manifest_path_exists(cache_env, name, monkeypatch):
    m = find_manifest(name)
    src = fetch(m)
    assert src.sha256 == m.sha256 == sha256_file(TEST_CACHE / "downloads" / f"{m.distribution}-{m.version}" / m.filename)
    assert (src.root / STAMP).read_text().split()[0] == m.sha256
    targets, missing = select_files(m, src)
    assert missing == [] and targets
    if m.kind is SourceKind.WHEEL:  # a wheel's native libraries are never unpacked: only the listed files
        unpacked = {p.relative_to(src.root).as_posix() for p in src.root.rglob("*") if p.is_file()} - {STAMP}
        assert unpacked == {t.path.relative_to(src.root).as_posix() for t in targets}
    # Fetching again is served from the cache: no pip run, no re-unpack (the unpacked files are left as they are)
    stamped = (src.root / STAMP).stat().st_mtime_ns, targets[0].path.stat().st_mtime_ns
    monkeypatch.setattr("ingest.fetch.pip_download", lambda *a, **k: pytest.fail("a cached release was downloaded"))
    again = fetch(m)
    assert again == src and ((src.root / STAMP).stat().st_mtime_ns, targets[0].path.stat().st_mtime_ns) == stamped


@pytest.mark.network
def test_hash_mismatch_removes_cached_file(cache_env, tmp_path, monkeypatch):
    m = find_manifest("flash-attn-4")
    fetch(m)  # make sure the real wheel is cached
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path))
    dl = tmp_path / "downloads" / f"{m.distribution}-{m.version}"
    dl.mkdir(parents=True)
    (dl / m.filename).write_bytes((TEST_CACHE / "downloads" / f"{m.distribution}-{m.version}" / m.filename).read_bytes() + b"x")
    with pytest.raises(KBError) as err:
        fetch(m)
    assert m.sha256 in str(err.value) and m.filename in str(err.value) and "got" in str(err.value)
    assert not (dl / m.filename).exists()


@pytest.mark.network
def test_unknown_version_says_what_to_check(tmp_path, monkeypatch):
    monkeypatch.setenv("KB_CACHE_DIR", str(tmp_path))
    with pytest.raises(KBError) as err:
        fetch_pypi("flash-attn-4", "0.0.0.999", SourceKind.WHEEL)
    assert "flash-attn-4==0.0.0.999" in str(err.value) and "pip index versions" in str(err.value)


def _tar(path: Path, members: list[tarfile.TarInfo], data: bytes = b"x") -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for info in members:
            tf.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


@pytest.mark.parametrize("name,kind,link", [("../evil.h", tarfile.REGTYPE, ""), ("/abs/evil.h", tarfile.REGTYPE, ""),
                                             ("pkg/link", tarfile.SYMTYPE, "/etc/passwd"), ("pkg/hard", tarfile.LNKTYPE, "../../x")])
def test_unsafe_tar_members_are_refused(tmp_path, name, kind, link):
    ok = tarfile.TarInfo("pkg/ok.h")
    ok.size = 1
    bad = tarfile.TarInfo(name)
    bad.type, bad.linkname, bad.size = kind, link, 1 if kind == tarfile.REGTYPE else 0
    archive = _tar(tmp_path / "bad.tar.gz", [ok, bad])
    with pytest.raises(KBError, match="refusing to unpack"):
        unpack(archive, tmp_path / "out", sha256_file(archive))
    assert not (tmp_path / "out").exists() and not (tmp_path / "evil.h").exists()


def test_unsafe_zip_member_is_refused(tmp_path):
    archive = tmp_path / "bad.whl"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ok.py", "x = 1\n")
        zf.writestr("../../escape.py", "x = 1\n")
    with pytest.raises(KBError, match="escapes"):
        unpack(archive, tmp_path / "out", sha256_file(archive))


def test_unpack_is_idempotent(tmp_path):
    ok = tarfile.TarInfo("pkg/ok.h")
    ok.size = 1
    archive = _tar(tmp_path / "good.tar.gz", [ok])
    out = unpack(archive, tmp_path / "out", "h1")
    marker = out / "pkg" / "marker"
    marker.write_text("kept")
    unpack(archive, tmp_path / "out", "h1")
    assert marker.exists()  # same hash: untouched
    unpack(archive, tmp_path / "out", "h2")
    assert not marker.exists() and (out / "pkg" / "ok.h").read_bytes() == b"x"


def test_fetch_local_file_and_dir(tmp_path):
    kernel = tmp_path / "k" / "my_mask.cuh"
    kernel.parent.mkdir()
    kernel.write_text("template <typename T>\n__device__ void apply_softcap(T &t, float softcap) { t = tanhf(t * softcap); }\n")
    one = fetch_local(kernel)
    assert one.kind is SourceKind.LOCAL and one.filename == str(kernel.resolve()) and one.sha256 == sha256_file(kernel)
    folder = fetch_local(kernel.parent)
    reports = lift_source(folder)
    assert [s.kind for r in reports for s in r.snippets] == ["softcap"]
    kernel.write_text(kernel.read_text() + "// changed\n")
    assert fetch_local(kernel.parent).sha256 != folder.sha256
    with pytest.raises(KBError, match="does not exist"):
        fetch_local(tmp_path / "nope")


def _unpack_into(args: tuple[str, str]) -> list[str]:
    archive, dest = args
    root = unpack(Path(archive), Path(dest), "h1")
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_processes_unpacking_one_archive_at_once_each_get_the_whole_tree(tmp_path):
    """Test workers (or two `kb ingest` runs) fetching one release at once: each unpacks into a directory of its own
    and the first whole tree wins, so none sees or deletes another's half-written tree."""
    archive = tmp_path / "many.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for i in range(400):
            data = (f"file {i}\n" * 50).encode()
            info = tarfile.TarInfo(f"pkg/d{i % 7}/f{i}.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    want = sorted([f"pkg/d{i % 7}/f{i}.txt" for i in range(400)] + [STAMP])
    with cf.ProcessPoolExecutor(4, mp_context=mp.get_context("spawn")) as pool:
        trees = list(pool.map(_unpack_into, [(str(archive), str(tmp_path / "src"))] * 8))
    assert all(t == want for t in trees)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.tar.gz", "src"]  # no partial copy left behind
