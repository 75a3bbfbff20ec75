"""CI's time rests on ``--dist loadgroup`` keeping each file on one worker (conftest.py groups them): where
the grouping silently stops (pytest 9.2 with pytest-xdist 3.8, pytest-dev/pytest-xdist#1386), every session
and module fixture is built once per worker and CI took half as long again."""

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("xdist")


def test_each_file_runs_on_one_worker_under_loadgroup():
    files = ["tests/test_contract.py", "tests/test_probe_detect.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", *files], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    workers = {}
    for worker, path in re.findall(r"^\[(gw\d+)\].*?(tests/\w+\.py)::", done.stdout, re.MULTILINE):
        workers.setdefault(path, set()).add(worker)
    assert set(workers) == set(files)
    assert all(len(ran_on) == 1 for ran_on in workers.values()), workers
