"""Where the repository is, for tests that start its programs or read its files, wherever the test lives."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOT_DIR = str(ROOT)  # the same, for os.path and environment variables
EXAMPLES = ROOT / "examples"
