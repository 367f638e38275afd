"""`fgpu cp`'s argument rules (fgpu_cli.files): which side is the session, and the name a
download keeps. The copies themselves run against the distributed stack: tests/test_files_e2e.py."""
from __future__ import annotations

import pytest

from fgpu_cli.files import _filename, split_remote


@pytest.mark.parametrize("arg, expected", [
    ("train:data/model.pt", ("train", "data/model.pt")), ("92aecdb8:", ("92aecdb8", "")),
    ("nb:~/notes.txt", ("nb", "notes.txt")), ("nb:~", ("nb", "")),
    ("model.pt", None), ("./a:b", None), ("/tmp/x:y", None), (":x", None),
])
def test_a_session_path_is_session_colon_path_as_in_scp(arg, expected):
    assert split_remote(arg) == expected


def test_a_download_keeps_the_servers_file_name_without_its_folders():
    assert _filename('attachment; filename="model.pt"') == "model.pt"
    assert _filename("attachment; filename*=utf-8''r%C3%A9sum%C3%A9.txt") == "résumé.txt"
    assert _filename('attachment; filename="../../etc/passwd"') == "passwd"
    assert _filename("inline") == "" and _filename('attachment; filename=".."') == ""
