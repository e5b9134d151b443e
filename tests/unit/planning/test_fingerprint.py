"""The digests a plan is kept and compared by: the code hash read once per process, the
cache directory read from the environment each time it is asked."""

import pathlib

import pytest

from autoshard.planning import cache, fingerprint


def test_the_code_hash_reads_the_package_once(monkeypatch):
    first = fingerprint.source_hash()

    def no_reading(*args, **kwargs):
        raise AssertionError("the package's files read again")
    monkeypatch.setattr(pathlib.Path, "rglob", no_reading)
    assert fingerprint.source_hash() == first


def test_the_code_hash_covers_every_layer():
    fingerprint.source_hash.cache_clear()
    seen = []
    real = pathlib.Path.read_bytes

    def reading(path):
        seen.append(path)
        return real(path)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pathlib.Path, "read_bytes", reading)
        fingerprint.source_hash()
    fingerprint.source_hash.cache_clear()
    folders = {p.parent.name for p in seen}
    assert {"solver", "cost", "rules", "planning", "rewrite"} <= folders


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "a"))
    assert cache.cache_dir(None) == tmp_path / "a"
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "b"))
    assert cache.cache_dir(None) == tmp_path / "b"
    monkeypatch.delenv(cache.CACHE_DIR_ENV)
    assert cache.cache_dir(None) is None
