"""Site profiles are read through a JSON copy in the user's cache (hpcrl.login.profiles._read_toml):
the copy must never outlive a change to its file, and a cache that cannot be used costs nothing
but the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcrl.login import profiles


@pytest.fixture
def sites(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HPCRL_SITES_PATH", str(tmp_path / "sites"))
    (tmp_path / "sites").mkdir()
    return tmp_path / "sites"


def _copies(tmp_path, stem: str) -> list:
    return sorted((tmp_path / "cache" / "hpcrl" / "sites").glob(f"{stem}-*.json"))


def test_a_site_file_is_read_from_its_copy_until_the_file_changes(sites, tmp_path):
    path = sites / "mine.toml"
    path.write_text('extends = "cuda"\n[env]\nNCCL_DEBUG = "INFO"\n')
    assert profiles.load("mine").env["NCCL_DEBUG"] == "INFO"
    [copy] = _copies(tmp_path, "mine")
    assert json.loads(copy.read_text()) == {"extends": "cuda", "env": {"NCCL_DEBUG": "INFO"}}
    # the copy is what the next command reads (changed here behind the file's back, to show it)
    copy.write_text(json.dumps({"extends": "cuda", "env": {"NCCL_DEBUG": "WARN"}}))
    assert profiles.load("mine").env["NCCL_DEBUG"] == "WARN"
    # an edit of the same size a moment later is still seen: the key holds the modification time
    path.write_text('extends = "cuda"\n[env]\nNCCL_DEBUG = "TRCE"\n')
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert profiles.load("mine").env["NCCL_DEBUG"] == "TRCE"


def test_a_file_json_cannot_copy_or_an_unusable_cache_is_read_as_toml(sites, tmp_path, monkeypatch):
    (sites / "dated.toml").write_text('extends = "cuda"\nsince = 1979-05-27\n')
    assert str(profiles.raw_profile("dated")["since"]) == "1979-05-27"      # a TOML date: no copy
    assert _copies(tmp_path, "dated") == []
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    (sites / "mine.toml").write_text('extends = "cuda"\n[env]\nNCCL_DEBUG = "INFO"\n')
    assert profiles.load("mine").env["NCCL_DEBUG"] == "INFO"
    (sites / "bad.toml").write_text("extends = \n")
    with pytest.raises(profiles.UserError, match=r"site file .*bad.toml: invalid TOML"):
        profiles.load("bad")


def test_a_cached_profile_spares_the_toml_parser(sites):
    code = ("import sys; from hpcrl.login import profiles; profiles.load('testbed'); "
            "print('tomllib' in sys.modules)")
    said = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]
    assert said == ["True", "False"]
