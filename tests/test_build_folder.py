"""The kernel build reuses compiled objects only from a build of the same sources
(dash._sources.prepare_build_folder, called by setup.py before ninja runs): ninja alone trusts
its recorded header dependencies, which were once empty and let a stale kernel object into a
build (docs/kernel-notes.md, eighteenth pass)."""

from __future__ import annotations

from pathlib import Path

from dash._sources import BUILD_STAMP_NAME, prepare_build_folder, sources_digest

ROOT = Path(__file__).resolve().parents[1]


def _previous_build(folder: Path, digest: str | None) -> Path:
    obj = folder / "csrc" / "generated" / "instantiations" / "bwd_hdim128_bf16.o"
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"object")
    if digest is not None:
        (folder / BUILD_STAMP_NAME).write_text(digest + "\n")
    return obj


def test_same_sources_keep_the_objects(tmp_path):
    obj = _previous_build(tmp_path / "build", "abc123")
    stamp = prepare_build_folder(tmp_path / "build", "abc123")
    assert obj.read_bytes() == b"object"
    # The stamp is gone until the new build succeeds: a failed build leaves nothing to trust.
    assert stamp == tmp_path / "build" / BUILD_STAMP_NAME and not stamp.exists()


def test_other_sources_remove_every_object(tmp_path):
    obj = _previous_build(tmp_path / "build", "abc123")
    prepare_build_folder(tmp_path / "build", "def456")
    assert not obj.exists() and (tmp_path / "build").is_dir()


def test_no_stamp_or_no_digest_builds_afresh(tmp_path):
    obj = _previous_build(tmp_path / "a", None)  # a folder of a build that never finished
    prepare_build_folder(tmp_path / "a", "abc123")
    assert not obj.exists()
    obj = _previous_build(tmp_path / "b", "abc123")
    prepare_build_folder(tmp_path / "b", None)  # sources that cannot be digested: trust nothing
    assert not obj.exists()
    prepare_build_folder(tmp_path / "c", "abc123")  # no folder yet
    assert (tmp_path / "c").is_dir()


def test_digest_follows_a_kernel_header(tmp_path):
    """What the stamp compares changes with any kernel header, the file ninja's record missed."""
    for rel in ("csrc/kernels/bwd_launch.h", "dash/config.py"):
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((ROOT / rel).read_bytes())
    before = sources_digest(tmp_path)
    header = tmp_path / "csrc/kernels/bwd_launch.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert sources_digest(tmp_path) != before
