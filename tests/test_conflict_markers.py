"""No tracked text file holds a merge-conflict marker (a merge left half-resolved reads as valid Markdown, and
the README numbers check passes over it, since it reads only linked numbers)."""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).parent.parent
# git's markers: a line that starts with seven <, |, or > and then a space or its end. A bare "=======" is
# left out: Markdown and reStructuredText underline headings with it, and it is never alone in a conflict.
MARKER = re.compile(rb"^(<{7}|\|{7}|>{7})(?: |$)", re.M)


def tracked_files(root: pathlib.Path) -> list[pathlib.Path]:
  """The files git tracks under `root` (its index), or every file outside .git where git cannot say."""
  try:
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True,
                            timeout=60).stdout
  except (OSError, subprocess.SubprocessError):
    return sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts)
  return sorted(root / name for name in listed.decode().split("\0") if name)


def conflict_markers(root: pathlib.Path) -> list[str]:
  """'path:line: marker' for every conflict marker in a tracked text file (a file with a NUL byte is binary)."""
  found = []
  for path in tracked_files(root):
    if not path.is_file():  # deleted in the work tree, not yet in the index
      continue
    data = path.read_bytes()
    if b"\0" in data[:8192]:
      continue
    for match in MARKER.finditer(data):
      line = data.count(b"\n", 0, match.start()) + 1
      found.append(f"{path.relative_to(root)}:{line}: {match[1].decode()}")
  return found


def test_no_tracked_file_holds_a_conflict_marker():
  assert conflict_markers(ROOT) == []


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_markers_planted_in_a_copy_are_found_with_their_lines(tmp_path):
  subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
  readme = (ROOT / "README.md").read_text()
  (tmp_path / "README.md").write_text(readme)
  (tmp_path / "heading.rst").write_text("Title\n=======\n")  # a heading underline is not a marker
  (tmp_path / "weights.bin").write_bytes(b"\0<<<<<<< HEAD\n")  # binary: not read
  (tmp_path / "untracked.md").write_text("<<<<<<< HEAD\n")  # not in git's index
  subprocess.run(["git", "-C", str(tmp_path), "add", "README.md", "heading.rst", "weights.bin"], check=True)
  assert conflict_markers(tmp_path) == []
  lines = readme.splitlines()
  planted = lines[:3] + ["<<<<<<< HEAD", "ours", "=======", "theirs", ">>>>>>> branch"] + lines[3:]
  (tmp_path / "README.md").write_text("\n".join(planted) + "\n")
  assert conflict_markers(tmp_path) == ["README.md:4: <<<<<<<", "README.md:8: >>>>>>>"]
