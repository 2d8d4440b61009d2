"""Progress output: plain, rate-limited lines when stderr is not a terminal (kiln/progress.py)."""
from __future__ import annotations

import io
import subprocess
import sys

from kiln.progress import LineBar


def test_line_bar_prints_whole_lines_rate_limited():
    buf = io.StringIO()
    with LineBar(total=1000, file=buf, desc="work", every=3600) as bar:
        for i in range(1000):
            bar.update(1)
            bar.set_postfix(loss=i)  # a postfix refresh must not print a line either
    out = buf.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 2  # the start and the end, nothing between within the interval
    assert lines[0].startswith("work:   0%") and "1000/1000" in lines[1] and "loss=999" in lines[1]


def test_line_bar_prints_again_after_the_interval():
    buf = io.StringIO()
    bar = LineBar(total=3, file=buf, desc="w", every=0.0, mininterval=0)
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert len(buf.getvalue().splitlines()) >= 4 and "\r" not in buf.getvalue()


def test_a_log_file_gets_lines_not_redraws(tmp_path):
    """What a user sees in `kiln ... > log 2>&1`: the module picks LineBar when stderr is a file."""
    code = "from kiln.progress import tqdm\nfor _ in tqdm(range(50), desc='job'): pass\n"
    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "-c", code], stderr=log, check=True)
    text = (tmp_path / "log").read_text()
    assert "\r" not in text and text.splitlines()[-1].startswith("job: 100%")


def test_messages_and_nested_bars_in_a_log_add_no_carriage_returns(tmp_path):
    """tqdm.write (the trainers' eval lines) and a bar inside a bar, in one log as `> log 2>&1` makes it."""
    code = ("from kiln.progress import tqdm\n"
            "with tqdm(total=2, desc='outer') as outer:\n"
            "    for i in range(2):\n"
            "        tqdm.write(f'eval {i}')\n"
            "        for _ in tqdm(range(3), desc='inner', leave=False): pass\n"
            "        outer.update(1)\n")
    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "-c", code], stdout=log, stderr=log, check=True)
    text = (tmp_path / "log").read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert "eval 0" in lines and "eval 1" in lines  # each message a line of its own
    assert all(line.split(":")[0] in ("outer", "inner") for line in lines if not line.startswith("eval"))
    assert lines[-1].startswith("outer: 100%")
